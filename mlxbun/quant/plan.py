"""plan.json, and the other input files of a quantization, checked where they come in.

A per-layer plan (``allocate`` writes one, ``quantize`` reads one; settings as in
:mod:`mlxbun.quant.spec`)::

    {"version": 1,
     "default": {"bits": 4, "group_size": 64, "mode": "affine"},
     "layers": {"model.layers.0.mlp.down_proj": {"bits": 8, "group_size": 64, "mode": "affine"},
                "model.layers.0.mlp.up_proj": {"bits": 3, "group_size": 32, "mode": "affine",
                                               "method": "gptq"},
                "lm_head": false},              false = leave unquantized
     ...}                                       other keys (allocate's report) are ignored

The Hessians a plan's gptq and awq entries need are ``hessians.safetensors``
(:mod:`mlxbun.quant.hessian`), named by the file or by the command=calibrate run directory holding it.

Example:
    >>> plan = load_plan("outputs/allocate/.../plan.json")
    >>> plan.layers["lm_head"], plan.default
    (None, QuantSpec(bits=4, group_size=64, mode='affine'))
"""

from __future__ import annotations

import json
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxbun.errors import InputError
from mlxbun.quant.spec import HESSIAN_METHODS, QuantSpec

PLAN_VERSION = 1
HESSIANS_NAME = "hessians.safetensors"  # its name in a command=calibrate run directory
HESSIANS_FILE = f"a Hessians file ({HESSIANS_NAME}, mlxbun.quant.hessian) or the calibrate run dir holding it"


@dataclass(frozen=True)
class Plan:
    """A per-layer plan: ``layers[path]`` is a QuantSpec, or None to leave that module unquantized.

    Modules not in ``layers`` take ``default``. ``allocate`` writes one (with its report beside
    these keys), ``quantize`` reads one.
    """

    default: QuantSpec
    layers: Mapping[str, QuantSpec | None] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "plan") -> Plan:
        """A checked plan; errors name ``source`` and the entry. Keys other than these are ignored."""
        if not isinstance(data, dict) or not isinstance(data.get("default"), dict):
            raise InputError(
                f"{source}: a plan is an object with a 'default' setting; see mlxbun/quant/plan.py"
            )
        if data.get("version", PLAN_VERSION) != PLAN_VERSION:
            raise InputError(
                f"{source}: plan version {data.get('version')!r} is not supported; use version {PLAN_VERSION}"
            )
        layers = {} if data.get("layers") is None else data["layers"]
        if not isinstance(layers, dict):
            raise InputError(f"{source}: 'layers' must map module paths to a setting or false")
        return cls(
            default=QuantSpec.from_dict(data["default"], key=f"{source}: default"),
            layers={
                path: None
                if entry is False
                else QuantSpec.from_dict(entry, key=f"{source}: layers[{path!r}]")
                for path, entry in layers.items()
            },
        )

    def to_dict(self) -> dict[str, Any]:
        layers = {p: (s.to_dict() if s else False) for p, s in sorted(self.layers.items())}
        return {"version": PLAN_VERSION, "default": self.default.to_dict(), "layers": layers}


def input_file(key: str, path: str | Path, *, what: str, directory: bool = False) -> Path:
    """``path`` (``~`` expanded), or an InputError naming ``key`` when it does not exist or is not a
    regular file (a FIFO or device would block or never end when read); ``directory`` allows one.

    Example:
        >>> input_file("quant.plan", "/dev/zero", what="a plan.json from `allocate`")
        Traceback (most recent call last):
        mlxbun.errors.InputError: quant.plan='/dev/zero' is a device, not a regular file; pass a plan.json ...
    """
    p = Path(path).expanduser()
    try:
        mode = p.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        raise InputError(f"{key}={str(path)!r} does not exist; pass {what}") from None
    if stat.S_ISREG(mode) or (directory and stat.S_ISDIR(mode)):
        return p
    kind = (
        "a directory" if stat.S_ISDIR(mode)
        else "a FIFO" if stat.S_ISFIFO(mode)
        else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
        else "a socket"
    )  # fmt: skip
    raise InputError(f"{key}={str(path)!r} is {kind}, not a regular file; pass {what}")


def hessians_file(path: str | Path, *, key: str = "quant.hessians") -> Path:
    """The Hessians file ``path`` names: the file itself, or the command=calibrate run directory
    holding ``hessians.safetensors``; an InputError naming ``key`` otherwise."""
    p = input_file(key, path, what=HESSIANS_FILE, directory=True)
    if not p.is_dir():
        return p
    if not (p / HESSIANS_NAME).exists():
        raise InputError(f"{key}={str(path)!r} is a directory without {HESSIANS_NAME}; pass {HESSIANS_FILE}")
    return input_file(key, p / HESSIANS_NAME, what=HESSIANS_FILE)


def check_hessians(method: str, plan: Plan | None, hessians: Any) -> None:
    """Refuse a run whose ``quant.method``, or a plan entry's method, needs Hessians when none are given."""
    if hessians is not None:
        return
    if method in HESSIAN_METHODS:
        raise InputError(f"quant.method={method!r} needs quant.hessians, {HESSIANS_FILE}")
    entries = {} if plan is None else {"default": plan.default, **plan.layers}
    for path, spec in entries.items():
        if spec is not None and spec.method in HESSIAN_METHODS:
            raise InputError(
                f"quant.plan gives {path!r} method {spec.method!r}, which needs quant.hessians, {HESSIANS_FILE}"
            )


def load_plan(path: str | Path) -> Plan:
    """Read and check a plan.json; errors name the file and the entry."""
    p = input_file("quant.plan", path, what="a plan.json from `allocate`")
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"quant.plan={str(path)!r} is not valid JSON ({e})") from None
    return Plan.from_dict(data, source=f"quant.plan={str(path)!r}")
