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

The package: ``allocation`` builds and solves the knapsack problem, ``budget`` counts bytes,
``knapsack`` solves, ``protect`` applies the ``allocate.protect`` rules, ``interactions`` and
``rounds`` measure in the model, ``check`` quantizes the plan and measures it; the sensitivity.json
read here is :mod:`mlxbun.quant.sensitivity.file`.
"""

from __future__ import annotations

import json
import logging
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any

from mlxbun.errors import DriftError, InputError
from mlxbun.io.atomic import atomic_write_json
from mlxbun.quant import hessian
from mlxbun.quant.allocate.allocation import Allocation, SourceModel, allocate, candidate_filter
from mlxbun.quant.allocate.check import CheckResult, check_plan
from mlxbun.quant.allocate.interactions import InModel
from mlxbun.quant.allocate.rounds import interactions_batch, interactions_skip, interactions_skip_memory
from mlxbun.quant.calibration import load_calibration, recorded_settings
from mlxbun.quant.mlxlm import load_tokenizer
from mlxbun.quant.plan import hessians_file
from mlxbun.quant.quantize.command import quantize_model_dir
from mlxbun.quant.sensitivity.file import Sensitivity, load_sensitivity, merge_sensitivities
from mlxbun.quant.spec import QuantSpec
from mlxbun.runs.provenance import RunResult
from mlxbun.source.fingerprint import model_fingerprint
from mlxbun.source.model import model_dir

log = logging.getLogger("mlxbun")

PLAN_FILE = "plan.json"


def _check_boundary(cfg: Any, src: Path) -> tuple[Sensitivity, QuantSpec]:
    """Everything that can be wrong with the input, before anything is written."""
    a = cfg.allocate
    if not a.sensitivity:
        raise InputError("allocate.sensitivity is not set; pass a sensitivity.json or the run dir holding it")
    sens = load_sensitivity(a.sensitivity)
    if cfg.quant.hessians is not None:
        hessian.check_model(hessians_file(cfg.quant.hessians), src)
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
    cfg: Any, model: SourceModel, sens: Sensitivity, default: QuantSpec, stack: ExitStack
) -> tuple[Allocation, InModel | None]:
    """The plan, and the model it was measured in (None without interactions), open in ``stack``:
    the check measures the written plan against its reference."""
    a = cfg.allocate
    plan = _allocate_from_cfg(cfg, model, sens, default, None)  # checks the input before any loading
    if a.interactions == 0:
        return plan, None
    cands = candidate_filter(sens, bits=a.bits, group_sizes=a.group_sizes, modes=a.modes, methods=a.methods)
    has_h = cfg.quant.hessians is not None
    why = interactions_skip(cands, largest=plan.solver["largest"], hessians=has_h) or _memory_skip(cfg, model)
    if why:
        log.warning("allocate.interactions=%d skipped: %s", a.interactions, why)
        return replace(plan, interactions={"skipped": why}), None
    c = cfg.sensitivity.calib
    log.info(
        "allocate.interactions: the reference over %d x %d calibration tokens, then the plan in the model",
        c.samples,
        c.seq_len,
    )
    tokens, hessians = _calibration(cfg, model.path), cfg.quant.hessians
    batch = _batch(cfg, model)
    in_model = stack.enter_context(InModel(model.path, tokens, batch_size=batch, hessians=hessians))
    return _allocate_from_cfg(cfg, model, sens, default, in_model), in_model


def _batch(cfg: Any, model: SourceModel) -> int:
    """Samples per forward of the interactions (see ``rounds.interactions_batch``)."""
    c = cfg.sensitivity
    return interactions_batch(batch_size=c.batch_size, seq_len=c.calib.seq_len, vocab=model.vocab)


def _memory_skip(cfg: Any, model: SourceModel) -> str | None:
    """Why interactions would not fit in memory (see ``rounds.interactions_skip_memory``)."""
    return interactions_skip_memory(
        parameters=model.tensors.parameters,
        batch=_batch(cfg, model),
        seq_len=cfg.sensitivity.calib.seq_len,
        vocab=model.vocab,
    )


def _calibration(cfg: Any, src: Path) -> Any:
    """The tokens interactions are measured on: ``sensitivity.calib``, as the check's."""
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
    cfg: Any, model: SourceModel, sens: Sensitivity, default: QuantSpec, in_model: InModel | None
) -> Allocation:
    a = cfg.allocate
    return allocate(
        sens,
        model_dir=model,
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
        hessians=cfg.quant.hessians, digests=Path(cfg.paths.cache).expanduser() / "digests",
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
    src = model_dir(cfg)
    sens, default = _check_boundary(cfg, src)
    cfg = replace(cfg, sensitivity=replace(cfg.sensitivity, calib=calibration_of(cfg, sens)))
    model = SourceModel.of(src)
    with ExitStack() as stack:
        plan, in_model = _plan_from_cfg(cfg, model, sens, default, stack)
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
