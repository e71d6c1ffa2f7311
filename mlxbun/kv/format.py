"""The framed header shared by single-file snapshots (``.kvs``) and block manifests (``.kvm``).

Byte layout (all integers little-endian)::

    0    8  magic            b"\\x89MLXBKV\\n"
    8    4  format version   u32 (this code reads and writes 1)
    12   4  reserved         u32, zero
    16   8  header length N  u64 (at most 64 MiB)
    24  32  header sha256    of the N header bytes
    56   N  header           canonical JSON, UTF-8 (sorted keys)
    ..      zero padding to data_start, the next multiple of 16 KiB      (.kvs only)
    data_start ..            tensor data, each tensor at a 16 KiB-aligned offset  (.kvs only)

The header (both layouts)::

    {"layout": "snapshot" | "blocks", "model": <fingerprint>, "tokenizer": <fingerprint>,
     "tokens": [ids...], "tokens_sha256": <sha256 of the ids as u32 LE>,
     "layers": [{"class": "KVCache" | "RotatingKVCache" | "QuantizedKVCache" | "CacheList",
                 "meta": {...}, "tensors": {name: {"dtype", "shape": [B, H, T, W], ...}}}],
     "hash": "xxh3_128" (.kvs written since the checksum change) | "blake3" (.kvm; older .kvs),
     .kvs:  each tensor also has "offset" (from data_start), "nbytes", "hash";
            "data_start", "data_bytes"
     .kvm:  "block_tokens": P, "blocks": [{"hash", "nbytes"}]}

Blocks are named by their BLAKE3-256 (64 lower-case hex digits): a content address must be
collision-resistant, or two different blocks could share a name. A snapshot's tensor hashes
only have to catch damage at rest (torn writes, flipped bits), so they are XXH3-128 (32 hex
digits): 15 GB/s per core here against BLAKE3's 3 GB/s, which took a verified snapshot
restore from 0.34 s to 0.27 s (512 MiB; unverified: 0.25 s). Older snapshots with BLAKE3 tensor
hashes still load; the header's "hash" says which one a file uses.

:func:`check_header` validates every field (class allow-list, dtypes, shapes against the meta,
offsets, sizes) before anything is allocated, so a lying header is refused, not trusted.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from typing import Any

import blake3
import numpy as np
import xxhash

from mlxbun.errors import DriftError, InputError
from mlxbun.kv import state

MAGIC = b"\x89MLXBKV\n"
VERSION = 1
PREFIX = struct.Struct("<8sIIQ32s")
ALIGN = 16 << 10
MAX_HEADER = 64 << 20
MAX_TENSOR_BYTES = 1 << 40
HEX64 = re.compile(r"[0-9a-f]{64}")
LAYOUTS = ("snapshot", "blocks")
HASH = "blake3"  # block names (.kvm)
CHECK = "xxh3_128"  # tensor hashes of .kvs files written now
TENSOR_HASHES = {"blake3": 64, "xxh3_128": 32}  # .kvs "hash" -> hex digits per tensor hash


class CorruptError(DriftError):
    """Stored bytes do not match their hashes or their own header (exit code 1)."""


class UnsupportedError(InputError):
    """A well-formed artifact this code refuses: another format version, an unknown cache class."""


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def digest(data: Any) -> str:
    """BLAKE3-256 hex digest of a bytes-like object."""
    return blake3.blake3(data).hexdigest()


def new_checker(name: str) -> Any:
    """An incremental hasher for a .kvs tensor hash named ``name`` (update/hexdigest)."""
    return xxhash.xxh3_128() if name == "xxh3_128" else blake3.blake3()


def check_digest(data: Any, name: str) -> str:
    """Hex digest of ``data`` with the .kvs tensor hash ``name``."""
    return xxhash.xxh3_128_hexdigest(data) if name == "xxh3_128" else digest(data)


def tokens_sha256(tokens: list[int]) -> str:
    return hashlib.sha256(np.asarray(tokens, dtype="<u4").tobytes()).hexdigest()


def encode(header: dict[str, Any]) -> bytes:
    """Prefix + canonical JSON header bytes."""
    body = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    return PREFIX.pack(MAGIC, VERSION, 0, len(body), hashlib.sha256(body).digest()) + body


def decode(raw_prefix: bytes, read_body: Any, *, what: str, file_size: int) -> dict[str, Any]:
    """Parse and hash-check a header; ``read_body(n)`` returns the next n bytes."""
    if len(raw_prefix) < PREFIX.size:
        raise CorruptError(f"{what}: truncated header ({len(raw_prefix)} of {PREFIX.size} prefix bytes)")
    magic, version, _, n, want = PREFIX.unpack(raw_prefix[: PREFIX.size])
    if magic != MAGIC:
        raise CorruptError(f"{what}: bad magic {magic!r}; not an mlxbun KV file")
    if version != VERSION:
        raise UnsupportedError(
            f"{what}: format version {version} is not supported; this mlxbun reads version {VERSION}"
        )
    if n > MAX_HEADER or PREFIX.size + n > file_size:
        raise CorruptError(f"{what}: header length {n} exceeds the file ({file_size} bytes) or {MAX_HEADER}")
    body = read_body(n)
    if len(body) != n or hashlib.sha256(body).digest() != want:
        raise CorruptError(f"{what}: header hash mismatch (torn or modified header)")
    try:
        header = json.loads(body)
    except ValueError as e:
        raise CorruptError(f"{what}: header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise CorruptError(f"{what}: header is not a JSON object")
    return header


def read_header(path: Any, *, what: str) -> tuple[dict[str, Any], int]:
    """Header of a .kvs/.kvm file and the file size."""
    with open(path, "rb") as f:
        import os

        size = os.fstat(f.fileno()).st_size
        header = decode(f.read(PREFIX.size), f.read, what=what, file_size=size)
    return header, size


# ---------------------------------------------------------------- validation


def _fail(what: str, msg: str) -> None:
    raise CorruptError(f"{what}: {msg}")


def _int(v: Any, what: str, key: str, lo: int = 0) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        _fail(what, f"{key}={v!r} must be an integer >= {lo}")
    return v


def _check_meta(cls: str, meta: Any, what: str) -> None:
    if cls not in state.CLASSES:
        raise UnsupportedError(
            f"{what}: cache class {cls!r} is not supported; choose one of {', '.join(state.CLASSES)}"
        )
    if not isinstance(meta, dict):
        _fail(what, "meta is not an object")
    if cls == "CacheList":
        subs = meta.get("caches")
        if not isinstance(subs, list) or not subs:
            _fail(what, "CacheList meta.caches must be a non-empty list")
        for i, s in enumerate(subs):
            if not isinstance(s, dict) or s.get("class") not in state.LEAF_CLASSES:
                raise UnsupportedError(
                    f"{what}.{i}: CacheList entry class {s!r} is not one of {', '.join(state.LEAF_CLASSES)}"
                )
            _check_meta(s["class"], s.get("meta"), f"{what}.{i}")
        return
    keys = {"KVCache": ("offset",), "QuantizedKVCache": ("offset", "group_size", "bits")}
    keys["RotatingKVCache"] = ("offset", "keep", "max_size", "idx")
    for k in keys[cls]:
        _int(meta.get(k), what, f"meta.{k}")
    if cls == "RotatingKVCache" and not meta.get("empty"):
        n = _int(meta.get("tokens"), what, "meta.tokens")
        if not meta["keep"] <= meta["idx"] <= n:
            _fail(what, f"meta.idx={meta['idx']} must lie in keep={meta['keep']}..tokens={n}")
    if cls == "QuantizedKVCache" and (meta["bits"] not in (2, 3, 4, 5, 6, 8) or meta["group_size"] <= 0):
        _fail(what, f"bits={meta['bits']} group_size={meta['group_size']} is not a valid quantization")


def _check_tensor(name: str, t: Any, tokens: int | None, what: str) -> tuple[int, ...]:
    where = f"{what} tensor {name!r}"
    if not isinstance(t, dict) or t.get("dtype") not in state.DTYPES:
        _fail(
            where,
            f"dtype {t.get('dtype') if isinstance(t, dict) else t!r} is not one of {', '.join(state.DTYPES)}",
        )
    shape = t.get("shape")
    if not isinstance(shape, list) or len(shape) != 4:
        _fail(where, f"shape {shape!r} is not 4 integers")
    shape = tuple(_int(d, where, "shape") for d in shape)
    if tokens is not None and shape[2] != tokens:
        _fail(where, f"shape {list(shape)} holds {shape[2]} tokens but the layer meta says {tokens}")
    if int(np.prod(shape, dtype=object)) * state.DTYPES[t["dtype"]][1] > MAX_TENSOR_BYTES:
        _fail(where, f"shape {list(shape)} is larger than {MAX_TENSOR_BYTES} bytes")
    return shape


def _check_pair(layer: dict[str, Any], prefix: str, cls: str, meta: dict, what: str) -> None:
    """keys/values of one leaf cache agree on batch, heads and tokens; quantized widths agree."""
    ts = layer["tensors"]
    names = [n for n in state.expected_tensors(cls, meta)]
    shapes = {n: tuple(ts[prefix + n]["shape"]) for n in names}
    if len({s[:3] for s in shapes.values()}) > 1:
        _fail(what, f"tensors disagree on batch/heads/tokens: {shapes}")
    if cls == "QuantizedKVCache" and shapes:
        for kind in ("keys", "values"):
            w = shapes[f"{kind}.weight"][3] * 32 // meta["bits"]
            if (
                ts[prefix + f"{kind}.weight"]["dtype"] != "uint32"
                or w != shapes[f"{kind}.scales"][3] * meta["group_size"]
            ):
                _fail(what, f"{kind} packed width and scales width disagree for bits={meta['bits']}")


def check_layer(i: int, layer: Any, what: str) -> None:
    where = f"{what} layer {i}"
    if not isinstance(layer, dict) or not isinstance(layer.get("tensors"), dict):
        _fail(where, "layer entry is not an object with tensors")
    cls, meta = layer.get("class"), layer.get("meta")
    _check_meta(cls, meta, where)
    want = state.expected_tensors(cls, meta)
    if sorted(layer["tensors"]) != sorted(want):
        _fail(where, f"tensors {sorted(layer['tensors'])} do not match class {cls} (expected {want})")
    leaves = (
        [(f"{j}.", s["class"], s["meta"]) for j, s in enumerate(meta["caches"])]
        if cls == "CacheList"
        else [("", cls, meta)]
    )
    for prefix, lcls, lmeta in leaves:
        tokens = state.valid_tokens(lcls, lmeta)
        for n in state.expected_tensors(lcls, lmeta):
            _check_tensor(prefix + n, layer["tensors"][prefix + n], tokens, where)
        _check_pair(layer, prefix, lcls, lmeta, where)


def check_header(h: dict[str, Any], *, what: str) -> None:
    """Validate a decoded header completely; raise CorruptError/UnsupportedError naming the field."""
    if h.get("layout") not in LAYOUTS:
        _fail(what, f"layout {h.get('layout')!r} is not one of {', '.join(LAYOUTS)}")
    allowed = tuple(TENSOR_HASHES) if h["layout"] == "snapshot" else (HASH,)
    if h.get("hash") not in allowed:
        raise UnsupportedError(
            f"{what}: hash {h.get('hash')!r} is not supported for layout {h['layout']}; "
            f"this mlxbun reads {' or '.join(allowed)}"
        )
    for k in ("model", "tokenizer", "tokens_sha256"):
        if not isinstance(h.get(k), str):
            _fail(what, f"{k} is missing")
    toks = h.get("tokens")
    if not isinstance(toks, list) or not all(isinstance(t, int) and 0 <= t < 1 << 32 for t in toks):
        _fail(what, "tokens must be a list of token ids")
    if tokens_sha256(toks) != h["tokens_sha256"]:
        _fail(what, "tokens do not match tokens_sha256")
    if not isinstance(h.get("layers"), list):
        _fail(what, "layers is not a list")
    for i, layer in enumerate(h["layers"]):
        check_layer(i, layer, what)


def tensors_of(h: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(qualified name 'layer.name', entry) for every tensor, in storage order."""
    return [
        (f"{i}.{n}", layer["tensors"][n])
        for i, layer in enumerate(h["layers"])
        for n in sorted(layer["tensors"])
    ]


def entry_nbytes(t: dict[str, Any]) -> int:
    b, hh, n, w = t["shape"]
    return b * hh * n * w * state.DTYPES[t["dtype"]][1]
