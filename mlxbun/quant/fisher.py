"""sensitivity.method=fisher: every module's KL at every candidate from one backward pass per sample.

The exact method (``sensitivity.py``) runs one partial forward per (module, candidate): its cost
grows with modules x candidates x depth. This estimate costs about ``3 + candidates`` forward
passes over the calibration set, whatever the depth or the number of candidates:

1. **Fisher pass** (one forward + one backward per calibration batch). KL(ref || ref + dY) is
   1/2 dY^T F dY to second order, F the Fisher information of the model's output distribution.
   Labels are sampled from the model's own distribution, so the gradient g_t of their
   log-likelihood with respect to a module's output at token t has E[g g^T] = F. Every target
   module gets a zero "tap" added to its output; one backward gives g for all of them at once.
   With dY_t = dW x_t, and the Fisher taken diagonal and split by rows and columns
   (sum_t g_ti^2 x_tj^2 ~ T * mean(g_i^2) * mean(x_j^2)), the per-token KL of a weight change is

       KL_m(dW) ~ 1/2 * sum_ij dW_ij^2 * r_i * c_j,     r = mean_t g_t^2,  c = mean_t x_t^2

   (an embedding lookup uses token frequencies as ``c``; a tied head adds its own term). Only the
   vectors r and c are kept: memory is the model plus one batch of activations.
2. **Scores** per (module, candidate): quantize -> dequantize the weight and evaluate the formula:
   elementwise work on the weight, no forwards. A new candidate costs one quantization.
3. **Calibration** (one forward per candidate and batch): all modules at candidate s together,
   KL(ref || cur) measured exactly; the scores of s are scaled by measured / sum of scores.
   This corrects the second-order formula where it breaks (2-3 bits, where KL stops being
   quadratic) and keeps the knapsack's trade-off between bit widths on the measured scale.

The returned numbers are per-module KLs in nats per token, the same unit as the exact method's,
so ``allocate`` reads either. ``bench/sensitivity_methods.py`` compares them with exact ones.

Example:
    >>> from mlxbun.quant.sensitivity import prepare
    >>> s = prepare(model_dir=d, bits=[2, 4, 8], group_size=64, mode="affine", calib_path=None,
    ...             samples=8, seq_len=256, seed=0, method="fisher", batch_size=1)
    >>> est = estimate(s.model, s.tokens, s.targets, s.cands, batch_size=1, seed=0)
    >>> est.kl["model.layers.0.mlp.down_proj"]["4"], est.factors["4"]
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mlxbun.quant.sensitivity import Candidate, Target, fake_quant, kl_from_stats, module_at, ref_stats


@dataclass
class Terms:
    """Row and column weights of one module: KL ~ 1/2 * sum over terms of rows @ dW^2 @ cols."""

    pairs: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)


@dataclass
class Estimate:
    kl: dict[str, dict[str, float]]  # path -> {bits: calibrated KL}
    raw: dict[str, dict[str, float]]  # path -> {bits: second-order score before calibration}
    factors: dict[str, float]  # bits -> measured whole-model KL / sum of raw scores
    measured: dict[str, float]  # bits -> whole-model KL with every module at that candidate
    forward_equivalents: float


# ---------------------------------------------------------------- taps


class _Tap:
    """Stands in for a module during the Fisher pass: adds a zero tap to its output, records inputs."""

    def __init__(self, mod: Any, path: str, rec: _Recorder) -> None:
        self.mod, self.path, self.rec = mod, path, rec

    def __getattr__(self, key: str) -> Any:
        return getattr(self.mod, key)

    def __call__(self, x: Any) -> Any:
        import mlx.core as mx

        if self.rec.embedding(self.path):
            self.rec.ids[self.path] = x
            return self.rec.tap(self.path, self.mod.weight[x].astype(mx.float32))
        self.rec.sq_in(self.path, x)
        return self.rec.tap(self.path, self.mod(x))

    def as_linear(self, x: Any) -> Any:
        import mlx.core as mx

        key = self.path + "@head"
        self.rec.sq_in(key, x)
        return self.rec.tap(key, x @ self.mod.weight.astype(mx.float32).T)


class _Recorder:
    """The zero taps of one batch and the squared inputs (summed over tokens) seen by each module."""

    def __init__(self, kinds: dict[str, str]) -> None:
        self.kinds = kinds
        self.deltas: dict[str, Any] = {}
        self.inputs: dict[str, Any] = {}
        self.ids: dict[str, Any] = {}
        self.shapes: dict[str, tuple] = {}

    def embedding(self, path: str) -> bool:
        return self.kinds[path] == "embedding"

    def tap(self, key: str, y: Any) -> Any:
        self.shapes[key] = y.shape
        return y + self.deltas[key] if key in self.deltas else y

    def sq_in(self, key: str, x: Any) -> None:
        import mlx.core as mx

        x = x.astype(mx.float32)
        self.inputs[key] = (x * x).reshape(-1, x.shape[-1]).sum(axis=0)


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


def _real(mod: Any) -> Any:
    """The module behind a stand-in (_Tap, _Cast)."""
    while isinstance(mod, (_Tap, _Cast)):
        mod = mod.mod
    return mod


def _kinds(model: Any, tgts: list[Target]) -> dict[str, str]:
    import mlx.nn as nn

    def kind(path: str) -> str:
        return "embedding" if isinstance(_real(module_at(model, path)), nn.Embedding) else "linear"

    return {t.path: kind(t.path) for t in tgts}


# ---------------------------------------------------------------- 1. Fisher pass


class FisherPass:
    """Accumulates r (mean squared output gradient) and c (mean squared input) for every target."""

    def __init__(self, model: Any, tgts: list[Target], *, seed: int) -> None:
        self.model, self.tgts = model, tgts
        self.rec = _Recorder(_kinds(model, tgts))
        self.key = seed
        self.grad_sq: dict[str, np.ndarray] = {}
        self.in_sq: dict[str, np.ndarray] = {}
        self.counts: dict[str, np.ndarray] = {}
        self.tokens = 0

    def _zeros(self, batch: Any) -> dict[str, Any]:
        """Zero taps shaped like each module's output (shapes from a forward without taps' grads)."""
        import mlx.core as mx

        if not self.rec.shapes:
            self.rec.deltas = {}
            mx.eval(self.model(batch[:, :1]))
        n, length = batch.shape
        return {k: mx.zeros((n, length, s[-1]), dtype=mx.float32) for k, s in self.rec.shapes.items()}

    def run(self, batch: Any) -> Any:
        """One forward + backward on ``batch``; returns the reference logits (float32)."""
        import mlx.core as mx

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
                return ll, mx.stop_gradient(logits), dict(self.rec.inputs)

            (_, logits, inputs), grads = mx.value_and_grad(loglik)(deltas)
            sq = {k: (g * g).reshape(-1, g.shape[-1]).sum(axis=0) for k, g in grads.items()}
            mx.eval(logits, inputs, sq)
        finally:
            self.rec.deltas = {}
            _uninstall(undo)
        self._accumulate(sq, inputs, batch)
        return logits

    def _accumulate(self, sq: dict, inputs: dict, batch: Any) -> None:
        for k, v in sq.items():
            self.grad_sq[k] = self.grad_sq.get(k, 0.0) + np.array(v, dtype=np.float64)
        for k, v in inputs.items():
            self.in_sq[k] = self.in_sq.get(k, 0.0) + np.array(v, dtype=np.float64)
        for k, ids in self.rec.ids.items():
            vocab = module_at(self.model, k).weight.shape[0]
            counts = np.bincount(np.array(ids).reshape(-1), minlength=vocab).astype(np.float64)
            self.counts[k] = self.counts.get(k, 0.0) + counts
        self.tokens += int(batch.size)

    def terms(self) -> dict[str, Terms]:
        """Each target's (rows, cols) pairs, normalised per token."""
        n = float(max(self.tokens, 1))
        out = {}
        for t in self.tgts:
            terms = Terms()
            if t.path in self.counts:  # lookup: rows are token frequencies, cols the output Fisher
                terms.pairs.append((self.counts[t.path] / n, self.grad_sq[t.path] / n))
            elif t.path in self.grad_sq:
                terms.pairs.append((self.grad_sq[t.path] / n, self.in_sq[t.path] / n))
            head = t.path + "@head"
            if head in self.grad_sq:  # a tied embedding is also the head
                terms.pairs.append((self.grad_sq[head] / n, self.in_sq[head] / n))
            out[t.path] = terms
        return out


# ---------------------------------------------------------------- 2. scores


CHUNK = 1 << 24  # weights per slice of rows scored at once (bounds the float32 temporaries)


def score(weight: Any, cand: Candidate, terms: Terms, *, dtype: str) -> float:
    """1/2 sum dW^2 * rows x cols for ``cand`` on ``weight``, in slices of rows (groups run along rows)."""
    import mlx.core as mx

    step = max(1, CHUNK // weight.shape[-1])
    total = 0.0
    for lo in range(0, weight.shape[0], step):
        w = weight[lo : lo + step].astype(mx.float32)
        d = fake_quant(w, cand, dtype=dtype) - w
        sq = d * d
        for rows, cols in terms.pairs:
            r = mx.array(rows[lo : lo + step].astype(np.float32))
            total += float((r @ sq @ mx.array(cols.astype(np.float32))).item())
    return 0.5 * total


# ---------------------------------------------------------------- 3. calibration


class _RefStore:
    """Reference logits of every batch, spilled to a temporary directory (float32 .npy)."""

    def __init__(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="mlxbun-fisher-")
        self.n = 0

    def put(self, logits: Any) -> None:
        np.save(Path(self._dir.name) / f"{self.n}.npy", np.array(logits))
        self.n += 1

    def get(self, j: int) -> np.ndarray:
        return np.load(Path(self._dir.name) / f"{j}.npy")

    def close(self) -> None:
        self._dir.cleanup()


def whole_model_kl(
    model: Any, batches: list, refs: _RefStore, tgts: list[Target], cand: Candidate, tick
) -> float:
    """KL(ref || every target at ``cand``), mean over tokens then samples; weights restored."""
    import mlx.core as mx

    saved = []
    try:
        for t in tgts:
            if cand.same(t.current):
                continue
            mod = _real(module_at(model, t.path))
            saved.append((mod, mod.weight))
            mod.weight = fake_quant(mod.weight, cand, dtype=t.dtype).astype(mod.weight.dtype)
            mx.eval(mod.weight)
        total, n = 0.0, 0
        for j, b in enumerate(batches):
            logits = model(b).astype(mx.float32)
            mx.eval(logits)
            kl = kl_from_stats(ref_stats(mx.array(refs.get(j))), logits)
            total, n = total + float(kl.sum()), n + len(kl)
            tick(1.0)
        return total / max(n, 1)
    finally:
        for mod, w in saved:
            mod.weight = w


# ---------------------------------------------------------------- entry point


class _F32Embeddings:
    """Casts embedding lookups to float32 so every matmul runs in float32 over low-precision weights."""

    def __init__(self, model: Any, tgts: list[Target]) -> None:
        import mlx.nn as nn

        self.undo = []
        for path, mod in model.named_modules():
            if isinstance(mod, nn.Embedding):
                parent_path, _, name = path.rpartition(".")
                parent = module_at(model, parent_path) if parent_path else model
                self.undo.append((parent, name, mod))
                setattr(parent, name, _Cast(mod))

    def close(self) -> None:
        _uninstall(self.undo)


class _Cast:
    def __init__(self, mod: Any) -> None:
        self.mod = mod

    def __getattr__(self, key: str) -> Any:
        return getattr(self.mod, key)

    def __call__(self, x: Any) -> Any:
        import mlx.core as mx

        return self.mod(x).astype(mx.float32)

    def as_linear(self, x: Any) -> Any:
        return self.mod.as_linear(x)


def estimate(
    model: Any,
    tokens: Any,
    tgts: list[Target],
    cands: list[Candidate],
    *,
    batch_size: int,
    seed: int,
    progress: Callable[[float], None] | None = None,
) -> Estimate:
    """Per-module KL estimates for every candidate (see the module docstring).

    ``progress(fraction)`` is called with the fraction of work done, counted in forward passes.
    """
    import mlx.core as mx

    batches = [mx.array(tokens[i : i + batch_size]) for i in range(0, tokens.shape[0], batch_size)]
    fwd = 3 * len(batches) + len(cands) * len(batches)  # fisher pass ~ forward + backward (2x)
    done = [0.0]

    def tick(units: float) -> None:
        done[0] += units
        if progress is not None:
            progress(min(done[0] / fwd, 1.0))

    cast = _F32Embeddings(model, tgts)
    refs = _RefStore()
    try:
        fp = FisherPass(model, tgts, seed=seed)
        for b in batches:
            refs.put(fp.run(b))
            tick(3.0)
        terms = fp.terms()
        raw = _scores(model, tgts, cands, terms)
        measured = {str(c.bits): whole_model_kl(model, batches, refs, tgts, c, tick) for c in cands}
    finally:
        refs.close()
        cast.close()
    return _calibrate(raw, measured, cands, forward_equivalents=fwd / len(batches))


def _scores(model: Any, tgts: list[Target], cands: list[Candidate], terms: dict[str, Terms]) -> dict:
    raw: dict[str, dict[str, float]] = {}
    for t in tgts:
        w = module_at(model, t.path).weight
        raw[t.path] = {
            str(c.bits): 0.0 if c.same(t.current) else score(w, c, terms[t.path], dtype=t.dtype)
            for c in cands
        }
    return raw


def _calibrate(raw: dict, measured: dict, cands: list[Candidate], *, forward_equivalents: float) -> Estimate:
    factors = {}
    for c in cands:
        b = str(c.bits)
        total = sum(v[b] for v in raw.values())
        factors[b] = measured[b] / total if total > 0 else 1.0
    kl = {p: {b: v * factors[b] for b, v in row.items()} for p, row in raw.items()}
    return Estimate(
        kl=kl, raw=raw, factors=factors, measured=measured, forward_equivalents=forward_equivalents
    )
