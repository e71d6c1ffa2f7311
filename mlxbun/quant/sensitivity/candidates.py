"""Rich candidates: each module's KL at every bits x group size x rounding method and microscaling
mode, from its measured KL at a few RTN settings and its input Hessian.

A module's KL grows linearly with its output error on the calibration inputs, ``trace(dW H dW^T)``
(:func:`mlxbun.quant.hessian.output_error`). The sensitivity measures (or estimates) the KL of RTN
at ``sensitivity.bits`` x ``sensitivity.group_size``; every other candidate of the same bits gets::

    KL(candidate) = KL(RTN, bits, base group) x error(candidate) / error(RTN, bits, base group)

Errors of RTN, of the microscaling modes and of the range search (``clip``) are exact (one
quantize -> dequantize each). GPTQ's is estimated, not run per setting: GPTQ's output error is
exactly ``sum_k |r_k|^2 / U_kk^2`` over columns k, with ``r_k`` the column's rounding residual and
``U`` the Cholesky factor of ``H^-1`` in GPTQ's column order (:func:`mlxbun.quant.rounding.gptq_factor`). The
residual of each column is taken as the range search's at that setting (GPTQ rounds with the same
search), which gives every (bits, group size) from one factorisation per module; one exact GPTQ
per module and bits (at :data:`ANCHOR_GROUP`) then scales that bits' estimates to the real one.
Cost per module: one Cholesky, one GPTQ per bits shared by its group sizes, and one quantize per
other candidate, instead of a GPTQ per (bits, group size). :func:`gptq_agreement` measures the
estimate against the exact error (``bench/gptq_estimate.py``).

Whole-model probes (:func:`mlxbun.quant.allocate.check.correction_factors`) then rescale each quantizer's
estimates by how a plan using them measures (:func:`corrected`).

Example:
    >>> specs = settings([2, 3, 4], group_sizes=[32, 64, 128], methods=["rtn", "gptq"], modes=["mxfp4"])
    >>> errs = module_errors(w, h, specs, dtype="bfloat16")
    >>> kl = to_kl({QuantSpec(bits=4, group_size=64): 0.01}, errs, base_group=64)
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlxbun.errors import InputError
from mlxbun.progress import Progress
from mlxbun.quant import rounding, workers
from mlxbun.quant.allocate.check import Probe, correction_factors, correction_key, rescaled
from mlxbun.quant.hessian import Hessians, output_error
from mlxbun.quant.probe import Written, fake_quant
from mlxbun.quant.quantize.cache import Rounded
from mlxbun.quant.quantize.stream import stream
from mlxbun.quant.sensitivity import variants
from mlxbun.quant.sensitivity.file import LayerSensitivity, Sensitivity
from mlxbun.quant.sensitivity.fisher import calibration_subset
from mlxbun.quant.spec import CANDIDATE_METHODS as METHODS
from mlxbun.quant.spec import MODE_BITS, MODE_DEFAULTS, QuantSpec, spec_for

log = logging.getLogger("mlxbun.sensitivity")

VERSION = 6  # of the estimate: a change gives new cache keys (4: MIN_SCORE_ROWS 256 -> 128, probes
# on the calibration subset; 5: no probe of a quantizer under check.MIN_PROBE_SHARE of the KL;
# 6: GPTQ in act-order)
PROBE_BPW = 4.5  # the probes' budget when allocate has none
# Rounds of probes at most: the first around the estimates' plan, each next one only when the
# corrected plan brings in a quantizer no probe measured.
PROBE_ROUNDS = 3
SAVE_EVERY = 20.0  # seconds between saves of the modules scored so far
# A weight of more than SCORE_WEIGHTS is scored on a fixed sample of its rows (rows_scored), never
# fewer than MIN_SCORE_ROWS: every fixture's weights fit whole; a wide down_proj, the most of a
# block's scoring time, keeps MIN_SCORE_ROWS (the candidates' ratios it gives: BENCHMARKS.md).
SCORE_WEIGHTS = 1 << 18
MIN_SCORE_ROWS = 128
ANCHOR_GROUP = 64  # the group size of the one exact GPTQ per module and bits that scales the others


def settings(
    bits: Sequence[int], *, group_sizes: Sequence[int], methods: Sequence[str], modes: Sequence[str]
) -> list[QuantSpec]:
    """The candidate settings: affine ``bits`` x ``group_sizes`` x ``methods``, and ``modes`` at
    their one setting (when its bits are in ``bits``). Errors name ``sensitivity.candidates``."""
    out = []
    for m in methods:
        if m not in METHODS:
            raise InputError(f"sensitivity.candidates.methods has {m!r}; choose from {', '.join(METHODS)}")
    for b in sorted(set(bits)):
        for g in sorted(set(group_sizes)):
            spec = spec_for("affine", b, g, key="sensitivity.candidates")
            out += [QuantSpec(bits=spec.bits, group_size=spec.group_size, method=m) for m in methods]
    for mode in modes:
        if mode == "affine" or mode not in MODE_BITS:
            allowed = ", ".join(m for m in MODE_BITS if m != "affine")
            raise InputError(f"sensitivity.candidates.modes has {mode!r}; choose from {allowed}")
        if MODE_DEFAULTS[mode][1] in bits:
            out.append(spec_for(mode, key="sensitivity.candidates"))
    return sorted(set(out))


def reference(spec: QuantSpec, base_group: int) -> QuantSpec:
    """The measured RTN setting a candidate's KL is scaled from: same bits, the base group size."""
    return QuantSpec(bits=spec.bits, group_size=base_group)


# ------------------------------------------------------------------------------- output errors


def _dequantized(w: Any, spec: QuantSpec, hessian: Any, factor: Any = None) -> Any:
    """``w`` (its source dtype) rounded at ``spec`` and back, float32: what quantize would write
    (``factor``: the Hessian's ``rounding.gptq_factor``, when computed already)."""
    return fake_quant(w, spec, dtype=str(w.dtype).rpartition(".")[2], hessian=hessian, factor=factor)


def _error(dw: Any, h: Any) -> float:
    return output_error(dw, h) if h is not None else float(mx.sum(dw * dw))


def gptq_closed_form(residual: Any, inv_diag: np.ndarray) -> float:
    """``sum_k |r_k|^2 / U_kk^2``: GPTQ's output error if its residual per column were ``residual``'s."""
    col = np.asarray((residual.astype("float32") ** 2).sum(axis=0), dtype=np.float64)
    return float(np.sum(col / inv_diag.astype(np.float64) ** 2))


def module_errors(
    w: Any, h: Any, specs: Sequence[QuantSpec], *, exact_gptq: bool = False
) -> tuple[dict[QuantSpec, float], dict[str, float]]:
    """Output error of ``w`` (its source dtype, (out, in)) at every setting in ``specs`` that fits.

    ``h``: its input Hessian (None: plain squared weight error, and gptq is not scored). GPTQ is
    estimated (module docstring) unless ``exact_gptq``; the second value is each bits' scale of the
    closed form to the exact GPTQ at :data:`ANCHOR_GROUP` (empty without gptq).
    """
    ref = w.astype(mx.float32)
    h = None if h is None else mx.array(h).astype(mx.float32)
    errs: dict[QuantSpec, float] = {}
    residuals: dict[tuple[int, int], Any] = {}
    gptq = [s for s in specs if s.method == "gptq" and s.fits(w.shape)]
    for spec in specs:
        if not spec.fits(w.shape) or spec.method == "gptq":
            continue
        dw = _dequantized(w, spec, h) - ref
        errs[spec] = _error(dw, h)
        if spec.method == "clip" or (spec.method == "rtn" and (spec.bits, spec.group_size) not in residuals):
            residuals[(spec.bits, spec.group_size)] = dw
    if not gptq or h is None:
        return errs, {}
    if exact_gptq:
        for spec in gptq:
            errs[spec] = _error(_dequantized(w, spec, h) - ref, h)
        return errs, {}
    factor = rounding.gptq_factor(np.asarray(h))  # once per module: every GPTQ below shares it
    order, U = factor
    inv_diag = np.empty(len(order))
    inv_diag[order] = np.abs(np.diag(U))  # column k's U_kk, k in GPTQ's order
    closed = {}
    for spec in gptq:
        r = residuals.get((spec.bits, spec.group_size))
        if r is None:  # no rtn/clip of this setting among the candidates: the range search's own
            r = _dequantized(w, QuantSpec(bits=spec.bits, group_size=spec.group_size, method="clip"), h)
            r = r - ref
        closed[spec] = gptq_closed_form(np.asarray(r), inv_diag)
    anchors: dict[str, float] = {}
    for bits in sorted({s.bits for s in gptq}):
        mine = [s for s in gptq if s.bits == bits]
        at = min(mine, key=lambda s: (abs(s.group_size - ANCHOR_GROUP), s.group_size))
        exact = _error(_dequantized(w, at, h, factor) - ref, h)
        scale = exact / closed[at] if closed[at] > 0 else 1.0
        for spec in mine:
            errs[spec] = closed[spec] * scale
        anchors[str(bits)] = scale
    return errs, anchors


def _module_errors_on_worker(w: np.ndarray, dtype: str, h: Any, specs: list) -> tuple[dict, dict]:
    """:func:`module_errors` in a worker process (:mod:`mlxbun.quant.workers`)."""
    return module_errors(workers.received(w, dtype), workers.received_hessian(h), specs)


def to_kl(
    measured: Mapping[QuantSpec, float], errors: Mapping[QuantSpec, float], *, base_group: int
) -> dict[QuantSpec, float]:
    """Each candidate's KL: its reference's measured KL x its error / the reference's error.

    Candidates whose reference was not measured (or has no error) are left out; the measured
    settings keep their own KL."""
    out = dict(measured)
    for spec, err in errors.items():
        ref = reference(spec, base_group)
        if spec in out or ref not in measured or ref not in errors:
            continue
        base = errors[ref]
        out[spec] = measured[ref] * err / base if base > 0 else measured[ref]
    return out


# ------------------------------------------------------------------------------- the sweep


def rows_scored(rows: int, cols: int) -> np.ndarray | None:
    """The rows of a (rows, cols) weight its candidates are scored on: all (None) when it has at
    most :data:`SCORE_WEIGHTS` weights, else ``max(MIN_SCORE_ROWS, SCORE_WEIGHTS // cols)`` of
    them, drawn without replacement by a fixed seed, in order."""
    keep = max(MIN_SCORE_ROWS, SCORE_WEIGHTS // max(1, cols))
    if rows <= keep:
        return None
    return np.sort(np.random.default_rng(0).choice(rows, keep, replace=False))


def score(
    *,
    weight: Callable[[str], Any],
    targets: Sequence[Any],
    hessians: Mapping[str, Any],
    measured: Mapping[str, Mapping[QuantSpec, float]],
    specs: Sequence[QuantSpec],
    base_group: int,
    done: Collection[str] = (),
    on_module: Callable[[str, dict[QuantSpec, float], dict[str, float]], None] | None = None,
    threads: int = 1,
) -> tuple[dict[str, dict[QuantSpec, float]], dict[str, dict[str, float]]]:
    """Every target in ``measured`` but those ``done``: its KL at every candidate (:func:`to_kl`),
    and the per-bits scales of its GPTQ estimate, each also handed to ``on_module`` as it is
    finished, in target order. ``weight(path)``: a module's float32 weight (read from disk a
    module at a time when the model is streamed); each is cast to its target's source dtype
    first, as quantize rounds it. ``threads`` modules are scored
    at once (on as many processes for a big model: :mod:`mlxbun.quant.workers`).

    Every error is a sum over the weight's rows (groups lie within a row; GPTQ treats rows alike),
    and a candidate's KL uses only the ratio of two errors of the same rows, so a big weight is
    scored on a sample of its rows (:func:`rows_scored`)."""
    todo = [t for t in targets if t.path in measured and t.path not in done]
    weights = sum(t.in_features * t.out_features for t in todo)
    out, anchors = {}, {}
    with workers.pool(threads=threads, weights=weights) as pool:
        read: dict[str, Any] = {}

        def errors(t: Any) -> tuple[dict[QuantSpec, float], dict[str, float]]:
            w = read.pop(t.path)
            rows = rows_scored(w.shape[-2], w.shape[-1])
            if rows is not None:
                w = mx.take(w, mx.array(rows), axis=-2)
            w = w.astype(getattr(mx, t.dtype))
            if pool is None:
                return module_errors(w, hessians[t.path] if t.path in hessians else None, specs)
            h = workers.hessian_for(hessians, t.path)
            return workers.run(
                pool, _module_errors_on_worker, *workers.sent(w), h, list(specs), width=w.shape[-1]
            )

        def prefetch(t: Any) -> None:  # read and evaluated on this thread: MLX streams are per thread
            read[t.path] = weight(t.path)
            mx.eval(read[t.path])

        errors.prefetch = prefetch  # type: ignore[attr-defined]

        for t, (errs, anchor) in stream(todo, errors, threads=threads):
            out[t.path] = to_kl(measured[t.path], errs, base_group=base_group)
            anchors[t.path] = anchor
            if on_module is not None:
                on_module(t.path, out[t.path], anchor)
    mx.clear_cache()  # the scoring's freed buffers: not held through the probes
    return out, anchors


def corrected(
    kls: dict[str, dict[QuantSpec, float]],
    plan: Callable[[dict[str, dict[QuantSpec, float]]], Mapping[str, QuantSpec | None]],
    *,
    stream: Any,
    hessians: str | Path,
    tokens: Any,
    out_dtype: str | None = "bfloat16",
    rounded: Path | None = None,
    reference: Any = None,
) -> tuple[dict[str, dict[QuantSpec, float]], list[dict[str, Any]]]:
    """``kls`` with each quantizer's estimates rescaled by whole-model probes around the plan the
    estimates give (``plan``: estimates -> every module's setting at the budget;
    :func:`mlxbun.quant.allocate.check.correction_factors`), and the probes. The corrected
    estimates are planned again, and a quantizer that plan uses that no probe measured is probed
    in another round (at most :data:`PROBE_ROUNDS`): a raw estimate beside corrected ones is
    what the plan would otherwise lean on.

    Each probe is the model with its plan's weights as quantize would write them
    (:class:`mlxbun.quant.probe.Written`; clip and GPTQ roundings kept under ``rounded`` for
    quantize to read back), measured against the reference on the calibration subset of
    ``tokens`` (``fisher.calibration_subset``: the samples the estimate's own whole-model KLs are
    measured on), all probes in one streamed pass (:func:`mlxbun.quant.sensitivity.variants.measure`);
    ``reference``: the reference's states on that subset, when already captured."""
    cache = None
    if rounded is not None:
        with open(hessians, "rb") as f:
            cache = Rounded(rounded, hashlib.file_digest(f, "sha256").hexdigest())
    source = stream.source()
    written = Written(
        dtype=out_dtype, dtypes=source["dtypes"] | {p: stream.stored_dtype(f"{p}.weight") for p in kls},
        hessians=Hessians(hessians), rounded=cache,
    )  # fmt: skip
    ref = reference or variants.Reference.capture(stream, calibration_subset(tokens))

    def measure(settings: list[Mapping[str, QuantSpec | None]]) -> list[float]:
        t0 = time.monotonic()
        wanted = [
            {p: s for p, s in layers.items() if s is not None and not s.matches(source["current"].get(p))}
            for layers in settings
        ]
        work = variants.rounding_work(stream, written.to_round(variants.roundings(stream, wanted)))
        progress = Progress(
            total=len(wanted), unit="probes", desc="sensitivity (probes)", heartbeat=True,
            work_total=work or None,
        )  # fmt: skip
        written.tick = lambda weights: progress.update(0, work=weights)  # each rounding as it is done
        try:  # a probe's blocks and head tick as they are done
            kl = variants.measure(stream, ref, wanted, fake=written, tick=progress.update)
        finally:
            written.tick = None
            progress.close()
        log.info(
            "sensitivity.candidates: %d probes measured KL %s (%.1f s)",
            len(kl), ", ".join(f"{v:.5g}" for v in kl), time.monotonic() - t0,
        )  # fmt: skip
        return kl

    def kl(p: str, s: QuantSpec) -> float | None:
        return kls[p].get(s) if p in kls else None

    sens = Sensitivity({p: LayerSensitivity(p, 0, v) for p, v in kls.items()})
    tied = {stream.embedding_path} if stream.head_paths == (stream.embedding_path,) else set()
    probes: dict[str, Probe] = {}
    fixed = kls
    for _ in range(PROBE_ROUNDS):
        layers = plan(fixed)
        measured = {k for k, p in probes.items() if p.measured is not None}
        keys = {correction_key(s, tied=p in tied) for p, s in layers.items() if s is not None}
        unmeasured = keys - measured - {"rtn"}
        if probes and not unmeasured:
            break
        found = correction_factors(layers, kl, measure, keys=unmeasured if probes else None, tied=tied)
        if not found:
            break
        probes |= {p.key: p for p in found if p.key not in measured}
        scaled = rescaled(sens, {k: p.factor for k, p in probes.items()}, tied)
        fixed = {p: dict(layer.kl) for p, layer in scaled.layers.items()}
    return fixed, [p.to_json() for p in probes.values()]


def gptq_agreement(
    w: Any, h: Any, *, bits: Sequence[int], group_sizes: Sequence[int]
) -> list[tuple[QuantSpec, float, float]]:
    """(setting, estimated, exact) GPTQ output error of ``w`` at each bits x group size."""
    specs = settings(bits, group_sizes=group_sizes, methods=["clip", "gptq"], modes=[])
    est, _ = module_errors(w, h, specs)
    exact, _ = module_errors(w, h, specs, exact_gptq=True)
    return [(s, est[s], exact[s]) for s in specs if s.method == "gptq" and s in est]
