"""Tests for mlxbun.kl, the one log-softmax and KL of the project."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlxbun.kl import as_float64, kl, kl_from_stats, kl_logp, kl_rows, log_probs, ref_stats


def reference(ref: np.ndarray, cur: np.ndarray, dtype: type = np.float64) -> np.ndarray:
    """KL per row, straight from the definition, in ``dtype``."""

    def logp(z):
        z = z.astype(dtype)
        m = z.max(-1, keepdims=True)
        return z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))

    p, q = logp(ref), logp(cur)
    return (np.exp(p) * (p - q)).sum(-1).mean(-1)


def test_every_form_equals_the_definition():
    rng = np.random.default_rng(0)
    a = (3 * rng.standard_normal((3, 6, 50))).astype(np.float32)
    b = a + rng.standard_normal(a.shape).astype(np.float32)
    want = reference(a, b)
    np.testing.assert_allclose(kl_rows(log_probs(mx.array(a)), mx.array(b)), want, rtol=1e-12)
    np.testing.assert_allclose(kl_from_stats(ref_stats(mx.array(a)), mx.array(b)), want, rtol=1e-9)
    np.testing.assert_allclose(kl_logp(log_probs(a), log_probs(b)), want, rtol=1e-12)
    assert kl(mx.array(a), mx.array(b)) == float(np.mean(kl_rows(log_probs(mx.array(a)), mx.array(b))))
    assert np.all(kl_rows(log_probs(mx.array(a)), mx.array(a)) == 0)


def test_numpy_float64_logits_keep_their_precision():
    """rotate compares float64 forwards whose KL is far below float32 resolution."""
    z = np.linspace(-3, 3, 64)[None, :].repeat(4, 0)
    assert as_float64(z).dtype == np.float64 and as_float64(z) is not z
    cur = z + 1e-5 * np.arange(64)
    # The same KL in extended precision; through float32 it is off by ~5e-5 relative.
    want = float(np.mean(reference(z.astype(np.longdouble), cur.astype(np.longdouble), np.longdouble)))
    assert abs(kl(z, cur) / want - 1) < 1e-7
    assert kl(mx.array(z.astype(np.float32)), mx.array(z.astype(np.float32))) == 0.0
