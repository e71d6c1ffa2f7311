"""command=pipeline: run several commands in order in one run directory.

Each step writes into ``<run_dir>/<step>`` and hands keys to later steps through
``RunResult.provides`` (e.g. synth provides ``model.name``; allocate provides ``quant.plan``).
Before the first step runs, every step's required settings are checked (``needs`` in
:data:`mlxbun.commands.COMMANDS`): a key is set in the config or provided by an earlier step
(``provides``), or nothing runs.

    <run_dir>/
        manifest.json
        synth/  quantize/  ...     one directory per step (``name-2`` when a step repeats)
"""

from __future__ import annotations

import copy
import gc
import logging
import sys
import time
from dataclasses import asdict, fields, is_dataclass, replace
from pathlib import Path
from typing import Any

from mlxbun import commands
from mlxbun.commands import COMMANDS
from mlxbun.config import schema
from mlxbun.errors import InputError
from mlxbun.quant.allocate.allocation import candidate_filter, check_reachable
from mlxbun.quant.plan import check_hessians, hessians_file, load_plan
from mlxbun.quant.sensitivity import candidates
from mlxbun.quant.sensitivity.file import LayerSensitivity, Sensitivity, load_sensitivity
from mlxbun.quant.spec import QuantSpec, spec_for
from mlxbun.runs.provenance import RunResult
from mlxbun.source.model import model_dir
from mlxbun.synth import write as synth_write

log = logging.getLogger("mlxbun")


def set_key(cfg: Any, dotted: str, value: Any) -> Any:
    """A copy of dataclass ``cfg`` with ``dotted`` (e.g. "model.name") set to ``value``."""
    head, _, rest = dotted.partition(".")
    if not is_dataclass(cfg) or head not in {f.name for f in fields(cfg)}:
        raise InputError(f"pipeline key {dotted!r} does not exist in the config")
    if not rest:
        return replace(cfg, **{head: value})
    return replace(cfg, **{head: set_key(getattr(cfg, head), rest, value)})


def get_key(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def check_steps(cfg: Any, steps: list[str]) -> None:
    """Refuse the pipeline before anything runs: unknown steps, or a step missing a setting."""

    if not steps:
        raise InputError(
            "pipeline.steps=[] is empty; list the commands to run, e.g. pipeline.steps=[synth,quantize]"
        )
    for step in steps:
        if step not in COMMANDS or step in ("pipeline", "help"):
            allowed = ", ".join(n for n in COMMANDS if n not in ("pipeline", "help"))
            raise InputError(f"pipeline.steps has {step!r}; choose from {allowed}")
    provided: set[str] = set()
    for i, step in enumerate(steps, 1):
        for group in COMMANDS[step].needs:
            if not any(k in provided or get_key(cfg, k) not in (None, False, "", []) for k in group):
                raise InputError(
                    f"pipeline.steps: step {i} ({step}) needs {' or '.join(group)}, which is not set and"
                    " no earlier step provides; set it (nothing was run)"
                )
        if step == "quantize" and "quant.plan" in provided:
            schema.check_plan_overrides(cfg.quant, plan="<allocate's plan.json>")
        provided.update(COMMANDS[step].provides)
    if "synth" in steps:
        _check_synth_room(cfg)
    _check_before_work(cfg, steps)


def _check_before_work(cfg: Any, steps: list[str]) -> None:
    """What a later step would refuse after earlier steps' work, refused before the first step:
    missing Hessians (or a Hessians path that is no regular file), a plan.json that does not
    read, an allocate budget below the smallest plan."""
    q, provided = cfg.quant, set()
    for i, step in enumerate(steps, 1):
        try:
            given = "quant.hessians" not in provided and q.hessians is not None
            if step in ("quantize", "allocate") and given:
                hessians_file(q.hessians)
            if step == "quantize" and "quant.hessians" not in provided:
                plan = load_plan(q.plan) if q.plan and "quant.plan" not in provided else None
                check_hessians(q.method, plan, q.hessians)
            if step == "allocate" and "model.name" not in provided and not cfg.model.synthetic:
                _check_budget(cfg, measured_here=set(steps[: i - 1]) & {"sensitivity", "sensitivity_merge"})
        except InputError as e:
            raise InputError(f"pipeline.steps: step {i} ({step}): {e} (nothing was run)") from None
        provided.update(COMMANDS[step].provides)


def _check_budget(cfg: Any, *, measured_here: set[str]) -> None:
    """The allocate budget against the smallest plan its candidates allow: those of the given
    sensitivity, or of the settings an earlier sensitivity step measures."""

    a, s = cfg.allocate, cfg.sensitivity
    if "sensitivity_merge" in measured_here:
        return  # the shards' settings are known only once they are merged
    if "sensitivity" in measured_here:
        kl = {spec_for(s.mode, b, s.group_size, key="sensitivity"): 0.0 for b in s.bits}
        if (c := s.candidates).enabled:
            base = next(iter(kl)).group_size
            kl |= dict.fromkeys(
                candidates.settings(
                    s.bits, group_sizes=[base, *c.group_sizes], methods=["rtn"], modes=c.modes
                ),
                0.0,
            )
        sens = Sensitivity({"": LayerSensitivity("", 0, kl)})
    else:
        sens = load_sensitivity(a.sensitivity)
    check_reachable(
        candidate_filter(sens, bits=a.bits, group_sizes=a.group_sizes, modes=a.modes, methods=a.methods),
        model_dir=model_dir(cfg),
        budget_bpw=a.budget_bpw,
        budget_bytes=a.budget_bytes,
        default=QuantSpec(bits=a.default_bits, group_size=a.default_group_size, mode=a.default_mode),
        out_dtype=cfg.quant.dtype,
        shard_bytes=cfg.io.shard_bytes,
    )


def _check_synth_room(cfg: Any) -> None:
    """A synth step's checkpoint must fit the disk and memory (see mlxbun.synth.write.check_room)."""
    spec = synth_write.resolve_spec(**{k: v for k, v in asdict(cfg.synth).items() if k != "out"})
    out = Path(cfg.synth.out).expanduser() if cfg.synth.out else Path(cfg.paths.run_dir) / "synth" / "model"
    synth_write.check_room(spec, out=out, partial_root=None)


def final_out(cfg: Any, steps: list[str]) -> Any:
    """``quant.out`` names where the run's model goes: when a tune step follows quantize, the
    tuned model goes there (tune.out) and quantize's stays in its step directory."""
    if "tune" in steps and "quantize" in steps[: steps.index("tune")] and cfg.quant.out and not cfg.tune.out:
        return set_key(set_key(cfg, "tune.out", cfg.quant.out), "quant.out", None)
    return cfg


_now = time.monotonic  # the run's clock (tests replace it)
MIN_TUNE_MINUTES = 0.5  # a tune step past the run's budget still trains: a few steps per block
# tune.max_minutes bounds tune's blocks and validation KL; writing and checking the model come
# after them and grow with the model as the blocks' share does
TUNE_CLOSING_SHARE = 0.1


def budgeted_tune(cfg: Any, elapsed_minutes: float) -> Any:
    """``cfg`` with tune.max_minutes lowered to what ``pipeline.max_minutes`` leaves after
    ``elapsed_minutes``, less writing and checking tune's model (:data:`TUNE_CLOSING_SHARE`), at
    least :data:`MIN_TUNE_MINUTES`; unchanged without a run budget."""
    budget = cfg.pipeline.max_minutes
    if budget is None:
        return cfg
    left = max(MIN_TUNE_MINUTES, (budget - elapsed_minutes) * (1 - TUNE_CLOSING_SHARE))
    own = cfg.tune.max_minutes
    if own is not None and own <= left:
        return cfg
    log.info(
        "pipeline: %.1f of pipeline.max_minutes=%g minutes used; tune gets %.1f of those left",
        elapsed_minutes, budget, left,
    )  # fmt: skip
    return set_key(cfg, "tune.max_minutes", round(left, 2))


def run_steps(cfg: Any, steps: list[str]) -> RunResult:
    cfg = final_out(cfg, steps)
    check_steps(cfg, steps)
    total = RunResult()
    run_dir, seen, provided = Path(cfg.paths.run_dir), {}, {}
    t0 = _now()
    for step in steps:
        if step == "tune":
            cfg = budgeted_tune(cfg, (_now() - t0) / 60)
        seen[step] = seen.get(step, 0) + 1
        sub = step if seen[step] == 1 else f"{step}-{seen[step]}"
        step_cfg = set_key(
            set_key(copy.deepcopy(cfg), "paths.run_dir", str(run_dir / sub)), "command.name", step
        )
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
        result = commands.resolve(step)(step_cfg)  # looked up at call time: tests replace it
        _release()
        for key, value in result.provides.items():
            cfg = set_key(cfg, key, value)
            provided[key] = value
        total.outputs += result.outputs
        total.written = [
            *(total.written or []),
            *(result.outputs if result.written is None else result.written),
        ]
        total.inputs += [p for p in result.inputs if not _under(p, run_dir)]
        total.metrics[sub] = result.metrics
        if result.message:
            total.message += f"[{sub}] {result.message}\n"
    # what the run ends with (e.g. model.name: the last step's model), for the manifest's reader
    total.metrics["provides"] = provided
    if "model.name" in provided:
        total.message += f"\nmodel: {provided['model.name']}"
    total.message = total.message.rstrip()
    return total


def _release() -> None:
    """A finished step's memory back to the OS before the next starts: its objects (a model in
    float32, say) collected, and MLX's cache of freed buffers emptied (MLX keeps freed buffers
    for reuse, so one step's peak would otherwise stay resident through the next)."""
    gc.collect()
    if (mx := sys.modules.get("mlx.core")) is not None:
        mx.clear_cache()


def _under(path: Path, root: Path) -> bool:
    try:
        Path(path).resolve().relative_to(root.resolve())
        return True
    except ValueError:
        return False


def run(cfg: Any) -> RunResult:
    return run_steps(cfg, list(cfg.pipeline.steps))
