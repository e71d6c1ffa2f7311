"""How a sharded model is laid out, as mlx-lm writes it: which tensors go in which shard, the
shards' file names, each file's header bytes, and the record of a finished layout.

Shards are filled greedily in insertion order up to ``shard_bytes`` of tensor data and a tensor is
never split (:func:`opens_shard`, mlx-lm's ``make_shards``); :func:`pack` replays that rule on
sizes alone, so a model's shards and file sizes are known before anything is written
(:mod:`mlxbun.quant.allocate.budget` predicts sizes with it). A header is compact JSON with sorted
keys, padded with spaces to a multiple of 8 bytes (:func:`header_bytes`). The writer is
:mod:`mlxbun.io.shards`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlxbun.errors import InputError
from mlxbun.io.dtypes import CODES as NP_TO_ST
from mlxbun.io.dtypes import ITEMSIZE

DEFAULT_SHARD_BYTES = 5 << 30


@dataclass(frozen=True)
class ShardLayout:
    """What a finished writer produced.

    Args:
        out_dir: the directory holding the shards.
        shards: shard file name -> tensor names in it (sorted), in shard order.
        total_size: bytes of tensor data (the index's ``total_size``).
        total_parameters: parameters by mlx-lm's count (packed weights at their logical size).
        index: the index dict (written only when there are several shards).
        digests: shard file name -> the writer's ``checksum`` of the whole file, computed
            while its bytes were written (a resume keeps the journal's, without a re-read).
        extra_digests: shard file name -> {kind: hex} of the writer's ``extra_digests`` kinds,
            computed in the same pass (absent for a kept shard of a journal that lacks them).
    """

    out_dir: Path
    shards: dict[str, list[str]]
    total_size: int
    total_parameters: int
    index: dict[str, Any]
    digests: dict[str, str] = field(default_factory=dict)
    extra_digests: dict[str, dict[str, str]] = field(default_factory=dict)

    @property
    def files(self) -> list[Path]:
        return [self.out_dir / f for f in self.shards]

    @property
    def index_written(self) -> bool:
        return len(self.shards) > 1


def opens_shard(filled: int, count: int, nbytes: int, shard_bytes: int) -> bool:
    """The packing rule (mlx-lm's ``make_shards``): a tensor of ``nbytes`` starts a new shard when
    the current one holds ``count`` tensors of ``filled`` bytes and it would pass ``shard_bytes``.

    The writer applies it while streaming; size prediction replays it on tensor sizes alone.
    """
    return count > 0 and filled + nbytes > shard_bytes


def final_names(n: int) -> list[str]:
    """mlx-lm's shard names for ``n`` shards."""
    if n == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def tensor_bytes(array: Any, name: str = "") -> tuple[str, tuple[int, ...], memoryview]:
    """(safetensors dtype, shape, contiguous little-endian bytes) of an mx.array or numpy array."""
    if isinstance(array, mx.array):
        dtype = NP_TO_ST.get(str(array.dtype).rpartition(".")[2])
        if dtype is None:
            raise InputError(f"tensor {name!r}: dtype {array.dtype} cannot be stored in safetensors")
        if array.dtype == mx.bfloat16:
            array = array.view(mx.uint16)
        mx.eval(array)
        arr = np.asarray(array)
    elif isinstance(array, np.ndarray):
        dtype = NP_TO_ST.get(array.dtype.name)
        if dtype is None or dtype == "BF16":
            allowed = ", ".join(k for k in NP_TO_ST if k != "bfloat16")
            raise InputError(
                f"tensor {name!r}: numpy dtype {array.dtype} cannot be stored; choose one of {allowed}"
            )
        arr = array.astype(array.dtype.newbyteorder("<"), copy=False)
    else:
        raise InputError(f"tensor {name!r}: expected an mx.array or numpy array, got {type(array).__name__}")
    flat = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    return dtype, tuple(int(d) for d in arr.shape), memoryview(flat)


def header_bytes(entries: list[tuple[str, str, tuple[int, ...], int]], metadata: dict[str, str]) -> bytes:
    """Length-prefixed header for (name, dtype, shape, nbytes) entries, in data order."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {"data_offsets": [offset, offset + nbytes], "dtype": dtype, "shape": list(shape)}
        offset += nbytes
    text = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def check_metadata(metadata: Mapping[str, str]) -> dict[str, str]:
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise InputError(
            f"metadata={dict(metadata)!r} must map strings to strings (safetensors __metadata__)"
        )
    return dict(metadata)


def pack(sizes: Sequence[int], shard_bytes: int) -> list[list[int]]:
    """The writer's shard split replayed on tensor sizes: each shard's indices into ``sizes``
    (:func:`opens_shard`). Used for declared tensors and by size prediction."""
    shards: list[list[int]] = []
    filled = 0
    for i, nbytes in enumerate(sizes):
        if not shards or opens_shard(filled, len(shards[-1]), nbytes, shard_bytes):
            shards.append([])
            filled = 0
        shards[-1].append(i)
        filled += nbytes
    return shards


def declared_shards(
    tensors: Sequence[tuple[str, str, tuple[int, ...]]], shard_bytes: int
) -> list[list[tuple[str, str, tuple[int, ...], int]]]:
    """Each shard's (name, dtype, shape, nbytes) for declared tensors."""
    entries, names = [], set()
    for name, dtype, shape in tensors:
        if name in names:
            raise InputError(f"tensors: {name!r} is declared twice; names must be unique")
        if dtype not in ITEMSIZE:
            raise InputError(f"tensors: {name!r} has dtype {dtype!r}; choose one of {', '.join(ITEMSIZE)}")
        names.add(name)
        entries.append((name, dtype, tuple(int(d) for d in shape), math.prod(shape) * ITEMSIZE[dtype]))
    return [[entries[i] for i in shard] for shard in pack([e[3] for e in entries], shard_bytes)]
