"""Exact byte accounting of a quantized MLX model, from the source's tensor shapes and a plan.

Nothing is quantized here: the shapes and dtypes that ``mx.quantize`` produces are known in
advance, so the size of the output is arithmetic. Two sizes, both predicted to the byte:

- ``tensor_bytes``: the sum of every stored tensor's data (the index's ``total_size``, and what
  mlx-lm's ``compute_bits_per_weight`` counts). Bits per weight are ``tensor_bytes * 8 /
  parameters``, where ``parameters`` is the logical parameter count (the source's elements:
  a quantized ``[out, in]`` weight still counts ``out * in``).
- ``file_bytes``: the sum of the model's ``.safetensors`` file sizes on disk, headers included
  (what ``du`` shows and a download costs). A budget in bytes means this number.

Per quantized ``[out, in]`` weight (``in`` divisible by the group size ``g``)::

    <path>.weight  uint32 [out, in * bits / 32]                  packed codes
    <path>.scales  [out, in / g]   affine: output dtype; mxfp4/mxfp8/nvfp4: uint8
    <path>.biases  [out, in / g]   affine only, output dtype

Every other tensor (norms, biases, unquantized weights) is stored in the output dtype when it is
floating point, else unchanged. A safetensors file is ``u64 header length | JSON header | data``
(the header as ``mlxbun.io.shards.header_bytes`` writes it: compact, sorted, space-padded to 8).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
}
FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}
# Config dtype names (schema.DTYPES) -> safetensors dtype codes.
DTYPE_CODES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
# Scales are 8-bit exponents (mx) or fp8 (nv) in the microscaling modes; affine adds biases.
UINT8_SCALE_MODES = {"mxfp4", "mxfp8", "nvfp4"}


@dataclass(frozen=True, order=True)
class Setting:
    """One way to store a linear layer: ``mode`` at ``bits`` with ``group_size``."""

    bits: int
    group_size: int
    mode: str = "affine"

    def to_json(self) -> dict[str, Any]:
        return {"bits": self.bits, "group_size": self.group_size, "mode": self.mode}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Setting:
        return cls(bits=int(d["bits"]), group_size=int(d["group_size"]), mode=str(d.get("mode", "affine")))

    def fits(self, shape: tuple[int, ...]) -> bool:
        """Whether a weight of ``shape`` can be stored this way (2-D, rows split into whole groups)."""
        return len(shape) == 2 and shape[-1] % self.group_size == 0


@dataclass(frozen=True)
class TensorSpec:
    """A tensor's name, safetensors dtype code and shape (no data)."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]


def store_dtype(dtype: str, out_dtype: str) -> str:
    """The dtype a tensor is written in: floating tensors take the output dtype."""
    return out_dtype if dtype in FLOAT_DTYPES else dtype


def quantized_specs(path: str, shape: tuple[int, ...], setting: Setting, out_dtype: str) -> list[TensorSpec]:
    """The tensors ``mx.quantize`` yields for the weight of module ``path`` (see the module doc)."""
    rows, cols = shape
    groups = cols // setting.group_size
    scale_dtype = "U8" if setting.mode in UINT8_SCALE_MODES else out_dtype
    specs = [
        TensorSpec(f"{path}.weight", "U32", (rows, cols * setting.bits // 32)),
        TensorSpec(f"{path}.scales", scale_dtype, (rows, groups)),
    ]
    if setting.mode == "affine":
        specs.append(TensorSpec(f"{path}.biases", out_dtype, (rows, groups)))
    return specs


def weight_bytes(shape: tuple[int, ...], setting: Setting | None, out_dtype: str) -> int:
    """Bytes of one module's weight stored with ``setting`` (None: unquantized)."""
    if setting is None:
        return math.prod(shape) * DTYPE_BYTES[out_dtype]
    return sum(s.nbytes for s in quantized_specs("w", shape, setting, out_dtype))


def module_of(name: str) -> str | None:
    """The module path of a ``<path>.weight`` tensor, else None."""
    return name[: -len(".weight")] if name.endswith(".weight") else None


def resolve(
    path: str, shape: tuple[int, ...], default: Setting | None, layers: Mapping[str, Setting | None]
) -> Setting | None:
    """The setting module ``path`` gets from a plan, or None when it stays unquantized.

    As in mlx-lm, only 2-D weights whose last dimension divides by the group size are quantized.
    """
    setting = layers[path] if path in layers else default
    return setting if setting is not None and setting.fits(shape) else None


def output_specs(
    source: Iterable[TensorSpec],
    *,
    default: Setting | None,
    layers: Mapping[str, Setting | None],
    out_dtype: str,
) -> list[TensorSpec]:
    """Every tensor of the quantized model, in source order."""
    out: list[TensorSpec] = []
    for spec in source:
        path = module_of(spec.name)
        setting = resolve(path, spec.shape, default, layers) if path else None
        if setting is not None:
            out += quantized_specs(path, spec.shape, setting, out_dtype)
        else:
            out.append(TensorSpec(spec.name, store_dtype(spec.dtype, out_dtype), spec.shape))
    return out


def file_size(specs: list[TensorSpec], metadata: Mapping[str, str] | None) -> int:
    """Bytes of one safetensors file holding ``specs``, as ``mlxbun.io.shards`` writes it."""
    from mlxbun.io.shards import header_bytes

    entries = [(s.name, s.dtype, s.shape, s.nbytes) for s in sorted(specs, key=lambda s: s.name)]
    return len(header_bytes(entries, dict(metadata or {}))) + sum(s.nbytes for s in specs)


def make_shards(specs: list[TensorSpec], *, shard_bytes: int) -> list[list[TensorSpec]]:
    """mlx-lm's greedy split: a new shard when the next tensor would pass ``shard_bytes``."""
    shards: list[list[TensorSpec]] = []
    size = 0
    for spec in specs:
        if not shards or size + spec.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


@dataclass(frozen=True)
class SizeReport:
    """The size of a (predicted or written) model: see the module doc for the definitions."""

    tensor_bytes: int
    file_bytes: int
    parameters: int
    shards: int

    @property
    def bpw(self) -> float:
        return 8 * self.tensor_bytes / self.parameters if self.parameters else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "tensor_bytes": self.tensor_bytes,
            "file_bytes": self.file_bytes,
            "parameters": self.parameters,
            "shards": self.shards,
            "bpw": self.bpw,
        }


def predict(
    source: list[TensorSpec],
    *,
    default: Setting | None,
    layers: Mapping[str, Setting | None],
    out_dtype: str = "BF16",
    shard_bytes: int = 5 << 30,
    metadata: Mapping[str, str] | None = None,
) -> SizeReport:
    """The size of ``source`` quantized with a plan, to the byte.

    Args:
        source: the source model's tensors (see :func:`read_specs`).
        default: setting of modules not in ``layers`` (None: leave them unquantized).
        layers: per-module settings; None leaves that module unquantized.
        out_dtype: safetensors code of the output dtype (``DTYPE_CODES["bfloat16"]``).
        shard_bytes: the writer's shard limit.
        metadata: the safetensors ``__metadata__`` the writer stores.

    Example:
        >>> predict(read_specs(src), default=Setting(4, 64), layers={}).bpw
        4.52...
    """
    metadata = {"format": "mlx"} if metadata is None else metadata
    specs = output_specs(source, default=default, layers=layers, out_dtype=out_dtype)
    shards = make_shards(specs, shard_bytes=shard_bytes)
    return SizeReport(
        tensor_bytes=sum(s.nbytes for s in specs),
        file_bytes=sum(file_size(shard, metadata) for shard in shards),
        parameters=sum(s.numel for s in source),
        shards=len(shards),
    )


def read_specs(model_dir: Path) -> list[TensorSpec]:
    """The tensors of a model directory (any layout ``open_model`` reads), sorted by name."""
    from mlxbun.io.safetensors import open_model

    with open_model(model_dir) as m:
        return [TensorSpec(i.name, i.dtype, tuple(i.shape)) for i in m.infos().values()]


def measure(model_dir: Path, *, parameters: int) -> SizeReport:
    """The size of a written model directory (``parameters``: the source's logical count)."""
    from mlxbun.io.safetensors import open_model

    with open_model(model_dir) as m:
        files = m.files
        tensor_bytes = m.total_bytes
    return SizeReport(
        tensor_bytes=tensor_bytes,
        file_bytes=sum(f.stat().st_size for f in files),
        parameters=parameters,
        shards=len(files),
    )
