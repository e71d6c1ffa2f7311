"""The Fisher pass of ``sensitivity.method=fisher``, streamed a decoder block at a time.

KL(ref || ref + dY) is 1/2 dY^T F dY to second order, F the Fisher information of the model's
output distribution. Labels are sampled from the model's own distribution, so the gradient g_t of
their log-likelihood at a module's output at token t has E[g g^T] = F, and with dY_t = dW x_t

    KL_m(dW) ~ 1/(2T) * sum_t (g_t . dW x_t)^2

is an unbiased estimate of the per-token KL of a weight change, cross-channel terms included.
An embedding lookup's dY_t is the row of dW its token selects; a tied head adds its own term to
the same dot product before it is squared.

Everything streams (:class:`mlxbun.quant.stream.Stream`), so memory is one block's weights and
activations plus the hidden states at one block boundary, whatever the depth:

    forward    embedding, then each block; the state entering each block is kept
               (:class:`Boundaries`: in memory, or on disk when large)
    head       per slice of tokens: logits, labels sampled from them, the gradient at the last
               state (vjp through the final norm and head) and at the logits (kept on disk in
               vocabulary columns, :class:`Columns`)
    blocks     last to first: the block read, its forward recomputed from its kept input with a
               zero tap at each module's output; one vjp gives the gradient entering the block
               and at every tap, and the block's modules are scored right there
    outside    the head and the embedding, a slice of vocabulary rows at a time

Example:
    >>> fp = FisherStream(Stream(model_dir), tgts, cands, seed=0)
    >>> raw = fp.run(tokens)                      # path -> {bits: 1/2 mean over tokens of (g . dW x)^2}
    >>> fp.reference(n=2)                         # the reference's states on the first 2 windows
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxbun.io.staging import ScratchDir
from mlxbun.quant.probe import Target, fake_quant
from mlxbun.quant.sensitivity.variants import Reference
from mlxbun.quant.spec import QuantSpec
from mlxbun.quant.streamed import Stream

BOUNDARY_MEMORY = 256 << 20  # the kept block inputs stay in memory up to this, else go to disk
ACTIVATION_BYTES = 512 << 20  # one block's recomputed forward and backward: windows per batch
CHUNK = 1 << 22  # weights per slice of vocabulary rows scored at once
COLUMNS_MEMORY = 256 << 20  # the logits' gradients stay in memory up to this, else go to disk
HEAD_TOKENS = 512  # tokens whose head and lookups are scored (scored_rows)


class Boundaries:
    """The hidden state entering each block, [n, T, D] float32 each: in memory, or one .npy file
    a block in a scratch directory when all of them would pass :data:`BOUNDARY_MEMORY`."""

    def __init__(self, count: int, shape: tuple[int, ...]) -> None:
        self.disk = count * int(np.prod(shape)) * 4 > BOUNDARY_MEMORY
        self._dir = ScratchDir("mlxbun-fisher-") if self.disk else None
        self._kept: dict[int, Any] = {}

    def put(self, i: int, h: mx.array) -> None:
        if self._dir is None:
            self._kept[i] = h
            return
        np.save(Path(self._dir.name) / f"{i}.npy", np.asarray(h))

    def get(self, i: int, rows: slice = slice(None)) -> mx.array:
        if self._dir is None:
            return self._kept[i][rows]
        return mx.array(np.load(Path(self._dir.name) / f"{i}.npy", mmap_mode="r")[rows])

    def close(self) -> None:
        self._kept = {}
        if self._dir is not None:
            self._dir.cleanup()


class Columns:
    """A [rows, vocab] float32 matrix written a slice of rows at a time and read a slice of
    columns at a time (the logits' gradients): in memory when small, else one file per column
    slice, so a read is one contiguous block."""

    def __init__(self, rows: int, cols: int, step: int) -> None:
        self.rows, self.cols, self.step = rows, cols, step
        self.memory = rows * cols * 4 <= COLUMNS_MEMORY
        self._whole = np.zeros((rows, cols), np.float32) if self.memory else None
        self._dir = None if self.memory else ScratchDir("mlxbun-fisher-")
        self._files: dict[int, Any] = {}

    def write(self, lo: int, block: np.ndarray) -> None:
        if self._whole is not None:
            self._whole[lo : lo + len(block)] = block
            return
        for c in range(0, self.cols, self.step):
            f = self._files.get(c)
            if f is None:
                f = self._files[c] = open(Path(self._dir.name) / f"{c}.bin", "w+b")  # noqa: SIM115
            part = np.ascontiguousarray(block[:, c : c + self.step])
            os.pwrite(f.fileno(), part.tobytes(), lo * part.shape[1] * 4)

    def read(self, c: int) -> np.ndarray:
        if self._whole is not None:
            return self._whole[:, c : c + self.step]
        width = min(self.step, self.cols - c)
        data = os.pread(self._files[c].fileno(), self.rows * width * 4, 0)
        return np.frombuffer(data, np.float32).reshape(self.rows, width)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files, self._whole = {}, None
        if self._dir is not None:
            self._dir.cleanup()


class _Tap(nn.Module):
    """Stands in for a block's linear: records its input and adds a zero tap to its output."""

    def __init__(self, module: Any, key: str, rec: dict) -> None:
        super().__init__()
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "_key", key)
        object.__setattr__(self, "_rec", rec)

    def __call__(self, x: Any) -> Any:
        rec, key = object.__getattribute__(self, "_rec"), object.__getattribute__(self, "_key")
        rec["inputs"][key] = x
        y = object.__getattribute__(self, "_module")(x)
        rec["widths"][key] = int(y.shape[-1])
        delta = rec["deltas"].get(key)
        return y if delta is None else y + delta


class FisherStream:
    """Scores every (target, candidate) with one streamed forward and backward (module docstring)."""

    def __init__(
        self,
        stream: Stream,
        tgts: list[Target],
        cands: list[QuantSpec],
        *,
        seed: int,
        tick: Callable[[float], None] = lambda units: None,
    ) -> None:
        self.stream, self.cands, self.seed, self.tick = stream, cands, seed, tick
        self.tgts = {t.path: t for t in tgts}
        total = sum(t.in_features * t.out_features for t in tgts) or 1
        # a module's share of a forward: its candidates' scores cost about one forward each in all
        self.share = {t.path: t.in_features * t.out_features / total for t in tgts}
        self.sums = {t.path: {str(c.bits): 0.0 for c in cands} for t in tgts}
        self.tokens = self.n_samples = 0
        self.bounds: Boundaries | None = None
        self.final: mx.array | None = None

    def todo(self, path: str) -> list[QuantSpec]:
        t = self.tgts[path]
        return [c for c in self.cands if not c.matches(t.current)]

    # ------------------------------------------------------------------ the pass

    def run(self, tokens: np.ndarray) -> dict[str, dict[str, float]]:
        """Per-token KL estimates of every target at every candidate (1/2 mean of the squares).

        ``tick(units)`` is called as work is done, in samples x forwards: a forward and a backward
        (3, its forward recomputed) over every sample, and each module's candidates' scores (one
        forward's share of the module per candidate): ``(4 + candidates) x samples`` in all."""
        s = self.stream
        n, length = tokens.shape
        self.tokens, self.n_samples = int(tokens.size), int(tokens.shape[0])
        self._windows = np.asarray(tokens)
        unit = n / (s.n_blocks + 1)  # samples x forward share of one block
        h = s.embed(tokens)
        self.bounds = Boundaries(s.n_blocks, h.shape)
        for i in range(s.n_blocks):
            self.bounds.put(i, h)
            with s.loaded(i):
                h = _batched(lambda x, i=i: s.run(i, x), h, self._batch(i, h))
            self.tick(unit)
        self.final = h
        grad, head_dots = self._head(tokens)
        for i in reversed(range(s.n_blocks)):
            grad = self._block(i, grad)
            self.tick(3 * unit)
        self._outside(tokens, grad, head_dots)
        return {p: {b: 0.5 * v / max(self.tokens, 1) for b, v in row.items()} for p, row in self.sums.items()}

    def reference(self, n: int) -> Reference:
        """The reference's states on the first ``n`` windows of the pass (for whole-model KLs)."""
        ref = Reference(tokens=self._windows[:n])
        ref.states = [self.bounds.get(i, slice(0, n)) for i in range(self.stream.n_blocks)]
        ref.final = self.final[:n]
        return ref.fit(self.stream)

    def close(self) -> None:
        if self.bounds is not None:
            self.bounds.close()

    def _batch(self, i: int, h: mx.array) -> int:
        """Windows per batch of block ``i``'s recomputed forward and backward."""
        widths = sum(
            t.in_features + t.out_features
            for p, t in self.tgts.items()
            if p.startswith(f"{self.stream.prefix}{i}.")
        )
        per_window = 4 * h.shape[1] * (6 * h.shape[2] + 3 * widths)
        return max(1, min(h.shape[0], ACTIVATION_BYTES // max(per_window, 1)))

    # ------------------------------------------------------------------ head

    def _head(self, tokens: np.ndarray) -> tuple[mx.array, dict[str, np.ndarray]]:
        """The gradient at the last state (every token), and the head's dots per candidate on the
        scored tokens (:meth:`scored_rows`; a tied head's are kept to be added to the lookups', an
        untied head is scored here)."""
        s = self.stream
        h = self.final.reshape(-1, self.final.shape[-1])
        rows, step = h.shape[0], s.token_rows()
        head = s.head_paths[0]
        scored = head in self.tgts
        picked = self.scored_rows(rows)
        where = np.full(rows, -1, np.int64)
        where[picked] = np.arange(len(picked))
        width = max(1, CHUNK // h.shape[1])
        cols = Columns(len(picked), s.vocab, width) if scored else None
        x_head = np.zeros((len(picked), h.shape[1]), np.float32) if scored else None
        grads = []
        for lo in range(0, rows, step):
            key = mx.random.key(self.seed * 1_000_003 + lo)
            g_h, g_logits, x = _head_grads(s, h[lo : lo + step], key)
            grads.append(g_h)
            mine = np.flatnonzero(where[lo : lo + step] >= 0)
            if scored and len(mine):
                first = int(where[lo + mine[0]])  # the picked rows of a slice are consecutive in cols
                cols.write(first, np.asarray(g_logits)[mine])
                x_head[first : first + len(mine)] = np.asarray(x)[mine]
        grad = mx.concatenate(grads).reshape(self.final.shape)
        dots = {}
        if scored:
            dots = self._head_dots(head, cols, mx.array(x_head))
            cols.close()
            if head != s.embedding_path:  # untied: its own module
                self._square(head, dots, rows / len(picked))
                dots = {}
        return grad, dots

    def scored_rows(self, rows: int) -> np.ndarray:
        """The tokens (of ``rows``, in order) whose head is scored: all of them up to
        :data:`HEAD_TOKENS`, else that many evenly spaced. The head and a tied embedding are each
        alone in their calibration group, whose measured KL sets their scale at every candidate
        it measures: only the ratio of a carried candidate's score to its source's comes from
        here, and the head's vocabulary-wide matmuls are most of the pass at a large vocabulary."""
        if rows <= HEAD_TOKENS:
            return np.arange(rows)
        return np.unique(np.linspace(0, rows - 1, HEAD_TOKENS).round().astype(np.int64))

    def _head_dots(self, path: str, cols: Columns, x: mx.array) -> dict[str, np.ndarray]:
        """Per candidate and token, g_logits . (dW x) over the head's rows, a column slice at a time."""
        w = self.stream.weight(path)
        dtype = self.tgts[path].dtype
        dots: dict[str, Any] = {}
        for lo in range(0, w.shape[0], cols.step):
            wc = w[lo : lo + cols.step].astype(mx.float32)
            g = mx.array(cols.read(lo))
            for c in self.todo(path):
                part = (g * (x @ (fake_quant(wc, c, dtype=dtype) - wc).T)).sum(axis=-1)
                dots[str(c.bits)] = part if str(c.bits) not in dots else dots[str(c.bits)] + part
                mx.eval(dots[str(c.bits)])
                self.tick(self.share[path] * self.n_samples * wc.shape[0] / w.shape[0])
        return {b: np.asarray(v, dtype=np.float64) for b, v in dots.items()}

    # ------------------------------------------------------------------ blocks

    def _block(self, i: int, grad: mx.array) -> mx.array:
        """Block ``i``'s backward from ``grad`` (the gradient leaving it); scores its modules and
        returns the gradient entering it."""
        s = self.stream
        prefix = f"{s.prefix}{i}."
        mine = [p for p in self.tgts if p.startswith(prefix)]
        weights = s.load(i)
        rec: dict = {"inputs": {}, "deltas": {}, "widths": {}}
        undo = [(p, s.module(p)) for p in mine]
        for p, m in undo:
            s._set_module(p, _Tap(m, p, rec))
        try:
            x_all = self.bounds.get(i)
            out = []
            b = self._batch(i, x_all)
            for lo in range(0, x_all.shape[0], b):
                x, g = x_all[lo : lo + b], grad[lo : lo + b]
                out.append(self._block_batch(i, x, g, rec, weights))
            return mx.concatenate(out)
        finally:
            for p, m in undo:
                s._set_module(p, m)
            s.release(i)

    def _block_batch(self, i: int, x: mx.array, cot: mx.array, rec: dict, weights: dict) -> mx.array:
        s = self.stream
        shapes = self._tap_shapes(i, x, rec)
        deltas = {p: mx.zeros((*x.shape[:2], w), mx.float32) for p, w in shapes.items()}

        def loss(x: mx.array, deltas: dict) -> tuple[mx.array, dict]:
            rec["deltas"] = deltas
            y = s.run(i, x)
            return (y * cot).sum(), {k: mx.stop_gradient(v) for k, v in rec["inputs"].items()}

        (_, inputs), (g_x, g_taps) = mx.value_and_grad(loss, argnums=(0, 1))(x, deltas)
        mx.eval(g_x, g_taps, inputs)
        rel = len(f"{s.prefix}{i}.")
        for p in shapes:
            w = weights[f"{p[rel:]}.weight"]
            self._score_linear(p, w, inputs[p], g_taps[p])
        return g_x

    def _tap_shapes(self, i: int, x: mx.array, rec: dict) -> dict[str, int]:
        """Each tap's output width, from a one-token forward."""
        rec["deltas"], rec["inputs"], rec["widths"] = {}, {}, {}
        mx.eval(self.stream.run(i, x[:1, :1]))
        rec["inputs"] = {}
        return dict(rec["widths"])

    def _score_linear(self, path: str, w: mx.array, x: mx.array, g: mx.array) -> None:
        """Adds sum over tokens of (g . dW x)^2 for each candidate; rows of W in slices."""
        dtype = self.tgts[path].dtype
        step = max(1, CHUNK // w.shape[-1])
        for c in self.todo(path):
            dot = mx.zeros(g.shape[:-1], mx.float32)
            for lo in range(0, w.shape[0], step):
                wc = w[lo : lo + step].astype(mx.float32)
                dot = dot + (g[..., lo : lo + step] * (x @ (fake_quant(wc, c, dtype=dtype) - wc).T)).sum(-1)
                mx.eval(dot)
            self.sums[path][str(c.bits)] += float(np.square(np.asarray(dot, dtype=np.float64)).sum())
            self.tick(self.share[path] * x.shape[0])

    # ------------------------------------------------------------------ embedding

    def _outside(self, tokens: np.ndarray, grad: mx.array, head_dots: dict[str, np.ndarray]) -> None:
        """The embedding's lookups: g at them (vjp of the embedding stage), their dots added to a
        tied head's, squared."""
        s = self.stream
        emb = s.embedding_path
        if emb not in self.tgts:
            return
        add = mx.zeros(grad.shape, mx.float32)
        g_emb = mx.grad(lambda a: (s.embed(tokens, add=a) * grad).sum())(add).reshape(-1, grad.shape[-1])
        picked = self.scored_rows(grad.shape[0] * grad.shape[1])
        ids = mx.array(tokens.reshape(-1)[picked])
        g_emb = g_emb[mx.array(picked)]
        w = s.weight(emb)
        step = max(1, CHUNK // w.shape[-1])
        dots = {b: mx.array(v.astype(np.float32)) for b, v in head_dots.items()}
        for lo in range(0, w.shape[0], step):
            wc = w[lo : lo + step].astype(mx.float32)
            inside = ((ids >= lo) & (ids < lo + wc.shape[0]))[:, None]
            where = mx.clip(ids - lo, 0, wc.shape[0] - 1)
            for c in self.todo(emb):
                d = fake_quant(wc, c, dtype=self.tgts[emb].dtype) - wc
                part = (g_emb * d[where] * inside).sum(-1)
                key = str(c.bits)
                dots[key] = part if key not in dots else dots[key] + part
                mx.eval(dots[key])
                if head_dots == {}:  # a tied head's share was counted with the head's
                    self.tick(self.share[emb] * self.n_samples * wc.shape[0] / w.shape[0])
        weight = tokens.size / len(picked)
        self._square(emb, {b: np.asarray(v, dtype=np.float64) for b, v in dots.items()}, weight)

    def _square(self, path: str, dots: dict[str, np.ndarray], weight: float = 1.0) -> None:
        """Adds the sum of the squared dots, ``weight`` times (a sample of the tokens stands for all)."""
        for b, v in dots.items():
            self.sums[path][b] += weight * float(np.square(v).sum())


def _batched(fn: Callable[[mx.array], mx.array], h: mx.array, batch: int) -> mx.array:
    out = []
    for lo in range(0, h.shape[0], batch):
        out.append(fn(h[lo : lo + batch]))
        mx.eval(out[-1])
    return mx.concatenate(out) if len(out) > 1 else out[0]


def _head_grads(s: Stream, h: mx.array, key: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """For a slice of last states ``h`` [rows, D]: the gradient at them of the log-likelihood of
    labels sampled from the model's own logits, the gradient at the logits, and the head's input."""
    seen: dict = {}

    def tap(x: mx.array, logits: mx.array) -> mx.array:
        seen["x"] = mx.stop_gradient(x)
        return logits + seen["delta"]

    rows = h.shape[0]
    seen["delta"] = mx.zeros((1, rows, s.vocab), mx.float32)

    def loglik(h: mx.array, delta: mx.array) -> mx.array:
        seen["delta"] = delta
        logits = s.head(h[None], tap=tap)
        y = mx.random.categorical(mx.stop_gradient(logits), key=key)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return mx.take_along_axis(logp, y[..., None], axis=-1).sum()

    _, (g_h, g_logits) = mx.value_and_grad(loglik, argnums=(0, 1))(h, seen["delta"])
    mx.eval(g_h, g_logits, seen["x"])
    return g_h, g_logits[0], seen["x"].reshape(rows, -1)
