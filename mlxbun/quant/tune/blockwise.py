"""Learned rounding a decoder block at a time (AutoRound's method, on mlx's affine format).

For each decoder block in order, every affine quantized module below 8 bits gets trainable

- a rounding offset per weight (AutoRound's v): the code is round((W - b) / s + v), W the
  reference's weight, so a weight near the middle of two levels moves with a small v; it starts
  where the input's code is (v = code - (W - b) / s), so nothing changes until training moves it;
- a scale and a bias per group (a log multiplier of the stored scale, a shift in its units), the
  values rounded to the stored dtype as they will be written;

trained by signed gradient descent (each step moves every value by the learning rate, decaying
linearly to zero, in the direction its gradient's sign says) to make the block's output on the
quantized model's own inputs (the blocks before it already tuned) match the reference block's
output on the reference's inputs: mean squared error. The block is kept only when the error on
validation windows (text of other kinds than the training windows) is lower than the input's;
the blocks' outputs then feed the next block. Memory is one block of each model, its trainable
values and the windows' hidden states; time grows with depth.

Example:
    >>> tb = TunedBlock(q_block_modules, reference_weights)   # see tune_blocks()
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from mlxbun.errors import InputError
from mlxbun.quant.rounding import BLOCK_ELEMENTS, pack
from mlxbun.quant.streamed import Stream, kl_rows

log = logging.getLogger("mlxbun")


class TunedLinear(nn.Module):
    """An affine quantized linear with trainable rounding offsets, group scales and biases."""

    def __init__(
        self, *, reference: mx.array, weight: mx.array, scales: mx.array, biases: mx.array, bits: int,
        group_size: int, bias: mx.array | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        rows, cols = reference.shape
        self._bits, self._gs, self._dtype = bits, group_size, scales.dtype
        self._maxq = float(2**bits - 1)
        self._w = reference.astype(mx.float32).reshape(rows, cols // group_size, group_size)
        self._s0, self._b0 = scales.astype(mx.float32), biases.astype(mx.float32)
        ones = mx.ones_like(self._s0)
        codes = mx.dequantize(weight, ones, mx.zeros_like(ones), group_size=group_size, bits=bits)
        codes = codes.astype(mx.float32).reshape(self._w.shape)
        self._bias = bias
        self.log_scale = mx.zeros_like(self._s0)
        self.shift = mx.zeros_like(self._s0)
        s, b = self.scales_biases()
        self.v = codes - (self._w - b[..., None]) / s[..., None]
        mx.eval(self.v, self._w)

    def scales_biases(self) -> tuple[mx.array, mx.array]:
        """The scales and biases as stored (rounded to their dtype; the rounding passed straight through)."""
        s = self._s0 * mx.exp(self.log_scale)
        b = self._b0 + self._s0 * self.shift
        s = s + mx.stop_gradient(s.astype(self._dtype).astype(mx.float32) - s)
        b = b + mx.stop_gradient(b.astype(self._dtype).astype(mx.float32) - b)
        return s, b

    def codes(self, s: mx.array, b: mx.array) -> mx.array:
        """round((W - b) / s + v) on the grid, its gradient passed straight through."""
        z = (self._w - b[..., None]) / s[..., None] + self.v
        q = mx.clip(mx.round(z), 0.0, self._maxq)
        return z + mx.stop_gradient(q - z)

    def weight(self) -> mx.array:
        s, b = self.scales_biases()
        w = self.codes(s, b) * s[..., None] + b[..., None]
        return w.reshape(w.shape[0], -1)

    def __call__(self, x: mx.array) -> mx.array:
        y = x.astype(mx.float32) @ self.weight().T
        return y if self._bias is None else y + self._bias

    def stored(self, path: str) -> dict[str, mx.array]:
        """The module's tensors as mlx writes them: packed codes, scales and biases."""
        s, b = self.scales_biases()
        q = mx.clip(mx.round((self._w - b[..., None]) / s[..., None] + self.v), 0.0, self._maxq)
        codes = np.asarray(q.astype(mx.uint8).reshape(q.shape[0], -1))
        step = max(1, BLOCK_ELEMENTS // codes.shape[1])
        packed = np.concatenate(
            [pack(codes[r : r + step], self._bits) for r in range(0, codes.shape[0], step)]
        )
        return {
            f"{path}.weight": mx.array(packed),
            f"{path}.scales": s.astype(self._dtype),
            f"{path}.biases": b.astype(self._dtype),
        }

    def changed(self, initial: dict[str, mx.array]) -> int:
        """Codes that differ from the input's."""
        s0, b0 = _stored_sb(self._s0, self._b0, self._dtype)
        before = mx.clip(mx.round((self._w - b0[..., None]) / s0[..., None] + initial["v"]), 0.0, self._maxq)
        s, b = self.scales_biases()
        after = mx.clip(mx.round((self._w - b[..., None]) / s[..., None] + self.v), 0.0, self._maxq)
        return int(mx.sum(before != after).item())


def _stored_sb(s: mx.array, b: mx.array, dtype: Any) -> tuple[mx.array, mx.array]:
    return s.astype(dtype).astype(mx.float32), b.astype(dtype).astype(mx.float32)


@dataclass
class BlockResult:
    """What tuning one block did."""

    block: int
    steps: int
    val_before: float
    val_after: float
    kept: bool
    codes_changed: int
    seconds: float
    best_step: int = 0  # the step whose values are kept (0: the input's)
    training_seconds: float = 0.0  # of ``seconds``, those in the step loop
    tensors: dict[str, mx.array] = field(default_factory=dict, repr=False)

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "tensors"}
        return {k: (round(v, 8) if isinstance(v, float) and math.isfinite(v) else v) for k, v in out.items()}


def mse(a: mx.array, b: mx.array) -> mx.array:
    return mx.mean(mx.square(a.astype(mx.float32) - b.astype(mx.float32)))


def batched_mse(fn: Callable[[mx.array], mx.array], x: mx.array, y: mx.array, batch: int) -> float:
    """Mean squared error of ``fn(x)`` against ``y`` over all windows, a batch at a time."""
    total = 0.0
    for lo in range(0, x.shape[0], batch):
        total += float(mse(fn(x[lo : lo + batch]), y[lo : lo + batch]).item()) * min(batch, x.shape[0] - lo)
    return total / max(x.shape[0], 1)


def run_batched(fn: Callable[[mx.array], mx.array], x: mx.array, batch: int) -> mx.array:
    out = []
    for lo in range(0, x.shape[0], batch):
        out.append(fn(x[lo : lo + batch]))
        mx.eval(out[-1])
    return mx.concatenate(out) if len(out) > 1 else out[0]


class SignSGD:
    """p <- p - lr_t * sign(grad), lr_t falling linearly from ``lr`` to 0 over ``steps``."""

    def __init__(self, lr: float, steps: int) -> None:
        self.lr, self.steps, self.t = lr, max(1, steps), 0

    def update(self, params: dict, grads: dict) -> dict:
        rate = self.lr * (1.0 - self.t / self.steps)
        self.t += 1
        return tree_map(lambda p, g: p - rate * mx.sign(g), params, grads)


def tune_block(
    stream: Stream,
    i: int,
    tuned: dict[str, TunedLinear],
    data: Windows,
    *,
    steps: int,
    lr: float,
    batch: int,
    seed: int,
    seconds: float | None = None,
) -> BlockResult:
    """Train block ``i`` of ``stream`` (its quantized modules swapped for ``tuned``, keyed by path)
    towards ``data``'s targets; keep it only when validation improves (module docstring)."""
    t0 = time.monotonic()
    block = stream.blocks[i]
    initial = {p: dict(tree_flatten(m.trainable_parameters())) for p, m in tuned.items()}

    def fn(x: mx.array) -> mx.array:
        return stream.run(i, x)

    before = batched_mse(fn, data.x_val, data.y_val, batch)
    done, after, best_step, training = 0, before, 0, 0.0
    if steps > 0 and data.x_train.shape[0]:
        done, after, best_step, training = _train(
            stream, i, block, tuned, data, steps=steps, lr=lr, batch=batch, seed=seed, seconds=seconds,
            validate=lambda: batched_mse(fn, data.x_val, data.y_val, batch), start=before,
        )  # fmt: skip
    kept = best_step > 0
    if not kept:
        for p, m in tuned.items():
            m.update(_unflat(initial[p]))
    changed = sum(m.changed(_unflat_flat(initial[p])) for p, m in tuned.items()) if kept else 0
    tensors = {}
    if kept:
        for p, m in tuned.items():
            tensors |= m.stored(p)
        mx.eval(tensors)
    return BlockResult(
        block=i, steps=done, val_before=before, val_after=after, kept=kept, codes_changed=changed,
        seconds=time.monotonic() - t0, best_step=best_step, tensors=tensors, training_seconds=training,
    )  # fmt: skip


def _unflat(flat: dict[str, mx.array]) -> dict:
    return tree_unflatten(list(flat.items()))


def _unflat_flat(flat: dict[str, mx.array]) -> dict[str, mx.array]:
    return {k.rpartition(".")[2]: v for k, v in flat.items()}


CHECKS = 4  # validation checks over a block's steps: the best of them (or the input) is kept


def _train(
    stream: Stream, i: int, block: Any, tuned: dict[str, TunedLinear], data: Windows, *, steps: int, lr: float,
    batch: int, seed: int, seconds: float | None = None, validate: Callable[[], float] | None = None,
    start: float = math.inf,
) -> tuple[int, float, int, float]:  # fmt: skip
    """Up to ``steps`` steps of signed gradient descent over random batches of the training
    windows; with ``seconds``, as many as fit in it at the pace of the steps after the first (which
    compiles kernels); the learning rate decays over the steps that will run. ``validate()`` (the
    validation error of the current values) is checked :data:`CHECKS` times; the values of the
    best check, or the input's when none is below ``start``, are left in the modules.
    Returns (steps run, the best validation error, its step: 0 for the input's, the loop's seconds)."""
    params = {p: m.trainable_parameters() for p, m in tuned.items()}
    opt = SignSGD(lr, steps)
    rng = np.random.default_rng([seed, i])
    n = data.x_train.shape[0]
    best, best_val, best_step = params, start, 0

    def loss(params: dict, x: mx.array, y: mx.array) -> mx.array:
        _set(tuned, params)
        return mse(stream.run(i, x), y)

    grad_fn = mx.value_and_grad(loss)
    done, clock, t0 = 0, None, time.monotonic()
    while done < opt.steps:
        pick = mx.array(np.sort(rng.choice(n, size=min(batch, n), replace=False)))
        _, grads = grad_fn(params, data.x_train[pick], data.y_train[pick])
        params = opt.update(params, grads)
        mx.eval(params)
        done += 1
        stop = False
        if seconds is not None:
            now = time.monotonic()
            if clock is None:  # the first step compiled the kernels: the pace is timed from here
                clock = now
            elif done == 3:  # two timed steps give the pace; the decay spreads over the steps that fit
                opt.steps = max(done, min(steps, 1 + int(seconds / max((now - clock) / 2, 1e-9))))
            elif now - clock >= seconds:
                stop = True
        if validate is not None and (done % max(1, opt.steps // CHECKS) == 0 or done >= opt.steps or stop):
            _set(tuned, params)
            value = validate()
            if value < best_val:
                best, best_val, best_step = params, value, done
        if stop:
            break
    _set(tuned, best if validate is not None else params)
    return done, best_val, best_step if validate is not None else done, time.monotonic() - t0


def _set(tuned: dict[str, TunedLinear], params: dict) -> None:
    for p, m in tuned.items():
        m.update(params[p])


@dataclass
class Windows:
    """One block's training and validation data: the quantized path's inputs and the reference
    block's outputs (on the reference's inputs)."""

    x_train: mx.array
    y_train: mx.array
    x_val: mx.array
    y_val: mx.array


# ----------------------------------------------------------------------------- the whole model


@dataclass
class Outcome:
    """What :func:`tune_streamed` did: per-block results, the validation KL of the input and of
    the tuned model, and the tensors to write (empty when the input is kept: no block kept, or
    the tuned model's validation KL not significantly lower, :func:`significantly_lower`)."""

    blocks: list[BlockResult]
    kl_before: float
    kl_after: float
    steps_per_block: list[int]
    seconds: float
    tensors: dict[str, mx.array]

    @property
    def improved(self) -> bool:
        """The tuned model is written: its validation KL is significantly below the input's."""
        return bool(self.tensors)


def tunable_modules(q: Stream, i: int) -> dict[str, dict[str, Any]]:
    """Block ``i``'s affine modules below 8 bits in the quantized model: path -> its setting."""
    current = q.source()["current"] if not hasattr(q, "_current") else q._current
    q._current = current
    prefix = f"{q.prefix}{i}."
    return {
        p: c for p, c in current.items() if p.startswith(prefix) and c["mode"] == "affine" and c["bits"] < 8
    }


def _tuned_linears(q: Stream, ref_weights: dict[str, mx.array], i: int) -> dict[str, TunedLinear]:
    out = {}
    rel = len(f"{q.prefix}{i}.")
    for path, c in tunable_modules(q, i).items():
        src = q.sources[f"{path}.weight"][: -len(".weight")]
        module = q.module(path)
        out[path] = TunedLinear(
            reference=ref_weights[f"{path[rel:]}.weight"], weight=q.reader.array(f"{src}.weight"),
            scales=q.reader.array(f"{src}.scales"), biases=q.reader.array(f"{src}.biases"), bits=c["bits"],
            group_size=c["group_size"], bias=module.get("bias") if isinstance(module, nn.Module) else None,
        )  # fmt: skip
    return out


def kl_between(ref: Stream, h_ref: mx.array, cur: Stream, h_cur: mx.array) -> np.ndarray:
    """KL(ref || cur) of each token, of two models' heads on their last states (token slices)."""
    a, b = h_ref.reshape(-1, h_ref.shape[-1]), h_cur.reshape(-1, h_cur.shape[-1])
    step, out = min(ref.token_rows(), cur.token_rows()), []
    for lo in range(0, a.shape[0], step):
        out.append(
            np.asarray(kl_rows(ref.head(a[None, lo : lo + step]), cur.head(b[None, lo : lo + step]))[0])
        )
    return np.concatenate(out).astype(np.float64)


def significantly_lower(after: np.ndarray, before: np.ndarray) -> bool:
    """Is the mean of ``after`` below ``before``'s by more than :data:`SIGNIFICANCE` standard errors
    of their per-token difference (a paired test: a gain inside the validation's noise is none)?"""
    d = after - before
    if len(d) < 2:
        return bool(d.mean() < 0)
    return bool(d.mean() < -SIGNIFICANCE * d.std(ddof=1) / np.sqrt(len(d)))


SIGNIFICANCE = 2.0


def step_seconds(left: float, blocks: int, outside: float) -> float:
    """A block's seconds for its steps: its share of the ``left`` seconds over the ``blocks`` still
    to tune, less what a block costs besides its steps (``outside``: the last one's reference and
    input passes and validation checks), so the budget holds to the end instead of running over by
    that much a block."""
    return max(0.0, left / blocks - outside)


def tune_streamed(
    ref: Stream,
    q: Stream,
    train: np.ndarray,
    val: np.ndarray,
    *,
    steps: int,
    lr: float,
    batch: int,
    seed: int,
    max_minutes: float | None = None,
    on_block: Callable[[BlockResult], None] | None = None,
) -> Outcome:
    """Tune every block of ``q`` against ``ref`` on ``train`` windows, choosing with ``val``
    windows (other kinds of text); ``max_minutes`` sets how many steps each block gets (the
    first steps are timed after a warm-up step), never whether a block is tuned."""
    t0 = time.monotonic()
    x_ref = {"train": ref.embed(train), "val": ref.embed(val)}
    x_q = {"train": q.embed(train), "val": q.embed(val)}
    x_in = x_q["val"]  # the input model's own path on the validation windows
    results, plan = [], []
    budget = None if max_minutes is None else 60.0 * max_minutes
    outside = 0.0  # the last block's seconds outside its step loop (reference and input passes, checks)
    for i in range(q.n_blocks):
        started = time.monotonic()
        with ref.loaded(i) as ref_w:
            y = {k: run_batched(lambda x, i=i: ref.run(i, x), v, batch) for k, v in x_ref.items()}
        _finite(y, ref, i, "tune.reference")
        q.load(i)
        tuned = _tuned_linears(q, ref_w, i)
        del ref_w
        saved = [(p, q.module(p)) for p in tuned]
        for p, m in tuned.items():
            q._set_module(p, m)
        try:
            x_in = run_batched(lambda x, i=i: q.run(i, x), x_in, batch)
            left = None if budget is None else budget - (time.monotonic() - t0)
            seconds = None if left is None else step_seconds(left, q.n_blocks - i, outside)
            data = Windows(x_train=x_q["train"], y_train=y["train"], x_val=x_q["val"], y_val=y["val"])
            res = None
            if tuned:
                res = tune_block(
                    q, i, tuned, data, steps=steps, lr=lr, batch=batch, seed=seed, seconds=seconds
                )
                plan.append(res.steps)
            x_q = {k: run_batched(lambda x, i=i: q.run(i, x), v, batch) for k, v in x_q.items()}
            _finite(x_q, q, i, "model.name")
        finally:
            for p, m in saved:
                q._set_module(p, m)
            q.release(i)
        x_ref = y
        if res is not None:
            outside = time.monotonic() - started - res.training_seconds
            results.append(res)
            if on_block is not None:
                on_block(res)
    before = kl_between(ref, x_ref["val"], q, x_in)
    after = kl_between(ref, x_ref["val"], q, x_q["val"])
    tensors = {k: v for r in results if r.kept for k, v in r.tensors.items()}
    better = significantly_lower(after, before)
    return Outcome(
        results,
        float(before.mean()),
        float(after.mean()),
        plan,
        time.monotonic() - t0,
        tensors if better else {},
    )


def _finite(states: dict[str, mx.array], stream: Stream, i: int, key: str) -> None:
    """Refuse a model whose block ``i`` gives a NaN or Inf (a damaged weight): nothing is tuned
    against, or written from, a model that computes garbage."""
    if not all(mx.isfinite(v).all().item() for v in states.values()):
        raise InputError(
            f"{key}={str(stream.dir)!r}: block {i}'s output is not finite (NaN or Inf); its weights"
            " are damaged"
        )
