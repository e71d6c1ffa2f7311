"""The quantization vocabulary: one setting type (QuantSpec), what MLX supports per mode, the
rounding methods and the protect-rule grammar.

Every layer that knows what a quantization setting is imports it from here, the config schema
first: it checks user input against these tables, so this module imports no mlx (and no numpy).
What MLX accepts (anything else raises in ``mx.quantize`` or is refused here)::

    mode     bits               group_size     default (mlx-lm's defaults_for_mode)
    affine   2, 3, 4, 5, 6, 8   32, 64, 128    4-bit, g64
    mxfp4    4                  32             4-bit, g32
    nvfp4    4                  16             4-bit, g16
    mxfp8    8                  32             8-bit, g32

A setting as JSON (plan.json entries, config.json ``quantization``) is
``{"group_size": 64, "bits": 4, "mode": "affine"}``; reading ignores unknown keys and fills a
missing bits or group size from the mode's default. A plan entry may add ``"method"`` (how an
affine weight is rounded: ``rtn``, ``clip``, ``gptq``, ``awq``; see ``mlxbun.quant.rounding``), so
one plan mixes quantizers; config.json never carries it (:meth:`QuantSpec.mlx_dict`). plan.json
itself is :mod:`mlxbun.quant.plan`.

Example:
    >>> QuantSpec(mode="mxfp4")
    QuantSpec(bits=4, group_size=32, mode='mxfp4')
    >>> spec_for("affine", 3, key="quant").to_dict()
    {'group_size': 64, 'bits': 3, 'mode': 'affine'}
    >>> QuantSpec.parse("affine:8:32")
    QuantSpec(bits=8, group_size=32, mode='affine')
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from mlxbun.errors import InputError

# mode -> (bits, group sizes) MLX's quantize accepts; the default is mlx-lm's defaults_for_mode.
MODE_BITS = {"affine": (2, 3, 4, 5, 6, 8), "mxfp4": (4,), "nvfp4": (4,), "mxfp8": (8,)}
MODE_GROUPS = {"affine": (32, 64, 128), "mxfp4": (32,), "nvfp4": (16,), "mxfp8": (32,)}
MODE_DEFAULTS = {"affine": (64, 4), "mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}  # (group, bits)
MODES = tuple(MODE_BITS)
AFFINE_BITS = MODE_BITS["affine"]
# Any mode's bits / group sizes: what a filter over several modes may name.
ALL_BITS = tuple(sorted({b for bs in MODE_BITS.values() for b in bs}))
ALL_GROUPS = tuple(sorted({g for gs in MODE_GROUPS.values() for g in gs}))
# mlx-lm's QuantizedKVCache quantizes keys and values with mx.quantize, affine: these are its choices.
KV_BITS = MODE_BITS["affine"]
KV_GROUPS = MODE_GROUPS["affine"]
# Microscaling modes store 8-bit scales (shared exponents, or fp8) and no biases.
UINT8_SCALE_MODES = frozenset({"mxfp4", "mxfp8", "nvfp4"})
MIXED_RULES = ("mixed_2_6", "mixed_3_4", "mixed_3_6", "mixed_4_6")
# How an affine weight is rounded (mlxbun.quant.rounding): rtn is mx.quantize's own rounding.
ROUNDING_METHODS = ("rtn", "clip", "gptq", "awq")
# The methods sensitivity.candidates scores from a module's Hessian (awq needs its folds first).
CANDIDATE_METHODS = ("rtn", "clip", "gptq")
# Rounding methods that need the layers' input Hessians (quant.hessians).
HESSIAN_METHODS = ("gptq", "awq")


@functools.total_ordering
@dataclass(frozen=True, kw_only=True)
class QuantSpec:
    """How one weight is quantized: ``mode`` at ``bits`` with ``group_size`` (None: the mode's default).

    Keyword-only, so fields can be added (each with a default that :meth:`to_dict` leaves out).
    Sorts by (bits, group_size, mode). Construction fills defaults and does not check the tables:
    :func:`spec_for` and :meth:`from_dict` check.
    """

    bits: int = None  # type: ignore[assignment]
    group_size: int = None  # type: ignore[assignment]
    mode: str = "affine"
    method: str = "rtn"  # how an affine weight is rounded (mlxbun.quant.rounding); not in config.json

    def __post_init__(self) -> None:
        group, bits = MODE_DEFAULTS.get(self.mode, (None, None))
        if self.bits is None:
            object.__setattr__(self, "bits", bits)
        if self.group_size is None:
            object.__setattr__(self, "group_size", group)

    def __lt__(self, other: QuantSpec) -> bool:
        if not isinstance(other, QuantSpec):
            return NotImplemented
        return self.sort_key() < other.sort_key()

    def sort_key(self) -> tuple:
        """(bits, group_size, mode), then any added fields as text (None first)."""
        extra = tuple(
            "" if (v := getattr(self, f.name)) is None else str(v)
            for f in fields(self)
            if f.name not in _CORE
        )
        return (self.bits, self.group_size, self.mode, *extra)

    def __str__(self) -> str:
        tail = "" if self.method == "rtn" else f" ({self.method})"
        return f"{self.mode}:{self.bits}:{self.group_size}{tail}"

    def mlx_dict(self) -> dict[str, Any]:
        """``{group_size, bits, mode}``: what ``to_quantized`` and config.json ``quantization`` take."""
        return {k: v for k, v in self.to_dict().items() if k in _CORE}

    def to_dict(self) -> dict[str, Any]:
        """mlx-lm's key order (group_size, bits, mode); fields at their default are left out."""
        out: dict[str, Any] = {"group_size": self.group_size, "bits": self.bits, "mode": self.mode}
        for f in fields(self):
            if f.name not in out and getattr(self, f.name) != f.default:
                out[f.name] = getattr(self, f.name)
        return out

    @classmethod
    def from_dict(cls, data: Any, *, key: str = "quant") -> QuantSpec:
        """A checked setting from ``{bits?, group_size?, mode?}``; unknown keys are ignored."""
        if not isinstance(data, Mapping):
            raise InputError(f"{key}: expected {{bits, group_size, mode}} or false, got {data!r}")
        extra = {f.name: data[f.name] for f in fields(cls) if f.name not in _CORE and f.name in data}
        spec = spec_for(data.get("mode", "affine"), data.get("bits"), data.get("group_size"), key=key)
        if "method" in extra:
            check_method(extra["method"], mode=spec.mode, key=f"{key}.method")
        return cls(bits=spec.bits, group_size=spec.group_size, mode=spec.mode, **extra)

    @classmethod
    def parse(cls, text: Any, *, key: str = "quant") -> QuantSpec:
        """``mode[:bits[:group_size]]`` (e.g. ``affine:4:64``, ``mxfp4``), a dict, or a QuantSpec."""
        if isinstance(text, QuantSpec):
            text = text.to_dict()
        if isinstance(text, Mapping):
            return cls.from_dict(text, key=key)
        parts = str(text).strip().split(":")
        if len(parts) > 3 or not all(p.strip().isdigit() for p in parts[1:]):
            raise InputError(f"{key}={text!r} is not MODE[:BITS[:GROUP_SIZE]]; e.g. affine:4:64 or mxfp4")
        nums = [int(p) for p in parts[1:]] + [None, None]
        return spec_for(parts[0].strip(), nums[0], nums[1], key=key)

    def matches(self, entry: Mapping[str, Any] | None) -> bool:
        """Whether a ``{bits, group_size, mode}`` entry (a model's current setting) names this one."""
        return entry is not None and (entry["bits"], entry["group_size"], entry.get("mode", "affine")) == (
            self.bits,
            self.group_size,
            self.mode,
        )

    def fits(self, shape: tuple[int, ...]) -> bool:
        """Whether a weight of ``shape`` can be stored this way (rows split into whole groups)."""
        return len(shape) >= 2 and shape[-1] % self.group_size == 0


_CORE = ("bits", "group_size", "mode")


def _choices(values: tuple) -> str:
    return ", ".join(str(v) for v in values)


def spec_for(
    mode: str, bits: int | None = None, group_size: int | None = None, *, key: str = "quant"
) -> QuantSpec:
    """The setting for ``mode`` with mlx-lm's per-mode defaults, checked against what MLX supports.

    Errors name ``<key>.mode``, ``<key>.bits`` or ``<key>.group_size``, the value and the choices.

    Example:
        >>> spec_for("mxfp4")
        QuantSpec(bits=4, group_size=32, mode='mxfp4')
    """
    if mode not in MODE_DEFAULTS:
        raise InputError(f"{key}.mode={mode!r} is not allowed; choose one of {_choices(MODES)}")
    g0, b0 = MODE_DEFAULTS[mode]
    bits = b0 if bits is None else bits
    group_size = g0 if group_size is None else group_size
    if mode == "affine":
        for name, value, allowed in (
            ("bits", bits, MODE_BITS[mode]),
            ("group_size", group_size, MODE_GROUPS[mode]),
        ):
            if value not in allowed:
                raise InputError(
                    f"{key}.{name}={value!r} is not allowed for mode=affine; choose one of {_choices(allowed)}"
                )
    elif (group_size, bits) != (g0, b0):
        name, value = ("bits", bits) if bits != b0 else ("group_size", group_size)
        raise InputError(
            f"{key}.{name}={value!r} is not allowed for mode={mode}; it supports only bits={b0} with"
            f" group_size={g0}"
        )
    return QuantSpec(bits=int(bits), group_size=int(group_size), mode=mode)


def check_method(method: str, *, mode: str = "affine", key: str = "quant.method") -> None:
    """Reject an unknown rounding method, or one other than rtn for a mode other than affine."""
    if method not in ROUNDING_METHODS:
        raise InputError(f"{key}={method!r} is not allowed; choose one of {_choices(ROUNDING_METHODS)}")
    if method != "rtn" and mode != "affine":
        raise InputError(f"{key}={method!r} needs mode affine, got mode={mode!r}; use method rtn")


@dataclass(frozen=True)
class Rule:
    """``pattern:min_bits`` (``allocate.protect``): matching modules get at least ``min_bits``.

    ``pattern`` is a glob over the module path when it has ``*?[``, else a run of whole dotted
    components (``lm_head``, ``down_proj``, ``layers.0.mlp``); the components ``first`` and
    ``last`` stand for the first and last block index.

    Example:
        >>> Rule.parse("layers.last.mlp.down_proj:6").matches("model.layers.11.mlp.down_proj", n_blocks=12)
        True
    """

    pattern: str
    min_bits: int

    @classmethod
    def parse(cls, text: str) -> Rule:
        pattern, sep, bits = str(text).rpartition(":")
        if not sep or not pattern or not bits.strip().isdigit():
            raise InputError(
                f"allocate.protect entry {text!r} is not PATTERN:BITS; e.g. lm_head:6 or layers.first.mlp.down_proj:6"
            )
        return cls(pattern.strip(), int(bits))

    def matches(self, path: str, *, n_blocks: int) -> bool:
        parts = [{"first": "0", "last": str(max(n_blocks - 1, 0))}.get(c, c) for c in self.pattern.split(".")]
        pattern = ".".join(parts)
        if any(ch in pattern for ch in "*?["):
            return fnmatch.fnmatchcase(path, pattern)
        return f".{pattern}." in f".{path}."


def check_mixed(mixed: str | None, *, mode: str, plan: Any = None) -> None:
    """The ``quant.mixed`` rule: one of mlx-lm's rules, affine only, not together with a plan."""
    if mixed is None:
        return
    if plan is not None:
        raise InputError("quant.plan and quant.mixed are both set; choose one")
    if mixed not in MIXED_RULES:
        raise InputError(f"quant.mixed={mixed!r} is not allowed; choose one of {_choices(MIXED_RULES)}")
    if mode != "affine":
        raise InputError(f"quant.mixed={mixed!r} needs quant.mode=affine (mlx-lm's rule); got {mode!r}")


def check_budget(budget_bpw: float | None, budget_bytes: int | None, *, required: bool = True) -> None:
    """The allocation budget: exactly one of bits per weight and bytes on disk (``required=False``:
    at most one, for a config that may not run ``allocate``)."""
    if budget_bpw is not None and budget_bytes is not None:
        raise InputError(
            f"allocate.budget_bpw={budget_bpw} and allocate.budget_bytes={budget_bytes} are both set;"
            " set exactly one"
        )
    if required and budget_bpw is None and budget_bytes is None:
        raise InputError(
            "allocate.budget_bpw and allocate.budget_bytes are both unset; set exactly one"
            " (e.g. allocate.budget_bpw=4.5)"
        )
