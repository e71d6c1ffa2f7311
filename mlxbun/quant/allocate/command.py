"""command=allocate: per-layer quantization settings that minimise summed KL under a true size budget.

Input: ``sensitivity.json`` (per-layer KL at candidate settings, from ``command=sensitivity``) and
the source model. The budget is bits per weight (stored tensor bits over the logical parameter
count, scales, biases, embeddings and every unquantized tensor included) or bytes on disk (the
``.safetensors`` files, headers included); see ``mlxbun.quant.allocate.budget`` for both definitions. The
choice is a multiple-choice knapsack solved exactly or with a stated bound
(``mlxbun.quant.allocate.knapsack``). Output::

    <run_dir>/
        plan.json     {"version": 1, "default": {bits, group_size, mode},
                       "layers": {path: {bits, group_size, mode} | false},     what quantize reads
                       "predicted_bytes", "predicted_bpw", "predicted_kl_sum",
                       "predicted": {tensor_bytes, file_bytes, parameters, shards, bpw},
                       "budget": {...}, "solver": {exact, unit, lower_bound, gap, ...},
                       "choices": {path: {bits, group_size, mode, kl, bytes}}, "source": {...},
                       "interactions": {decisions, rounds, kl_before, kl_after, forwards}
                                       | {skipped},       with allocate.interactions
                       "sensitivity": {method, group_sizes, methods, modes, probes}}
                                       with sensitivity.candidates: what was scored, what the
                                       probes measured (``mlxbun.quant.sensitivity.candidates``)
        check.json    with allocate.check: the plan quantized, measured KL vs the reference
        model/        with allocate.check: that quantized model

With ``allocate.interactions`` (default 16) the plan is then improved in the quantized model
itself: the steps nearest the knapsack's threshold are measured with every other module quantized
as planned, and the knapsack solved again with those costs (``mlxbun.quant.allocate.interactions``); the
model's KL on the calibration set before and after is in plan.json. It needs the float32 model in
memory and is skipped (with a warning, and said in plan.json) when that does not fit.

Around the knapsack problem built and solved here: ``sensitivity_file`` reads the input,
``protect`` holds the ``allocate.protect`` rules, ``interaction_rounds`` (on ``interactions``)
the rounds, ``memory`` whether they fit, ``check`` the plan quantized and measured and the
per-quantizer corrections of the objective.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mlxbun.errors import DriftError, InputError
from mlxbun.io.atomic import atomic_write_json
from mlxbun.io.dtypes import CODES
from mlxbun.io.safetensors import read_config
from mlxbun.quant.allocate import budget
from mlxbun.quant.allocate.budget import SizeReport, Source
from mlxbun.quant.allocate.check import CheckResult, check_plan
from mlxbun.quant.allocate.interactions import InModel, Option, chosen
from mlxbun.quant.allocate.knapsack import Solution, solve
from mlxbun.quant.allocate.protect import count_blocks, fixed_setting, min_bits
from mlxbun.quant.allocate.rounds import (
    improve,
    interactions_batch,
    interactions_skip,
    interactions_skip_memory,
)
from mlxbun.quant.calibration import load_calibration, recorded_settings
from mlxbun.quant.plan import Plan, hessians_file
from mlxbun.quant.quantize.command import quantize_model_dir
from mlxbun.quant.quantize.convert import resolve_dtype
from mlxbun.quant.sensitivity.file import LayerSensitivity, Sensitivity, load_sensitivity, merge_sensitivities
from mlxbun.quant.spec import QuantSpec, Rule, check_budget
from mlxbun.runs.provenance import RunResult
from mlxbun.source.fingerprint import model_fingerprint

log = logging.getLogger("mlxbun")

PLAN_FILE = "plan.json"
DEFAULT = QuantSpec(bits=4, group_size=64, mode="affine")


# ------------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class Choice:
    """The setting one module gets (None: unquantized), its KL (None: not measured) and bytes."""

    setting: QuantSpec | None
    kl: float | None
    nbytes: int

    def to_json(self) -> dict[str, Any]:
        head = self.setting.to_dict() if self.setting else {"bits": None, "group_size": None, "mode": None}
        return {**head, "kl": self.kl, "bytes": self.nbytes, "measured": self.kl is not None}


@dataclass(frozen=True)
class Allocation:
    """A per-layer plan with its predicted size and KL: plan.json is its :meth:`to_json`."""

    default: QuantSpec
    choices: Mapping[str, Choice]
    size: SizeReport
    kl_sum: float
    budget: Mapping[str, Any] = field(default_factory=dict)
    solver: Mapping[str, Any] = field(default_factory=dict)
    source: Mapping[str, Any] = field(default_factory=dict)
    interactions: Mapping[str, Any] = field(default_factory=dict)

    @property
    def layers(self) -> dict[str, QuantSpec | None]:
        return {p: c.setting for p, c in self.choices.items()}

    @property
    def plan(self) -> Plan:
        """What ``quantize`` reads (:class:`mlxbun.quant.plan.Plan`)."""
        return Plan(default=self.default, layers=self.layers)

    def to_json(self) -> dict[str, Any]:
        """plan.json: the plan's keys, and the report beside them (which plan readers ignore)."""
        return {
            **self.plan.to_dict(),
            "predicted_bytes": self.size.file_bytes,
            "predicted_bpw": self.size.bpw,
            "predicted_kl_sum": self.kl_sum,
            "predicted": self.size.to_json(),
            "budget": dict(self.budget),
            "solver": dict(self.solver),
            "source": dict(self.source),
            "choices": {p: c.to_json() for p, c in sorted(self.choices.items())},
            **({"interactions": dict(self.interactions)} if self.interactions else {}),
        }


# ------------------------------------------------------------------------------- allocation


@dataclass
class _Problem:
    """The knapsack items (measured modules) and what is fixed around them."""

    paths: list[str]
    options: list[list[tuple[QuantSpec, int, float]]]
    fixed: dict[str, QuantSpec | None]


def _problem(
    sens: Sensitivity,
    source: Source,
    *,
    candidates: Collection[QuantSpec] | None,
    rules: Sequence[Rule],
    default: QuantSpec,
    out_dtype: str | None,
) -> _Problem:
    shapes, dtypes = source.shapes, source.weight_dtypes(out_dtype)
    unknown = sorted(set(sens.layers) - set(shapes))
    if unknown:
        raise InputError(
            f"allocate.sensitivity has module {unknown[0]!r}, which is not a quantizable module of the"
            f" model ({len(unknown)} such); pass the sensitivity of this model"
        )
    n_blocks = count_blocks(shapes)
    paths, options, fixed = [], [], {}
    for path, shape in sorted(shapes.items()):
        need = min_bits(path, rules, n_blocks=n_blocks)
        if path not in sens.layers:
            fixed[path] = fixed_setting(path, shape, default, need)
            continue
        opts = [
            (s, budget.weight_bytes(shape, s, dtypes[path]), kl)
            for s, kl in sorted(sens.layers[path].kl.items())
            if (candidates is None or s in candidates) and s.fits(shape) and s.bits >= need
        ]
        if not opts:
            measured = ", ".join(f"{s.mode}:{s.bits}:{s.group_size}" for s in sorted(sens.layers[path].kl))
            raise InputError(
                f"no candidate setting is left for {path!r} (measured {measured}; needs >= {need} bits,"
                f" in_features={shape[-1]}); widen allocate.bits/group_sizes/modes or probe more bits"
            )
        paths.append(path)
        options.append(opts)
    return _Problem(paths, options, fixed)


def _predict(
    source: Source, default: QuantSpec, layers: Mapping[str, QuantSpec | None], **kw: Any
) -> SizeReport:
    return budget.predict(source, default=default, layers=layers, **kw)


def _range_error(key: str, value: float, lo: SizeReport, hi: SizeReport) -> InputError:
    return InputError(
        f"{key}={value} cannot be met: the candidates give between {lo.bpw:.4f} and {hi.bpw:.4f} bpw"
        f" ({lo.tensor_bytes} to {hi.tensor_bytes} tensor bytes, {lo.file_bytes} to {hi.file_bytes} bytes"
        " on disk); choose a budget in that range or add lower-bit candidates"
    )


def allocate(
    sens: Sensitivity,
    *,
    model_dir: str | Path,
    candidates: Collection[QuantSpec] | None = None,
    budget_bpw: float | None = None,
    budget_bytes: int | None = None,
    protect: Sequence[str | Rule] = (),
    default: QuantSpec = DEFAULT,
    out_dtype: str | None = "bfloat16",
    shard_bytes: int = 5 << 30,
    max_states: int = 1 << 16,
    in_model: InModel | None = None,
    decisions: int = 16,
    rounds: int = 2,
) -> Allocation:
    """Choose one setting per measured module, minimising summed KL within the budget.

    Modules absent from ``sens`` (embeddings, an unprobed lm_head) take ``default`` (raised by
    ``protect`` rules) and count in the budget like everything else.

    Args:
        sens: per-module KL (see :func:`load_sensitivity`).
        model_dir: the source model the sensitivity was measured on.
        candidates: settings allowed (None: every measured one).
        budget_bpw: bits per weight over all stored tensors (``budget.SizeReport.bpw``).
        budget_bytes: bytes of the ``.safetensors`` files on disk, headers included.
        protect: ``"pattern:min_bits"`` rules (see :class:`Rule`).
        default: setting of unmeasured modules and the plan's ``default``.
        out_dtype: dtype quantize writes (scales, biases and unquantized tensors); None follows
            config.json as ``quantize`` does.
        shard_bytes: the writer's shard limit (headers are per shard).
        max_states: knapsack DP states before sizes are rounded (see ``knapsack``).
        in_model: the model to measure how modules interact in (``mlxbun.quant.allocate.interactions``);
            None: the summed objective alone.
        decisions: steps near the threshold measured per round in ``in_model``.
        rounds: re-solves at most (each kept only when the model's KL is lower).

    Example:
        >>> plan = allocate(load_sensitivity(run), model_dir=src, budget_bpw=4.5, protect=["lm_head:6"])
        >>> plan.size.bpw <= 4.5, plan.kl_sum
    """
    check_budget(budget_bpw, budget_bytes)
    code = _dtype_code(out_dtype, Path(model_dir))
    source = budget.read_source(Path(model_dir))
    rules = [r if isinstance(r, Rule) else Rule.parse(r) for r in protect]
    prob = _problem(sens, source, candidates=candidates, rules=rules, default=default, out_dtype=code)
    kw = {"out_dtype": code, "shard_bytes": shard_bytes}
    lo = _predict(source, default, {**prob.fixed, **_pick(prob, min)}, **kw)
    hi = _predict(source, default, {**prob.fixed, **_pick(prob, max)}, **kw)
    fixed_bytes = lo.tensor_bytes - sum(min(o[1] for o in opts) for opts in prob.options)
    if budget_bpw is not None:
        key, value, limit = "allocate.budget_bpw", budget_bpw, math.floor(budget_bpw * source.parameters / 8)
        capacity = limit - fixed_bytes

        def solver(p: _Problem) -> Solution | None:
            return solve(_items(p), capacity, max_states=max_states) if capacity >= 0 else None

    else:
        key, value, limit = "allocate.budget_bytes", budget_bytes, budget_bytes

        def solver(p: _Problem) -> Solution | None:
            return _solve_file_budget(p, source, default, budget_bytes, fixed_bytes, lo, max_states, kw)

    sol = solver(prob)
    if sol is None:
        raise _range_error(key, value, lo, hi)
    if (hi.tensor_bytes if budget_bpw is not None else hi.file_bytes) < limit:
        log.warning(
            "%s=%s is more than the largest plan needs (%.4f bpw, %d bytes on disk): every module takes"
            " its lowest-KL candidate and the plan is smaller than the budget", key, value, hi.bpw, hi.file_bytes,
        )  # fmt: skip
    limits = {"key": key, "value": value, "limit_bytes": limit, "unit": "tensor" if budget_bpw else "file"}
    report: dict[str, Any] = {}
    largest = all(j == _pick_index(opts, max) for opts, j in zip(prob.options, sol.choice, strict=True))
    if in_model is not None and decisions > 0:
        settings = {o[0] for opts in prob.options for o in opts}
        if why := interactions_skip(settings, largest=largest, hessians=in_model.hessians is not None):
            report = {"skipped": why}
            log.warning("allocate.interactions skipped: %s", why)
        else:
            fixed = {p: budget.resolve(p, source.shapes[p], s, {}) for p, s in prob.fixed.items()}

            def resolve(options: list[list[Option]]) -> Solution | None:
                return solver(_Problem(prob.paths, options, prob.fixed))

            sol, report = improve(
                prob.paths, prob.options, fixed, sol, resolve, in_model, decisions=decisions, rounds=rounds
            )
    plan = _plan(prob, sol, source, default, kw, sens, limits=limits, interactions=report)
    return replace(plan, solver={**plan.solver, "largest": largest})


def check_reachable(
    settings: Collection[QuantSpec],
    *,
    model_dir: str | Path,
    budget_bpw: float | None,
    budget_bytes: int | None,
    default: QuantSpec = DEFAULT,
    out_dtype: str | None = "bfloat16",
    shard_bytes: int = 5 << 30,
) -> None:
    """Refuse, before anything is measured, a budget below the smallest plan ``settings`` can give:
    every module at its smallest fitting setting (others at ``default``; protection rules only add
    bytes, so they are left out), from the safetensors headers alone. Raises :func:`allocate`'s error."""
    source = budget.read_source(Path(model_dir))
    layers = {}
    for path, shape in source.shapes.items():
        if fitting := {s: 0.0 for s in settings if s.fits(shape)}:
            layers[path] = LayerSensitivity(path, 0, fitting)
    code = _dtype_code(out_dtype, Path(model_dir))
    prob = _problem(Sensitivity(layers), source, candidates=None, rules=[], default=default, out_dtype=code)
    kw = {"out_dtype": code, "shard_bytes": shard_bytes}
    lo = _predict(source, default, {**prob.fixed, **_pick(prob, min)}, **kw)
    if budget_bpw is not None and lo.tensor_bytes > math.floor(budget_bpw * source.parameters / 8):
        key, value = "allocate.budget_bpw", budget_bpw
    elif budget_bytes is not None and lo.file_bytes > budget_bytes:
        key, value = "allocate.budget_bytes", budget_bytes
    else:
        return
    raise _range_error(key, value, lo, _predict(source, default, {**prob.fixed, **_pick(prob, max)}, **kw))


def _pick_index(opts: list[tuple[QuantSpec, int, float]], by: Any) -> int:
    return by(range(len(opts)), key=lambda k: (opts[k][1], -opts[k][2]))


def _dtype_code(dtype: str | None, model_dir: Path) -> str | None:
    """The safetensors code of the dtype ``quantize`` will write, by its own rule."""
    resolved = resolve_dtype(dtype, read_config(model_dir))
    return CODES[resolved] if resolved else None


def _pick(prob: _Problem, by: Any) -> dict[str, QuantSpec]:
    """Each item's cheapest (min) or largest (max) option by bytes."""
    return {
        p: by(opts, key=lambda o: (o[1], -o[2]))[0] for p, opts in zip(prob.paths, prob.options, strict=True)
    }


def _items(prob: _Problem) -> list[tuple[list[int], list[float]]]:
    return [([o[1] for o in opts], [o[2] for o in opts]) for opts in prob.options]


def _solve_file_budget(
    prob: _Problem,
    source: Source,
    default: QuantSpec,
    budget_bytes: int,
    fixed_bytes: int,
    lo: SizeReport,
    max_states: int,
    kw: dict[str, Any],
) -> Solution | None:
    """Headers depend (by a few bytes) on the choice: solve, measure the overshoot, tighten, repeat."""
    capacity = budget_bytes - fixed_bytes - (lo.file_bytes - lo.tensor_bytes)
    for _ in range(16):
        sol = solve(_items(prob), capacity, max_states=max_states) if capacity >= 0 else None
        if sol is None:
            return None
        layers = {**prob.fixed, **_chosen(prob, sol)}
        over = _predict(source, default, layers, **kw).file_bytes - budget_bytes
        if over <= 0:
            return sol
        # Below this choice's own bytes: a cut smaller than the slack under capacity would
        # return the same choice again.
        capacity = min(capacity, sol.nbytes) - over
    return None


def _chosen(prob: _Problem, sol: Solution) -> dict[str, QuantSpec]:
    return chosen(prob.paths, prob.options, sol.choice)


def _plan(
    prob: _Problem,
    sol: Solution,
    source: Source,
    default: QuantSpec,
    kw: dict[str, Any],
    sens: Sensitivity,
    *,
    limits: Mapping[str, Any],
    interactions: Mapping[str, Any],
) -> Allocation:
    shapes, dtypes = source.shapes, source.weight_dtypes(kw["out_dtype"])
    choices: dict[str, Choice] = {}
    for i, (path, j) in enumerate(zip(prob.paths, sol.choice, strict=True)):
        setting, nbytes, kl = prob.options[i][j]
        choices[path] = Choice(setting, kl, nbytes)
    for path, setting in prob.fixed.items():
        real = budget.resolve(path, shapes[path], setting, {})
        choices[path] = Choice(real, None, budget.weight_bytes(shapes[path], real, dtypes[path]))
    size = _predict(source, default, {p: c.setting for p, c in choices.items()}, **kw)
    solver = {
        "exact": sol.exact,
        "unit_bytes": sol.unit,
        "lower_bound": sol.lower_bound,
        "gap_bound": sol.cost - sol.lower_bound,
        "slack_bound_bytes": sol.slack_bound,
        "items": len(prob.paths),
    }
    src = {  # fingerprints, not paths: the same inputs give the same plan.json bytes anywhere
        "model_fingerprint": sens.model_fingerprint,
        "calibration_fingerprint": sens.calibration_fingerprint,
        "out_dtype": kw["out_dtype"],
        "shard_bytes": kw["shard_bytes"],
    }
    return Allocation(default, choices, size, sol.cost, dict(limits), solver, src, dict(interactions))


# ------------------------------------------------------------------------------- command


def candidate_filter(
    sens: Sensitivity,
    *,
    bits: Collection[int],
    group_sizes: Collection[int],
    modes: Collection[str],
    methods: Collection[str] = (),
) -> set[QuantSpec]:
    """Measured settings allowed by the config lists (an empty list allows any)."""
    measured = {s for layer in sens.layers.values() for s in layer.kl}
    return {
        s
        for s in measured
        if (not bits or s.bits in bits)
        and (not group_sizes or s.group_size in group_sizes)
        and (not modes or s.mode in modes)
        and (not methods or s.method in methods)
    }


def _check_boundary(cfg: Any, src: Path) -> tuple[Sensitivity, QuantSpec]:
    """Everything that can be wrong with the input, before anything is written."""
    a = cfg.allocate
    if not a.sensitivity:
        raise InputError("allocate.sensitivity is not set; pass a sensitivity.json or the run dir holding it")
    sens = load_sensitivity(a.sensitivity)
    if cfg.quant.hessians is not None:
        hessians_file(cfg.quant.hessians)
    if a.extra_sensitivity:
        extra = [load_sensitivity(x, key="allocate.extra_sensitivity") for x in a.extra_sensitivity]
        sens = merge_sensitivities([sens, *extra])
    if sens.model_fingerprint and sens.model_fingerprint != model_fingerprint(src, depth="sampled"):
        raise InputError(
            f"allocate.sensitivity={a.sensitivity!r} was measured on another model than {str(src)!r}"
            " (model fingerprints differ); pass the model it was measured on"
        )
    return sens, QuantSpec(bits=a.default_bits, group_size=a.default_group_size, mode=a.default_mode)


def _plan_from_cfg(
    cfg: Any, src: Path, sens: Sensitivity, default: QuantSpec, stack: ExitStack
) -> tuple[Allocation, InModel | None]:
    """The plan, and the model it was measured in (None without interactions), open in ``stack``:
    the check measures the written plan against its reference."""
    a = cfg.allocate
    plan = _allocate_from_cfg(cfg, src, sens, default, None)  # checks the input before any loading
    if a.interactions == 0:
        return plan, None
    cands = candidate_filter(sens, bits=a.bits, group_sizes=a.group_sizes, modes=a.modes, methods=a.methods)
    has_h = cfg.quant.hessians is not None
    why = interactions_skip(cands, largest=plan.solver["largest"], hessians=has_h) or _memory_skip(
        cfg, src, plan.size.parameters
    )
    if why:
        log.warning("allocate.interactions=%d skipped: %s", a.interactions, why)
        return replace(plan, interactions={"skipped": why}), None
    c = cfg.sensitivity.calib
    log.info(
        "allocate.interactions: the reference over %d x %d calibration tokens, then the plan in the model",
        c.samples,
        c.seq_len,
    )
    tokens, hessians = _calibration(cfg, src), cfg.quant.hessians
    in_model = stack.enter_context(InModel(src, tokens, batch_size=_batch(cfg, src), hessians=hessians))
    return _allocate_from_cfg(cfg, src, sens, default, in_model), in_model


def _vocab(src: Path) -> int:
    return int(read_config(src).get("vocab_size", 0))


def _batch(cfg: Any, src: Path) -> int:
    """Samples per forward of the interactions (see ``rounds.interactions_batch``)."""
    c = cfg.sensitivity
    return interactions_batch(batch_size=c.batch_size, seq_len=c.calib.seq_len, vocab=_vocab(src))


def _memory_skip(cfg: Any, src: Path, parameters: int) -> str | None:
    """Why interactions would not fit in memory (see ``rounds.interactions_skip_memory``)."""
    seq_len = cfg.sensitivity.calib.seq_len
    return interactions_skip_memory(
        parameters=parameters, batch=_batch(cfg, src), seq_len=seq_len, vocab=_vocab(src)
    )


def _calibration(cfg: Any, src: Path) -> Any:
    """The tokens interactions are measured on: ``sensitivity.calib``, as the check's."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    c = cfg.sensitivity.calib
    calib = load_calibration(
        tokenizer=load_tokenizer(src), path=c.path, samples=c.samples, seq_len=c.seq_len, seed=c.seed
    )
    return calib.tokens


def calibration_of(cfg: Any, sens: Sensitivity) -> Any:
    """``sensitivity.calib`` when set (a difference from the sensitivity's is said once), else the
    calibration ``sens`` was measured on, as its sensitivity.json records it."""
    c, recorded = cfg.sensitivity.calib, recorded_settings(sens.calibration)
    if recorded is None:
        return c
    if c != type(c)():
        given = {k: getattr(c, k) for k in recorded}
        given["path"] = None if c.path is None else str(Path(c.path).expanduser().resolve())
        if given != recorded:
            log.warning(
                "allocate: sensitivity.calib %s differs from the calibration %s was measured on (%s);"
                " interactions and the check use sensitivity.calib", given, sens.path, recorded,
            )  # fmt: skip
        return c
    if recorded["path"] is not None and not Path(recorded["path"]).is_file():
        raise InputError(
            f"allocate.sensitivity={str(sens.path)!r} was measured on calibration file {recorded['path']!r},"
            " which does not exist; set sensitivity.calib.path (and samples, seq_len, seed)"
        )
    return replace(c, **recorded)


def _allocate_from_cfg(
    cfg: Any, src: Path, sens: Sensitivity, default: QuantSpec, in_model: InModel | None
) -> Allocation:
    a = cfg.allocate
    return allocate(
        sens,
        model_dir=src,
        candidates=candidate_filter(
            sens, bits=a.bits, group_sizes=a.group_sizes, modes=a.modes, methods=a.methods
        ),
        budget_bpw=a.budget_bpw,
        budget_bytes=a.budget_bytes,
        protect=list(a.protect),
        default=default,
        out_dtype=cfg.quant.dtype,
        shard_bytes=cfg.io.shard_bytes,
        max_states=a.max_states,
        in_model=in_model,
        decisions=a.interactions,
        rounds=a.interaction_rounds,
    )


def candidates_record(sens: Sensitivity) -> dict[str, Any]:
    """plan.json's "sensitivity": the candidates a sensitivity.json scored and its probes' measured
    KL (``sensitivity.candidates``); empty for a sensitivity without them."""
    import json

    doc = json.loads(sens.path.read_text()) if sens.path is not None else {}
    rich = doc.get("candidates")
    if not rich:
        return {}
    keep = ("group_sizes", "methods", "modes", "probes", "probe_budget")
    return {"sensitivity": {"method": doc.get("method"), **{k: rich[k] for k in keep if k in rich}}}


def _summary(plan: Allocation, plan_path: Path) -> tuple[dict[str, Any], str]:
    metrics = {
        "predicted_bytes": plan.size.file_bytes,
        "predicted_bpw": plan.size.bpw,
        "predicted_kl_sum": plan.kl_sum,
        "exact": plan.solver["exact"],
        "gap_bound": plan.solver["gap_bound"],
    }
    it = plan.interactions
    kept = sum(r["kept"] for r in it.get("rounds", []))
    solved = "moved by interactions" if kept else "optimal" if plan.solver["exact"] else "near-optimal"
    msg = (
        f"plan: {plan.size.bpw:.4f} bpw, {plan.size.file_bytes} bytes on disk, summed KL {plan.kl_sum:.5g}"
        f" ({solved}; LP bound {plan.solver['lower_bound']:.5g}) -> {plan_path}"
    )
    if "skipped" in it:
        msg += f"\ninteractions: skipped ({it['skipped']})"
    elif it:
        metrics |= {"interactions_kl_before": it["kl_before"], "interactions_kl_after": it["kl_after"]}
        steps = sum(len(r["steps"]) for r in it["rounds"])
        msg += (
            f"\ninteractions: KL of the quantized model on the calibration text {it['kl_before']:.5g} ->"
            f" {it['kl_after']:.5g} ({steps} steps measured in {len(it['rounds'])} round(s), {kept} kept;"
            f" {it['forwards']:.1f} forward passes and one for the reference)"
        )
    return metrics, msg


def _check_from_cfg(
    cfg: Any, plan: Allocation, plan_path: Path, src: Path, sens: Sensitivity, in_model: InModel | None
) -> CheckResult:
    """Quantize with the plan into ``<run_dir>/model``; check.json; DriftError if sizes differ. With
    ``in_model`` (same calibration) the written model is measured against its reference."""
    c, run_dir = cfg.sensitivity.calib, plan_path.parent
    res = quantize_model_dir(
        src, run_dir / "model", plan=plan_path, dtype=cfg.quant.dtype, shard_bytes=cfg.io.shard_bytes,
        hessians=cfg.quant.hessians,
    )  # fmt: skip
    check = check_plan(
        plan, model_dir=src, written=res.out, calib_path=c.path, samples=c.samples, seq_len=c.seq_len,
        seed=c.seed, expected_calibration=sens.calibration_fingerprint,
        measure=None if in_model is None else in_model.kl_of,
    )  # fmt: skip
    atomic_write_json(run_dir / "check.json", check.to_json(base=run_dir))
    if check.measured != check.predicted:
        raise DriftError(f"predicted size {check.predicted} != written size {check.measured} ({check.out})")
    return check


def run(cfg: Any) -> Any:
    """command=allocate: plan.json for ``model.name`` from ``allocate.sensitivity`` and the budget."""
    from mlxbun.source.model import model_dir  # here: the name is a parameter of the library functions

    src = model_dir(cfg)
    sens, default = _check_boundary(cfg, src)
    cfg = replace(cfg, sensitivity=replace(cfg.sensitivity, calib=calibration_of(cfg, sens)))
    with ExitStack() as stack:
        plan, in_model = _plan_from_cfg(cfg, src, sens, default, stack)
        run_dir = Path(cfg.paths.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        plan_path = run_dir / PLAN_FILE
        atomic_write_json(plan_path, plan.to_json() | candidates_record(sens))
        check = _check_from_cfg(cfg, plan, plan_path, src, sens, in_model) if cfg.allocate.check else None
    outputs = [plan_path]
    metrics, msg = _summary(plan, plan_path)
    if check is not None:
        outputs += [run_dir / "check.json", check.out]
        metrics |= {"measured_bytes": check.measured.file_bytes, "measured_kl": check.measured_kl}
        msg += f"\ncheck: wrote {check.measured.file_bytes} bytes, measured KL {check.measured_kl:.5g} -> {check.out}"
    return RunResult(
        outputs=outputs,
        inputs=[src, sens.path, *(Path(x).expanduser() for x in cfg.allocate.extra_sensitivity)],
        metrics=metrics,
        message=msg,
        provides={"quant.plan": str(plan_path)},
    )
