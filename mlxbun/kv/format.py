"""The mlxbun header (all layouts and versions), block manifests (``.kvm``) and the older
single-file snapshots (``.kvs``, still read); its validation.

Snapshots written now (format 3, ``.safetensors``) are mlx-lm prompt-cache files that carry this
header in their metadata: see :mod:`mlxbun.kv.promptcache`. A ``.kvs`` of format version 2 is a
safetensors file with ``__pad__`` tensors between the K/V tensors (which mlx-lm's loader
rejects)::

    0    8  N                 u64 LE, the safetensors header length; 8 + N is a multiple of 16 KiB
    8    N  safetensors JSON, space-padded:
              {"__metadata__":{"mlxbun.kvs":"2","header_sha256":"<64 hex>","header":"<mlxbun header>"},
               "<layer>.<name>":{"dtype":"F16","shape":[B,H,T,W],"data_offsets":[a,b]}, ...,
               "__pad__.<k>":{"dtype":"U8","shape":[gap],"data_offsets":[..]}, ...}
    8+N     tensor data (data_start, on a 16 KiB boundary); each tensor starts SKEW (64) bytes
            past a 16 KiB boundary; the gaps are listed as ``__pad__`` entries so that the data
            is contiguous, as safetensors requires

The magic is the fixed text ``{"__metadata__":{"mlxbun.kvs":"`` at offset 8, followed by the
format version. ``header_sha256`` sits at a fixed offset (:data:`KVS_HASH_AT`); it is the sha256
of bytes ``0 .. 8+N`` with those 64 digits read as ``0``, so it covers the length, the whole
table and the padding. The tensor table is derived from the mlxbun header: a reader re-encodes
it and requires the same bytes, so the table that ``mx.load`` follows is the one the hash and
the validation covered.

Block manifests and snapshots written before version 2 use this framing (still read)::

    0    8  magic            b"\\x89MLXBKV\\n"
    8    4  format version   u32 (1)
    12   4  reserved         u32, zero
    16   8  header length N  u64 (at most 64 MiB)
    24  32  header sha256    of the N header bytes
    56   N  header           canonical JSON, UTF-8 (sorted keys)
    ..      zero padding to data_start, the next multiple of 16 KiB      (.kvs only)
    data_start ..            tensor data, each tensor at a 16 KiB-aligned offset  (.kvs only)

The header (every layout and version; format 3 adds "model_name" and "tokenizer_config", and
stores RotatingKVCache rings as they lie in memory, ``meta.ring``)::

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
digits), several times faster to check than BLAKE3. Older snapshots with BLAKE3 tensor hashes
still load; the header's "hash" says which one a file uses.

:func:`check_header` validates every field (class allow-list, dtypes, shapes against the meta,
offsets, sizes) before anything is allocated, so a lying header is refused, not trusted.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from typing import Any

import blake3
import numpy as np
import xxhash

from mlxbun.errors import DriftError, InputError
from mlxbun.io.dtypes import CODES
from mlxbun.kv import state

MAGIC = b"\x89MLXBKV\n"
VERSION = 1
PREFIX = struct.Struct("<8sIIQ32s")
ALIGN = 16 << 10
# Version-2 tensors start SKEW bytes past a 16 KiB boundary. mlx's CPU allocator returns buffers
# 24 bytes past a page boundary, and copying a page-aligned source into them is slower on x86
# (the kernel's copy hits 4K aliasing). Any offset that is not just below the destination's is fast.
SKEW = 64
TENSOR_ALIGN = 64  # what readers require of a tensor offset (version 1 wrote 16 KiB multiples)
MAX_HEADER = 64 << 20
MAX_TENSOR_BYTES = 1 << 40
HEX64 = re.compile(r"[0-9a-f]{64}")
LAYOUTS = ("snapshot", "blocks")
HASH = "blake3"  # block names (.kvm)
CHECK = "xxh3_128"  # tensor hashes of .kvs files written now
TENSOR_HASHES = {"blake3": 64, "xxh3_128": 32}  # .kvs "hash" -> hex digits per tensor hash

KVS_VERSION = 2  # .kvs files written now: a safetensors container
KVS_MAGIC = b'{"__metadata__":{"mlxbun.kvs":"'  # at offset 8
_KVS_LEAD = KVS_MAGIC + str(KVS_VERSION).encode() + b'","header_sha256":"'
KVS_HASH_AT = 8 + len(_KVS_LEAD)  # the 64 hex digits of header_sha256
ST_DTYPES = {n: CODES[n] for n in state.DTYPES}


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
        header, size, _ = read_header_fd(f.fileno(), what=what)
    return header, size


def read_header_fd(fd: int, *, what: str) -> tuple[dict[str, Any], int, int]:
    """Header of the .kvs/.kvm file open as ``fd`` (either framing), the file size and the format
    version (1: the framed header; 2: a safetensors .kvs)."""
    size = os.fstat(fd).st_size
    lead = os.pread(fd, PREFIX.size, 0)  # longer than 8 + len(KVS_MAGIC)
    if lead[:8] == MAGIC or lead[8 : 8 + len(KVS_MAGIC)] != KVS_MAGIC:
        header = decode(lead, lambda n: os.pread(fd, n, PREFIX.size), what=what, file_size=size)
        return header, size, VERSION
    return decode_kvs(fd, size, what=what), size, KVS_VERSION


def kvs_table(header: dict[str, Any]) -> bytes:
    """The safetensors JSON of a version-2 .kvs (``header_sha256`` as zeros), unpadded."""
    meta = {"mlxbun.kvs": str(KVS_VERSION), "header_sha256": "0" * 64}
    meta["header"] = json.dumps(header, sort_keys=True, separators=(",", ":"))
    table: dict[str, Any] = {"__metadata__": meta}
    pos = pads = 0
    for name, t in sorted(tensors_of(header), key=lambda e: e[1]["offset"]):
        if t["offset"] > pos:
            table[f"__pad__.{pads}"] = {
                "dtype": "U8",
                "shape": [t["offset"] - pos],
                "data_offsets": [pos, t["offset"]],
            }
            pads += 1
        pos = t["offset"] + t["nbytes"]
        table[name] = {
            "dtype": ST_DTYPES[t["dtype"]],
            "shape": t["shape"],
            "data_offsets": [t["offset"], pos],
        }
    return json.dumps(table, separators=(",", ":")).encode()


def encode_kvs(header: dict[str, Any]) -> bytes:
    """The first ``data_start`` bytes of a version-2 .kvs: length, table, padding, with its hash."""
    body = kvs_table(header)
    n = header["data_start"] - 8
    if len(body) > n:
        raise ValueError(
            f"snapshot table of {len(body)} bytes does not fit before data_start={header['data_start']}"
        )
    raw = struct.pack("<Q", n) + body + b" " * (n - len(body))
    return raw[:KVS_HASH_AT] + hashlib.sha256(raw).hexdigest().encode() + raw[KVS_HASH_AT + 64 :]


def decode_kvs(fd: int, size: int, *, what: str) -> dict[str, Any]:
    """Parse and hash-check the header of a version-2 .kvs open as ``fd`` (its magic matched)."""
    (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    end = 8 + len(KVS_MAGIC)
    version = os.pread(fd, 12, end).split(b'"', 1)[0]
    if version != str(KVS_VERSION).encode():
        raise UnsupportedError(
            f"{what}: format version {version.decode(errors='replace')} is not supported; "
            f"this mlxbun reads .kvs versions 1 and {KVS_VERSION}"
        )
    if n > MAX_HEADER:
        raise CorruptError(f"{what}: header length {n} exceeds {MAX_HEADER}")
    if 8 + n > size:
        raise CorruptError(f"{what}: truncated header ({size} of {8 + n} header bytes)")
    raw = os.pread(fd, 8 + n, 0)
    want = raw[KVS_HASH_AT : KVS_HASH_AT + 64]
    if (
        len(raw) != 8 + n
        or hashlib.sha256(raw[:KVS_HASH_AT] + b"0" * 64 + raw[KVS_HASH_AT + 64 :]).hexdigest().encode()
        != want
    ):
        raise CorruptError(f"{what}: header hash mismatch (torn or modified header)")
    try:
        header = json.loads(json.loads(raw[8:])["__metadata__"]["header"])
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptError(f"{what}: header is not the expected JSON ({e})") from None
    if not isinstance(header, dict):
        raise CorruptError(f"{what}: header is not a JSON object")
    if header.get("data_start") != 8 + n:
        raise CorruptError(f"{what}: data_start={header.get('data_start')!r} but the table ends at {8 + n}")
    return header


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
    if cls == "RotatingKVCache" and not meta.get("empty") and meta.get("ring", False) is not False:
        n = _int(meta.get("tokens"), what, "meta.tokens")
        if meta["ring"] is not True or not meta["idx"] <= n <= meta["offset"]:
            _fail(what, f"ring meta idx={meta['idx']} tokens={n} offset={meta['offset']} is not a ring state")
    elif cls == "RotatingKVCache" and not meta.get("empty"):
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
