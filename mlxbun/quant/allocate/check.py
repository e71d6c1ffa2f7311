"""allocate.check: a plan quantized for real, and its measured KL against the objective's prediction.

The objective (summed per-module KL) misses how modules interact, and for candidates whose KL is
estimated (other rounding methods, group sizes or modes than the measured ones) the estimate can be
off by a factor that depends on the quantizer. :func:`correction_factors` measures that factor per
quantizer with whole-model probes around a plan:

    base   = the plan with every module at its measured reference (RTN, same bits)
    r      = measured KL(base) / predicted KL(base)                  how modules interact
    probe_k= the plan's modules of quantizer k as planned, the rest at their reference; when those
             carry under PROBE_SHARE of the probe's predicted KL, the rest's largest are made k's
             too (k at their reference's bits), so the factor is not the noise of a small share
    f_k    = (measured KL(probe_k) / r - predicted KL of the rest) / predicted KL of k's modules

``rescaled`` multiplies every candidate of quantizer k by f_k before solving again.

Example:
    >>> probes = correction_factors(plan.layers, lambda p, s: sens.layers[p].kl[s], measure)
    >>> better = allocate(rescaled(sens, {p.key: p.factor for p in probes}), ...)
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxbun.errors import InputError
from mlxbun.kl import kl_rows, log_probs
from mlxbun.quant.allocate import budget
from mlxbun.quant.allocate.budget import SizeReport
from mlxbun.quant.calibration import load_calibration
from mlxbun.quant.mlxlm import load_tokenizer
from mlxbun.quant.probe import load_model
from mlxbun.quant.sensitivity.file import LayerSensitivity, Sensitivity
from mlxbun.quant.spec import MODE_BITS, QuantSpec

FACTOR_RANGE = (0.1, 10.0)  # a probe's factor is clipped to this: one noisy probe cannot dominate
# A probe's factor is its quantizer's share of the measured KL over its share of the predicted:
# the whole model's measurement noise over that share. Under PROBE_SHARE, the probe takes more
# modules at the quantizer (on the 8-layer fixture one clip module of 58 measured factors
# 0.47-0.68, moved 42 modules to clip and cost 9% more held-out KL at three sizes); a quantizer
# that still carries under MIN_PROBE_SHARE is not probed (factor 1).
PROBE_SHARE = 0.5
# of the probes: in the name of the corrected estimates a run keeps (2: PROBE_SHARE; 3: rounds
# of probes until the corrected plan uses no quantizer left unmeasured; 4: a tied embedding's
# GPTQ probed apart)
VERSION = 4
MIN_PROBE_SHARE = 0.05


@dataclass(frozen=True)
class CheckResult:
    """The plan quantized for real: sizes predicted vs written, summed vs measured KL."""

    out: Path
    predicted: SizeReport
    measured: SizeReport
    predicted_kl_sum: float
    measured_kl: float
    calibration_fingerprint: str
    calibration_matches: bool

    def to_json(self, *, base: Path | None = None) -> dict[str, Any]:
        """JSON for check.json; ``model`` is relative to ``base`` (the file's directory) when inside it."""
        out = self.out
        if base is not None and out.resolve().is_relative_to(base.resolve()):
            out = out.resolve().relative_to(base.resolve())
        return {
            "model": str(out),
            "predicted": self.predicted.to_json(),
            "measured": self.measured.to_json(),
            "size_exact": self.predicted == self.measured,
            "predicted_kl_sum": self.predicted_kl_sum,
            "measured_kl": self.measured_kl,
            "measured_over_predicted": self.measured_kl / self.predicted_kl_sum
            if self.predicted_kl_sum
            else None,
            "calibration_fingerprint": self.calibration_fingerprint,
            "calibration_matches_sensitivity": self.calibration_matches,
        }


KL_BYTES = 64 << 20  # float64 log-probs held at once by measured_kl (a 150K vocabulary: ~50 tokens;
# each of its float64 temporaries is this size, so it bounds the probes' peak, not only their speed)


def measured_kl(
    ref_dir: str | Path, model_dir: str | Path, tokens: Any, *, batch_size: int = 8, reference: Any = None
) -> float:
    """KL(reference || model) of the output distributions, mean over tokens and samples.

    Both models run dequantized in float32 (BLAS matmuls on CPU), as the sensitivity probes do,
    so the number is on the same scale as the per-layer KLs it is compared with. ``reference``:
    ``ref_dir`` already loaded by :func:`load_model` (not loaded again). Samples go ``batch_size``
    at a time, fewer (and their tokens in slices) when their float64 log-probs would pass
    :data:`KL_BYTES`.
    """
    import numpy as np

    ref = reference if reference is not None else load_model(ref_dir)[0]
    cur, _, _ = load_model(model_dir)
    n, length = tokens.shape
    per_token = 8 * ref(mx.array(tokens[:1, :1])).shape[-1]
    batch_size = max(1, min(batch_size, KL_BYTES // (per_token * length)))
    step = max(1, min(length, KL_BYTES // per_token))
    total = 0.0
    for i in range(0, n, batch_size):
        batch = mx.array(tokens[i : i + batch_size])
        r, c = ref(batch), cur(batch)
        for t in range(0, length, step):
            rows = kl_rows(log_probs(r[:, t : t + step]), c[:, t : t + step])  # mean over the slice
            total += float(np.sum(np.asarray(rows, dtype=np.float64))) * min(step, length - t) / length
    return total / n


def check_plan(
    plan: Any,
    *,
    model_dir: str | Path,
    written: str | Path,
    calib_path: str | None = None,
    samples: int = 24,
    seq_len: int = 512,
    seed: int = 0,
    expected_calibration: str | None = None,
    measure: Callable[[Path], float] | None = None,
) -> CheckResult:
    """The model ``written`` with the plan (an ``allocate.Allocation``; allocate runs quantize)
    against the plan: its size and its KL to ``model_dir`` (``measure(written)``: the KL against a
    reference already computed on the same calibration, e.g. ``InModel.kl_of``; default
    :func:`measured_kl`).

    Example:
        >>> r = check_plan(plan, model_dir=src, written="run/model", samples=8, seq_len=256)
        >>> r.predicted == r.measured, r.measured_kl, r.predicted_kl_sum
    """
    written = Path(written)
    measured = budget.measure(written, parameters=plan.size.parameters)
    tok = load_tokenizer(Path(model_dir))
    calib = load_calibration(tokenizer=tok, path=calib_path, samples=samples, seq_len=seq_len, seed=seed)
    kl = measured_kl(model_dir, written, calib.tokens) if measure is None else measure(written)
    return CheckResult(
        out=written,
        predicted=plan.size,
        measured=measured,
        predicted_kl_sum=plan.kl_sum,
        measured_kl=kl,
        calibration_fingerprint=calib.fingerprint,
        calibration_matches=calib.fingerprint == expected_calibration,
    )


# ------------------------------------------------------------------------------- corrections


# Rounding methods whose estimate weighs a weight's error by its inputs' Hessian. A tied
# embedding's is the head's, so the estimate leaves out what the rounding does to the lookups:
# such a module's estimates get a factor of their own, and the blocks' factor is theirs alone.
HEAD_WEIGHTED = frozenset({"gptq"})
TIED = " (tied embedding)"  # the suffix of a tied embedding's own key


def correction_key(spec: QuantSpec, *, tied: bool = False) -> str:
    """Which quantizer a candidate's KL estimate belongs to: its rounding method, or its mode;
    ``tied``: the module is a tied embedding, whose Hessian-weighted methods are keyed apart."""
    key = spec.method if spec.mode == "affine" else spec.mode
    return key + TIED if tied and key in HEAD_WEIGHTED else key


def reference_of(spec: QuantSpec) -> QuantSpec:
    """The RTN affine setting a candidate is compared with: same bits (and group size when affine)."""
    group = spec.group_size if spec.mode == "affine" else 64
    return QuantSpec(bits=spec.bits, group_size=group, mode="affine")


@dataclass(frozen=True)
class Probe:
    """One whole-model measurement: the modules of quantizer ``key`` as planned, the rest at RTN."""

    key: str
    modules: int
    predicted: float
    measured: float | None  # None: not probed (its modules' share of the KL is under MIN_PROBE_SHARE)
    factor: float
    planned: int = 0  # of ``modules``, those the plan has at this quantizer (the rest: added)

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


Layers = Mapping[str, QuantSpec | None]


def correction_factors(
    layers: Layers,
    kl: Callable[[str, QuantSpec], float | None],
    measure: Callable[[list[Layers]], list[float]],
    keys: set[str] | None = None,
    tied: Collection[str] = (),
) -> list[Probe]:
    """Per-quantizer factors from 1 + (quantizers other than RTN in ``layers``) whole-model probes,
    all measured at once. A probe whose planned modules carry under :data:`PROBE_SHARE` of its
    predicted KL takes the other modules at the quantizer too (:func:`variant`), largest predicted
    KL first, until they do; one that still carries under :data:`MIN_PROBE_SHARE` is not made
    (measured None, factor 1). ``keys``: probe only these quantizers (when none of them is made,
    nothing is measured and the list is empty); ``tied``: the tied embedding's path, when the model
    has one (its Hessian-weighted settings are probed apart, :func:`correction_key`).

    Args:
        layers: a plan's setting of every module (None: unquantized).
        kl: a module's predicted KL at a setting; None for a module the objective does not score.
        measure: the whole model's KL with each of these settings (e.g. :func:`mlxbun.quant.variants.measure`).
    """
    base = {p: (reference_of(s) if s is not None else None) for p, s in layers.items()}
    scored = [p for p, s in layers.items() if s is not None and kl(p, s) is not None]

    def predicted(settings: Layers, paths: list[str]) -> float:
        total = 0.0
        for p in paths:
            value = kl(p, settings[p])
            if value is None:
                raise InputError(f"allocate.check: no KL for {p!r} at {settings[p]}; probe its RTN reference")
            total += value
        return total

    def key_of(p: str, s: QuantSpec) -> str:
        return correction_key(s, tied=p in tied)

    planned_rtn = sum(key_of(p, layers[p]) == "rtn" for p in scored)
    pred_base = predicted(base, scored)
    planned = [("rtn", base, scored, pred_base, 0.0, planned_rtn)]
    for key in sorted({key_of(p, layers[p]) for p in scored} - {"rtn"}):
        if keys is None or key in keys:
            planned.append(_probe_settings(key, layers, base, scored, kl, predicted, key_of))
    to_measure = [
        i
        for i, (_, settings, _, pk, po, _) in enumerate(planned)
        if i == 0 or pk >= MIN_PROBE_SHARE * (pk + po)
    ]
    if keys is not None and len(to_measure) == 1:
        return []
    values = dict(zip(to_measure, measure([planned[i][1] for i in to_measure]), strict=True))
    meas_base = values[0]
    r = meas_base / pred_base if pred_base > 0 else 1.0
    probes = [Probe("rtn", len(scored), pred_base, meas_base, 1.0, planned_rtn)]
    for i, (key, _, mine, pk, po, n_planned) in enumerate(planned[1:], start=1):
        if i not in values:
            probes.append(Probe(key, len(mine), pk + po, None, 1.0, n_planned))
            continue
        m = values[i]
        f = (m / r - po) / pk if pk > 0 else 1.0
        f = min(max(f, FACTOR_RANGE[0]), FACTOR_RANGE[1])
        probes.append(Probe(key, len(mine), pk + po, m, f, n_planned))
    return probes


def _probe_settings(
    key: str,
    layers: Layers,
    base: Layers,
    scored: list[str],
    kl: Callable,
    predicted: Callable,
    key_of: Callable,
) -> tuple[str, dict, list[str], float, float, int]:
    """Quantizer ``key``'s probe: (key, settings, its modules, their predicted KL, the rest's, how
    many the plan has at ``key``); ``key_of(path, setting)``: a module's :func:`correction_key`."""
    mine = [p for p in scored if key_of(p, layers[p]) == key]
    settings = {p: (layers[p] if p in mine else base[p]) for p in layers}
    n_planned = len(mine)
    pk, po = predicted(settings, mine), predicted(base, [p for p in scored if p not in mine])
    others = [(p, variant(base[p], key)) for p in scored if p not in mine]
    values = [(kl(p, v), p, v) for p, v in others if v is not None and key_of(p, v) == key]
    for value, p, v in sorted((x for x in values if x[0] is not None), key=lambda x: -x[0]):
        if pk >= PROBE_SHARE * (pk + po):
            break
        settings[p] = v
        mine.append(p)
        pk, po = pk + value, po - kl(p, base[p])
    return key, settings, mine, pk, po, n_planned


def variant(reference: QuantSpec, key: str) -> QuantSpec | None:
    """Quantizer ``key``'s setting at an RTN ``reference``'s bits (and group size, when affine);
    None when the mode has no such bits. (A rounding method's setting the objective has not scored
    has no KL: the probe passes it by.)"""
    key = key.removesuffix(TIED)
    if key not in MODE_BITS:
        return QuantSpec(bits=reference.bits, group_size=reference.group_size, method=key)
    if key != "affine" and reference.bits in MODE_BITS[key]:
        return QuantSpec(mode=key)
    return None


def rescaled(sens: Sensitivity, factors: Mapping[str, float], tied: Collection[str] = ()) -> Sensitivity:
    """Every candidate's KL times its quantizer's factor (:func:`correction_key`; absent: 1);
    ``tied``: the tied embedding's path, when the model has one."""
    layers = {
        path: LayerSensitivity(
            path,
            layer.params,
            {s: v * factors.get(correction_key(s, tied=path in tied), 1.0) for s, v in layer.kl.items()},
        )
        for path, layer in sens.layers.items()
    }
    return Sensitivity(
        layers, sens.model_fingerprint, sens.calibration_fingerprint, sens.path, sens.calibration
    )
