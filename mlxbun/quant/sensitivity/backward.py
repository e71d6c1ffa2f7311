"""The Fisher pass of ``sensitivity.method=fisher``: every (module, candidate) scored from one
forward + backward per calibration batch.

KL(ref || ref + dY) is 1/2 dY^T F dY to second order, F the Fisher information of the model's
output distribution. Labels are sampled from the model's own distribution, so the gradient g_t of
their log-likelihood with respect to a module's output at token t has E[g g^T] = F. Every target
module gets a zero "tap" added to its output; one backward gives g for all of them at once. With
dY_t = dW x_t, E[(g_t . dY_t)^2] = dY_t^T F_t dY_t, so one label sample per token gives an
unbiased estimate of the per-token KL of a weight change, cross-channel terms included:

    KL_m(dW) ~ 1/(2T) * sum_t (g_t . dW x_t)^2

(it ranks modules closer to exact than the diagonal sum_i g_ti^2 (dW x_t)_i^2). An embedding
lookup's dY_t is the row of dW its token selects; a tied head adds its own term to the same dot
product.

A batch's gradients and module inputs go to a temporary directory: memory is the model plus one
batch of activations (batches shrink to keep them under ``ACTIVATION_BYTES``); when the whole
pass's fit in ``POOL_MEMORY_BYTES`` they stay in memory. Scores are computed once per pool of
batches (``POOL_BYTES`` on disk): quantize -> dequantize the weight once, then one matmul with the
pooled inputs, so a new candidate costs one quantization and about one forward.

Example:
    >>> fp = FisherPass(model, tgts, cands, seed=0, tick=lambda units: None, samples=len(tokens))
    >>> for b in batches:
    ...     fp.run(b)
    >>> fp.scores()["model.layers.0.mlp.down_proj"]["4"]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxbun.quant.probe import Spill, Target, fake_quant, module_at
from mlxbun.quant.spec import QuantSpec

# ---------------------------------------------------------------- taps


class _Tap:
    """Stands in for a module during the Fisher pass: adds a zero tap to its output, records inputs."""

    def __init__(self, mod: Any, path: str, rec: _Recorder) -> None:
        self.mod, self.path, self.rec = mod, path, rec

    def __getattr__(self, key: str) -> Any:
        return getattr(self.mod, key)

    def __call__(self, x: Any) -> Any:
        if self.rec.kinds[self.path] == "embedding":
            self.rec.ids[self.path] = x
            return self.rec.tap(self.path, self.mod.weight[x].astype(mx.float32))
        self.rec.inputs[self.path] = x
        return self.rec.tap(self.path, self.mod(x))

    def as_linear(self, x: Any) -> Any:
        key = self.path + HEAD
        self.rec.inputs[key] = x
        return self.rec.tap(key, x @ self.mod.weight.astype(mx.float32).T)


HEAD = "@head"  # the tap of a tied embedding used as the output head
CHUNK = 1 << 22  # weights per slice of rows scored at once (bounds the float32 temporaries)
# Batches' gradients and inputs wait on disk until they reach this, then are scored together: each
# candidate's quantization error is computed once per pool, not once per batch (at 0.5B, about
# 35 s a pool for the six bit widths; a 256-token sample pools 0.72 GB there: 16 make two pools).
POOL_BYTES = 8 << 30
# A pool whose batches all fit in this stays in memory: a small model's pass skips the disk.
POOL_MEMORY_BYTES = 512 << 20
# One Fisher batch's taps, their gradients, recorded inputs and float32 logits stay under this:
# fewer samples per batch where a large vocabulary would pass it (150K: ~1 GB per 128-token sample).
ACTIVATION_BYTES = 1 << 30


class _Recorder:
    """The zero taps of one batch and what each module saw (inputs, or token ids for lookups)."""

    def __init__(self, kinds: dict[str, str]) -> None:
        self.kinds = kinds
        self.deltas: dict[str, Any] = {}
        self.inputs: dict[str, Any] = {}
        self.ids: dict[str, Any] = {}
        self.shapes: dict[str, tuple] = {}

    def tap(self, key: str, y: Any) -> Any:
        self.shapes[key] = y.shape
        return y + self.deltas[key] if key in self.deltas else y


def _install(model: Any, tgts: list[Target], rec: _Recorder) -> list[tuple[Any, str, Any]]:
    undo = []
    for t in tgts:
        parent_path, _, name = t.path.rpartition(".")
        parent = module_at(model, parent_path) if parent_path else model
        mod = getattr(parent, name)
        setattr(parent, name, _Tap(mod, t.path, rec))
        undo.append((parent, name, mod))
    return undo


def _uninstall(undo: list[tuple[Any, str, Any]]) -> None:
    for parent, name, mod in reversed(undo):
        setattr(parent, name, mod)


def real_module(mod: Any) -> Any:
    """The module behind a stand-in (_Tap)."""
    while isinstance(mod, _Tap):
        mod = mod.mod
    return mod


def _kinds(model: Any, tgts: list[Target]) -> dict[str, str]:
    def kind(path: str) -> str:
        return "embedding" if isinstance(real_module(module_at(model, path)), nn.Embedding) else "linear"

    return {t.path: kind(t.path) for t in tgts}


# ---------------------------------------------------------------- 1. Fisher pass


class FisherPass:
    """Scores every (target, candidate): the sum over tokens of (g_t . dW x_t)^2, g the gradient
    of the sampled labels' log-likelihood at the module's output."""

    def __init__(
        self,
        model: Any,
        tgts: list[Target],
        cands: list[QuantSpec],
        *,
        seed: int,
        tick: Callable[[float], None],
        samples: int | None = None,
    ) -> None:
        """``samples``: how many the pass will see, if known (a pool that fits
        POOL_MEMORY_BYTES is then kept in memory)."""
        self.model, self.tgts, self.cands, self.tick = model, tgts, cands, tick
        self.samples = samples
        self.share = {t.path: t.in_features * t.out_features for t in tgts}
        total = sum(self.share.values())
        self.share = {p: v / total for p, v in self.share.items()}
        self.rec = _Recorder(_kinds(model, tgts))
        self.key = seed
        self.sums: dict[str, dict[str, float]] = {t.path: {str(c.bits): 0.0 for c in cands} for t in tgts}
        self.tokens = 0
        self.pool = Spill()
        self._pooled: list[int] = []  # samples of each pooled batch
        self._pool_bytes = 0

    def samples_per_batch(self, tokens: Any, batch_size: int) -> int:
        """``batch_size``, or fewer so that one batch's activations stay under ACTIVATION_BYTES:
        per token, float32 taps, their gradients and inputs (3 x the summed output widths) and
        the logits with their softmax temporaries (4 x the vocabulary)."""
        undo = _install(self.model, self.tgts, self.rec)
        try:
            self.rec.deltas = {}
            logits = self.model(mx.array(tokens[:1, :1]))
            mx.eval(logits)
        finally:
            self.rec.inputs, self.rec.ids = {}, {}
            _uninstall(undo)
        widths = sum(s[-1] for s in self.rec.shapes.values())
        per_sample = 4 * tokens.shape[1] * (3 * widths + 4 * logits.shape[-1])
        return max(1, min(batch_size, ACTIVATION_BYTES // per_sample))

    def _zeros(self, batch: Any) -> dict[str, Any]:
        """Zero taps shaped like each module's output (shapes from a one-token forward)."""
        if not self.rec.shapes:
            self.rec.deltas = {}
            mx.eval(self.model(batch[:, :1]))
        n, length = batch.shape
        return {k: mx.zeros((n, length, s[-1]), dtype=mx.float32) for k, s in self.rec.shapes.items()}

    def run(self, batch: Any) -> Any:
        """One forward + backward on ``batch``, then its scores; returns the reference logits."""
        undo = _install(self.model, self.tgts, self.rec)
        try:
            deltas = self._zeros(batch)
            key = mx.random.key(self.key)
            self.key += 1

            def loglik(d: dict) -> Any:
                self.rec.deltas = d
                logits = self.model(batch).astype(mx.float32)
                y = mx.random.categorical(mx.stop_gradient(logits), key=key)
                logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
                ll = mx.take_along_axis(logp, y[..., None], axis=-1).sum()
                return (
                    ll,
                    mx.stop_gradient(logits),
                    {k: mx.stop_gradient(v) for k, v in self.rec.inputs.items()},
                )

            (_, logits, inputs), grads = mx.value_and_grad(loglik)(deltas)
            mx.eval(logits, inputs, grads)
            ids = dict(self.rec.ids)
            self.tick(3.0 * batch.shape[0])
        finally:
            self.rec.deltas, self.rec.inputs, self.rec.ids = {}, {}, {}
            _uninstall(undo)
        j = len(self._pooled)
        if self.tokens == 0 and self.samples is not None:
            nbytes = sum(v.nbytes for arrays in (grads, inputs, ids) for v in arrays.values())
            self.pool.in_memory = nbytes * self.samples <= POOL_MEMORY_BYTES * batch.shape[0]
        for kind, arrays in (("g", grads), ("x", inputs), ("ids", ids)):
            for k, v in arrays.items():
                self._pool_bytes += self.pool.put(f"{kind}{j}{k}", v)
        self._pooled.append(batch.shape[0])
        self.tokens += int(batch.size)
        if self._pool_bytes >= POOL_BYTES:
            self.flush()
        return logits

    def flush(self) -> None:
        """Scores the pooled batches: every target's gradients and inputs of all of them at once."""
        if not self._pooled:
            return
        for t in self.tgts:
            self._score(t)
            self.tick(len(self.cands) * sum(self._pooled) * self.share[t.path])
        self.pool.clear()
        self._pooled, self._pool_bytes = [], 0

    def _pooled_array(self, kind: str, key: str, cols: slice | None = None) -> np.ndarray | None:
        """``key``'s array of kind g, x or ids over the pooled batches, concatenated (None if the
        pass recorded none); ``cols`` slices the last axis, read through a memory map so that only
        the slice is resident (a tied head's gradients are the largest arrays of the pass)."""
        names = [f"{kind}{j}{key}" for j in range(len(self._pooled))]
        if not self.pool.has(names[0]):
            return None
        parts = []
        for name in names:
            whole = self.pool.get(name, mmap=cols is not None)
            parts.append(np.array(whole if cols is None else whole[..., cols]))
            del whole
        return np.concatenate(parts)

    def _g(self, key: str, cols: slice | None = None) -> Any:
        g = self._pooled_array("g", key, cols)
        return None if g is None else mx.array(g)

    def _score(self, t: Target) -> None:
        """Adds the pool's sum over tokens of (g . dY)^2 for every candidate of ``t``. Rows go in
        slices: each slice's gradients are read once, every candidate's error on those rows adds
        its part of each token's g . dY, and the dots are squared once all rows are in."""
        w = real_module(module_at(self.model, t.path)).weight
        step = max(1, CHUNK // w.shape[-1])
        todo = [c for c in self.cands if not c.matches(t.current)]
        ids = self._pooled_array("ids", t.path)
        ids = None if ids is None else mx.array(ids)
        inputs = {}
        for key in (t.path, t.path + HEAD):
            if (x := self._pooled_array("x", key)) is not None:
                inputs[key] = mx.array(x)
        lookup = None if ids is None else self._g(t.path)  # a lookup's dY is a row: all columns
        dots: dict[str, Any] = {}
        for lo in range(0, w.shape[0], step):
            rows = slice(lo, min(lo + step, w.shape[0]))
            g = {
                t.path: lookup if ids is not None else self._g(t.path, rows),
                HEAD: self._g(t.path + HEAD, rows),
            }
            wc = w[rows].astype(mx.float32)
            for c in todo:
                part = self._dots(t, fake_quant(wc, c, dtype=t.dtype) - wc, lo, g, inputs, ids)
                key = str(c.bits)
                dots[key] = part if key not in dots else dots[key] + part
                mx.eval(dots[key])
        for bits, dot in dots.items():
            self.sums[t.path][bits] += float(np.array(mx.square(dot), dtype=np.float64).sum())

    def _dots(self, t: Target, d: Any, lo: int, g: dict, inputs: dict, ids: Any) -> Any:
        """Per token, the part of g . dY from the rows lo:lo+len(d), dW = ``d``; ``g`` holds the
        gradients of those rows (the module's, and a tied head's at HEAD)."""
        dot = mx.array(0.0)  # broadcasts to [batch, tokens] with the first term
        if ids is not None:  # lookup: dY_t = dW[token_t], for the tokens whose row is in the slice
            inside = ((ids >= lo) & (ids < lo + d.shape[0]))[..., None]
            picked = d[mx.clip(ids - lo, 0, d.shape[0] - 1)]
            dot = dot + (g[t.path] * picked * inside).sum(axis=-1)
        elif g[t.path] is not None:
            dot = dot + (g[t.path] * (inputs[t.path] @ d.T)).sum(axis=-1)
        if g[HEAD] is not None:  # a tied embedding is also the head
            dot = dot + (g[HEAD] * (inputs[t.path + HEAD] @ d.T)).sum(axis=-1)
        return dot

    def scores(self) -> dict[str, dict[str, float]]:
        """Per-token KL estimates, 1/2 * sums / tokens (the pool scored first)."""
        self.flush()
        return {p: {b: 0.5 * v / max(self.tokens, 1) for b, v in row.items()} for p, row in self.sums.items()}

    def close(self) -> None:
        """Removes the pool's temporary directory."""
        self.pool.close()
