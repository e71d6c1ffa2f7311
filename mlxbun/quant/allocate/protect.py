"""allocate.protect: rules that keep chosen modules at or above a bit width.

A rule is ``pattern:min_bits`` (``lm_head:6``, ``layers.first.mlp.down_proj:6``; its grammar is
:class:`mlxbun.quant.spec.Rule`, which the config checks); a measured module's candidates below
its rules' largest ``min_bits`` are dropped, an unmeasured module's default setting is raised to it.

Example:
    >>> rules = [Rule.parse("layers.last.mlp.down_proj:6")]
    >>> min_bits("model.layers.11.mlp.down_proj", rules, n_blocks=12)
    6
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence

from mlxbun.errors import InputError
from mlxbun.quant.spec import AFFINE_BITS, QuantSpec, Rule

LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")


def min_bits(path: str, rules: Sequence[Rule], *, n_blocks: int) -> int:
    """The bits ``rules`` ask of ``path`` at least (0: none)."""
    return max((r.min_bits for r in rules if r.matches(path, n_blocks=n_blocks)), default=0)


def count_blocks(paths: Collection[str]) -> int:
    """Blocks of a model, from its module paths (``...layers.<i>...``)."""
    return 1 + max((int(m.group(1)) for p in paths if (m := LAYER_INDEX.search(f".{p}."))), default=-1)


def fixed_setting(path: str, shape: tuple[int, ...], default: QuantSpec, need: int) -> QuantSpec | None:
    """An unmeasured module's setting: the default, raised to ``need`` bits by a protection rule."""
    if need <= default.bits:
        return default
    if default.mode != "affine" or need > max(AFFINE_BITS):
        raise InputError(
            f"allocate.protect asks {path!r} for >= {need} bits, which the default "
            f"{default.mode} {default.bits}-bit setting cannot give; probe {path!r} in sensitivity"
        )
    return QuantSpec(
        bits=min(b for b in AFFINE_BITS if b >= need), group_size=default.group_size, mode=default.mode
    )
