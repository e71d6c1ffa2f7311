"""sensitivity.method=exact: every (module, candidate) measured, one partial forward per probe.

For every quantizable module and every candidate bit width, the module's weight is quantized then
dequantized, the calibration samples run through the model, and the score is KL(ref || cur) =
mean over tokens of sum_v p_ref (log p_ref - log p_cur) of the float32 logits (softmax and sums
in float64), averaged over samples. ``sensitivity_ref.py`` does exactly that, one full forward
per sample. This module computes the same numbers faster:

- a module in block i only changes blocks i..L: the reference hidden state entering block i is
  kept (for all samples, one block boundary at a time) and each probe runs blocks i..L only;
  ``lm_head`` probes run the head only;
- samples run in batches; weights are float32 (fake-quantized candidates too), so matmuls go
  through the optimized BLAS on Linux CPU (MLX's bf16 and quantized CPU matmuls do not);
- reference probabilities are computed once and kept when they fit ``ref_cache_mb``; the next
  probe is queued (``mx.async_eval``) while numpy scores the previous one.

The model runs through mlx-lm's own class (``probe.Stack``), so every architecture with a block
loop works. Work is grouped by the first block a module changes ("group" = block index; 0 also
holds the embedding, L is the head).

Example:
    >>> from mlxbun.quant.sensitivity.setup import prepare
    >>> s = prepare(model_dir=d, bits=[4, 8], group_size=64, mode="affine", calib_path=None,
    ...             samples=4, seq_len=128, seed=0, method="exact", batch_size=4)
    >>> groups = {0: [t for t in s.targets if t.group == 0]}
    >>> Sweep(s.model, s.tokens, batch_size=4).run(groups, s.cands, on_group=print)
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlxbun.kl import kl_from_stats, ref_stats
from mlxbun.quant.probe import Stack, Target, fake_quant, module_at
from mlxbun.quant.spec import QuantSpec


class Sweep:
    """The fast exact sweep over groups; results go to ``on_group(group, {path: {bits: kl}})``.

    Probe forwards are built lazily and queued with ``mx.async_eval`` one ahead, so MLX computes
    the next probe while numpy scores the previous one (KL in float64 runs on the CPU too).
    """

    def __init__(self, model: Any, tokens: Any, *, batch_size: int, ref_cache_mb: float = 1024) -> None:
        self.stack = Stack(model)
        self.model = model
        n = tokens.shape[0]
        self.batches = [mx.array(tokens[i : i + batch_size]) for i in range(0, n, batch_size)]
        self.n_samples = n
        self.h_last = [self._eval(self.stack.forward(b, stop=self.stack.n)) for b in self.batches]
        self.ref_cache_mb = ref_cache_mb
        self._ref: list | None = None

    @staticmethod
    def _eval(x: Any) -> Any:
        mx.eval(x)
        return x

    def ref_logits(self, j: int) -> Any:
        """Reference logits of batch j (lazy; built with the weights in place now)."""
        return self.stack.forward(self.batches[j], start=self.stack.n, h=self.h_last[j])

    def cache_refs(self) -> None:
        """Keep every batch's reference statistics when they fit ``ref_cache_mb``."""
        first = ref_stats(self.ref_logits(0))
        if first[0].nbytes * len(self.batches) <= self.ref_cache_mb * (1 << 20):
            self._ref = [first] + [ref_stats(self.ref_logits(k)) for k in range(1, len(self.batches))]

    def advance(self, hs: list | None, frm: int, to: int) -> list | None:
        """Hidden states entering block ``to`` from those entering block ``frm`` (None = tokens)."""
        if to == 0:
            return None
        if to == self.stack.n:
            return self.h_last
        if frm == to:
            return hs
        return [
            self._eval(self.stack.forward(b, start=frm, h=None if hs is None else hs[j], stop=to))
            for j, b in enumerate(self.batches)
        ]

    def probe_graphs(self, g: int, target: Target, cand: QuantSpec, hs: list | None):
        """Lazy (logits, ref logits or None) per batch with ``target`` fake-quantized; weight restored."""
        mod = module_at(self.model, target.path)
        original = mod.weight
        quantized = fake_quant(original, cand, dtype=target.dtype)
        for j, b in enumerate(self.batches):
            ref = None if self._ref is not None else self.ref_logits(j)
            mod.weight = quantized  # the graph keeps this array; swapping back does not change it
            try:
                logits = self.stack.forward(b, start=g, h=None if hs is None else hs[j])
            finally:
                mod.weight = original
            mx.async_eval(logits if ref is None else [logits, ref])
            yield j, logits, ref

    def jobs(self, groups: dict[int, list[Target]], cands: list[QuantSpec]):
        """Every probe in order, then ("done", g) after the last probe of group g."""
        hs, at = None, 0
        for g in sorted(groups):
            hs, at = self.advance(hs, at, g), g
            for t in groups[g]:
                for c in cands:
                    if c.matches(t.current):
                        yield "zero", g, t, c, None
                        continue
                    for job in self.probe_graphs(g, t, c, hs):
                        yield "probe", g, t, c, job
            yield "done", g, None, None, None

    def run(
        self, groups: dict[int, list[Target]], cands: list[QuantSpec], *, on_group, progress=None
    ) -> None:
        self.cache_refs()
        self.n_cands = len(cands)
        totals: dict[int, dict[str, dict[str, float]]] = {}
        pending = None
        for job in self.jobs(groups, cands):
            if pending is not None:
                self._consume(pending, totals, groups, on_group, progress)
            pending = job  # the job just queued computes while the previous one is scored
        if pending is not None:
            self._consume(pending, totals, groups, on_group, progress)

    def _consume(self, job: tuple, totals: dict, groups: dict, on_group, progress) -> None:
        kind, g, t, c, payload = job
        if kind == "done":
            results = {
                p: {b: v / self.n_samples for b, v in kl.items()} for p, kl in totals.pop(g, {}).items()
            }
            on_group(g, results)
            return
        acc = totals.setdefault(g, {}).setdefault(t.path, {})
        acc.setdefault(str(c.bits), 0.0)
        if progress is not None:  # a module counts once all its probes are in; work = blocks run
            share = 1.0 / (self.n_cands * (len(self.batches) if kind == "probe" else 1))
            progress.update(share, work=share * self.n_cands * (self.stack.n - g + 1))
        if kind == "probe":
            j, logits, ref = payload
            stats = self._ref[j] if ref is None else ref_stats(ref)
            for v in kl_from_stats(stats, logits).tolist():  # sample order, as the reference sums
                acc[str(c.bits)] += v


def group_cost(g: int, targets_in: list[Target], n_blocks: int, n_cands: int) -> int:
    """The blocks a group's probes run, over all its modules and candidates."""
    return len(targets_in) * n_cands * (n_blocks - g + 1)
