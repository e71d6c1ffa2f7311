"""tune's validation: the KL of the reference's next-token distributions against the input's and
the tuned model's on the validation windows, a slice of tokens at a time, and the test that
says whether the tuned model is written (:func:`gained`).

Example:
    >>> before, after = kl_between(ref, h_ref, q, [h_input, h_tuned])
    >>> gained(after, before, min_gain=0.05)
"""

from __future__ import annotations

import time
from collections.abc import Callable

import mlx.core as mx
import numpy as np

from mlxbun.kl import kl_logits
from mlxbun.quant.streamed import Stream


def kl_between(
    ref: Stream,
    h_ref: mx.array,
    cur: Stream,
    states: list[mx.array],
    *,
    tick: Callable[[], None] = lambda: None,
) -> list[np.ndarray]:
    """KL(ref || cur) of each token, of the reference's head on its last states ``h_ref`` against
    ``cur``'s head on each of ``states`` (the same windows through other blocks), in slices of
    tokens: each slice's reference logits are computed once, and ``cur``'s head casts its weight
    once for all the states (at a large vocabulary that cast is most of a slice). ``tick()``
    after each slice."""
    a = h_ref.reshape(-1, h_ref.shape[-1])
    bs = [h.reshape(-1, h.shape[-1]) for h in states]
    step, out = kl_step(ref, cur), [[] for _ in bs]
    for lo in range(0, a.shape[0], step):
        r = ref.head(a[None, lo : lo + step])
        c = cur.head(mx.concatenate([b[None, lo : lo + step] for b in bs], axis=1))
        n = r.shape[1]
        for k in range(len(bs)):
            out[k].append(np.asarray(kl_logits(r, c[:, k * n : (k + 1) * n])[0]))
        tick()
    return [np.concatenate(o).astype(np.float64) for o in out]


def kl_step(ref: Stream, cur: Stream) -> int:
    """Tokens in a slice of :func:`kl_between` (``cur``'s logits are that many per state)."""
    return min(ref.token_rows(), cur.token_rows())


def kl_seconds(ref: Stream, h_ref: mx.array, cur: Stream, h_cur: mx.array) -> float:
    """The seconds :func:`kl_between` will take on states of ``h_ref``'s and ``h_cur``'s shapes
    (``cur`` on two of them), from one of its slices run now: its head and KL work does not depend
    on the states' values, so a time budget can keep room for the closing validation KL (at 27B's
    width on 2 cores it took half as long as the blocks it closed)."""
    step = kl_step(ref, cur)
    tokens = h_ref.shape[0] * h_ref.shape[1]
    a = h_ref.reshape(-1, h_ref.shape[-1])[None, :step]
    b = h_cur.reshape(-1, h_cur.shape[-1])[None, :step]
    t0 = time.monotonic()
    kl_between(ref, a, cur, [b, b])
    return (time.monotonic() - t0) * -(-tokens // step)


def gained(after: np.ndarray, before: np.ndarray, min_gain: float) -> bool:
    """Is the tuned model's mean per-token validation KL ``after`` at least ``min_gain`` (a
    fraction) below the input's ``before``, and :func:`significantly_lower`? Validation gains of
    2.5% and 4% (significant: tokens of a window are not independent, so the standard error
    reads small) came with held-out KL 1% and 7% worse (BENCHMARKS.md, tune's gain)."""
    return bool(after.mean() <= (1.0 - min_gain) * before.mean()) and significantly_lower(after, before)


def significantly_lower(after: np.ndarray, before: np.ndarray) -> bool:
    """Is the mean of ``after`` below ``before``'s by more than :data:`SIGNIFICANCE` standard errors
    of their per-token difference (a paired test: a gain inside the validation's noise is none)?"""
    d = after - before
    if len(d) < 2:
        return bool(d.mean() < 0)
    return bool(d.mean() < -SIGNIFICANCE * d.std(ddof=1) / np.sqrt(len(d)))


SIGNIFICANCE = 2.0
