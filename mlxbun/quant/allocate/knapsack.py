"""Multiple-choice knapsack: pick one option per item, minimising summed cost under a byte capacity.

The solver is a dynamic program over the budget left after every item takes its cheapest option.
Byte counts are divided by their greatest common divisor first; on real models (power-of-two
shapes) that makes the state space small and the DP **exact**. When the reduced budget still has
more than ``max_states`` states, option sizes are rounded *up* to a unit ``u``; the answer stays
feasible and its cost is at most the optimum for a budget ``n * u`` bytes smaller (proof: any
selection with true extra bytes <= E - n*u has sum(ceil(x/u)) <= E/u states, so the DP saw it). A
greedy pass then spends the bytes the rounding left over. Every answer carries the LP-relaxation
lower bound (convex hulls, fractional greedy), so ``cost - lower_bound`` certifies the gap.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Solution:
    """One option index per item, its total cost and bytes, and the certificate.

    Attributes:
        choice: the chosen option's index, per item (indices into the caller's option lists).
        cost: summed cost of the choice.
        nbytes: summed bytes of the choice.
        lower_bound: LP-relaxation bound; no selection within the capacity costs less.
        exact: True when the DP ran on exact byte counts (then ``cost`` is the optimum).
        unit: bytes per DP state (the gcd when exact, the rounding unit otherwise).
        slack_bound: when not exact, ``cost`` <= the optimum at ``capacity - slack_bound``.
    """

    choice: tuple[int, ...]
    cost: float
    nbytes: int
    lower_bound: float
    exact: bool
    unit: int
    slack_bound: int


def pareto(nbytes: Sequence[int], cost: Sequence[float]) -> list[int]:
    """Indices of the undominated options, by increasing bytes (and so decreasing cost)."""
    order = sorted(range(len(nbytes)), key=lambda j: (nbytes[j], cost[j], j))
    keep: list[int] = []
    for j in order:
        if not keep or cost[j] < cost[keep[-1]]:
            keep.append(j)
    return keep


def lp_lower_bound(items: Sequence[tuple[Sequence[int], Sequence[float]]], capacity: int) -> float:
    """The LP relaxation's optimum: cheapest options, then hull upgrades by cost saved per byte."""
    base_cost, left, steps = 0.0, capacity, []
    for nbytes, cost in items:
        keep = pareto(nbytes, cost)
        hull = [keep[0]]
        for j in keep[1:]:
            # Lower convex hull: drop points above the segment to the next one.
            while len(hull) >= 2 and _slope(nbytes, cost, hull[-2], hull[-1]) >= _slope(
                nbytes, cost, hull[-1], j
            ):
                hull.pop()
            hull.append(j)
        base_cost += cost[hull[0]]
        left -= nbytes[hull[0]]
        steps += [(nbytes[b] - nbytes[a], cost[a] - cost[b]) for a, b in zip(hull, hull[1:], strict=False)]
    if left < 0:
        return math.inf
    for dbytes, saved in sorted(steps, key=lambda s: -s[1] / s[0]):
        take = min(1.0, left / dbytes)
        base_cost -= take * saved
        left -= take * dbytes
        if left <= 0:
            break
    return base_cost


def _slope(nbytes: Sequence[int], cost: Sequence[float], a: int, b: int) -> float:
    return (cost[b] - cost[a]) / (nbytes[b] - nbytes[a])


def solve(
    items: Sequence[tuple[Sequence[int], Sequence[float]]], capacity: int, *, max_states: int = 1 << 16
) -> Solution | None:
    """Choose one option per item minimising summed cost with summed bytes <= ``capacity``.

    Args:
        items: per item, (bytes of each option, cost of each option).
        capacity: the byte budget for all items together.
        max_states: DP budget states; beyond it sizes are rounded up (see the module doc).

    Returns:
        The solution, or None when even the cheapest options exceed ``capacity``.

    Example:
        >>> solve([([1, 2], [5.0, 1.0]), ([1, 3], [4.0, 3.5])], 4).choice
        (1, 0)
    """
    fronts = [pareto(b, c) for b, c in items]
    low = [b[f[0]] for (b, _), f in zip(items, fronts, strict=True)]
    extra_cap = capacity - sum(low)
    if extra_cap < 0:
        return None
    extras = [[b[j] - lo for j in f] for (b, _), f, lo in zip(items, fronts, low, strict=True)]
    costs = [[c[j] for j in f] for (_, c), f in zip(items, fronts, strict=True)]
    unit, exact = _unit(extras, extra_cap, max_states)
    picked = _fill(extras, costs, _dp(extras, costs, extra_cap, unit), extra_cap)
    choice = tuple(f[k] for f, k in zip(fronts, picked, strict=True))
    return Solution(
        choice=choice,
        cost=float(sum(c[j] for (_, c), j in zip(items, choice, strict=True))),
        nbytes=int(sum(b[j] for (b, _), j in zip(items, choice, strict=True))),
        lower_bound=lp_lower_bound(items, capacity),
        exact=exact,
        unit=unit,
        slack_bound=0 if exact else len(items) * unit,
    )


def _unit(extras: list[list[int]], cap: int, max_states: int) -> tuple[int, bool]:
    """Bytes per DP state: the gcd of all option extras (exact) or a coarser rounding unit."""
    g = 0
    for ex in extras:
        for x in ex:
            g = math.gcd(g, x)
    g = max(g, 1)
    if cap // g <= max_states:
        return g, True
    return g * math.ceil(cap / g / max_states), False


def _dp(extras: list[list[int]], costs: list[list[float]], cap: int, unit: int) -> list[int]:
    """Exact DP on sizes ``ceil(extra / unit)`` and capacity ``cap // unit``; front indices."""
    states = cap // unit + 1
    best = np.zeros(states)  # best[c]: min cost of the items so far within c units
    arg = np.zeros((len(extras), states), dtype=np.uint8)
    for i, (ex, cs) in enumerate(zip(extras, costs, strict=True)):
        new = np.full(states, np.inf)
        for k, (x, c) in enumerate(zip(ex, cs, strict=True)):
            w = -(-x // unit)
            if w >= states:
                break
            cand = best[: states - w] + c
            better = cand < new[w:]
            new[w:][better] = cand[better]
            arg[i, w:][better] = k
        best = new
    picked, c = [], states - 1
    for i in range(len(extras) - 1, -1, -1):
        k = int(arg[i, c])
        picked.append(k)
        c -= -(-extras[i][k] // unit)
    return picked[::-1]


def _fill(extras: list[list[int]], costs: list[list[float]], picked: list[int], cap: int) -> list[int]:
    """Spend bytes left by rounding: best single upgrade that fits, until none fits or helps."""
    picked = list(picked)
    left = cap - sum(ex[k] for ex, k in zip(extras, picked, strict=True))
    while True:
        best, move = 0.0, None
        for i, (ex, cs) in enumerate(zip(extras, costs, strict=True)):
            k = picked[i]
            for j in range(k + 1, len(ex)):
                if ex[j] - ex[k] <= left and cs[k] - cs[j] > best:
                    best, move = cs[k] - cs[j], (i, j)
        if move is None:
            return picked
        i, j = move
        left -= extras[i][j] - extras[i][picked[i]]
        picked[i] = j
