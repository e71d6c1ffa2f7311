"""mlx-lm's prompt-cache file, the container of format-3 snapshots (``snapshots/<name>.safetensors``).

A format-3 snapshot is exactly what ``mlx_lm.models.cache.save_prompt_cache`` writes — tensor
names from ``tree_flatten([c.state for c in cache])``, metadata ``tree_flatten([user metadata,
class names, scalars])`` — so ``load_prompt_cache``, ``mlx_lm generate --prompt-cache-file`` and
``mx.load`` open it. mlxbun's integrity data rides in the user metadata; there are no extra
tensors. Layout (a plain safetensors file, tensors back to back)::

    0    8  N                 u64 LE, the JSON length; 8 + N = data_start, SKEW past 16 KiB
    8    N  JSON, space-padded:
              {"__metadata__":{"0.mlxbun_kvs":"3","0.mlxbun_sha256":"<64 hex>",
                 "0.mlxbun_header":"<mlxbun header JSON>",
                 "0.model":"<model reference>","0.tokenizer_config":"<JSON>",
                 "1.<i>":"<class of layer i>",
                 "2.0":"","2.<k>.0":"<tensor name of scalar k>","2.<k>.1":"scalar"|"string"|"none"},
               "<i>.0":{"dtype":"F16","shape":[B,H,T,W],"data_offsets":[a,b]}, ...}
    data_start ..             the K/V tensors in layer order (mlxbun header order), then the
                              scalar, string and none entries (I32 / I32 / empty F32)

``0.mlxbun_sha256`` sits at a fixed offset (:data:`HASH_AT`): the sha256 of bytes
``0 .. data_start`` with those digits read as ``0``. The table is derived from the mlxbun header
(the format-2 header, plus ``model_name`` and ``tokenizer_config``): a reader re-encodes it and
requires the same bytes, so what ``mx.load`` follows is what the hash and validation covered.
The K/V tensors hold valid tokens only (mlx-lm's own files keep the 256-step padded buffers);
the scalars (offsets, ring positions, quantization) are derived from the layer meta, so they
cannot disagree with it.

The data starts :data:`SKEW` bytes past a 16 KiB boundary (header padding only), as format 2's
tensors do (see ``format.SKEW``).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from typing import Any

import numpy as np

from mlxbun.io.dtypes import CODES
from mlxbun.kv import format as fmt
from mlxbun.kv import state

VERSION = 3
MAGIC = b'{"__metadata__":{"0.mlxbun_kvs":"'  # at offset 8
_LEAD = MAGIC + str(VERSION).encode() + b'","0.mlxbun_sha256":"'
HASH_AT = 8 + len(_LEAD)
SKEW = fmt.SKEW
TOKENIZER_CONFIG = "{}"  # what mlx_lm cache_prompt writes without --eos-token
ST_DTYPES = fmt.ST_DTYPES | {"int32": CODES["int32"]}

# (name below the layer, kind, payload): kind "tensor" (payload: mlxbun tensor name),
# "scalar" (int), "string" (str) or "none"
Leaf = tuple[str, str, Any]


def leaves(cls: str, meta: dict[str, Any]) -> list[Leaf]:
    """The flattened ``state`` of one mlx-lm cache of class ``cls``, in mlx-lm's order."""
    if cls == "CacheList":
        out: list[Leaf] = []
        for j, sub in enumerate(meta["caches"]):
            for name, kind, val in leaves(sub["class"], sub["meta"]):
                out.append((f"{j}.0.{name}", kind, f"{j}.{val}" if kind == "tensor" else val))
            out.append((f"{j}.1", "string", sub["class"]))
        return out
    empty = bool(meta.get("empty"))
    if cls == "QuantizedKVCache":
        kv = [
            (f"{i}.{j}", "tensor", f"{kind}.{part}")
            for i, kind in enumerate(("keys", "values"))
            for j, part in enumerate(state.QUANT_PARTS)
        ]
        scalars = [meta["offset"], meta["group_size"], meta["bits"]]
    else:
        kv = [("0", "tensor", "keys"), ("1", "tensor", "values")]
        scalars = [meta["offset"]]
        if cls == "RotatingKVCache":
            scalars += [meta["keep"], meta["max_size"], meta["idx"]]
    if empty:
        kv = [("0", "none", None), ("1", "none", None)]
    return kv + [(str(2 + k), "scalar", v) for k, v in enumerate(scalars)]


def small(kind: str, val: Any) -> tuple[str, list[int], bytes]:
    """(dtype, shape, bytes) of a scalar, string or none leaf, as ``save_prompt_cache`` stores it."""
    if kind == "scalar":
        return "int32", [], np.int32(val).tobytes()
    if kind == "string":
        return "int32", [len(val)], np.array([ord(ch) for ch in val], dtype="<i4").tobytes()
    return "float32", [0], b""


def entries(header: dict[str, Any]) -> tuple[list[tuple[str, str]], list[tuple[str, str, Any]]]:
    """The file's tensors: (file name, mlxbun qualified name) of the K/V tensors, and
    (file name, kind, payload) of the scalar/string/none leaves, both in storage order."""
    names: dict[str, str] = {}
    rest = []
    for i, layer in enumerate(header["layers"]):
        for name, kind, val in leaves(layer["class"], layer["meta"]):
            if kind == "tensor":
                names[f"{i}.{val}"] = f"{i}.{name}"
            else:
                rest.append((f"{i}.{name}", kind, val))
    return [(names[q], q) for q, _ in fmt.tensors_of(header)], rest


def metadata(header: dict[str, Any]) -> dict[str, str]:
    """The safetensors metadata: mlxbun's keys first (the hash at a fixed offset), then mlx-lm's."""
    meta = {
        "0.mlxbun_kvs": str(VERSION),
        "0.mlxbun_sha256": "0" * 64,
        "0.mlxbun_header": json.dumps(header, sort_keys=True, separators=(",", ":")),
        "0.model": header["model_name"],
        "0.tokenizer_config": header["tokenizer_config"],
    }
    meta |= {f"1.{i}": layer["class"] for i, layer in enumerate(header["layers"])}
    meta["2.0"] = ""
    _, rest = entries(header)
    for k, (name, kind, _) in enumerate(rest, start=1):
        meta[f"2.{k}.0"], meta[f"2.{k}.1"] = name, kind
    return meta


def tail(header: dict[str, Any]) -> bytes:
    """The bytes after the last K/V tensor: every scalar/string leaf, back to back."""
    return b"".join(small(kind, val)[2] for _, kind, val in entries(header)[1])


def table(header: dict[str, Any]) -> bytes:
    """The safetensors JSON (``0.mlxbun_sha256`` as zeros), unpadded."""
    doc: dict[str, Any] = {"__metadata__": metadata(header)}
    big, rest = entries(header)
    specs = dict(fmt.tensors_of(header))
    end = 0
    for name, q in big:
        t = specs[q]
        end = t["offset"] + t["nbytes"]
        doc[name] = {"dtype": ST_DTYPES[t["dtype"]], "shape": t["shape"], "data_offsets": [t["offset"], end]}
    for name, kind, val in rest:
        dtype, shape, raw = small(kind, val)
        doc[name] = {"dtype": ST_DTYPES[dtype], "shape": shape, "data_offsets": [end, end + len(raw)]}
        end += len(raw)
    return json.dumps(doc, separators=(",", ":")).encode()


def plan(header: dict[str, Any], nbytes: list[int]) -> None:
    """Fill offsets (back to back), ``data_bytes`` and ``data_start`` of a new header in place;
    ``nbytes`` are the K/V tensor sizes in :func:`mlxbun.kv.format.tensors_of` order."""
    end = 0
    for (_, t), n in zip(fmt.tensors_of(header), nbytes, strict=True):
        t.update(offset=end, nbytes=n)
        end += n
    header["data_bytes"] = end + len(tail(header))
    header["data_start"] = 0
    need = 8 + len(table(header)) + 64  # room for data_start's own digits
    header["data_start"] = fmt.align(need - SKEW) + SKEW


def encode(header: dict[str, Any]) -> bytes:
    """The first ``data_start`` bytes: length, table, padding, with the header hash filled in."""
    body = table(header)
    n = header["data_start"] - 8
    if len(body) > n:
        raise ValueError(f"snapshot table of {len(body)} bytes does not fit before data_start")
    raw = struct.pack("<Q", n) + body + b" " * (n - len(body))
    return raw[:HASH_AT] + hashlib.sha256(raw).hexdigest().encode() + raw[HASH_AT + 64 :]


def is_v3(lead: bytes) -> bool:
    return lead[8 : 8 + len(MAGIC)] == MAGIC


def decode(fd: int, size: int, *, what: str) -> dict[str, Any]:
    """Parse and hash-check the mlxbun header of a format-3 snapshot open as ``fd``."""
    (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    version = os.pread(fd, 12, 8 + len(MAGIC)).split(b'"', 1)[0]
    if version != str(VERSION).encode():
        raise fmt.UnsupportedError(
            f"{what}: format version {version.decode(errors='replace')} is not supported; "
            f"this mlxbun reads versions 1 to {VERSION}"
        )
    if n > fmt.MAX_HEADER:
        raise fmt.CorruptError(f"{what}: header length {n} exceeds {fmt.MAX_HEADER}")
    if 8 + n > size:
        raise fmt.CorruptError(f"{what}: truncated header ({size} of {8 + n} header bytes)")
    raw = os.pread(fd, 8 + n, 0)
    zeroed = raw[:HASH_AT] + b"0" * 64 + raw[HASH_AT + 64 :]
    if len(raw) != 8 + n or hashlib.sha256(zeroed).hexdigest().encode() != raw[HASH_AT : HASH_AT + 64]:
        raise fmt.CorruptError(f"{what}: header hash mismatch (torn or modified header)")
    try:
        header = json.loads(json.loads(raw[8:])["__metadata__"]["0.mlxbun_header"])
    except (ValueError, KeyError, TypeError) as e:
        raise fmt.CorruptError(f"{what}: header is not the expected JSON ({e})") from None
    if not isinstance(header, dict):
        raise fmt.CorruptError(f"{what}: header is not a JSON object")
    for key in ("model_name", "tokenizer_config"):
        if not isinstance(header.get(key), str):
            raise fmt.CorruptError(f"{what}: {key} is missing")
    if header.get("data_start") != 8 + n:
        raise fmt.CorruptError(
            f"{what}: data_start={header.get('data_start')!r} but the table ends at {8 + n}"
        )
    return header


def check_layout(h: dict[str, Any], size: int, *, what: str) -> None:
    """Tensors back to back in header order, then the tail; the file ends with the data."""
    end = 0
    for name, t in fmt.tensors_of(h):
        if t.get("offset") != end:
            fmt._fail(
                what, f"tensor {name!r}: offset={t.get('offset')!r}, expected {end} (tensors are contiguous)"
            )
        end += t["nbytes"]
    if h["data_bytes"] != end + len(tail(h)):
        fmt._fail(what, f"data_bytes={h['data_bytes']} but the tensors and scalars take {end + len(tail(h))}")
