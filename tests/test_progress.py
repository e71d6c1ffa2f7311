"""Progress's ETA against a synthetic clock: within 30% of the truth once 10% of the work is done."""

from __future__ import annotations

import io
import random

import pytest

from mlxbun.progress import Progress


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _worst_error(setup: float, steps: list[tuple[float, float]]) -> float:
    """Run ``steps`` (seconds, work) after ``setup`` seconds; the largest relative ETA error seen
    at an update once 10% of the work is done."""
    clock = Clock()
    total = sum(w for _, w in steps)
    p = Progress(total=len(steps), unit="steps", stream=io.StringIO(), log_every=1e9, work_total=total,
                 clock=clock)  # fmt: skip
    clock.now += setup
    seen = []
    for secs, work in steps:
        clock.now += secs
        p.update(1, work=work)
        seen.append((clock.now, p.fraction(), p.eta()))
    end = clock.now
    return max(abs(eta - (end - t)) / (end - t) for t, f, eta in seen if 0.1 <= f < 0.99)


def _noisy(n: int, seed: int, spread: float = 0.5) -> list[float]:
    rng = random.Random(seed)
    return [rng.uniform(1 - spread, 1 + spread) for _ in range(n)]


@pytest.mark.parametrize(
    ("name", "setup", "steps"),
    [
        # a reference pass before the first step, a first step that warms caches up
        ("warm-up", 30.0, [(20.0, 1.0)] + [(1.0, 1.0)] * 99),
        ("noise", 10.0, [(s, 1.0) for s in _noisy(200, 0)]),
        # steps of unequal cost, fed as work (a deep group's probes vs a shallow one's)
        ("weights", 5.0, [(w * 0.1 * s, w) for w, s in zip(_noisy(80, 1), _noisy(80, 2), strict=True)]),
        # the first 5% from the page cache, then from disk at half the pace
        ("cached start", 0.0, [(0.5, 1.0)] * 10 + [(1.0, 1.0)] * 190),
        # exact sensitivity: a probe in group g runs 17 - g blocks (its work) plus the head and KL,
        # which cost the same in every group; the deep groups come first
        (
            "fixed + per-work cost",
            3.0,
            [
                (s * (1.0 + 0.1 * (17 - g)), 17 - g)
                for g, s in zip([g for g in range(16) for _ in range(7)], _noisy(112, 4, 0.1), strict=True)
            ],
        ),
    ],
)
def test_eta_is_within_30_percent_once_a_tenth_is_done(name: str, setup: float, steps: list) -> None:
    assert _worst_error(setup, steps) <= 0.3, name


def test_eta_before_any_work_and_at_the_end() -> None:
    clock = Clock()
    p = Progress(total=4, unit="steps", stream=io.StringIO(), clock=clock)
    assert p.eta() == float("inf")
    clock.now = 2.0
    p.update(1)
    assert p.eta() == pytest.approx(6.0)  # one update: the pace since the start
    p.update(3)
    assert p.eta() == 0.0
