"""Hadamard matrices of order n = m·2^k built exactly in numpy, and their fast row transform.

``mx.hadamard_transform`` returns NaN or garbage without raising for sizes it does not support
(FINDINGS.md), so the rotation fold builds its own: a base matrix of order m (1, a Paley I
order q+1 for a prime q ≡ 3 mod 4, or a Paley II order 2(q+1) for a prime q ≡ 1 mod 4) times a
Sylvester matrix of order 2^k, ``H = H_m ⊗ H_{2^k}``. Every base matrix is checked
(``H Hᵀ = m I`` in integers) when it is built. Sizes with no such construction are refused.

Covers every power of two and e.g. 1152 = 36·32, 2304, 3840 = 60·64, 4608, 5376 = 84·64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from mlxbun.errors import InputError

BASES = ("sylvester", "paley1", "paley2")


def _is_prime(q: int) -> bool:
    return q >= 2 and all(q % d for d in range(2, math.isqrt(q) + 1))


def _base_for(m: int) -> tuple[str, int | None] | None:
    """(construction, prime q) for a Hadamard matrix of order m, or None when none is known here."""
    if m == 1:
        return "sylvester", None
    if _is_prime(m - 1) and (m - 1) % 4 == 3:
        return "paley1", m - 1
    if m % 2 == 0 and _is_prime(m // 2 - 1) and (m // 2 - 1) % 4 == 1:
        return "paley2", m // 2 - 1
    return None


def supported_orders(limit: int = 100) -> list[int]:
    """Base orders m <= limit, not themselves twice a smaller one, that this module can build."""
    return [
        m
        for m in range(1, limit + 1)
        if m == 1 or (m & (m - 1) and _base_for(m) and (m % 2 or _base_for(m // 2) is None))
    ]


@dataclass(frozen=True)
class HadamardSpec:
    """How H of order n is built: ``H = base(order, q) ⊗ sylvester(2**power)``.

    Args:
        n: the order of H (the hidden size).
        base: "sylvester" (order 1), "paley1" or "paley2".
        order: m, the order of the base matrix.
        q: the prime of the Paley construction (None for sylvester).
        power: k with n = m · 2**k.
    """

    n: int
    base: str
    order: int
    q: int | None
    power: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "n": self.n,
            "base": self.base,
            "order": self.order,
            "q": self.q,
            "power": self.power,
            "kron": "base ⊗ sylvester",
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HadamardSpec:
        spec = cls(n=int(d["n"]), base=d["base"], order=int(d["order"]), q=d.get("q"), power=int(d["power"]))
        buildable = _base_for(spec.order) == (spec.base, spec.q)
        if spec.base not in BASES or spec.order << spec.power != spec.n or not buildable:
            raise InputError(f"hadamard={d!r} is not a construction this version can build")
        return spec

    def describe(self) -> str:
        if self.base == "sylvester":
            return f"sylvester(2^{self.power})"
        return f"{self.base}(q={self.q}, order {self.order}) ⊗ sylvester(2^{self.power})"


def plan(n: int) -> HadamardSpec:
    """The construction for order ``n``: the largest power of two with a buildable base.

    Raises:
        InputError: no Hadamard construction here for ``n`` (names n and what is supported).

    Example:
        >>> plan(5376).describe()
        'paley1(q=83, order 84) ⊗ sylvester(2^6)'
    """
    if n >= 1:
        k = (n & -n).bit_length() - 1
        for power in range(k, -1, -1):
            found = _base_for(n >> power)
            if found is not None:
                return HadamardSpec(n=n, base=found[0], order=n >> power, q=found[1], power=power)
    orders = ", ".join(str(m) for m in supported_orders(100))
    raise InputError(
        f"hidden_size={n} has no Hadamard construction here; supported: n = m·2^k with m one of "
        f"{orders}, ... (1, Paley I q+1 for primes q ≡ 3 mod 4, Paley II 2(q+1) for primes q ≡ 1 mod 4)"
    )


def _jacobsthal(q: int) -> np.ndarray:
    squares = np.zeros(q, dtype=np.int64)
    squares[[(x * x) % q for x in range(1, q)]] = 1
    chi = np.where(squares == 1, 1, -1)
    chi[0] = 0
    idx = np.arange(q)
    return chi[(idx[None, :] - idx[:, None]) % q]


def _paley1(q: int) -> np.ndarray:
    s = np.zeros((q + 1, q + 1), dtype=np.int64)
    s[0, 1:], s[1:, 0], s[1:, 1:] = 1, -1, _jacobsthal(q)
    return s + np.eye(q + 1, dtype=np.int64)


def _paley2(q: int) -> np.ndarray:
    c = np.zeros((q + 1, q + 1), dtype=np.int64)
    c[0, 1:], c[1:, 0], c[1:, 1:] = 1, 1, _jacobsthal(q)
    zero_block = np.array([[1, -1], [-1, -1]], dtype=np.int64)
    sign_block = np.array([[1, 1], [1, -1]], dtype=np.int64)
    return np.kron(c, sign_block) + np.kron(np.eye(q + 1, dtype=np.int64), zero_block)


@lru_cache(maxsize=16)
def base_matrix(base: str, q: int | None) -> np.ndarray:
    """The integer base matrix of a construction, checked to satisfy ``H Hᵀ = m I``."""
    if base == "sylvester":
        h = np.ones((1, 1), dtype=np.int64)
    else:
        h = _paley1(q) if base == "paley1" else _paley2(q)
    m = h.shape[0]
    if not np.array_equal(h @ h.T, m * np.eye(m, dtype=np.int64)):
        raise AssertionError(f"{base}(q={q}) is not a Hadamard matrix")
    h.setflags(write=False)
    return h


def dense(spec: HadamardSpec) -> np.ndarray:
    """The full ±1 matrix H (float64, n×n); for tests and small n."""
    h = base_matrix(spec.base, spec.q).astype(np.float64)
    for _ in range(spec.power):
        h = np.kron(h, np.array([[1.0, 1.0], [1.0, -1.0]]))
    return h


def _fwht_last(x: np.ndarray) -> np.ndarray:
    """x · H_{2^k} along the last axis (Sylvester order), by in-place butterflies on a copy.

    One scratch buffer is reused for every level: allocating per level cost 3× the time.
    """
    x = np.array(x, dtype=np.float64, order="C", copy=True)
    size = x.shape[-1]
    scratch = np.empty(x.size // 2 if size > 1 else 0)
    h = 1
    while h < size:
        y = x.reshape(-1, size // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        diff = scratch.reshape(a.shape)
        np.subtract(a, b, out=diff)
        np.add(a, b, out=a)
        b[...] = diff
        h *= 2
    return x


def apply_rows(x: np.ndarray, spec: HadamardSpec, *, transpose: bool = False) -> np.ndarray:
    """``x @ H`` (``x @ Hᵀ`` with transpose) for float64 ``x`` [rows, n], in O(rows·n·(m + k)).

    Example:
        >>> spec = plan(8)
        >>> np.allclose(apply_rows(np.eye(8), spec), dense(spec))
        True
    """
    rows, n = x.shape
    if n != spec.n:
        raise ValueError(f"apply_rows: x has {n} columns, H has order {spec.n}")
    y = x.reshape(rows, spec.order, n // spec.order)
    if spec.order > 1:
        base = base_matrix(spec.base, spec.q).astype(np.float64)
        base = base.T if transpose else base  # Sylvester factors are symmetric; Paley ones need not be
        y = np.einsum("rij,ia->raj", y, base, optimize=True)
    return _fwht_last(y).reshape(rows, n)
