"""Exact byte accounting of a quantized MLX model, from the source's tensor shapes and a plan.

Nothing is quantized here: the shapes and dtypes that ``mx.quantize`` produces are known in
advance, so the size of the output is arithmetic. Two sizes, both predicted to the byte:

- ``tensor_bytes``: the sum of every stored tensor's data (the index's ``total_size``, and what
  mlx-lm's ``compute_bits_per_weight`` counts). Bits per weight are ``tensor_bytes * 8 /
  parameters``, where ``parameters`` is the logical parameter count (the source's elements:
  a quantized ``[out, in]`` weight still counts ``out * in``).
- ``file_bytes``: the sum of the model's ``.safetensors`` file sizes on disk, headers included
  (what ``du`` shows and a download costs). A budget in bytes means this number.

Per quantized ``[..., out, in]`` weight (``in`` divisible by the group size ``g``)::

    <path>.weight  uint32 [..., out, in * bits / 32]              packed codes
    <path>.scales  [..., out, in / g]   affine: output dtype; mxfp4/mxfp8/nvfp4: uint8
    <path>.biases  [..., out, in / g]   affine only, output dtype

Every other tensor (norms, biases, unquantized weights) is stored in the output dtype when it is
floating point, else unchanged. A safetensors file is ``u64 header length | JSON header | data``
(the header as ``mlxbun.io.layout.header_bytes`` writes it: compact, sorted, space-padded to 8).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxbun.io.dtypes import CODES, FLOAT_CODES, ITEMSIZE
from mlxbun.io.layout import header_bytes, pack
from mlxbun.io.safetensors import open_model
from mlxbun.quant.skeleton import build_skeleton
from mlxbun.quant.spec import UINT8_SCALE_MODES, QuantSpec


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
        return self.numel * ITEMSIZE[self.dtype]


def store_dtype(dtype: str, out_dtype: str | None) -> str:
    """The dtype a tensor is written in: floating tensors take the output dtype (None: their own)."""
    return out_dtype if out_dtype and dtype in FLOAT_CODES else dtype


def quantized_specs(
    path: str, shape: tuple[int, ...], setting: QuantSpec, out_dtype: str
) -> list[TensorSpec]:
    """The tensors ``mx.quantize`` yields for the weight of module ``path`` (see the module doc)."""
    *lead, cols = shape
    groups = (*lead, cols // setting.group_size)
    scale_dtype = "U8" if setting.mode in UINT8_SCALE_MODES else out_dtype
    specs = [
        TensorSpec(f"{path}.weight", "U32", (*lead, cols * setting.bits // 32)),
        TensorSpec(f"{path}.scales", scale_dtype, groups),
    ]
    if setting.mode == "affine":
        specs.append(TensorSpec(f"{path}.biases", out_dtype, groups))
    return specs


def weight_bytes(shape: tuple[int, ...], setting: QuantSpec | None, out_dtype: str) -> int:
    """Bytes of one module's weight stored with ``setting`` (None: unquantized)."""
    if setting is None:
        return math.prod(shape) * ITEMSIZE[out_dtype]
    return sum(s.nbytes for s in quantized_specs("w", shape, setting, out_dtype))


def module_of(name: str) -> str | None:
    """The module path of a ``<path>.weight`` tensor, else None."""
    return name[: -len(".weight")] if name.endswith(".weight") else None


@dataclass(frozen=True)
class Source:
    """A model before quantization: its tensors in writing order and its quantizable modules.

    Attributes:
        specs: every tensor the output holds (after mlx-lm's ``sanitize``), in the order the
            writer receives them (``tree_flatten`` of the model's parameters).
        quantizable: module paths with ``to_quantized`` (Linear, Embedding, SwitchLinear) that
            the model class does not refuse; only these can take a setting.
        keep_dtype: tensor names the model's ``cast_predicate`` keeps in their own dtype.
    """

    specs: tuple[TensorSpec, ...]
    quantizable: frozenset[str]
    keep_dtype: frozenset[str] = frozenset()

    @classmethod
    def from_specs(cls, specs: Iterable[TensorSpec]) -> Source:
        """Without a model class: every ``<path>.weight`` of rank >= 2 is quantizable."""
        specs = tuple(specs)
        paths = {module_of(s.name) for s in specs if len(s.shape) >= 2}
        return cls(specs, frozenset(p for p in paths if p))

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Module path -> weight shape, for the quantizable modules."""
        return {p: s.shape for s in self.specs if (p := module_of(s.name)) in self.quantizable}

    def dtype_of(self, spec: TensorSpec, out_dtype: str | None) -> str:
        """The dtype ``spec`` is written in (before any quantization)."""
        return spec.dtype if spec.name in self.keep_dtype else store_dtype(spec.dtype, out_dtype)

    def weight_dtypes(self, out_dtype: str | None) -> dict[str, str]:
        """Module path -> dtype its weight is cast to before quantizing (scales take it too)."""
        return {
            p: self.dtype_of(s, out_dtype) for s in self.specs if (p := module_of(s.name)) in self.quantizable
        }

    @property
    def parameters(self) -> int:
        return sum(s.numel for s in self.specs)


def resolve(
    path: str, shape: tuple[int, ...], default: QuantSpec | None, layers: Mapping[str, QuantSpec | None]
) -> QuantSpec | None:
    """The setting module ``path`` gets from a plan, or None when it stays unquantized.

    As in mlx-lm, a weight whose last dimension the group size does not divide stays as it is.
    """
    setting = layers[path] if path in layers else default
    return setting if setting is not None and setting.fits(shape) else None


def output_specs(
    source: Source,
    *,
    default: QuantSpec | None,
    layers: Mapping[str, QuantSpec | None],
    out_dtype: str | None,
) -> list[TensorSpec]:
    """Every tensor of the quantized model, in writing order."""
    out: list[TensorSpec] = []
    for spec in source.specs:
        path = module_of(spec.name)
        quantizable = path in source.quantizable
        setting = resolve(path, spec.shape, default, layers) if quantizable else None
        dtype = source.dtype_of(spec, out_dtype)
        if setting is not None:
            out += quantized_specs(path, spec.shape, setting, dtype)
        else:
            out.append(TensorSpec(spec.name, dtype, spec.shape))
    return out


def file_size(specs: list[TensorSpec], metadata: Mapping[str, str] | None) -> int:
    """Bytes of one safetensors file holding ``specs`` (in writing order: data follows it, and
    offsets' digits count), as ``mlxbun.io.shards`` writes it."""
    entries = [(s.name, s.dtype, s.shape, s.nbytes) for s in specs]
    return len(header_bytes(entries, dict(metadata or {}))) + sum(s.nbytes for s in specs)


def make_shards(specs: list[TensorSpec], *, shard_bytes: int) -> list[list[TensorSpec]]:
    """The writer's shard split, replayed on sizes (:func:`mlxbun.io.layout.pack`)."""
    return [[specs[i] for i in shard] for shard in pack([s.nbytes for s in specs], shard_bytes)]


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
    source: Source,
    *,
    default: QuantSpec | None,
    layers: Mapping[str, QuantSpec | None],
    out_dtype: str | None = "BF16",
    shard_bytes: int = 5 << 30,
    metadata: Mapping[str, str] | None = None,
) -> SizeReport:
    """The size of ``source`` quantized with a plan, to the byte.

    Args:
        source: the source model (see :func:`read_source`).
        default: setting of modules not in ``layers`` (None: leave them unquantized).
        layers: per-module settings; None leaves that module unquantized.
        out_dtype: safetensors code of the output dtype (``mlxbun.io.dtypes.CODES["bfloat16"]``); None keeps
            each tensor's own dtype.
        shard_bytes: the writer's shard limit.
        metadata: the safetensors ``__metadata__`` the writer stores.

    Example:
        >>> predict(read_source(src), default=QuantSpec(bits=4, group_size=64), layers={}).bpw
        4.52...
    """
    metadata = {"format": "mlx"} if metadata is None else metadata
    specs = output_specs(source, default=default, layers=layers, out_dtype=out_dtype)
    shards = make_shards(specs, shard_bytes=shard_bytes)
    return SizeReport(
        tensor_bytes=sum(s.nbytes for s in specs),
        file_bytes=sum(file_size(shard, metadata) for shard in shards),
        parameters=source.parameters,
        shards=len(shards),
    )


def read_specs(model_dir: Path) -> list[TensorSpec]:
    """The tensors of a model directory (any layout ``open_model`` reads), sorted by name."""
    with open_model(model_dir) as m:
        return [TensorSpec(i.name, i.dtype, tuple(i.shape)) for i in m.infos().values()]


def read_source(model_dir: Path) -> Source:
    """The model as ``quantize`` sees it: mlx-lm's model class, sanitized tensors, writing order.

    Reads config.json and the safetensors headers only (no tensor data). A directory without
    config.json falls back to :meth:`Source.from_specs` on its raw tensors.
    """
    if not (Path(model_dir) / "config.json").is_file():
        return Source.from_specs(read_specs(model_dir))
    sk = build_skeleton(model_dir)
    order = [k for k, _ in tree_flatten(sk.model.parameters())]
    specs = tuple(
        TensorSpec(k, CODES[str(sk.weights[k].dtype).rpartition(".")[2]], tuple(sk.weights[k].shape))
        for k in order
    )
    cast_ok = getattr(sk.model, "cast_predicate", lambda _: True)
    allow = getattr(sk.model, "quant_predicate", None)
    leaves = tree_flatten(sk.model.leaf_modules(), is_leaf=nn.Module.is_module)
    quantizable = frozenset(
        p
        for p, m in leaves
        if hasattr(m, "to_quantized") and "weight" in m and (allow is None or allow(p, m))
    )
    return Source(specs, quantizable, frozenset(s.name for s in specs if not cast_ok(s.name)))


def measure(model_dir: Path, *, parameters: int) -> SizeReport:
    """The size of a written model directory (``parameters``: the source's logical count)."""
    with open_model(model_dir) as m:
        files = m.files
        tensor_bytes = m.total_bytes
    return SizeReport(
        tensor_bytes=tensor_bytes,
        file_bytes=sum(f.stat().st_size for f in files),
        parameters=parameters,
        shards=len(files),
    )
