"""Progress for long work: a bar with rate and ETA on a terminal, plain log lines otherwise."""

from __future__ import annotations

import logging
import sys
import time
from typing import TextIO

log = logging.getLogger("mlxbun")


def human_bytes(n: float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1: 512 B, 3.4 MiB, 1.2 PiB."""
    for suffix in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {suffix}" if suffix == "B" else f"{n:.1f} {suffix}"
        n /= 1024
    return f"{n:.1f} PiB"


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
    return human_bytes(n) if unit == "B" else f"{n:,.0f} {unit}"


class Progress:
    """Counts work done against a total and reports rate and ETA.

    On a terminal it redraws one line at most 10 times a second; elsewhere (logs, CI) it logs a
    line every ``log_every`` seconds and once at the end.

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
    ) -> None:
        self.total, self.unit, self.desc = total, unit, desc
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.log_every = log_every
        self.done = 0.0
        self.start = self._last = time.monotonic()

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.start, 1e-9)
        rate = self.done / elapsed
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        pct = 100.0 * self.done / self.total if self.total else 100.0
        eta_s = human_seconds(eta)
        return (
            f"{self.desc} {pct:5.1f}% {_human(self.done, self.unit)}/{_human(self.total, self.unit)}"
            f" {_human(rate, self.unit)}/s ETA {eta_s}"
        )

    def update(self, n: float = 1) -> None:
        self.done += n
        now = time.monotonic()
        if self.tty and now - self._last >= 0.1:
            self.stream.write("\r" + self.line())
            self.stream.flush()
            self._last = now
        elif not self.tty and now - self._last >= self.log_every:
            log.info(self.line())
            self._last = now

    def close(self) -> None:
        if self.tty:
            self.stream.write("\r" + self.line() + "\n")
            self.stream.flush()
        else:
            log.info(self.line())
