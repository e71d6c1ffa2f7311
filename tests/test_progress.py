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


def test_a_time_budget_that_outlasts_the_work_leaves_the_eta_to_the_pace() -> None:
    """tune on a small model under the recipe's 40 minutes: its 7 blocks ran their tune.steps in
    51 s while the ETA counted down the 40 minutes. The budget is the latest end, not the end."""
    clock = Clock()
    p = Progress(total=7, unit="blocks", stream=io.StringIO(), log_every=1e9, clock=clock)
    p.deadline(2400.0)
    assert p.eta() == pytest.approx(2400.0)  # nothing done: only the budget is known
    for _ in range(3):
        clock.now += 7.0
        p.update(1)
    assert p.eta() == pytest.approx(4 * 7.0)


def test_a_time_budget_sets_the_eta_whatever_the_pace_of_its_items() -> None:
    """tune under tune.max_minutes: blocks get fewer steps as the budget runs down, so their pace
    tells nothing of the end; the budget does (the heartbeat's lines between blocks included),
    while the pace says later."""
    clock = Clock()
    p, paced = (
        Progress(total=24, unit="blocks", stream=io.StringIO(), log_every=1e9, clock=clock) for _ in "ab"
    )
    p.deadline(660.0)
    clock.now = 5.0
    assert p.eta() == pytest.approx(655.0)  # before any block
    for secs in [60.0, 40.0, 35.0]:  # the first blocks take the most steps
        clock.now += secs
        p.update(1)
        paced.update(1)
        assert p.eta() == pytest.approx(660.0 - clock.now)
    clock.now += 25.0  # a heartbeat inside the next block
    assert p.eta() == pytest.approx(660.0 - clock.now)
    clock.now = 700.0  # past the budget: the pace of the blocks again
    assert p.eta() == paced.eta() > 0


class _Recorded(Progress):
    """A Progress that keeps (time, fraction, eta) after every update."""

    def __init__(self, clock: Clock) -> None:
        super().__init__(total=0, unit="steps", stream=io.StringIO(), log_every=1e9, clock=clock)
        self.seen: list[tuple[float, float, float]] = []

    def update(self, n: float = 1, *, work: float = 0.0) -> None:
        super().update(n, work=work)
        self.seen.append((self._clock(), self.fraction(), self.eta()))


class _FakeInModel:
    """allocate's InModel on a synthetic clock: a measurement from block ``start`` runs the
    blocks after it and the head (1 s each, +-10%), plus a fixed 0.2 s."""

    def __init__(self, clock: Clock, starts: dict[str, int], n: int) -> None:
        self.clock, self.starts, self.noise = clock, starts, random.Random(5)
        self.stack = type("Stack", (), {"n": n})()

    def start(self, path: str) -> int:
        return self.starts[path]

    def kl_with(self, path: str, spec: object) -> float:
        self.clock.now += 0.2 + (self.stack.n + 1 - self.starts[path]) * self.noise.uniform(0.9, 1.1)
        return 0.0


def test_interactions_eta_counts_blocks_run_and_is_within_30_percent_once_a_tenth_is_done() -> None:
    """allocate's interaction steps measured in block order cost 33 blocks at the embedding and
    2 at the head: counted as steps the ETA said 3x the time; counted as blocks run, within 30%."""
    from mlxbun.quant.allocate import rounds
    from mlxbun.quant.allocate.interactions import Step

    clock, n = Clock(), 32
    starts = {f"model.layers.{i % n}.m{i}": i % n for i in range(96)}
    in_model = _FakeInModel(clock, starts, n)
    near = [Step(i, p, 1, 0.0) for i, p in enumerate(starts)]
    options = [[(None, 0, 0.0)] * 2 for _ in starts]
    p = _Recorded(clock)
    clock.now += 7.0  # the reference pass before the first step
    rounds._round_progress(p, in_model, near, r=0, rounds=2)
    rounds._measured(options, near, in_model, 0.0, p)
    end = clock.now
    worst = max(abs(eta - (end - t)) / (end - t) for t, f, eta in p.seen if 0.1 <= f < 0.99)
    assert worst <= 0.3


def test_sensitivity_says_what_it_does_before_the_first_progress_line(tiny_model, tmp_path, caplog) -> None:
    """Loading, fingerprinting and calibrating come before the first progress line: each says so."""
    from mlxbun.quant.sensitivity.command import sensitivity

    model = tiny_model()
    caplog.set_level("INFO", logger="mlxbun")
    sensitivity(
        model_dir=model, out_dir=tmp_path, work_dir=tmp_path / "w", bits=[4, 8], samples=2, seq_len=16,
        batch_size=2, method="exact",
    )  # fmt: skip
    lines = [r.getMessage() for r in caplog.records]
    first = next(i for i, m in enumerate(lines) if m.startswith("sensitivity") and "% " in m)
    assert any("loading and fingerprinting" in m and "2 x 16 calibration tokens" in m for m in lines[:first])
    assert any("groups to compute" in m and "timing one forward" in m for m in lines[:first])


def test_the_forwards_after_the_work_are_not_done_at_100_percent() -> None:
    """The probes tick their blocks' forwards (items, in forward cost) with their roundings
    (work), then the heads' forwards with no work: once the work is all done the percentage is
    not 100% and the ETA not 0 while forwards are left (a 0.5B second probe round sat at 100%,
    ETA 0 s, for the last 40 s of its 3 minutes)."""
    clock = Clock()
    blocks = [(1.0, w, s * (1.0 + 2.0 * w)) for w, s in zip(_noisy(30, 5), _noisy(30, 6, 0.1), strict=True)]
    heads = [(3.0, 0.0, 3.0 * s) for s in _noisy(8, 7, 0.1)]
    steps = blocks + heads
    p = Progress(total=sum(n for n, _, _ in steps), unit="probes", stream=io.StringIO(), log_every=1e9,
                 work_total=sum(w for _, w, _ in steps), clock=clock)  # fmt: skip
    clock.now += 2.0
    seen = []
    for n, work, secs in steps:
        clock.now += secs
        p.update(n, work=work)
        seen.append((clock.now, p.fraction(), p.eta()))
    end = clock.now
    at_heads = [(f, eta, end - t) for t, f, eta in seen[len(blocks) - 1 : -1]]  # the work is all done
    assert all(f < 1 for f, _, _ in at_heads)
    assert max(abs(eta - real) / real for _, eta, real in at_heads) <= 0.3


def test_eta_between_coarse_updates_counts_the_item_in_flight() -> None:
    """tune's validation KL: 17 slices of ~10 s after a 5 s set-up, its ETA read by the heartbeat
    between slices. Stretching the pace to the heartbeat's time read up to 1.8x the time left;
    the time since the last slice is now spent from it, within 30% once a tenth is done."""
    clock = Clock()
    p = Progress(total=17, unit="slices", stream=io.StringIO(), log_every=1e9, clock=clock)
    clock.now = 5.0
    ends = [5.0 + 10.0 * s for s in range(1, 18)]
    seen = []
    for k, end in enumerate(ends):
        while clock.now + 3.0 < end:  # a heartbeat every 3 s inside the slice
            clock.now += 3.0
            if k:
                seen.append((clock.now, p.fraction(), p.eta()))
        clock.now = end
        p.update(1)
    worst = max(abs(eta - (ends[-1] - t)) / (ends[-1] - t) for t, f, eta in seen if f >= 0.1)
    assert worst <= 0.3


def test_eta_of_an_item_later_than_the_usual_gap_grows() -> None:
    """A slice that takes longer than the others stretches the pace: the ETA does not count down
    to zero while the work has slowed."""
    clock = Clock()
    p = Progress(total=10, unit="slices", stream=io.StringIO(), log_every=1e9, clock=clock)
    for _ in range(3):
        clock.now += 10.0
        p.update(1)
    clock.now += 5.0
    assert p.eta() == pytest.approx(65.0)  # 7 slices of 10 s, 5 s into the fourth
    clock.now += 30.0  # the fourth slice is late: 35 s in
    assert p.eta() > 65.0
