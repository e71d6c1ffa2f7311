"""A candidate against the reference's top-K record, per scored token, in float32 on the default device.

The record (:mod:`mlxbun.eval.record`) keeps the reference's K largest logits and merges the other
V - K tokens into one outcome, the tail (mass P). With d_i = z'_i - z_i the candidate's logit shift
of each kept token and d_T = lse_tail(z') - lse_tail(z) the tail's, KL of the merged distributions
is, as in :func:`mlxbun.kl.kl_logits`,

    KLD_K = log E[e^(d - m)] - E[d - m] = log1p(E[c] + E[expm1(c) - c]) - E[c],   c = d - m, m = E[d]

(E over the kept tokens' p_i and the tail's P): every term is a small difference, so an 8-bit
candidate's KL of 1e-6 keeps its digits in float32, and L' - L = m + log E[e^c] gives each token's
NLL change and Δp without subtracting two large log-sums.

Merging the tail can only lose KL (log-sum inequality):
    0 <= KLD - KLD_K = P * KL(p_tail / P || q_tail / Q) <= P * max KL(r || q_tail / Q) = bound,
the max over every tail r the record allows: no tail entry of p is above p_K (the K-th largest), so
r_i <= c = p_K / P. KL is convex in r, so the max is at a vertex: mass c on each of the candidate's
least likely tail tokens in turn, the remainder on the next. The bound is exact for what the
record keeps (some reference tail reaches it); K = V makes it 0.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mlxbun.eval.passes import slices
from mlxbun.eval.record import on_device, tail_lse
from mlxbun.quant.calibration import Windows

SERIES = 0.1  # |c| below this: expm1(c) - c from its series (float32 expm1 minus c loses digits)
SORTED = 4096  # the worst tail's least likely tokens sorted per row at most (a sort of V is slow on CPUs)


class NonFinite(Exception):
    """A candidate's statistics are not finite: NaN or infinite logits (``row``: the first such token)."""

    def __init__(self, row: int) -> None:
        super().__init__(row)
        self.row = row


def _expm1_minus(c: Any) -> Any:
    """expm1(c) - c (>= 0), accurate in float32 for small and large ``c``."""
    import mlx.core as mx

    series = c * c * (0.5 + c * (1 / 6 + c * (1 / 24 + c * (1 / 120 + c * (1 / 720)))))
    return mx.where(mx.abs(c) < SERIES, series, mx.expm1(c) - c)


def merged_kl(w: Any, d: Any, mass: Any, d_tail: Any) -> tuple[Any, Any]:
    """(KLD_K, L' - L) per row from the kept tokens' probabilities ``w`` and shifts ``d`` ``[rows, K]``
    and the tail's mass and shift ``[rows]`` (module docstring)."""
    import mlx.core as mx

    total = w.sum(axis=-1) + mass  # 1 up to float32 rounding: every mean below divides by it
    m = ((w * d).sum(axis=-1) + mass * d_tail) / total
    c, c_tail = d - m[:, None], d_tail - m
    lin = ((w * c).sum(axis=-1) + mass * c_tail) / total
    curv = ((w * _expm1_minus(c)).sum(axis=-1) + mass * _expm1_minus(c_tail)) / total
    log_e = mx.log1p(lin + curv)  # log E[e^c]
    return log_e - lin, m + log_e


def worst_tail(z: Any, rec: dict[str, Any], cur_tail: Any) -> Any:
    """Per row, the largest KL(r || q_tail / Q) over tail distributions r with every r_i <= p_K / P
    (exact while the worst case fills fewer than ``SORTED`` tokens; above, a larger valid bound)."""
    import mlx.core as mx

    idx = rec["idx"]
    n_tail = z.shape[1] - idx.shape[1]
    share = mx.minimum(mx.exp(rec["logit"].min(axis=-1) - rec["tail"]), 1.0)  # c = p_K / P
    full = mx.minimum(mx.floor(1.0 / share), n_tail)  # tokens at mass c
    m = int(min(mx.max(full).item() + 1, n_tail, SORTED))
    rest = mx.put_along_axis(z, idx, mx.array(np.inf, dtype=mx.float32), axis=-1)
    if m < rest.shape[1]:
        rest = mx.partition(rest, m - 1, axis=-1)[:, :m]
    # log q_hat of the m least likely tail tokens, ascending; every later one is at least the last
    low = mx.sort(rest, axis=-1) - cur_tail[:, None]
    j, at = mx.arange(m)[None, :], full[:, None]
    w = mx.where(j < at, share[:, None], 0.0)
    w = mx.where(j == at, mx.maximum(1.0 - full * share, 0.0)[:, None], w)
    terms = mx.where(w > 0, w * (mx.log(mx.maximum(w, 1e-30)) - low), 0.0).sum(axis=-1)
    beyond = mx.maximum(full - m, 0.0)  # tokens at mass c past the sorted ones, each at the last's q_hat
    rem = mx.where(full >= m, mx.maximum(1.0 - full * share, 0.0), 0.0)
    last = low[:, -1]
    terms += beyond * share * (mx.log(share) - last) + mx.where(
        rem > 0, rem * (mx.log(mx.maximum(rem, 1e-30)) - last), 0.0
    )
    return mx.maximum(terms, 0.0)


def token_stats(rec: dict[str, Any], logits: Any, targets: Any) -> dict[str, Any]:
    """Per row of float32 ``logits [rows, vocab]`` against record rows ``rec`` (MLX arrays): ``kld``
    (KLD_K), ``bound`` (KLD - KLD_K is in [0, bound]), ``same_top``, ``dp`` (p_cur - p_ref of the next
    token ``targets``), ``nll_ref`` and ``dnll`` (nll_cur - nll_ref)."""
    import mlx.core as mx

    z = logits.astype(mx.float32)
    idx = rec["idx"]
    w = mx.exp(rec["logit"] - rec["lse"][:, None])
    d = mx.take_along_axis(z, idx, axis=-1) - rec["logit"]
    has_tail = idx.shape[1] < z.shape[1]
    mass = mx.exp(rec["tail"] - rec["lse"]) if has_tail else mx.zeros_like(rec["lse"])
    cur_tail = tail_lse(z, idx) if has_tail else None
    d_tail = cur_tail - rec["tail"] if has_tail else mx.zeros_like(mass)
    kld, dlse = merged_kl(w, d, mass, d_tail)
    shift_t = mx.take_along_axis(z, targets[:, None].astype(mx.int32), axis=-1)[:, 0] - rec["target"]
    dnll = dlse - shift_t
    logp_t = rec["target"] - rec["lse"]
    return {
        "kld": kld,
        "bound": mass * worst_tail(z, rec, cur_tail) if has_tail else mx.zeros_like(kld),
        "same_top": mx.argmax(z, axis=-1).astype(mx.int32) == rec["top"],
        "dp": mx.exp(logp_t) * mx.expm1(-dnll),
        "nll_ref": -logp_t,
        "dnll": dnll,
    }


def per_token(
    model: Any, rec: dict[str, np.ndarray], text: Windows, *, batch_size: int, desc: str
) -> dict[str, np.ndarray]:
    """:func:`token_stats` of ``model`` over every window, as float64 (bool) numpy arrays per token.

    Raises:
        NonFinite: a slice of its logits holds NaN or Inf (scoring stops there).
    """
    import mlx.core as mx

    parts = []
    for at, logits, targets in slices(model, text.tokens, batch_size=batch_size, desc=desc):
        part = token_stats(on_device(rec, at, at + logits.shape[0]), logits, targets)
        mx.eval(part)
        part = {k: np.array(v) for k, v in part.items()}
        # a NaN or Inf logit anywhere in a row reaches its KLD, bound or NLL change (no pass of its own)
        ok = np.isfinite(part["kld"]) & np.isfinite(part["bound"]) & np.isfinite(part["dnll"])
        if not ok.all():
            raise NonFinite(at + int(np.argmin(ok)))
        parts.append(part)
    out = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    return {k: v if v.dtype == np.bool_ else v.astype(np.float64) for k, v in out.items()}
