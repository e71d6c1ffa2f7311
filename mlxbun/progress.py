"""Progress for long work: a bar with rate and ETA on a terminal, plain log lines otherwise."""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

log = logging.getLogger("mlxbun")
# (time, amount done) marks kept for the ETA's rate window; thinned by half when full.
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


class Progress:
    """Counts work done against a total and reports rate and ETA.

    On a terminal it redraws one line at most 10 times a second; elsewhere (logs, CI) it logs a
    line every ``log_every`` seconds and once at the end. With ``heartbeat=True`` a daemon thread
    also reports every ``log_every`` seconds while no update arrives (long steps stay visible).
    When items cost unequal work (a deep group's probes vs a shallow one's), ``update(n, work=w)``
    counts ``w`` of ``work_total``: the percentage and ETA follow work, the rate counts items.

    The ETA is the work left at the recent rate: measured from the first update on (setup and
    warm-up before it are not the work's pace) over the last half of that time (a pace that
    drifts is followed, one slow item does not swing it); with one update, from the start.

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
        self._clock = clock
        self.start = self._last = clock()
        self._marks: list[tuple[float, float]] = []  # (time, amount done) at each update
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        if heartbeat:
            self._thread = threading.Thread(target=self._beat, daemon=True, name=f"progress {desc}")
            self._thread.start()

    def fraction(self) -> float:
        if self.work_total:
            return min(self.work / self.work_total, 1.0)
        return min(self.done / self.total, 1.0) if self.total else 1.0

    def _amount(self) -> tuple[float, float]:
        """(done, total) in what the ETA follows: work when given, else items; ``total`` may grow."""
        return (self.work, self.work_total) if self.work_total else (self.done, self.total)

    def eta(self) -> float:
        """Seconds left (inf before any work): see the class docstring."""
        now, (done, total) = self._clock(), self._amount()
        if done >= total:
            return 0.0
        if done <= 0:
            return float("inf")
        if len(self._marks) < 2:
            return (now - self.start) * (total - done) / done
        t0 = self._marks[0][0]
        cutoff = now - (now - t0) / 2
        tm, dm = max((m for m in self._marks if m[0] <= cutoff), default=self._marks[0])
        if done <= dm or now <= tm:
            tm, dm = self._marks[0]
        return (now - tm) * (total - done) / (done - dm) if done > dm and now > tm else float("inf")

    def line(self) -> str:
        elapsed = max(self._clock() - self.start, 1e-9)
        rate = self.done / elapsed
        f = self.fraction()
        eta_s = human_seconds(self.eta())
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
        self._marks.append((self._clock(), self._amount()[0]))

    def hint(self, seconds: float) -> None:
        """An estimate of the whole run's duration, shown as the ETA until the first work is done."""
        with self._lock:
            self.eta_hint = self._clock() - self.start + seconds
            self._report(force=True)

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
