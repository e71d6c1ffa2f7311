"""A model's parameter count from its tensors' names, dtypes and shapes (mlx-lm's convention),
and the bits, group size and mode of each packed quantized weight, from config.json's
``quantization`` block or from the shapes.

Example:
    >>> count_parameters({"l.weight": ("U32", (8, 16)), "l.scales": ("BF16", (8, 2))})
    1024
"""

from __future__ import annotations

import math
from typing import Any

from mlxbun.errors import InputError

QUANT_MODE_BY_RATIO = {2: ("nvfp4", 4, 16), 4: ("mxfp4", 4, 32), 8: ("mxfp8", 8, 32)}


def quantization_block(config: dict[str, Any]) -> dict[str, Any] | None:
    """The ``quantization`` (or ``quantization_config``) block of a config.json, if any."""
    q = config.get("quantization", config.get("quantization_config"))
    return q if isinstance(q, dict) else None


def _from_config(q: dict[str, Any], module: str) -> dict[str, Any] | None:
    """The module's entry in a quantization block, else the block's defaults (None if neither)."""
    entry = q.get(module)
    src = entry if isinstance(entry, dict) and "bits" in entry else q
    bits, gs = src.get("bits"), src.get("group_size", q.get("group_size"))
    if not (_positive_int(bits) and _positive_int(gs)):
        return None
    return {"bits": bits, "group_size": gs, "mode": src.get("mode", q.get("mode", "affine"))}


def _positive_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def _consistent(qp: dict[str, Any], packed: int, groups: int) -> bool:
    """Does (bits, group_size) explain a packed width of ``packed`` words and ``groups`` scales?"""
    return packed * 32 % qp["bits"] == 0 and packed * 32 // qp["bits"] == groups * qp["group_size"]


def quant_params(
    module: str,
    *,
    weight_shape: tuple[int, ...],
    scales_shape: tuple[int, ...],
    scales_dtype: str,
    quantization: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """{bits, group_size, mode, source} of a packed weight: from the config block or its shapes.

    Rule: an entry for ``module`` in ``quantization`` wins, then the block's top-level bits and
    group_size, if they explain the shapes (packed * 32 / bits == groups * group_size). Otherwise
    the shapes decide: uint8 scales give nvfp4/mxfp4/mxfp8 from the packed/groups ratio; float
    scales mean affine with group size 64 (mlx's default), else the first of 32, 128, 16 that
    gives legal bits. Shapes alone cannot tell 4-bit g32 from 2-bit g64; pass the block.
    """
    packed, groups = weight_shape[-1] if weight_shape else 0, scales_shape[-1] if scales_shape else 0
    qp = _from_config(quantization or {}, module)
    if qp is not None and _consistent(qp, packed, groups):
        return {**qp, "source": "config"}
    if (
        groups > 0
        and scales_dtype == "U8"
        and packed % groups == 0
        and packed // groups in QUANT_MODE_BY_RATIO
    ):
        mode, bits, gs = QUANT_MODE_BY_RATIO[packed // groups]
        return {"bits": bits, "group_size": gs, "mode": mode, "source": "shapes"}
    for gs in (64, 32, 128, 16):
        if (
            groups > 0
            and (packed * 32) % (groups * gs) == 0
            and (packed * 32) // (groups * gs) in (2, 3, 4, 5, 6, 8)
        ):
            return {
                "bits": packed * 32 // (groups * gs),
                "group_size": gs,
                "mode": "affine",
                "source": "shapes",
            }
    raise InputError(
        f"cannot infer the bits of packed weight {module!r}: shape {weight_shape}, scales {scales_shape};"
        " add its entry to config.json's quantization block"
    )


def count_parameters(
    tensors: dict[str, tuple[str, tuple[int, ...]]],
    *,
    quantization: dict[str, Any] | None = None,
    strict: bool = True,
) -> int:
    """Parameter count by mlx-lm's ``get_total_parameters`` convention, from names and shapes.

    A ``<m>.weight`` of dtype U32 with a ``<m>.scales`` sibling is a packed quantized weight and
    counts ``prod(shape) * 32 // bits`` (its logical size, bits from :func:`quant_params`);
    ``<m>.scales`` and ``<m>.biases`` of such a module count 0; every other tensor counts its
    element count.

    Args:
        tensors: name -> (safetensors dtype, shape).
        quantization: the config.json ``quantization`` block, if known (else bits are inferred).
        strict: raise when a packed weight's bits cannot be inferred (else count its words).

    Example:
        >>> count_parameters({"l.weight": ("U32", (8, 16)), "l.scales": ("BF16", (8, 2))})
        1024
    """
    total = 0
    for name, (dtype, shape) in tensors.items():
        module, _, leaf = name.rpartition(".")
        scales = tensors.get(f"{module}.scales")
        if scales is None or leaf not in ("weight", "scales", "biases"):
            total += math.prod(shape)
        elif leaf == "weight" and dtype == "U32":
            total += _packed_parameters(module, shape, scales, quantization, strict)
        elif leaf == "weight":
            total += math.prod(shape)
    return total


def _packed_parameters(
    module: str, shape: tuple, scales: tuple, quantization: dict | None, strict: bool
) -> int:
    try:
        qp = quant_params(
            module,
            weight_shape=shape,
            scales_shape=scales[1],
            scales_dtype=scales[0],
            quantization=quantization,
        )
    except InputError:
        if strict:
            raise
        return math.prod(shape)
    return math.prod(shape) * 32 // qp["bits"]
