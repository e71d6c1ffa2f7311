"""Quantizer variants that write mlx's plain affine format: range (clip) search and GPTQ rounding.

``mx.quantize`` takes each group's min and max as its range. ``method="clip"`` instead tries
shrunken ranges (a fixed grid of ratios), then refits scale and bias by least squares to the
codes they give, and keeps per group whichever candidate has the smallest squared error,
optionally weighted per input column (e.g. by the mean squared activation E[x_j^2], which makes
it the layer's output error for independent inputs). ``mx.quantize``'s own result is always
one of the candidates, so the error is never above it. ``method="gptq"`` (Frantar et al. 2022)
rounds column by column and spreads each column's rounding error over the columns not yet
rounded, through the inverse of the layer's input Hessian H (:mod:`mlxbun.quant.hessian`); the
groups' scales and biases come first from the range search, then the columns are rounded in
act-order (largest diag(H) first; :func:`gptq_factor`).
A module without H falls back to the range search. ``method="awq"`` is the range search on a
weight whose columns :mod:`mlxbun.quant.awq` has already scaled (the scales live in the weights). The output is ``(packed, scales,
biases)`` exactly as ``mx.quantize`` lays them out (codes packed as one little-endian bit stream
per row), so stock ``mlx_lm.load`` reads it; the same input gives the same bytes.

Example:
    >>> wq, scales, biases = quantize(w, bits=3, group_size=64, method="clip")
    >>> mx.dequantize(wq, scales, biases, group_size=64, bits=3)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

from mlxbun.errors import NumericFailure
from mlxbun.quant.spec import check_method

VERSION = 3  # of what the rounding gives: bump on any change of its bytes (it keys the rounded cache)
DAMP = 0.01  # GPTQ's diagonal dampening, relative to the mean of diag(H)
# Range ratios tried for each group (1.0 = min/max); fixed so results are deterministic.
RATIOS = tuple(1.0 - 0.025 * i for i in range(1, 21))
REFITS = 2
CHUNK = 1 << 22  # weights (de)quantized at once: bounds the temporaries of a large embedding
BLOCK_ELEMENTS = 1 << 14  # rows are searched in blocks of about this many weights (x the ratios)


class NotPositiveDefinite(ValueError):
    """GPTQ's Cholesky of a dampened H failed: H is not positive semi-definite."""


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes (rows, cols) in [0, 2**bits) -> uint32 (rows, cols*bits/32), mlx's bit order."""
    rows, cols = codes.shape
    planes = (codes[..., None].astype(np.uint32) >> np.arange(bits, dtype=np.uint32)) & 1
    stream = np.packbits(planes.astype(np.uint8).reshape(rows, cols * bits), axis=-1, bitorder="little")
    return np.ascontiguousarray(stream).view("<u4").astype(np.uint32)


def _codes(w: Any, s: Any, b: Any, n: int) -> Any:
    return mx.clip(mx.round((w - b) / s), 0, n)


def _err(w: Any, q: Any, s: Any, b: Any, imp: Any) -> Any:
    return mx.sum(imp * mx.square(w - (s * q + b)), axis=-1, keepdims=True)


def _stored(x: Any, dtype: Any) -> Any:
    """The value a scale or bias has once written in ``dtype``; zero scales become tiny."""
    x = x.astype(dtype).astype(mx.float32)
    return mx.where(x == 0, mx.array(1e-8, mx.float32).astype(dtype).astype(mx.float32), x)


def _refit(w: Any, q: Any, imp: Any, s: Any, b: Any) -> tuple[Any, Any]:
    """Weighted least-squares scale and bias for fixed codes (unchanged where degenerate)."""
    iq = imp * q  # once: (imp * q) * q and (imp * q) * w are what imp * q * q and imp * q * w compute
    sw, sq = mx.sum(imp, -1, keepdims=True), mx.sum(iq, -1, keepdims=True)
    sqq, swx = mx.sum(iq * q, -1, keepdims=True), mx.sum(imp * w, -1, keepdims=True)
    sqx = mx.sum(iq * w, -1, keepdims=True)
    det = sw * sqq - sq * sq
    ok = det > 1e-12 * mx.maximum(sw * sqq, 1e-30)
    s_new = (sw * sqx - sq * swx) / mx.where(ok, det, 1.0)
    b_new = (swx - s_new * sq) / mx.maximum(sw, 1e-30)
    return mx.where(ok, s_new, s), mx.where(ok, b_new, b)


def _search_block(w: Any, imp: Any, *, bits: int, group_size: int, dtype: Any) -> tuple[Any, Any, Any]:
    """Best (codes, scale, bias) per group of a float32 block (rows, cols).

    Every range ratio is searched at once (a leading axis of ``len(RATIOS) + 1``); the candidates
    are then taken in the order ratio by ratio, refit by refit, each kept where its error is
    strictly below the best so far (ties keep the earlier one), starting from ``mx.quantize``'s.
    """
    n = (1 << bits) - 1
    rows, cols = w.shape
    wg = w.reshape(rows, cols // group_size, group_size)
    ig = imp.reshape(1, cols // group_size, group_size)
    _, s0, b0 = mx.quantize(w.astype(dtype), group_size=group_size, bits=bits)
    best_s, best_b = _stored(s0[..., None], dtype), _stored(b0[..., None], dtype)
    best_e = _err(wg, _codes(wg, best_s, best_b, n), best_s, best_b, ig)
    lo, hi = mx.min(wg, -1, keepdims=True), mx.max(wg, -1, keepdims=True)
    ratios = mx.array((1.0, *RATIOS), mx.float32).reshape(-1, 1, 1, 1)
    s = _stored(mx.maximum((hi - lo) * ratios / n, 1e-8), dtype)
    b = _stored(lo * ratios, dtype)
    errs, scales, biases = [best_e[None]], [best_s[None]], [best_b[None]]
    for step in range(REFITS + 1):
        q = _codes(wg, s, b, n)
        errs.append(_err(wg, q, s, b, ig))
        scales.append(s)
        biases.append(b)
        if step < REFITS:
            s, b = _refit(wg, q, ig, s, b)
            s, b = _stored(s, dtype), _stored(b, dtype)
    # order: mx.quantize's, then ratio by ratio, refit by refit; argmin keeps the first minimum
    e = _in_order(errs, ratios.shape[0])
    pick = mx.argmin(mx.where(mx.isnan(e), mx.inf, e), axis=0, keepdims=True)
    pick = mx.where(mx.isnan(e[:1]), 0, pick)  # no error is below a NaN one: mx.quantize's stays
    best_s = mx.take_along_axis(_in_order(scales, ratios.shape[0]), pick, axis=0)[0]
    best_b = mx.take_along_axis(_in_order(biases, ratios.shape[0]), pick, axis=0)[0]
    mx.eval(best_s, best_b)
    return _codes(wg, best_s, best_b, n).reshape(rows, cols), best_s[..., 0], best_b[..., 0]


def _in_order(parts: list[Any], ratios: int) -> Any:
    """[first (1, ...), then one (ratios, ...) per refit step] -> (1 + ratios x steps, ...), ratio-major."""
    tried = mx.stack(parts[1:], axis=1).reshape(-1, *parts[1].shape[1:])
    return mx.concatenate([parts[0], tried], axis=0)


def _search(
    w: Any, imp: Any, *, bits: int, group_size: int, dtype: Any, codes: bool = True
) -> tuple[np.ndarray | None, Any, Any]:
    """:func:`_search_block` over ``w`` (rows, cols; any float dtype) in blocks of rows of about
    :data:`BLOCK_ELEMENTS` weights: the codes packed (:func:`pack`; None unless ``codes``),
    scales and biases (float32)."""
    rows, cols = w.shape
    step = max(1, BLOCK_ELEMENTS // cols)
    packed, scales, biases = [], [], []
    for r0 in range(0, rows, step):
        q, s, b = _search_block(
            w[r0 : r0 + step].astype(mx.float32), imp, bits=bits, group_size=group_size, dtype=dtype
        )
        if codes:  # else never evaluated (mlx is lazy)
            packed.append(pack(np.asarray(q.astype(mx.uint8)), bits))
        scales.append(s)
        biases.append(b)
    return np.concatenate(packed) if codes else None, mx.concatenate(scales), mx.concatenate(biases)


def inverse_factor(h: np.ndarray, order: np.ndarray | None = None) -> np.ndarray:
    """Upper-triangular U with ``H^-1 = U^T U`` (dampened H, its rows and columns taken in
    ``order``; default: as given), without forming ``H^-1``.

    With P the reversal, ``P H P = L L^T`` gives ``H = (P L P)(P L P)^T``, so ``U = P L^-1 P``:
    one Cholesky and one triangular inverse in float32. Both run in numpy's own LAPACK and BLAS,
    which every numpy wheel carries: MLX's CPU LAPACK is as fast only with a system OpenBLAS
    loaded (BENCHMARKS.md, "GPTQ's factor"). The diagonal is dampened in float64 and H is copied
    once, in float32 and already reversed: at the widest H a model has (the down_proj's) every
    copy counts.
    """
    n = h.shape[0]
    order = np.arange(n) if order is None else np.asarray(order)
    diag = np.diag(h)[order].astype(np.float64)
    damped = np.where(diag <= 0, 1.0, diag) + DAMP * max(float(diag.mean()), 1e-12)
    back = order[::-1]
    H = np.asarray(h, dtype=np.float32)[np.ix_(back, back)]
    H[np.diag_indices(n)] = damped[::-1].astype(np.float32)
    _check_factor(_cholesky(H))  # L, in H's place
    inv = _lower_inverse(H)
    del H  # before the reversed copy: at most H's size three times over
    return np.ascontiguousarray(inv[::-1, ::-1])


FACTOR_BLOCK = 512  # rows and columns a step of the blocked Cholesky and its updates take


def _cholesky(H: np.ndarray) -> np.ndarray:
    """Lower L with ``H = L L^T``, computed in place in ``H`` (float32) by blocks: each diagonal
    block factored alone (small), the panel below it solved against it, the trailing lower part
    updated a block of rows at a time. numpy's own ``cholesky`` works in float64 (4x H in
    temporaries); this holds H and a block-wide panel."""
    n, b = H.shape[0], FACTOR_BLOCK
    for k in range(0, n, b):
        e = min(k + b, n)
        try:
            D = np.linalg.cholesky(H[k:e, k:e]).astype(np.float32)
        except np.linalg.LinAlgError:
            raise NotPositiveDefinite(
                "is not positive definite (its Cholesky failed after dampening)"
            ) from None
        H[k:e, k:e] = D
        if e == n:
            break
        H[e:, k:e] = H[e:, k:e] @ _lower_inverse(D).T
        panel = H[e:, k:e]
        for r in range(e, n, b):  # the lower part of H[e:, e:] -= panel panel^T, a block of rows at a time
            s = min(r + b, n)
            H[r:s, e:s] -= panel[r - e : s - e] @ panel[: s - e].T
    for k in range(0, n, b):  # the strictly upper part still holds H's values
        s = min(k + b, n)
        H[k:s, s:] = 0
        H[k:s, k:s][np.triu_indices(s - k, 1)] = 0
    return H


def _lower_inverse(L: np.ndarray) -> np.ndarray:
    """The inverse of lower-triangular ``L`` by halves: [[A, 0], [B, C]]^-1 is
    [[A^-1, 0], [-C^-1 B A^-1, C^-1]], so the work is matrix products (BLAS-3)."""
    n = L.shape[0]
    if n <= 128:
        return np.tril(np.linalg.inv(L))
    k = n // 2
    out = np.zeros_like(L)
    out[:k, :k] = a = _lower_inverse(L[:k, :k])
    out[k:, k:] = c = _lower_inverse(L[k:, k:])
    out[k:, :k] = -(c @ (L[k:, :k] @ a))
    return out


def _check_factor(L: np.ndarray) -> None:
    """A factor whose diagonal is not finite and positive throughout is a failed one (a NaN or Inf
    in H passes LAPACK's pivot test)."""
    d = np.diag(L)
    if not (np.isfinite(d).all() and (d > 0).all()):
        raise NotPositiveDefinite("is not positive definite (its Cholesky failed after dampening)")


def gptq_factor(h: Any) -> tuple[np.ndarray, np.ndarray]:
    """GPTQ's column order and the :func:`inverse_factor` of ``h`` taken in that order.

    The order is act-order (GPTQ's ``desc_act``): the columns of largest diag(H) first (ties in
    column order), so the inputs that carry the most energy are rounded while the most columns are
    left to absorb their error (BENCHMARKS.md has its gain over the plain order)."""
    h = np.asarray(h)
    order = np.argsort(-np.diag(h).astype(np.float64), kind="stable")
    return order, inverse_factor(h, order)


def _gptq_block(
    W: np.ndarray, U: np.ndarray, s: np.ndarray, b: np.ndarray, n: int
) -> tuple[np.ndarray, np.ndarray]:
    """Round the columns of one block (``W``: rows x block, updated in place; ``s``, ``b``: each
    column's group scale and bias) one by one, each column's error spread over the block's later
    columns; (codes, scaled errors)."""
    codes = np.empty(W.shape, dtype=np.uint8)
    err = np.empty(W.shape, dtype=np.float32)
    for k in range(W.shape[1]):
        q = np.clip(np.round((W[:, k] - b[:, k]) / s[:, k]), 0, n)
        codes[:, k] = q
        e = (W[:, k] - (s[:, k] * q + b[:, k])) / U[k, k]
        W[:, k + 1 :] -= np.outer(e, U[k, k + 1 :])
        err[:, k] = e
    return codes, err


def _gptq(
    w: Any, h: Any, *, bits: int, group_size: int, factor: tuple[np.ndarray, np.ndarray] | None = None
) -> tuple[np.ndarray, Any, Any]:
    """GPTQ codes, scales and biases of ``w`` (rows, cols) for the input Hessian ``h``
    (``factor``: its :func:`gptq_factor`, when already computed).

    Static groups with act-order: every group's scale and bias come first from the range search
    (weighted by diag(H)) on the weight as given, then the columns are rounded in
    :func:`gptq_factor`'s order, each on its own group's grid, so the groups stay mlx's contiguous
    ones. float32 throughout (as the reference implementation); the update of the later columns
    after each block of ``group_size`` columns is one matmul through mlx (BLAS), the column loop
    runs on the block's slice only.
    """
    n = (1 << bits) - 1
    W = np.array(w.astype(mx.float32), dtype=np.float32)
    imp = np.maximum(np.diag(np.asarray(h, dtype=np.float32)), 0)
    order, U = gptq_factor(h) if factor is None else factor
    _, scales, biases = _search(
        mx.array(W), mx.array(imp), bits=bits, group_size=group_size, dtype=w.dtype, codes=False
    )
    s, b = np.asarray(scales, np.float32), np.asarray(biases, np.float32)
    group = order // group_size
    W = W[:, order]
    rows, cols = W.shape
    codes = np.empty((rows, cols), dtype=np.uint8)
    for i in range(0, cols, group_size):
        j = i + group_size
        g = group[i:j]
        codes[:, order[i:j]], err = _gptq_block(W[:, i:j], U[i:j, i:j], s[:, g], b[:, g], n)
        if j < cols:
            W[:, j:] -= np.asarray(mx.array(err) @ mx.array(U[i:j, j:]))
    return codes, scales, biases


def dequantized(
    wq: Any, scales: Any, biases: Any, *, group_size: int, bits: int, mode: str = "affine", dtype: Any
) -> Any:
    """mlx's dequantize as ``dtype``, in slices of rows of about :data:`CHUNK` weights,
    each evaluated before the next: whole, a large vocabulary's temporaries are several times the
    float32 matrix."""
    rows = wq.shape[-2]
    step = max(1, CHUNK // max(1, wq.size * 32 // bits // rows))

    def part(lo: int) -> Any:
        return mx.dequantize(
            wq[..., lo : lo + step, :], scales[..., lo : lo + step, :],
            None if biases is None else biases[..., lo : lo + step, :], group_size, bits, mode,
        ).astype(dtype)  # fmt: skip

    return filled_by_rows(rows, step, part)


def filled_by_rows(rows: int, step: int, part: Callable[[int], Any]) -> Any:
    """The arrays of ``rows`` rows (axis -2) whose rows ``lo:lo + step`` are ``part(lo)`` (an
    array, or a list of arrays: codes, scales and biases), each part evaluated into its place
    before the next is made: memory is the result and one part, where parts and their
    concatenation are the result twice (a 262,144-word embedding: 2.8 GB more)."""
    first = part(0)
    many = isinstance(first, (list, tuple))
    got = list(first) if many else [first]
    del first
    if rows <= step:
        mx.eval(*got)
        return got if many else got[0]
    out = [mx.zeros((*a.shape[:-2], rows, a.shape[-1]), a.dtype) for a in got]
    for lo in range(0, rows, step):
        if lo:
            got = list(part(lo)) if many else [part(lo)]
        for o, a in zip(out, got, strict=True):
            o[..., lo : lo + step, :] = a
        del got
        mx.eval(*out)  # each update is done in its array's buffer: it has no other reader
    return out if many else out[0]


def check_finite(path: str, arrays: dict[str, Any]) -> None:
    """Refuse to publish a quantized module whose scales or biases hold a NaN or Inf (whatever
    rounded it: an Inf weight makes ``mx.quantize`` give NaN scales too)."""
    for name in (f"{path}.scales", f"{path}.biases"):
        a = arrays.get(name)
        if a is not None and mx.issubdtype(a.dtype, mx.floating) and not mx.all(mx.isfinite(a)).item():
            bad = int(mx.sum(~mx.isfinite(a)).item())
            raise NumericFailure(
                f"quantize: {name} holds {bad} NaN or Inf value(s) (module {path!r}); nothing was published"
            )


def quantize(
    w: Any,
    *,
    bits: int,
    group_size: int,
    method: str = "clip",
    importance: Any = None,
    hessian: Any = None,
    factor: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[Any, Any, Any]:
    """``mx.quantize(w, group_size, bits)`` (affine) with the rounding chosen by ``method``.

    Args:
        w: weight (out, in), or stacked experts (..., out, in) rounded one matrix at a time
            (each with the module's ``importance`` and ``hessian``); scales and biases come
            back in its dtype.
        bits, group_size: as in ``mx.quantize``.
        method: "rtn" (``mx.quantize`` itself), "clip", "gptq" or "awq" (= "clip" here: the
            activation-aware scales are folded into the weight before; module docstring).
        importance: optional non-negative weight per input column (length ``in``) for "clip";
            default: diag(``hessian``) when given, else uniform.
        hessian: the layer's input Hessian (in, in); "gptq" without it does "clip".
        factor: ``gptq_factor(hessian)`` when the caller has it (GPTQ of one module at
            several settings factors its Hessian once).
    """
    check_method(method)
    if method == "rtn":
        return tuple(mx.quantize(w, group_size=group_size, bits=bits))
    if w.ndim > 2:  # stacked experts (SwitchLinear): each (out, in) matrix on its own
        kw = {"bits": bits, "group_size": group_size, "method": method, "importance": importance}
        parts = [quantize(w[e], **kw, hessian=hessian, factor=factor) for e in range(w.shape[0])]
        return tuple(mx.stack([p[k] for p in parts]) for k in range(3))
    rows, cols = w.shape
    if method == "gptq" and hessian is not None:  # rows are independent: slices bound the temporaries
        factor = gptq_factor(hessian) if factor is None else factor
        # equal slices of at most 2 x CHUNK weights: each slice runs the whole column loop, so a
        # short last slice would cost as much as a full one
        slices = -(-rows * cols // (2 * CHUNK))
        step = -(-rows // slices)
        parts = []
        for r0 in range(0, rows, step):
            codes, s, b = _gptq(w[r0 : r0 + step], hessian, bits=bits, group_size=group_size, factor=factor)
            parts.append((pack(codes, bits), s.astype(w.dtype), b.astype(w.dtype)))
            mx.eval(parts[-1][1:])
        if len(parts) == 1:
            return mx.array(parts[0][0]), parts[0][1], parts[0][2]
        packed = mx.array(np.concatenate([p[0] for p in parts]))
        return packed, mx.concatenate([p[1] for p in parts]), mx.concatenate([p[2] for p in parts])
    if importance is None and hessian is not None:
        importance = np.maximum(np.diag(np.asarray(hessian, dtype=np.float32)), 0)
    imp = mx.ones((cols,), mx.float32) if importance is None else mx.array(importance).astype(mx.float32)
    packed, s, b = _search(w, imp, bits=bits, group_size=group_size, dtype=w.dtype)
    return mx.array(packed), s.astype(w.dtype), b.astype(w.dtype)
