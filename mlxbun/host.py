"""What this machine leaves this process: the memory it may still allocate.

Example:
    >>> available_memory()  # bytes, or None where /proc/meminfo and RLIMIT_AS say nothing
"""

from __future__ import annotations

import contextlib
import resource


def available_memory() -> int | None:
    """Bytes this process may still allocate: MemAvailable, capped by RLIMIT_AS (``ulimit -v``)."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) << 10 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        pass
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    if soft != resource.RLIM_INFINITY:
        with contextlib.suppress(OSError, StopIteration, ValueError), open("/proc/self/status") as f:
            used = next(int(line.split()[1]) << 10 for line in f if line.startswith("VmSize:"))
            soft -= used
        avail = soft if avail is None else min(avail, soft)
    return avail
