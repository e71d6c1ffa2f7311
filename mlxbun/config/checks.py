"""The checks the config's sections run on their values, and the limits they hold values to.

Each check raises an InputError naming the key, the value and what is allowed. Units: a key ending
in ``_gb`` is in GiB (2**30 bytes, as mlx-lm's ``5 << 30`` shard ceiling), ``_mb`` MiB and ``_kib``
KiB; :func:`gib_bytes` converts.
"""

from __future__ import annotations

import math
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, get_type_hints

from mlxbun.errors import InputError

GIB = 1 << 30
# The widest stored weight (float32): no plan can need more bits per weight.
MAX_BPW = 32
# Statuses a run ends in (RunRecord.status, manifest "status"); "running" until then.
RUN_STATUSES = ("running", "ok", "failed", "interrupted")
# Sizes at most 8 EiB, the most bytes a signed 64-bit count holds (1e300 GiB is no size).
MAX_BYTES = 2**63 - 1
MAX_GB = MAX_BYTES // GIB
# Tokens at most 2^24 (16,777,216), above any model's context.
MAX_TOKENS = 2**24
# Run records `runs` lists at most (sqlite takes a 64-bit LIMIT; no registry holds more).
MAX_RUNS_LIMIT = 10**9


def gib_bytes(value: float | None) -> int | None:
    """``value`` GiB in bytes (None stays None)."""
    return None if value is None else max(1, int(value * GIB))


def choose(key: str, value: Any, allowed: tuple | list) -> None:
    """Raise an InputError unless ``value`` is one of ``allowed``."""
    if value not in allowed:
        shown = ", ".join(str(a) for a in allowed)
        raise InputError(f"{key}={value!r} is not allowed; choose one of {shown}")


def check_strings(cfg: Any, prefix: str = "") -> None:
    """Raise an InputError where a list-of-strings key holds something else (``key=[[a]]``:
    OmegaConf keeps the nested list)."""
    hints = get_type_hints(type(cfg))
    for f in fields(cfg):
        value, key = getattr(cfg, f.name), f"{prefix}{f.name}"
        if is_dataclass(value):
            check_strings(value, key + ".")
        elif hints.get(f.name) == list[str]:
            for item in value or ():
                if not isinstance(item, str):
                    raise InputError(
                        f"{key} has {item!r}, not a string; give {key}=[a,b] (one pair of brackets)"
                    )


def positive(key: str, value: float | int | None, *, allow_zero: bool = False) -> None:
    """Raise an InputError unless ``value`` is None or > 0 (>= 0 with allow_zero)."""
    if value is None:
        return
    bound = ">= 0" if allow_zero else "> 0"
    if isinstance(value, float) and not math.isfinite(value):
        raise InputError(f"{key}={value!r} is out of range; it must be a finite number {bound}")
    if value < 0 or (value == 0 and not allow_zero):
        raise InputError(f"{key}={value!r} is out of range; it must be {bound}")


def not_empty(key: str, value: str | None) -> None:
    """Raise an InputError when a path key is set to an empty string (``quant.out=``): that is no
    path, and taking it as the default location would ignore the setting."""
    if value is not None and not str(value).strip():
        raise InputError(f"{key}={value!r} is empty; give a path, or leave {key} unset for its default")


def gib_key(key: str, value: float | None) -> None:
    """Raise an InputError unless ``value`` GiB is None or a size in (0, MAX_GB]."""
    positive(key, value)
    at_most(key, value, MAX_GB, "8 EiB, the most bytes a 64-bit count holds")


def at_most(key: str, value: float | int | None, limit: float | int, why: str = "") -> None:
    """Raise an InputError when ``value`` is above ``limit`` (``why`` says where it comes from)."""
    if value is not None and value > limit:
        reason = f" ({why})" if why else ""
        raise InputError(f"{key}={value!r} is out of range; it must be at most {limit}{reason}")


def at_least(key: str, value: float | int | None, limit: float | int, why: str = "") -> None:
    """Raise an InputError when ``value`` is below ``limit`` (``why`` says what needs it)."""
    if value is not None and value < limit:
        reason = f" ({why})" if why else ""
        raise InputError(f"{key}={value!r} is out of range; it must be >= {limit}{reason}")


def check_outputs(outputs: str | None, *, on_disk: bool = False) -> None:
    """``paths.outputs`` is a directory runs can go under: not empty, not the filesystem root,
    and (``on_disk``) no existing file in the way; InputError naming the value otherwise."""
    allowed = "choose a directory for run outputs, e.g. paths.outputs=outputs"
    if outputs is None or not str(outputs).strip():
        raise InputError(f"paths.outputs={outputs!r} is empty; {allowed}")
    path = Path(outputs).expanduser()
    resolved = path.resolve()
    if resolved == Path(resolved.anchor):
        raise InputError(f"paths.outputs={outputs!r} is the filesystem root; {allowed}")
    blocker = (
        next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None) if on_disk else None
    )
    if blocker is not None:
        raise InputError(f"paths.outputs={outputs!r} is not a directory ({blocker} is a file); {allowed}")
