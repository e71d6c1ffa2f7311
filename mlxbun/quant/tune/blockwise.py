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
the blocks' outputs then feed the next block. Rounding passes the gradient straight through
where a code is inside the grid and not where it is clipped (AutoRound's clamp).

Memory, whatever the depth: the block's reference weights in their stored dtype, its float32
offsets and their gradients, the modules' weights as the gradient builds them, the input's and
the best check's codes (uint8), the windows' hidden states; neither model's embedding nor head
while the blocks train (:meth:`mlxbun.quant.streamed.Stream.outside_released`). Time grows with
depth.

Example:
    >>> tb = TunedBlock(q_block_modules, reference_weights)   # see tune_blocks()
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_map

from mlxbun.errors import InputError
from mlxbun.quant.rounding import BLOCK_ELEMENTS, pack
from mlxbun.quant.streamed import Stream
from mlxbun.quant.tune.budget import blocks_to_train, carried_share, kl_tokens, seconds_until
from mlxbun.quant.tune.validation import gained, kl_between, kl_seconds, kl_step

log = logging.getLogger("mlxbun")


class TunedLinear(nn.Module):
    """An affine quantized linear with trainable rounding offsets, group scales and biases.

    The reference weight is held in its stored dtype. The matmul's gradient is written out
    (:func:`_tuned_matmul`): through autodiff a bias's gradient inside the grid is a difference of
    two equal terms, whose float noise signed descent would follow at the full rate."""

    def __init__(
        self, *, reference: mx.array, weight: mx.array, scales: mx.array, biases: mx.array, bits: int,
        group_size: int, bias: mx.array | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        rows, cols = reference.shape
        self._bits, self._gs, self._dtype = bits, group_size, scales.dtype
        self._maxq = float(2**bits - 1)
        self._w = reference.reshape(rows, cols // group_size, group_size)
        self._s0, self._b0 = scales.astype(mx.float32), biases.astype(mx.float32)
        self._bias = bias
        self.log_scale = mx.zeros_like(self._s0)
        self.shift = mx.zeros_like(self._s0)
        ones = mx.ones_like(self._s0)
        codes = mx.dequantize(weight, ones, mx.zeros_like(ones), group_size=group_size, bits=bits)
        self.v = mx.zeros(self._w.shape, dtype=mx.float32)
        self.restore({"codes": codes.astype(mx.uint8).reshape(self._w.shape)})

    def scales_biases(self) -> tuple[mx.array, mx.array]:
        """The scales and biases as stored (rounded to their dtype; the rounding passed straight through)."""
        s = self._s0 * mx.exp(self.log_scale)
        b = self._b0 + self._s0 * self.shift
        s = s + mx.stop_gradient(s.astype(self._dtype).astype(mx.float32) - s)
        b = b + mx.stop_gradient(b.astype(self._dtype).astype(mx.float32) - b)
        return s, b

    def _codes(self, s: mx.array, b: mx.array) -> mx.array:
        return mx.clip(mx.round(_grid(self._w, s, b) + self.v), 0.0, self._maxq)

    def weight(self) -> mx.array:
        """The float32 weight the module computes with (its gradient as :func:`_tuned_matmul`'s)."""
        s, b = self.scales_biases()
        return _tuned_weight(self._w, self._maxq)(self.v, s, b)

    def __call__(self, x: mx.array) -> mx.array:
        s, b = self.scales_biases()
        y = _tuned_matmul(self._w, self._maxq)(x.astype(mx.float32), self.v, s, b)
        return y if self._bias is None else y + self._bias

    def snapshot(self) -> dict[str, mx.array]:
        """The module's state, compact: its codes (uint8), log scales and shifts; :meth:`restore` returns to it."""
        s, b = self.scales_biases()
        out = {"codes": self._codes(s, b).astype(mx.uint8), "log_scale": self.log_scale, "shift": self.shift}
        mx.eval(out)
        return out

    def restore(self, state: dict[str, mx.array]) -> None:
        """Set the values that give ``state``'s codes, scales and biases (each code mid-level)."""
        self.log_scale = state.get("log_scale", self.log_scale)
        self.shift = state.get("shift", self.shift)
        s, b = self.scales_biases()
        self.v = state["codes"].astype(mx.float32) - _grid(self._w, s, b)
        mx.eval(self.v, self.log_scale, self.shift)

    def stored(self, path: str) -> dict[str, mx.array]:
        """The module's tensors as mlx writes them: packed codes, scales and biases."""
        s, b = self.scales_biases()
        codes = np.asarray(self._codes(s, b).astype(mx.uint8).reshape(self._w.shape[0], -1))
        step = max(1, BLOCK_ELEMENTS // codes.shape[1])
        packed = np.concatenate(
            [pack(codes[r : r + step], self._bits) for r in range(0, codes.shape[0], step)]
        )
        return {
            f"{path}.weight": mx.array(packed),
            f"{path}.scales": s.astype(self._dtype),
            f"{path}.biases": b.astype(self._dtype),
        }

    def changed(self, state: dict[str, mx.array]) -> int:
        """Codes that differ from ``state``'s (a :meth:`snapshot`)."""
        s, b = self.scales_biases()
        return int(mx.sum(self._codes(s, b).astype(mx.uint8) != state["codes"]).item())


def _grid(w: mx.array, s: mx.array, b: mx.array) -> mx.array:
    """(W - b) / s: the reference's weights in grid steps of their group."""
    return (w.astype(mx.float32) - b[..., None]) / s[..., None]


def _built(w: mx.array, v: mx.array, s: mx.array, b: mx.array, maxq: float) -> tuple[mx.array, ...]:
    """(Wq as [rows, columns], the grid positions, the codes, where the codes are inside the grid),
    Wq = clip(round((W - b) / s + v), 0, maxq) * s + b over the groups of ``w``'s last axis."""
    r = _grid(w, s, b)
    z = mx.round(r + v)
    q = mx.clip(z, 0.0, maxq)
    wq = (q * s[..., None] + b[..., None]).reshape(q.shape[0], -1)
    return wq, r, q, (z == q).astype(mx.float32)


def _weight_grads(dw: mx.array, s: mx.array, r: mx.array, q: mx.array, inside: mx.array) -> tuple:
    """Wq's gradient into (v, s, b): rounding passes it straight through where the code is inside
    the grid and not where it is clipped, so a clipped weight moves with its group's scale and bias
    (as AutoRound's clamp does), and a bias gets none from the weights whose codes its shift
    cancels (straight through, Wq = W + v s there)."""
    dw = dw.reshape(q.shape)
    return (
        dw * s[..., None] * inside,
        mx.sum(dw * (q - inside * r), axis=-1),
        mx.sum(dw * (1.0 - inside), axis=-1),
    )


def _tuned_weight(w: mx.array, maxq: float) -> Callable[..., mx.array]:
    """``f(v, s, b)``: Wq (:func:`_built`) with :func:`_weight_grads`' gradient."""

    @mx.custom_function
    def f(v: mx.array, s: mx.array, b: mx.array) -> mx.array:
        return _built(w, v, s, b, maxq)[0]

    @f.vjp
    def f_vjp(primals: tuple, dw: mx.array, _out: mx.array) -> tuple:
        v, s, b = primals
        _, r, q, inside = _built(w, v, s, b, maxq)
        return _weight_grads(dw, s, r, q, inside)

    return f


def _tuned_matmul(w: mx.array, maxq: float) -> Callable[..., mx.array]:
    """``f(x, v, s, b) = x @ Wq.T`` (:func:`_built`) with :func:`_weight_grads`' gradient (Wq built
    again in the backward pass)."""

    @mx.custom_function
    def f(x: mx.array, v: mx.array, s: mx.array, b: mx.array) -> mx.array:
        return x @ _built(w, v, s, b, maxq)[0].T

    @f.vjp
    def f_vjp(primals: tuple, dy: mx.array, _y: mx.array) -> tuple:
        x, v, s, b = primals
        wq, r, q, inside = _built(w, v, s, b, maxq)
        dw = dy.reshape(-1, dy.shape[-1]).T @ x.reshape(-1, x.shape[-1])
        return (dy @ wq, *_weight_grads(dw, s, r, q, inside))

    return f


@dataclass
class BlockResult:
    """What tuning one block did."""

    block: int
    steps: int
    val_before: float | None  # None: carried untrained (the time budget held no step), not checked
    val_after: float | None
    kept: bool
    codes_changed: int
    seconds: float
    best_step: int = 0  # the step whose values are kept (0: the input's)
    training_seconds: float = 0.0  # of ``seconds``, those in the step loop
    pace: float | None = None  # a step's seconds after the first, under a time budget
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

    def rate(self) -> float:
        """This step's rate (and the step counted)."""
        rate = self.lr * (1.0 - self.t / self.steps)
        self.t += 1
        return rate

    def update(self, params: dict, grads: dict, rate: float) -> dict:
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
    pace: float | None = None,
) -> BlockResult:
    """Train block ``i`` of ``stream`` (its quantized modules swapped for ``tuned``, keyed by path)
    towards ``data``'s targets; keep it only when validation improves (module docstring).
    ``seconds``, ``pace``: :func:`_train`'s."""
    t0 = time.monotonic()
    initial = {p: m.snapshot() for p, m in tuned.items()}

    def fn(x: mx.array) -> mx.array:
        return stream.run(i, x)

    before = batched_mse(fn, data.x_val, data.y_val, batch)
    done, after, best_step, training = 0, before, 0, 0.0
    if steps > 0 and data.x_train.shape[0]:
        done, after, best_step, training, pace = _train(
            stream, i, tuned, data, steps=steps, lr=lr, batch=batch, seed=seed, seconds=seconds,
            validate=lambda: batched_mse(fn, data.x_val, data.y_val, batch), start=before, initial=initial,
            pace=pace,
        )  # fmt: skip
    kept = best_step > 0  # when not, _train left the input's values
    changed = sum(m.changed(initial[p]) for p, m in tuned.items()) if kept else 0
    tensors = {}
    if kept:
        for p, m in tuned.items():
            tensors |= m.stored(p)
        mx.eval(tensors)
    return BlockResult(
        block=i, steps=done, val_before=before, val_after=after, kept=kept, codes_changed=changed,
        seconds=time.monotonic() - t0, best_step=best_step, tensors=tensors, training_seconds=training,
        pace=pace,
    )  # fmt: skip


CHECKS = 4  # validation checks over a block's steps: the best of them (or the input) is kept


def _train(
    stream: Stream, i: int, tuned: dict[str, TunedLinear], data: Windows, *, steps: int, lr: float,
    batch: int, seed: int, seconds: float | None = None, validate: Callable[[], float] | None = None,
    start: float = math.inf, initial: dict[str, dict[str, mx.array]] | None = None, pace: float | None = None,
) -> tuple[int, float, int, float, float | None]:  # fmt: skip
    """Up to ``steps`` steps of signed gradient descent over random batches of the training
    windows; with ``seconds``, as many as fit in it: at ``pace`` (a step's seconds, timed on an
    earlier block; none when not one fits), else at the pace of the two steps after the first
    (which compiles kernels), and never a step that the time left cannot hold. The learning rate
    decays over the steps that will run. ``validate()`` (the validation error of the current
    values) is checked :data:`CHECKS` times; the values of the best check, or the input's
    (``initial``: the modules' snapshots) when none is below ``start``, are left in the modules.
    Returns (steps run, the best validation error, its step: 0 for the input's, the loop's
    seconds, the pace of this block's steps after the first, or when only the first ran and no
    ``pace`` was given, that step's time, else ``pace``)."""
    opt = SignSGD(lr, steps)
    if seconds is not None and pace is not None:
        opt.steps = min(opt.steps, int(seconds / pace))
    rng = np.random.default_rng([seed, i])
    n = data.x_train.shape[0]
    if validate is not None and initial is None:
        initial = {p: m.snapshot() for p, m in tuned.items()}
    best, best_val, best_step = initial, start, 0

    def loss(params: dict, x: mx.array, y: mx.array) -> mx.array:
        for p, m in tuned.items():
            m.update(params[p])
        return mse(stream.run(i, x), y)

    grad_fn = mx.value_and_grad(loss)
    done, timed, first, t0 = 0, [], 0.0, time.monotonic()
    mark = t0  # when the step now running started (after the last validation check)
    while done < opt.steps:
        pick = mx.array(np.sort(rng.choice(n, size=min(batch, n), replace=False)))
        params = {p: m.trainable_parameters() for p, m in tuned.items()}
        _, grads = grad_fn(params, data.x_train[pick], data.y_train[pick])
        del params
        rate = opt.rate()
        for p, m in tuned.items():  # a module at a time: one module's old and new values at once
            new = opt.update(m.trainable_parameters(), grads.pop(p), rate)
            mx.eval(new)
            m.update(new)
        done += 1
        stop = False
        if seconds is not None:
            now = time.monotonic()
            if done > 1:  # the first step compiles the kernels: not a step's pace
                timed.append(now - mark)
            else:
                first = now - mark
            if pace is None and len(timed) == 2:  # the decay spreads over the steps that fit
                pace = max(sum(timed) / 2, 1e-9)
                opt.steps = max(done, min(steps, done + int((seconds - (now - t0)) / pace)))
            # a step the time left cannot hold is not started (at 27B's width a step takes minutes)
            stop = now - t0 + (pace or (timed[-1] if timed else now - t0)) > seconds
            mark = now
        if validate is not None and (done % max(1, opt.steps // CHECKS) == 0 or done >= opt.steps or stop):
            value = validate()
            if value < best_val:  # kept compactly: codes, not every module's float32 offsets
                best, best_val, best_step = {p: m.snapshot() for p, m in tuned.items()}, value, done
            if seconds is not None:
                mark = time.monotonic()
        if stop:
            break
    if timed:  # this block's own pace: the next block follows the machine's load
        pace = sum(timed) / len(timed)
    elif pace is None and done and seconds is not None:  # the first step's, kernels compiled in: a
        pace = first  # bound that keeps the next block from a step its share cannot hold
    if validate is None:
        return done, best_val, done, time.monotonic() - t0, pace
    for p, m in tuned.items():
        m.restore(best[p])
    return done, best_val, best_step, time.monotonic() - t0, pace


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
    the tuned model's validation KL not lower enough, :func:`gained`)."""

    blocks: list[BlockResult]
    kl_before: float
    kl_after: float
    steps_per_block: list[int]
    seconds: float
    tensors: dict[str, mx.array]
    kl_seconds: float = 0.0  # the closing validation KL's
    kl_tokens: int = 0  # the validation tokens it read (fewer than all under a tight budget)
    kl_seconds_expected: float | None = None  # as :func:`kl_seconds` timed it (under a time budget)

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


def _tuned_linears(q: Stream, ref: Stream, ref_w: dict[str, mx.array], i: int) -> dict[str, TunedLinear]:
    """Block ``i``'s tunable modules of ``q`` as :class:`TunedLinear`, their reference weights
    taken out of ``ref_w`` (float32, as read) and held in the reference's stored dtype."""
    out = {}
    rel = len(f"{q.prefix}{i}.")
    for path, c in tunable_modules(q, i).items():
        src = q.sources[f"{path}.weight"][: -len(".weight")]
        module = q.module(path)
        out[path] = TunedLinear(
            reference=ref_w.pop(f"{path[rel:]}.weight").astype(getattr(mx, ref.stored_dtype(f"{path}.weight"))),
            weight=q.reader.array(f"{src}.weight"),
            scales=q.reader.array(f"{src}.scales"), biases=q.reader.array(f"{src}.biases"), bits=c["bits"],
            group_size=c["group_size"], bias=module.get("bias") if isinstance(module, nn.Module) else None,
        )  # fmt: skip
    return out


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
    min_gain: float = 0.0,
    on_block: Callable[[BlockResult], None] | None = None,
    on_kl: Callable[[int, float | None], Callable[[], None]] | None = None,
    on_budget: Callable[[float], None] | None = None,
) -> Outcome:
    """Tune every block of ``q`` against ``ref`` on ``train`` windows, choosing with ``val``
    windows (other kinds of text); ``max_minutes`` holds the blocks and the closing validation KL
    (timed on one of its slices first, :func:`kl_seconds`; over fewer tokens when it would take
    more than :data:`KL_SHARE` of the budget, :func:`kl_tokens`): it sets how many steps each block
    gets, at the pace of the block before (the first block times its own after a warm-up step);
    the blocks it cannot train are carried through untrained (:func:`blocks_to_train`).
    ``on_budget(seconds)`` with the blocks' seconds from then on (under a budget); ``on_block``
    after each block; ``on_kl(slices, expected seconds)`` when the validation KL starts,
    returning what to call after each of its slices."""
    t0 = time.monotonic()
    x_ref = {"train": ref.embed(train), "val": ref.embed(val)}
    x_q = {"train": q.embed(train), "val": q.embed(val)}
    x_in = x_q["val"]  # the input model's own path on the validation windows
    results, plan = [], []
    budget = None if max_minutes is None else 60.0 * max_minutes
    expected, kept = None, val.size  # the validation KL's seconds, over its first ``kept`` tokens
    if budget is not None:  # the budget ends with the validation KL, not before it
        expected, kept = _closing_kl(ref, q, x_ref["val"], x_in, budget)
        budget = max(0.0, budget - expected)
        if on_budget is not None:
            on_budget(max(0.0, budget - (time.monotonic() - t0)))
    outside = None  # the last block's seconds outside its step loop (reference and input passes, checks)
    pace = None  # a step's seconds, as the block before ran them
    share = carried_share(train.shape[0], val.shape[0])
    spent = False  # no block left can hold a step: they are carried through on the validation windows
    with ref.outside_released(train.shape[1]), q.outside_released(train.shape[1]):
        for i in range(q.n_blocks):
            started = time.monotonic()
            trained = q.n_blocks - i  # of the blocks left, those the budget trains (the first ones)
            if budget is not None and pace is not None and not spent:
                o = outside or 0.0
                trained = blocks_to_train(budget - (started - t0), q.n_blocks - i, o, o * share, pace)
                spent = trained == 0
            if spent:
                x_ref, x_in, x_q = _carried(ref, q, i, x_ref, x_in, x_q, batch)
                results.append(BlockResult(i, 0, None, None, False, 0, time.monotonic() - started))
                plan.append(0)
                if on_block is not None:
                    on_block(results[-1])
                continue

            left_after = q.n_blocks - i - trained  # blocks carried after the trained ones
            res, x_ref, x_in, x_q = _trained_block(
                ref, q, i, x_ref, x_in, x_q, steps=steps, lr=lr, batch=batch, seed=seed, pace=pace,
                seconds_for=None if budget is None else functools.partial(
                    seconds_until, budget + t0, outside, trained, left_after * share
                ),
            )  # fmt: skip
            if res is not None:
                pace, outside = res.pace, time.monotonic() - started - res.training_seconds
                plan.append(res.steps)
                results.append(res)
                if on_block is not None:
                    on_block(res)
    tick = on_kl(-(-kept // kl_step(ref, q)), expected) if on_kl is not None else (lambda: None)
    started = time.monotonic()
    first = [h.reshape(1, -1, h.shape[-1])[:, :kept] for h in (x_ref["val"], x_in, x_q["val"])]
    before, after = kl_between(ref, first[0], q, first[1:], tick=tick)
    tensors = {k: v for r in results if r.kept for k, v in r.tensors.items()}
    return Outcome(
        results, float(before.mean()), float(after.mean()), plan, time.monotonic() - t0,
        tensors if gained(after, before, min_gain) else {}, kl_seconds=time.monotonic() - started,
        kl_tokens=len(before), kl_seconds_expected=expected,
    )  # fmt: skip


def _closing_kl(ref: Stream, q: Stream, h_ref: mx.array, h_in: mx.array, budget: float) -> tuple[float, int]:
    """(seconds, tokens) of the closing validation KL under a ``budget`` of seconds: timed on one
    slice (:func:`kl_seconds`), over the tokens that fit its share (:func:`kl_tokens`)."""
    step, tokens = kl_step(ref, q), h_in.shape[0] * h_in.shape[1]
    expected = kl_seconds(ref, h_ref, q, h_in)
    kept = kl_tokens(tokens, step, expected, budget)
    return expected * -(-kept // step) / -(-tokens // step), kept


def _trained_block(
    ref: Stream, q: Stream, i: int, x_ref: dict[str, mx.array], x_in: mx.array, x_q: dict[str, mx.array],
    *, steps: int, lr: float, batch: int, seed: int, pace: float | None,
    seconds_for: Callable[[float], float] | None,
) -> tuple[BlockResult | None, dict[str, mx.array], mx.array, dict[str, mx.array]]:  # fmt: skip
    """Block ``i`` trained (:func:`tune_block`): the reference's states through it, the input's and
    the tuned path's after it. ``seconds_for(passes)``: the seconds its steps get, given what its
    passes before them took (None: no budget). Returns (its result, or None with nothing to tune;
    the reference's, the input's and the tuned path's states after it)."""
    started = time.monotonic()
    with ref.loaded(i) as ref_w:
        y = {k: run_batched(lambda x: ref.run(i, x), v, batch) for k, v in x_ref.items()}
    passes = time.monotonic() - started
    _finite(y, ref, i, "tune.reference")
    rel = len(f"{q.prefix}{i}.")  # the tuned modules' input weights are read by TunedLinear, packed
    q.load(i, skip={f"{p[rel:]}.weight" for p in tunable_modules(q, i)})
    tuned = _tuned_linears(q, ref, ref_w, i)
    del ref_w
    saved = [(p, q.module(p)) for p in tuned]
    for p, m in tuned.items():
        q._set_module(p, m)
    try:
        mark = time.monotonic()
        x_in = run_batched(lambda x: q.run(i, x), x_in, batch)
        seconds = None if seconds_for is None else seconds_for(passes + time.monotonic() - mark)
        data = Windows(x_train=x_q["train"], y_train=y["train"], x_val=x_q["val"], y_val=y["val"])
        res = None
        if tuned:
            res = tune_block(
                q, i, tuned, data, steps=steps, lr=lr, batch=batch, seed=seed, seconds=seconds, pace=pace
            )
        x_q = {k: run_batched(lambda x: q.run(i, x), v, batch) for k, v in x_q.items()}
        _finite(x_q, q, i, "model.name")
    finally:
        for p, m in saved:
            q._set_module(p, m)
        q.release(i)
    return res, y, x_in, x_q


def _carried(
    ref: Stream, q: Stream, i: int, x_ref: dict[str, mx.array], x_in: mx.array, x_q: dict[str, mx.array], batch: int
) -> tuple[dict[str, mx.array], mx.array, dict[str, mx.array]]:  # fmt: skip
    """Block ``i`` untrained, once the budget holds no step: the reference's, the input's and the
    tuned path's validation states through it (the closing KL's), not the training windows'
    (eight times as many by default: their passes were most of a block's time without steps)."""
    with ref.loaded(i):
        y = {"val": run_batched(lambda x: ref.run(i, x), x_ref["val"], batch)}
    _finite(y, ref, i, "tune.reference")
    q.load(i)
    try:
        x_in = run_batched(lambda x: q.run(i, x), x_in, batch)
        x_q = {"val": run_batched(lambda x: q.run(i, x), x_q["val"], batch)}
        _finite(x_q, q, i, "model.name")
    finally:
        q.release(i)
    return y, x_in, x_q


def _finite(states: dict[str, mx.array], stream: Stream, i: int, key: str) -> None:
    """Refuse a model whose block ``i`` gives a NaN or Inf (a damaged weight): nothing is tuned
    against, or written from, a model that computes garbage."""
    if not all(mx.isfinite(v).all().item() for v in states.values()):
        raise InputError(
            f"{key}={str(stream.dir)!r}: block {i}'s output is not finite (NaN or Inf); its weights"
            " are damaged"
        )
