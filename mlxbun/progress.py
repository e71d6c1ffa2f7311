"""Progress for long work: a bar with rate and ETA on a terminal, plain log lines otherwise."""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

log = logging.getLogger("mlxbun")
# (time, items done, work done) marks kept for the ETA's rate window; thinned by half when full.
MAX_MARKS = 256


def human_bytes(n: float, *, digits: int = 1) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1: 512 B, 3.4 MiB, 1.2 PiB.

    The project's one byte formatter (binary units everywhere); ``digits`` is the number of
    decimals after a unit larger than a byte (the registry's tables show two).
    """
    for suffix in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {suffix}" if suffix == "B" else f"{n:.{digits}f} {suffix}"
        n /= 1024
    return f"{n:.{digits}f} PiB"


def human_count(n: int) -> str:
    """A count (parameters) in the largest decimal unit that keeps it >= 1, three significant
    digits: 950, 12.6K, 494M, 1.54B. The project's one count formatter."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def human_seconds(s: float) -> str:
    """A duration as 45s, 12m05s or 3h07m (never 3,147s)."""
    if s != s or s in (float("inf"), float("-inf")):
        return "?"
    s = max(0, round(s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _human(n: float, unit: str) -> str:
    if unit != "B":
        return f"{n:,.0f} {unit}" if abs(n) >= 10 or n == int(n) else f"{n:.2g} {unit}"
    return human_bytes(n)


def _at_pace(now: float, ta: float, tl: float, gaps: int, moved: float, left: float) -> float:
    """Seconds for ``left`` at the pace of ``moved`` from ``ta`` to the last update ``tl`` (``gaps``
    updates apart). The time since ``tl`` is the item in flight's: within an update's usual gap it
    is spent from the time left (a heartbeat between coarse items, e.g. tune's validation KL's
    5-14 s slices, read up to 1.8x the time left when it stretched the pace to now); past the gap
    the item is late, and the pace is stretched to now with the item counted done."""
    if moved <= 0 or tl <= ta:
        return float("inf")
    since, gap, item = now - tl, (tl - ta) / gaps, moved / gaps
    if since <= gap:
        return max(left * (tl - ta) / moved - since, 0.0)
    return max(left - item, 0.0) * (now - ta) / (moved + item)


class Progress:
    """Counts work done against a total and reports rate and ETA.

    On a terminal it redraws one line at most 10 times a second; elsewhere (logs, CI) it logs a
    line every ``log_every`` seconds and once at the end. With ``heartbeat=True`` a daemon thread
    also reports every ``log_every`` seconds while no update arrives (long steps stay visible).
    When items cost unequal work (a deep group's probes vs a shallow one's), ``update(n, work=w)``
    counts ``w`` of ``work_total``: the percentage and ETA follow both (below), the rate counts items.

    The ETA is the work left at the recent rate: measured from the first update on (setup and
    warm-up before it are not the work's pace) over the last half of that time (a pace that
    drifts is followed, one slow item does not swing it); with one update, from the start. Between
    updates the time since the last one is spent from it, until an item is later than the usual
    gap (:func:`_at_pace`). With
    ``work_total``, an item's time is fitted as a fixed cost per item plus a cost per unit of work
    (a probe's logits and KL cost the same in every group), when the window tells them apart.

    Example:
        >>> p = Progress(total=nbytes, unit="B", desc="quantize")
        >>> p.update(len(chunk)); ...; p.close()
    """

    def __init__(
        self,
        *,
        total: float,
        unit: str = "B",
        desc: str = "",
        stream: TextIO | None = None,
        log_every: float = 10.0,
        work_total: float | None = None,
        heartbeat: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total, self.unit, self.desc = total, unit, desc
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.log_every = log_every
        self.done = 0.0
        self.work_total, self.work = work_total, 0.0
        self.eta_hint: float | None = None  # a caller's estimate of the whole run, until work is done
        self._deadline: float | None = None  # when a time budget ends the work (clock time)
        self._clock = clock
        self.start = self._last = clock()
        self._marks: list[tuple[float, float, float]] = []  # (time, done, work) at each update
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        if heartbeat:
            self._thread = threading.Thread(target=self._beat, daemon=True, name=f"progress {desc}")
            self._thread.start()

    def fraction(self) -> float:
        """Done, in [0, 1]: items (or with ``work_total``, the fitted cost of the items and work
        done against the whole's, or work alone until the fit tells them apart; never whole while
        items are left: the probes' forwards run after their roundings)."""
        return self._fraction(self._two_costs(self._marks))

    def _fraction(self, costs: tuple[float, float] | None) -> float:
        """:meth:`fraction` with the fitted ``costs`` given (fitted once a line)."""
        if not self.work_total:
            return min(self.done / self.total, 1.0) if self.total else 1.0
        whole = 0.0 if costs is None else costs[0] * self.total + costs[1] * self.work_total
        f = self.work / self.work_total
        if whole > 0:
            f = (costs[0] * self.done + costs[1] * self.work) / whole  # type: ignore[index]
        return min(f, 1.0) if self.done >= self.total else min(f, 0.999)

    def eta(self) -> float:
        """Seconds left (inf before any work): see the class docstring."""
        return self._eta(self._two_costs(self._marks))

    def _eta(self, costs: tuple[float, float] | None) -> float:
        now, f = self._clock(), self._fraction(costs)
        if f >= 1:
            return 0.0
        if f <= 0:
            paced = float("inf")
        elif len(self._marks) < 2:
            paced = _at_pace(now, self.start, self._marks[-1][0], 1, f, 1 - f)
        else:
            paced = self._paced(now, f, costs)
        if self._deadline is not None and now < self._deadline:  # the budget, or sooner at the pace
            return min(self._deadline - now, paced)
        return paced

    def _paced(self, now: float, f: float, costs: tuple[float, float] | None) -> float:
        """Seconds left at the recent pace (two marks or more)."""
        window = self._window(now)
        (ta, na, wa), (tl, nl, wl) = window[0], window[-1]
        if costs is not None:  # the fitted costs, at the window's pace
            a, b = costs
            moved = a * (nl - na) + b * (wl - wa)
            left = a * max(self.total - self.done, 0.0) + b * max(self.work_total - self.work, 0.0)
            return _at_pace(now, ta, tl, len(window) - 1, moved, left)
        amount = (lambda m: m[2] / self.work_total) if self.work_total else (lambda m: m[1] / self.total)
        return _at_pace(now, ta, tl, len(window) - 1, f - amount(window[0]), 1 - f)

    def _window(self, now: float) -> list[tuple[float, float, float]]:
        """The marks of the last half of the time since the first update, from the one before it."""
        cutoff = now - (now - self._marks[0][0]) / 2
        first = max((i for i, m in enumerate(self._marks) if m[0] <= cutoff), default=0)
        return self._marks[first:] if len(self._marks) - first >= 2 else self._marks[-2:]

    def _two_costs(self, marks: list[tuple[float, float, float]]) -> tuple[float, float] | None:
        """(a, b) >= 0: seconds per item and per unit of work, fitted by least squares to the
        steps between ``marks``; None without work_total or when the steps cannot tell them
        apart (every step the same work per item)."""
        if not self.work_total:
            return None
        steps = [
            (t1 - t0, n1 - n0, w1 - w0) for (t0, n0, w0), (t1, n1, w1) in zip(marks, marks[1:], strict=False)
        ]
        nn, ww = sum(n * n for _, n, _ in steps), sum(w * w for _, _, w in steps)
        nw, nt, wt = (
            sum(n * w for _, n, w in steps),
            sum(t * n for t, n, _ in steps),
            sum(t * w for t, _, w in steps),
        )
        det = nn * ww - nw * nw
        if det <= 1e-2 * nn * ww:  # nearly one work per item: the split is noise
            return None
        a, b = (nt * ww - wt * nw) / det, (wt * nn - nt * nw) / det
        return None if a < 0 or b < 0 else (a, b)

    def line(self) -> str:
        elapsed = max(self._clock() - self.start, 1e-9)
        rate = self.done / elapsed
        costs = self._two_costs(self._marks)  # once a line: the percentage and the ETA share them
        f = self._fraction(costs)
        eta_s = human_seconds(self._eta(costs))
        if f == 0 and self.eta_hint is not None:
            eta_s = f"~{human_seconds(max(self.eta_hint - elapsed, 0))} (estimated from a timed forward)"
        return (
            f"{self.desc} {100.0 * f:5.1f}% {_human(self.done, self.unit)}/{_human(self.total, self.unit)}"
            f" {_human(rate, self.unit)}/s elapsed {human_seconds(elapsed)} ETA {eta_s}"
        )

    def update(self, n: float = 1, *, work: float = 0.0) -> None:
        with self._lock:
            self.done += n
            self.work += work
            self._mark()
            self._report(force=False)

    def _mark(self) -> None:
        if len(self._marks) >= MAX_MARKS:  # keep the first (warm-up's end) and every other one
            self._marks = self._marks[:1] + self._marks[2::2]
        self._marks.append((self._clock(), self.done, self.work))

    def hint(self, seconds: float) -> None:
        """An estimate of the whole run's duration, shown as the ETA until the first work is done."""
        with self._lock:
            self.eta_hint = self._clock() - self.start + seconds
            self._report(force=True)

    def deadline(self, seconds: float) -> None:
        """The work ends ``seconds`` from now whatever its pace (a time budget sets how much of it
        is done, e.g. tune's steps per block): the ETA counts down to that, and follows the rate
        only once it has passed."""
        with self._lock:
            self._deadline = self._clock() + seconds

    def _report(self, *, force: bool) -> None:
        now = self._clock()
        if self.tty and (force or now - self._last >= 0.1):
            self.stream.write("\r" + self.line())
            self.stream.flush()
            self._last = now
        elif not self.tty and (force or now - self._last >= self.log_every):
            log.info(self.line())
            self._last = now

    def _beat(self) -> None:
        while not self._stop.wait(min(1.0, self.log_every)):
            with self._lock:
                if self._clock() - self._last >= self.log_every:
                    self._report(force=True)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            if self.tty:
                self.stream.write("\r" + self.line() + "\n")
                self.stream.flush()
            else:
                log.info(self.line())
