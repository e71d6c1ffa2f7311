"""Progress for long work: a bar with rate and ETA on a terminal, plain log lines otherwise."""

from __future__ import annotations

import logging
import sys
import time
from typing import TextIO

log = logging.getLogger("mlxbun")


def _human(n: float, unit: str) -> str:
    if unit != "B":
        return f"{n:,.0f} {unit}"
    for suffix in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or suffix == "TB":
            return f"{n:.1f} {suffix}" if suffix != "B" else f"{n:.0f} B"
        n /= 1000
    return f"{n:.1f} TB"


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
        eta_s = f"{eta:,.0f}s" if eta != float("inf") else "?"
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
