"""sensitivity.method=fisher: every module's KL at every candidate from one backward pass per sample.

The exact method (``exact.py``) runs one partial forward per (module, candidate): its cost
grows with modules x candidates x depth. This estimate costs about ``3 + candidates`` forward
passes over the calibration set, whatever the depth or the number of candidates:

1. **Fisher pass** (``fisher_pass.py``; one forward + one backward per calibration batch): the
   gradient g_t of sampled labels' log-likelihood at every module's output; a weight change's
   KL is estimated as 1/(2T) * sum_t (g_t . dW x_t)^2, cross-channel terms included.
2. **Scores** per (module, candidate), once per pool of batches: quantize -> dequantize the
   weight once, then one matmul with the pooled inputs.
3. **Calibration** (per candidate, one forward over an eighth of the calibration samples per
   group of modules: one role, and at <= 3 bits one quarter of the depth; ``GroupKL``): the
   group's modules at candidate s together, KL(ref || cur) measured exactly; its scores are
   scaled by measured / sum of estimates. This corrects the second-order formula where it breaks
   (2-3 bits, where KL stops being quadratic) and keeps the knapsack's trade-off between bit
   widths on the measured scale. 8 bits takes 6 bits' factors (``carried``): both are deep in
   the quadratic regime, the factors measured at 8 bits swing by role, and it saves a forward
   per role.
4. **Exact refinement** (optional, ``refine``): a fraction of the modules is probed exactly at
   a few bit widths on the same subset (``exact.Sweep``), and each module's estimate is scaled
   to its probe.

The returned numbers are per-module KLs in nats per token, the same unit as the exact method's,
so ``allocate`` reads either. ``bench/sensitivity_methods.py`` compares them with exact ones.

Example:
    >>> from mlxbun.quant.sensitivity.command import prepare
    >>> s = prepare(model_dir=d, bits=[2, 4, 8], group_size=64, mode="affine", calib_path=None,
    ...             samples=8, seq_len=256, seed=0, method="fisher", batch_size=1)
    >>> est = estimate(s.model, s.tokens, s.targets, s.cands, batch_size=1, seed=0)
    >>> est.kl["model.layers.0.mlp.down_proj"]["4"], est.factors["4"]
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from mlxbun.kl import kl_from_stats, ref_stats
from mlxbun.progress import human_bytes
from mlxbun.quant.probe import Spill, Stack, Target, fake_quant, module_at, timed_forward
from mlxbun.quant.sensitivity import backward as fisher_pass
from mlxbun.quant.sensitivity.backward import FisherPass, real_module
from mlxbun.quant.sensitivity.exact import Sweep
from mlxbun.quant.spec import QuantSpec

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


# ---------------------------------------------------------------- 3. calibration


class GroupKL:
    """KL(ref || the model with a group of modules at one candidate) on the calibration subset.

    A group's forward starts at the first block it changes: the hidden state entering that block
    is computed once per batch with the original weights and kept (a deep group skips the blocks
    before it). The reference's softmax statistics are computed once per batch and spilled."""

    def __init__(self, model: Any, batches: list, refs: Spill) -> None:
        self.stack = Stack(model)
        self.model, self.batches, self.refs = model, batches, refs
        self._entry: dict[tuple[int, int], Any] = {}  # (block, batch) -> hidden state entering it
        self._stats: set[int] = set()

    def cost(self, groups: list[list[Target]]) -> float:
        """Forward-pass equivalents per calibration sample: each group from its first block
        (blocks run + head over blocks + head), and one partial forward per distinct start."""
        whole = self.stack.n + 1
        starts = [self.start(ts) for ts in groups]
        return sum((whole - s) / whole for s in starts) + sum(s / whole for s in set(starts))

    def start(self, tgts: list[Target]) -> int:
        return min(min(t.group for t in tgts), self.stack.n)

    def kl(self, tgts: list[Target], cand: QuantSpec, tick: Callable[[float], None]) -> float:
        """Mean over tokens then samples; the weights are restored."""
        start = self.start(tgts)
        share = (self.stack.n + 1 - start) / (self.stack.n + 1)
        for j, b in enumerate(self.batches):
            if start > 0 and (start, j) not in self._entry:
                self._entry[(start, j)] = self.stack.forward(b, stop=start)
                mx.eval(self._entry[(start, j)])
                tick(b.shape[0] * start / (self.stack.n + 1))
        saved = []
        try:
            for t in tgts:
                if cand.matches(t.current):
                    continue
                mod = real_module(module_at(self.model, t.path))
                saved.append((mod, mod.weight))
                mod.weight = fake_quant(mod.weight, cand, dtype=t.dtype).astype(mod.weight.dtype)
                mx.eval(mod.weight)
            total, n = 0.0, 0
            for j, b in enumerate(self.batches):
                logits = self.stack.forward(b, start=start, h=self._entry.get((start, j))).astype(mx.float32)
                mx.eval(logits)
                kl = kl_from_stats(self._ref_stats(j, b.shape[0]), logits)
                total, n = total + float(kl.sum()), n + len(kl)
                tick(b.shape[0] * share)
            return total / max(n, 1)
        finally:
            for mod, w in saved:
                mod.weight = w

    def _ref_stats(self, j: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
        if j not in self._stats:
            p, neg_entropy = ref_stats(self.refs.get(f"ref{j}")[:rows])
            self.refs.put(f"p{j}", p)
            self.refs.put(f"negent{j}", neg_entropy)
            self._stats.add(j)
            return p, neg_entropy
        return self.refs.get(f"p{j}"), self.refs.get(f"negent{j}")


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
# Part of the resume cache key: bump it whenever the estimate's numbers change, so that a warm
# run never returns what an older estimator cached (2: 8 bits takes 6 bits' factors; 3: only
# measured factors are carried, and a quantized source's own setting stays at KL 0; 4: a quantized
# source's modules are not fitted to fall with bits; 5: 8 bits is measured where 6 bits leaves
# some of its modules unchanged; 6: the calibration subset is an eighth of the samples, not a quarter).
VERSION = 6


def carried(cands: list[QuantSpec]) -> dict[str, str]:
    """Candidates whose factors are not measured -> the candidate whose factors they take."""
    if not any(c.mode == "affine" and c.bits == CARRY_BITS for c in cands):
        return {}
    return {str(c.bits): str(CARRY_BITS) for c in cands if c.mode == "affine" and c.bits > CARRY_BITS}


def to_measure(groups: dict[str, dict[str, list[Target]]], cands: list[QuantSpec]) -> dict[str, dict]:
    """The calibration groups measured, per candidate: those that change some module (a quantized
    source's own setting changes nothing: KL 0), except a carried candidate's groups whose source
    group changes every module they change (where it does not, e.g. a source already at 6 bits
    in some layers, the source's factor was measured on other modules: the group is measured)."""
    by_bits, carry = {str(c.bits): c for c in cands}, carried(cands)

    def changed(b: str, ts: list[Target]) -> set[str]:
        return {t.path for t in ts if not by_bits[b].matches(t.current)}

    def measure(b: str, k: str) -> bool:
        mine = changed(b, groups[b][k])
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
    model: Any,
    tokens: Any,
    tgts: list[Target],
    cands: list[QuantSpec],
    *,
    batch_size: int,
    seed: int,
    refine: float = 0.0,
    refine_bits: list[int] | None = None,
    progress: Callable[[float], None] | None = None,
    hint: Callable[[float], None] | None = None,
) -> Estimate:
    """Per-module KL estimates for every candidate (see the module docstring).

    ``refine`` is the fraction of modules probed exactly at ``refine_bits`` (see :func:`refine_kl`).
    ``progress(fraction)`` is called with the fraction of work done, counted in forward passes;
    ``hint(seconds)`` once at the start with the run's duration estimated from one timed forward.
    """
    n = tokens.shape[0]
    done = [0.0]

    def tick(units: float) -> None:
        done[0] += units
        if progress is not None:
            progress(min(done[0] / fwd, 1.0))

    fp = FisherPass(model, tgts, cands, seed=seed, tick=tick, samples=n)
    if (fewer := fp.samples_per_batch(tokens, batch_size)) < batch_size:
        log.info(
            "sensitivity: fisher batches of %d samples (activations under %s)",
            fewer,
            human_bytes(fisher_pass.ACTIVATION_BYTES),
        )
        batch_size = fewer
    batches = [mx.array(tokens[i : i + batch_size]) for i in range(0, n, batch_size)]
    n_sub = len(calibration_subset(tokens))
    sub = [mx.array(tokens[i : min(i + batch_size, n_sub)]) for i in range(0, n_sub, batch_size)]
    groups = {str(c.bits): calibration_groups(tgts, c) for c in cands}
    todo = to_measure(groups, cands)
    probes = probe_plan(tgts, cands, refine=refine, refine_bits=refine_bits)
    if refine > 0 and not any(probes.values()):
        log.warning(
            "sensitivity.refine=%g probes nothing: the modules chosen are already at refine_bits=%s;"
            " choose other sensitivity.refine_bits",
            refine,
            refine_bits or "the middle candidate",
        )
    refs = Spill()
    calib = GroupKL(model, sub, refs)
    # fisher pass ~ forward + backward + the candidates' error matmuls (~1 forward each)
    fwd = (3 + len(cands)) * n
    fwd += calib.cost([ts for c in cands for ts in todo[str(c.bits)].values()]) * n_sub
    fwd += probe_cost(tgts, probes, n_blocks=max(t.group for t in tgts)) * n_sub  # in samples

    if hint is not None:
        hint(timed_forward(model, tokens, batch_size) * fwd / min(batch_size, n))
    try:
        for j, b in enumerate(batches):
            refs.put(f"ref{j}", fp.run(b))
        raw = fp.scores()
        measured = {
            str(c.bits): {k: calib.kl(ts, c, tick) for k, ts in todo[str(c.bits)].items()} for c in cands
        }
    finally:
        refs.close()
        fp.close()
    measured = {b: kls for b, kls in measured.items() if kls}
    unfitted = {t.path: {str(c.bits) for c in cands} if t.current is not None else set() for t in tgts}
    est = _calibrate(raw, measured, groups, carried(cands), unfitted, forward_equivalents=fwd / n)
    if not probes:
        return est
    exact = exact_probes(model, tokens[:n_sub], tgts, probes, batch_size=batch_size, tick=tick)
    return refine_kl(est, exact, groups)


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


def probe_cost(tgts: list[Target], probes: dict[str, list[QuantSpec]], *, n_blocks: int) -> float:
    """Forward-pass equivalents per calibration-subset sample of the exact probes (blocks run)."""
    return sum((n_blocks - t.group + 1) / (n_blocks + 1) * len(probes.get(t.path, ())) for t in tgts)


class _Ticks:
    """The exact sweep's progress (blocks run) as forward-pass units of the estimate."""

    def __init__(self, tick: Callable[[float], None], *, n_blocks: int, samples: int) -> None:
        self.tick, self.scale = tick, samples / (n_blocks + 1)

    def update(self, n: float = 1, *, work: float = 0.0) -> None:
        self.tick(work * self.scale)


def exact_probes(
    model: Any, tokens: Any, tgts: list[Target], probes: dict[str, list[QuantSpec]], *, batch_size: int, tick
) -> dict[str, dict[str, float]]:
    """Exact KL of each planned (module, candidate) on ``tokens`` (the calibration subset)."""
    sweep = Sweep(model, tokens, batch_size=batch_size)
    ticks = _Ticks(tick, n_blocks=sweep.stack.n, samples=len(tokens))
    out: dict[str, dict[str, float]] = {}
    for c in sorted({c for cs in probes.values() for c in cs}, key=lambda c: c.bits):
        groups: dict[int, list[Target]] = {}
        for t in tgts:
            if c in probes.get(t.path, ()):
                groups.setdefault(t.group, []).append(t)

        def keep(g: int, results: dict) -> None:
            for path, row in results.items():
                out.setdefault(path, {}).update(row)

        sweep.run(groups, [c], on_group=keep, progress=ticks)
    return out


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
