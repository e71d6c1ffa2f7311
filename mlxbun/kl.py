"""KL(ref || cur) of next-token distributions from logits: the one log-softmax and KL of the project.

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


# ------------------------------------------------------------------- eval: top-K reference, statistics
#
# A reference distribution p is kept as its K largest log-probs (and their token ids), the log of
# the tail mass P = sum of the other V - K probabilities, and the log-prob of the text's next token.
# Against a candidate q (full distribution, tail mass Q over the same V - K tokens):
#
#     KLD_K = sum_{i in top K} p_i log(p_i / q_i) + P log(P / Q)
#
# Merging the tail into one outcome can only lose information (log-sum inequality), so
#     0 <= KLD - KLD_K = P * KL(p_tail / P || q_tail / Q) <= P * max KL(r || q_tail / Q) = bound
# the max over every r the record allows: no tail entry of p is above p_K (the K-th largest), so
# r_i <= c = p_K / P. KL is convex in r, so the max is at a vertex: mass c on each of the
# candidate's smallest tail probabilities in turn, the remainder on the next. The bound is exact
# for what the record keeps (some reference tail reaches it), computed per token; K >= vocab makes it 0.


def top_k(logp: np.ndarray, targets: np.ndarray, *, k: int) -> dict[str, np.ndarray]:
    """The cached form of ``[rows, vocab]`` reference log-probs: ``idx``/``logp`` (largest first,
    ties by token id, as ``argmax``), ``tail`` (log of the rest's mass, -inf when none) and
    ``target`` (log-prob of each row's next token ``targets``)."""
    rows, vocab = logp.shape
    k = min(k, vocab)
    idx = np.sort(np.argpartition(-logp, k - 1, axis=-1)[:, :k], axis=-1)
    vals = np.take_along_axis(logp, idx, axis=-1)
    order = np.argsort(-vals, axis=-1, kind="stable")
    idx, vals = np.take_along_axis(idx, order, axis=-1), np.take_along_axis(vals, order, axis=-1)
    return {
        "idx": idx.astype(np.int32),
        "logp": vals,
        "tail": _tail_logsumexp(logp, idx),
        "target": logp[np.arange(rows), targets],
    }


def _tail_logsumexp(logp: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """log of the probability mass outside ``idx`` per row (-inf when ``idx`` covers the vocabulary)."""
    rest = logp.copy()
    np.put_along_axis(rest, idx, -np.inf, axis=-1)
    top = rest.max(axis=-1)
    safe = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):
        return safe + np.log(np.exp(rest - safe[:, None]).sum(axis=-1))


def token_stats(
    ref: dict[str, np.ndarray], cur_logp: np.ndarray, targets: np.ndarray
) -> dict[str, np.ndarray]:
    """Per token, a candidate (``[rows, vocab]`` float64 log-probs) against a :func:`top_k` reference:
    ``kld`` (KLD_K), ``bound`` (KLD - KLD_K is in [0, bound]), ``same_top``, ``dp`` (p_cur - p_ref of
    the next token), ``nll_ref`` and ``nll_cur``."""
    rows = np.arange(len(targets))
    q_top = np.take_along_axis(cur_logp, ref["idx"], axis=-1)
    kld = (np.exp(ref["logp"]) * (ref["logp"] - q_top)).sum(axis=-1)
    cur_tail = _tail_logsumexp(cur_logp, ref["idx"])
    has_tail = np.isfinite(ref["tail"])
    mass = np.where(has_tail, np.exp(ref["tail"]), 0.0)
    with np.errstate(invalid="ignore"):
        kld += np.where(has_tail, mass * (ref["tail"] - cur_tail), 0.0)
    bound = mass * _worst_tail(ref, cur_logp, cur_tail) if has_tail.any() else np.zeros(len(kld))
    cur_target = cur_logp[rows, targets]
    return {
        "kld": kld,
        "bound": bound,
        "same_top": cur_logp.argmax(axis=-1) == ref["idx"][:, 0],
        "dp": np.exp(cur_target) - np.exp(ref["target"]),
        "nll_ref": -ref["target"],
        "nll_cur": -cur_target,
    }


def _worst_tail(ref: dict[str, np.ndarray], cur_logp: np.ndarray, cur_tail: np.ndarray) -> np.ndarray:
    """Per row, the largest KL(r || q_tail / Q) over tail distributions r with every r_i <= p_K / P."""
    rest = cur_logp.copy()
    np.put_along_axis(rest, ref["idx"], np.inf, axis=-1)
    n_tail = rest.shape[1] - ref["idx"].shape[1]
    share = np.minimum(np.exp(ref["logp"][:, -1] - ref["tail"]), 1.0)  # c = p_K / P
    full = np.minimum(np.floor(1.0 / share), n_tail).astype(np.int64)  # tokens at mass c
    m = int(min(full.max() + 1, n_tail))
    small = np.sort(np.partition(rest, m - 1, axis=-1)[:, :m], axis=-1) - cur_tail[:, None]  # log q_hat
    j = np.arange(m)[None, :]
    w = np.where(j < full[:, None], share[:, None], 0.0)
    w = np.where(j == full[:, None], np.maximum(1.0 - full * share, 0.0)[:, None], w)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(w > 0, w * (np.log(w) - small), 0.0)
    return np.maximum(terms.sum(axis=-1), 0.0)


PERCENTILES = (50.0, 90.0, 95.0, 99.0, 99.9)


def summary(stats: dict[str, np.ndarray]) -> dict[str, float]:
    """llama.cpp's ``--kl-divergence`` report of :func:`token_stats` over every token: mean KLD ± its
    standard error, median, 90/95/99/99.9% and max KLD, same top p ±, RMS Δp ±, both PPLs ± and
    their ratio ±, and the mean top-K bound (``kld_bound``: the mean KLD is low by at most it)."""
    kld, n = stats["kld"], len(stats["kld"])
    pct = np.percentile(kld, PERCENTILES)
    same = float(np.mean(stats["same_top"]))
    dp2 = stats["dp"] ** 2
    rms = float(np.sqrt(dp2.mean()))
    d = stats["nll_cur"] - stats["nll_ref"]
    ratio = float(np.exp(d.mean()))
    out = {
        "tokens": n,
        "kld_mean": float(kld.mean()),
        "kld_mean_err": _sem(kld),
        "kld_median": float(pct[0]),
        "kld_max": float(kld.max()),
        "kld_bound": float(stats["bound"].mean()),
        "same_top": same,
        "same_top_err": float(np.sqrt(same * (1 - same) / max(n - 1, 1))),
        "rms_dp": rms,
        "rms_dp_err": _sem(dp2) / (2 * rms) if rms > 0 else 0.0,
        "ppl_ref": float(np.exp(stats["nll_ref"].mean())),
        "ppl_ref_err": float(np.exp(stats["nll_ref"].mean())) * _sem(stats["nll_ref"]),
        "ppl": float(np.exp(stats["nll_cur"].mean())),
        "ppl_err": float(np.exp(stats["nll_cur"].mean())) * _sem(stats["nll_cur"]),
        "ppl_ratio": ratio,
        "ppl_ratio_err": ratio * _sem(d),
    }
    out |= {f"kld_p{q:g}".replace(".", "_"): float(v) for q, v in zip(PERCENTILES[1:], pct[1:], strict=True)}
    return out


def _sem(x: np.ndarray) -> float:
    """Standard error of the mean (0 for one value)."""
    return float(np.std(x, ddof=1) / np.sqrt(len(x))) if len(x) > 1 else 0.0
