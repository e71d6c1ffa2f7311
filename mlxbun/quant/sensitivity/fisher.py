"""sensitivity.method=fisher: every module's KL at every candidate from one backward pass per sample.

The exact method (``exact.py``) runs one partial forward per (module, candidate): its cost
grows with modules x candidates x depth. This estimate costs about ``3 + candidates`` forward
passes over the calibration set, whatever the depth or the number of candidates:

1. **Fisher pass** (``backward.py``; one forward, then one backward a block at a time): the
   gradient g_t of sampled labels' log-likelihood at every module's output; a weight change's
   KL is estimated as 1/(2T) * sum_t (g_t . dW x_t)^2, cross-channel terms included. Each
   block's modules are scored where its backward runs: quantize -> dequantize the weight once
   per candidate, then one matmul with the block's inputs.
2. **Calibration** (per candidate, over an eighth of the calibration samples per group of
   modules: one role, and at <= 3 bits one quarter of the depth): the group's modules at
   candidate s together, KL(ref || cur) measured exactly (``variants.measure``: every group in
   one streamed pass from the first block it changes); its scores are scaled by measured / sum
   of estimates. This corrects the second-order formula where it breaks (2-3 bits, where KL
   stops being quadratic) and keeps the knapsack's trade-off between bit widths on the measured
   scale. 8 bits takes 6 bits' factors (``carried``): both are deep in the quadratic regime, the
   factors measured at 8 bits swing by role, and it saves a forward per role.
3. **Exact refinement** (optional, ``refine``): a fraction of the modules is measured exactly at
   a few bit widths on the same subset (one variant each), and each module's estimate is
   scaled to its measurement.

Everything reads the model a decoder block at a time (:class:`mlxbun.quant.stream.Stream`), so
memory does not grow with depth.

The returned numbers are per-module KLs in nats per token, the same unit as the exact method's,
so ``allocate`` reads either. ``bench/sensitivity_methods.py`` compares them with exact ones.

Example:
    >>> from mlxbun.quant.sensitivity.setup import prepare
    >>> s = prepare(model_dir=d, bits=[2, 4, 8], group_size=64, mode="affine", calib_path=None,
    ...             samples=8, seq_len=256, seed=0, method="fisher", batch_size=1)
    >>> est = estimate(s.stream, s.tokens, s.targets, s.cands, seed=0)
    >>> est.kl["model.layers.0.mlp.down_proj"]["4"], est.factors["4"]
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from mlxbun.quant.probe import Target, fake_quant
from mlxbun.quant.sensitivity import variants
from mlxbun.quant.sensitivity.backward import FisherStream
from mlxbun.quant.spec import QuantSpec
from mlxbun.quant.streamed import Stream

log = logging.getLogger(__name__)


@dataclass
class Estimate:
    kl: dict[str, dict[str, float]]  # path -> {bits: calibrated KL}
    raw: dict[str, dict[str, float]]  # path -> {bits: second-order score before calibration}
    factors: dict[str, dict[str, float]]  # bits -> group -> measured KL / sum of its raw scores
    measured: dict[str, dict[str, float]]  # bits -> group -> KL with the group's modules quantized
    forward_equivalents: float
    probes: dict[str, dict[str, float]] = None  # path -> {bits: exact KL on the calibration subset}
    # path -> bits kept out of the monotone fit: every candidate of a module whose source is
    # quantized (its own setting is KL 0, and re-quantizing to a grid the source's fits in, 2 bits
    # to 4, loses less than to 5: exact KL need not fall with bits there)
    unfitted: dict[str, set[str]] = None


# ---------------------------------------------------------------- entry point


# Whole-model KL measurements (the group calibration, exact refinement and the candidates' probes)
# run on the first 1/CALIB_FRACTION of the calibration samples (at least one). 4 -> 8 halved the
# group calibration's forwards (about 5 of a 0.5B recipe's minutes) and the probes' KL; 2 against
# 4 had moved plan KL by a few percent either way (bench/results/sensitivity_draws.md).
CALIB_FRACTION = 8


def calibration_subset(tokens: Any) -> Any:
    """The calibration samples whole-model KL measurements run on: the first 1/CALIB_FRACTION."""
    return tokens[: max(1, len(tokens) // CALIB_FRACTION)]


LOW_BITS = 3  # at and below, the second-order estimate breaks down by depth: calibrate per depth too
DEPTH_BUCKETS = 4


def role(path: str) -> str:
    """What a module does, the same in every block: ``q_proj``, ``down_proj``, ``embed_tokens``..."""
    return path.rsplit(".", 1)[-1]


CARRY_BITS = 6  # affine candidates above take this candidate's factors (when it is one)
# Part of the resume cache key: bumped whenever the estimate's numbers change, so that a warm run
# never returns what an older estimator cached.
VERSION = 7


def carried(cands: list[QuantSpec]) -> dict[str, str]:
    """Candidates whose factors are not measured -> the candidate whose factors they take."""
    if not any(c.mode == "affine" and c.bits == CARRY_BITS for c in cands):
        return {}
    return {str(c.bits): str(CARRY_BITS) for c in cands if c.mode == "affine" and c.bits > CARRY_BITS}


def to_measure(
    groups: dict[str, dict[str, list[Target]]],
    cands: list[QuantSpec],
    *,
    sampled: frozenset[str] = frozenset(),
) -> dict[str, dict]:
    """The calibration groups measured, per candidate: those that change some module (a quantized
    source's own setting changes nothing: KL 0), except a carried candidate's groups whose source
    group changes every module they change (where it does not, e.g. a source already at 6 bits
    in some layers, the source's factor was measured on other modules: the group is measured).
    A group holding a module scored on a sample of the tokens (``sampled``: the head, the
    embedding) is always measured: its scores' ratio between bit widths is too noisy to carry."""
    by_bits, carry = {str(c.bits): c for c in cands}, carried(cands)

    def changed(b: str, ts: list[Target]) -> set[str]:
        return {t.path for t in ts if not by_bits[b].matches(t.current)}

    def measure(b: str, k: str) -> bool:
        mine = changed(b, groups[b][k])
        if mine & sampled:
            return True
        return bool(mine) and (b not in carry or not mine <= changed(carry[b], groups[carry[b]][k]))

    return {b: {k: ts for k, ts in by_key.items() if measure(b, k)} for b, by_key in groups.items()}


def calibration_groups(tgts: list[Target], cand: QuantSpec) -> dict[str, list[Target]]:
    """Modules quantized together in one calibration forward: one role, and at low bits one
    quarter of the depth (where the second-order estimate breaks down unevenly, e.g. late v_proj)."""
    n_blocks = max(t.group for t in tgts) + 1
    out: dict[str, list[Target]] = {}
    for t in tgts:
        key = role(t.path)
        if cand.mode == "affine" and cand.bits <= LOW_BITS:
            key += f"@{min(t.group * DEPTH_BUCKETS // n_blocks, DEPTH_BUCKETS - 1)}"
        out.setdefault(key, []).append(t)
    return out


def estimate(
    stream: Stream,
    tokens: Any,
    tgts: list[Target],
    cands: list[QuantSpec],
    *,
    seed: int,
    refine: float = 0.0,
    refine_bits: list[int] | None = None,
    progress: Callable[[float], None] | None = None,
) -> Estimate:
    """Per-module KL estimates for every candidate (see the module docstring), the model read a
    block at a time from ``stream``.

    ``refine`` is the fraction of modules probed exactly at ``refine_bits`` (see :func:`refine_kl`).
    ``progress(fraction)`` is called with the fraction of work done, counted in forward passes.
    """
    n = tokens.shape[0]
    n_sub = len(calibration_subset(tokens))
    groups = {str(c.bits): calibration_groups(tgts, c) for c in cands}
    todo = to_measure(groups, cands, sampled=frozenset({stream.embedding_path, *stream.head_paths}))
    probes = probe_plan(tgts, cands, refine=refine, refine_bits=refine_bits)
    if refine > 0 and not any(probes.values()):
        log.warning(
            "sensitivity.refine=%g probes nothing: the modules chosen are already at refine_bits=%s;"
            " choose other sensitivity.refine_bits",
            refine,
            refine_bits or "the middle candidate",
        )
    group_variants = [
        (b, k, {t.path: c for t in ts if not c.matches(t.current)})
        for c in cands
        for b in [str(c.bits)]
        for k, ts in todo[b].items()
    ]
    probe_variants = [(t, c) for t in tgts for c in probes.get(t.path, ())]
    # forward, backward (+ its recomputed forward) and the candidates' error matmuls (~1 forward
    # each) over all samples, then each variant's blocks on the subset
    head, nb = stream.head_share(), stream.n_blocks
    fwd = (4 + len(cands)) * n
    starts = [_start(stream, v) for _, _, v in group_variants] + [
        _start(stream, {t.path: c}) for t, c in probe_variants
    ]
    fwd += sum((nb - max(s, 0)) * (1 - head) / nb + head for s in starts) * n_sub
    done = [0.0]

    def tick(units: float) -> None:
        done[0] += units
        if progress is not None:
            progress(min(done[0] / fwd, 1.0))

    fp = FisherStream(stream, tgts, cands, seed=seed, tick=tick)
    try:
        raw = fp.run(tokens)
        ref = fp.reference(n_sub)
    finally:
        fp.close()
    dtypes = {t.path: t.dtype for t in tgts}

    def rtn(path: str, w: Any, spec: QuantSpec, out_dtype: Any = mx.float32, codes: bool = False) -> Any:
        return fake_quant(w, spec, dtype=dtypes[path], out_dtype=out_dtype, codes=codes)

    def on_subset(forwards: float, work: float = 0.0) -> None:  # RTN: no roundings to count
        tick(forwards * n_sub)

    kls = variants.measure(stream, ref, [v for _, _, v in group_variants], fake=rtn, tick=on_subset)
    measured: dict[str, dict[str, float]] = {}
    for (b, k, _), value in zip(group_variants, kls, strict=True):
        measured.setdefault(b, {})[k] = value
    unfitted = {t.path: {str(c.bits) for c in cands} if t.current is not None else set() for t in tgts}
    est = _calibrate(raw, measured, groups, carried(cands), unfitted, forward_equivalents=fwd / n)
    if not probe_variants:
        return est
    values = variants.measure(stream, ref, [{t.path: c} for t, c in probe_variants], fake=rtn, tick=on_subset)
    exact: dict[str, dict[str, float]] = {}
    for (t, c), value in zip(probe_variants, values, strict=True):
        exact.setdefault(t.path, {})[str(c.bits)] = value
    return refine_kl(est, exact, groups)


def _start(stream: Stream, variant: dict[str, QuantSpec]) -> int:
    return min((variants.block_of(stream, p) for p in variant), default=stream.n_blocks)


# ---------------------------------------------------------------- 4. exact refinement

REFINE_MIN_RATIO = 1e-3  # a module's correction is clipped to [1/1000, 1000] of its group's scale


def probe_plan(
    tgts: list[Target], cands: list[QuantSpec], *, refine: float, refine_bits: list[int] | None
) -> dict[str, list[QuantSpec]]:
    """The (module, candidate) pairs probed exactly: the first ``ceil(refine * modules)`` modules,
    largest first, each at ``refine_bits`` (default: the middle candidate)."""
    if refine <= 0:
        return {}
    by_bits = {c.bits: c for c in cands}
    bits = refine_bits or [sorted(by_bits)[(len(by_bits) - 1) // 2]]
    chosen = [by_bits[b] for b in bits if b in by_bits]
    count = min(len(tgts), int(np.ceil(refine * len(tgts))))
    order = sorted(tgts, key=lambda t: (-t.in_features * t.out_features, t.group, t.path))[:count]
    return {t.path: [c for c in chosen if not c.matches(t.current)] for t in order}


def refine_kl(est: Estimate, exact: dict, groups: dict) -> Estimate:
    """Each probed module's estimate scaled by exact KL (calibration subset) / estimated KL at the
    probed bits (a HIGGS-style per-module coefficient); between probed bits the log of the
    correction is interpolated in bits, beyond them held."""
    group_of = {b: {t.path: k for k, ts in g.items() for t in ts} for b, g in groups.items()}
    kl = {}
    for path, row in est.kl.items():
        ratios = {}
        for b, value in exact.get(path, {}).items():
            den = est.raw[path][b] * est.factors[b][group_of[b][path]]
            if den > 0 and value > 0:
                ratios[int(b)] = float(np.clip(value / den, REFINE_MIN_RATIO, 1 / REFINE_MIN_RATIO))
        if not ratios:
            kl[path] = row
            continue
        xs = sorted(ratios)
        logs = [np.log(ratios[x]) for x in xs]
        pre = {b: est.raw[path][b] * est.factors[b][group_of[b][path]] for b in row}
        scaled = {b: v * float(np.exp(np.interp(int(b), xs, logs))) for b, v in pre.items()}
        kl[path] = _monotone(scaled, keep=est.unfitted.get(path, set()))
    fpe = est.forward_equivalents
    return Estimate(kl=kl, raw=est.raw, factors=est.factors, measured=est.measured, forward_equivalents=fpe,
                    probes=exact, unfitted=est.unfitted)  # fmt: skip


def _calibrate(
    raw: dict,
    measured: dict,
    groups: dict,
    carry: dict[str, str],
    unfitted: dict[str, set[str]],
    *,
    forward_equivalents: float,
) -> Estimate:
    """Scale each calibration group's scores by its KL measured on the calibration subset / its
    estimate over all samples (a ``carry`` candidate's unmeasured group: by its source's factor
    for the same group); then make each module's KL non-increasing in bits, apart from the
    ``unfitted`` bits (a quantized source's module: see ``Estimate.unfitted``; the factors of
    neighbouring bits are measured apart). The denominator is the all-sample estimate: the Fisher
    scores of a small subset are noisy (sampled labels), and dividing by a noisy estimate biases
    every factor upwards."""
    factors: dict[str, dict[str, float]] = {}
    kl: dict[str, dict[str, float]] = {p: {} for p in raw}
    for b, kls in measured.items():
        factors[b] = {}
        for key, value in kls.items():
            den = sum(raw[t.path][b] for t in groups[b][key])
            factors[b][key] = value / den if den > 0 else 1.0
    for b in sorted(groups, key=lambda b: b in carry):  # sources first
        source = factors.get(carry.get(b), {})  # a group not measured: its source's, or no change
        factors[b] = {k: factors.get(b, {}).get(k, source.get(k, 1.0)) for k in groups[b]}
    for b, by_group in factors.items():
        for key, factor in by_group.items():
            for t in groups[b][key]:
                kl[t.path][b] = raw[t.path][b] * factor
    kl = {p: _monotone(row, keep=unfitted.get(p, set())) for p, row in kl.items()}
    return Estimate(
        kl=kl, raw=raw, factors=factors, measured=measured, forward_equivalents=forward_equivalents,
        unfitted=unfitted,
    )  # fmt: skip


def _monotone(row: dict[str, float], keep: set[str] = frozenset()) -> dict[str, float]:
    """KL non-increasing in bits: adjacent violators pooled (geometric mean), as in isotonic fits;
    the bits in ``keep`` are left as they are and out of the fit."""
    bits = sorted((b for b in row if b not in keep), key=int)
    blocks = [[row[b]] for b in bits]
    merged: list[list[float]] = []
    for blk in blocks:
        merged.append(blk)
        while len(merged) > 1 and _gmean(merged[-1]) > _gmean(merged[-2]):
            last = merged.pop()
            merged[-1] = merged[-1] + last
    fitted = dict(zip(bits, (_gmean(m) for m in merged for _ in m), strict=True))
    return {b: fitted.get(b, row[b]) for b in sorted(row, key=int)}


def _gmean(xs: list[float]) -> float:
    if min(xs) <= 0:
        return sum(xs) / len(xs)
    return float(np.exp(np.mean(np.log(xs))))
