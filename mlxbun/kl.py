"""KL(ref || cur) of next-token distributions from logits, in float64 numpy: the probes' KL;
and :func:`kl_logits`, the streamed steps' KL in float32 without cancellation, slice by slice.

(command=eval scores candidates against a top-K record in float32 on MLX's device instead:
:mod:`mlxbun.eval.score`.)

Softmax and sums run in float64 numpy: the KL of an 8-bit probe can be ~1e-7, below the float32
rounding of log-probs near -log(vocab), and MLX's float64 exp is only float32-accurate on CPU.
MLX logits are cast to float32 first (the precision the forwards run in); numpy logits are taken
as they are (float64 stays float64). Shapes: ``[..., tokens, vocab]``.

Example:
    >>> ref = log_probs(model(batch))                # [batch, tokens, vocab], float64
    >>> kl_rows(ref, quantized_model(batch))         # [batch]: mean over tokens of each row
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np


def as_float64(logits: Any) -> np.ndarray:
    """Logits as a fresh float64 numpy array (MLX arrays pass through float32)."""
    if not isinstance(logits, np.ndarray):
        logits = logits.astype(mx.float32)
    return np.array(logits, dtype=np.float64)


def log_softmax(z: np.ndarray) -> np.ndarray:
    """log-softmax over the last axis, in place on a float64 array (returned)."""
    z -= z.max(axis=-1, keepdims=True)
    z -= np.log(np.exp(z).sum(axis=-1, keepdims=True))
    return z


def log_probs(logits: Any) -> np.ndarray:
    """Log-probabilities of ``logits`` (MLX or numpy), float64 numpy."""
    return log_softmax(as_float64(logits))


def kl_logp(ref_logp: np.ndarray, cur_logp: np.ndarray) -> np.ndarray:
    """KL(ref || cur) per token from log-probabilities, then the mean over tokens (``[..., tokens]``)."""
    return (np.exp(ref_logp) * (ref_logp - cur_logp)).sum(axis=-1).mean(axis=-1)


def kl_rows(ref_logp: np.ndarray, logits: Any) -> np.ndarray:
    """:func:`kl_logp` against the log-probabilities of ``logits``: shape ``ref_logp.shape[:-2]``."""
    return kl_logp(ref_logp, log_probs(logits))


def kl(ref_logits: Any, cur_logits: Any) -> float:
    """Mean over every token of KL(softmax(ref) || softmax(cur))."""
    return float(np.mean(kl_rows(log_probs(ref_logits), cur_logits)))


def ref_stats(logits: Any) -> tuple[np.ndarray, np.ndarray]:
    """(p_ref, sum_v p_ref log p_ref) of the reference logits: what every probe against it reuses."""
    logp = log_probs(logits)
    p = np.exp(logp)
    return p, (p * logp).sum(axis=-1)


def kl_from_stats(stats: tuple[np.ndarray, np.ndarray], logits: Any) -> np.ndarray:
    """:func:`kl_rows` as sum p log p - sum p z_cur + logsumexp(z_cur): one exp per element, not two.

    For ``[batch, tokens, vocab]`` logits; returns ``[batch]``.
    """
    p, neg_entropy = stats
    z = as_float64(logits)
    cross = np.einsum("btv,btv->bt", p, z)
    top = z.max(axis=-1)
    z -= top[..., None]  # in place: one vocabulary-sized float64 array per call
    lse = top + np.log(np.exp(z, out=z).sum(axis=-1))
    return (neg_entropy - cross + lse).mean(axis=-1)


def kl_logits(ref_logits: mx.array, cur_logits: mx.array) -> mx.array:
    """KL(softmax(ref) || softmax(cur)) per row, in float32 without cancellation.

    With p the reference's distribution and d = cur - ref, KL = log E_p[e^d] - E_p[d]
    = log1p(E_p[expm1(d - E_p[d])]): every term is a small difference, so a KL of 1e-7 keeps its
    digits in float32 (subtracting log-probs near -log(vocab) would lose them), on any device.
    On MLX's CPU backend the same formula runs in numpy, whose vectorized exp is many times
    faster than MLX's CPU exp over a large vocabulary; on a GPU it stays on the device."""
    if mx.default_device() == mx.cpu:
        ref, cur = (np.array(z.astype(mx.float32)) for z in (ref_logits, cur_logits))
        return mx.array(_kl_rows_host(ref, cur))
    return _kl_rows_device(ref_logits, cur_logits)


def _kl_rows_device(ref_logits: mx.array, cur_logits: mx.array) -> mx.array:
    ref = ref_logits.astype(mx.float32)
    d = cur_logits.astype(mx.float32) - ref
    p = mx.softmax(ref, axis=-1)
    centred = d - (p * d).sum(axis=-1, keepdims=True)
    return mx.log1p((p * mx.expm1(centred)).sum(axis=-1))


def _kl_rows_host(ref: np.ndarray, cur: np.ndarray) -> np.ndarray:
    """:func:`kl_logits` on float32 numpy arrays it may overwrite (two vocabulary-sized temporaries)."""
    d = np.subtract(cur, ref, out=cur)
    ref -= ref.max(axis=-1, keepdims=True)
    p = np.exp(ref, out=ref)
    p /= p.sum(axis=-1, keepdims=True)
    d -= (p * d).sum(axis=-1, keepdims=True)
    np.expm1(d, out=d)
    d *= p
    return np.log1p(d.sum(axis=-1))
