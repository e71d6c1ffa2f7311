"""Turn mlx-lm prompt caches into plain tensors + JSON meta and back, for the allow-listed classes.

Only valid tokens are kept: a ``KVCache`` buffer padded in 256-token steps is trimmed to its
``offset``; a wrapped ``RotatingKVCache`` ring is stored in temporal order and re-rotated on
restore so that later steps compute bit-identically (snapshots written before format 3); since
format 3 the ring is stored as it lies in memory (``meta.ring``), which is what mlx-lm's own
``RotatingKVCache.state`` holds, so stock loaders rebuild the same cache. Each layer becomes a :class:`LayerState`
(class name, meta, named tensors); tensors are numpy views of (evaluated) mlx buffers, cut into
rows ``(batch, head)`` of shape ``(tokens, width)`` so that a row is contiguous in memory.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as C

from mlxbun.errors import InputError
from mlxbun.io.dtypes import CODES, ITEMSIZE
from mlxbun.io.safetensors import NP_DTYPES

CLASSES = ("KVCache", "RotatingKVCache", "QuantizedKVCache", "CacheList")
LEAF_CLASSES = CLASSES[:3]
# mlx dtype name -> (numpy dtype used to move the bytes, itemsize), for the dtypes a cache holds
DTYPES: dict[str, tuple[Any, int]] = {
    n: (NP_DTYPES[CODES[n]], ITEMSIZE[CODES[n]]) for n in ("float16", "bfloat16", "float32", "uint32")
}
QUANT_PARTS = ("weight", "scales", "biases")


@dataclass
class Tensor:
    """One 4-D cache tensor ``(B, H, T, W)``: only the first ``T`` tokens of ``buf`` are valid.

    ``buf`` is a C-contiguous numpy view of the full mlx buffer (which ``ref`` keeps alive),
    so ``buf[b, h, :T]`` is a contiguous row without copying.
    """

    dtype: str
    shape: tuple[int, int, int, int]
    buf: np.ndarray
    ref: Any = None

    @property
    def rows(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def row_token_bytes(self) -> int:
        return self.shape[3] * DTYPES[self.dtype][1]

    @property
    def nbytes(self) -> int:
        return self.rows * self.shape[2] * self.row_token_bytes

    def row(self, r: int, start: int = 0, stop: int | None = None) -> memoryview:
        b, h = divmod(r, self.shape[1])
        stop = self.shape[2] if stop is None else min(stop, self.shape[2])
        if stop <= start:
            return memoryview(b"")
        return memoryview(self.buf[b, h, start:stop]).cast("B")


@dataclass
class LayerState:
    cls: str
    meta: dict[str, Any]
    tensors: dict[str, Tensor]


def _dtype_name(a: mx.array) -> str:
    name = str(a.dtype).removeprefix("mlx.core.")
    if name not in DTYPES:
        raise InputError(f"cache dtype {name!r} is not supported; choose one of {', '.join(DTYPES)}")
    return name


def tensor_of(a: mx.array, tokens: int) -> Tensor:
    """Wrap the first ``tokens`` tokens (axis 2) of an mlx buffer without copying."""
    name = _dtype_name(a)
    if a.ndim != 4 or a.shape[2] < tokens:
        raise InputError(f"cache tensor shape {tuple(a.shape)} cannot hold {tokens} tokens on axis 2")
    src = a.view(mx.uint16) if name == "bfloat16" else a
    mx.eval(src)
    buf = np.array(src, copy=False)
    if not buf.flags["C_CONTIGUOUS"]:
        buf = np.ascontiguousarray(buf)
    b, h, _, w = a.shape
    return Tensor(dtype=name, shape=(b, h, tokens, w), buf=buf, ref=src)


def _kv_tensors(keys: Any, values: Any, tokens: int, quantized: bool) -> dict[str, Tensor]:
    if not quantized:
        return {"keys": tensor_of(keys, tokens), "values": tensor_of(values, tokens)}
    out = {}
    for kind, parts in (("keys", keys), ("values", values)):
        for part, arr in zip(QUANT_PARTS, parts, strict=True):
            out[f"{kind}.{part}"] = tensor_of(arr, tokens)
    return out


def layer_state(c: Any, where: str) -> LayerState:
    """Describe one cache object; refuse classes outside the allow-list."""
    cls = type(c).__name__
    if cls not in CLASSES or type(c).__module__ != "mlx_lm.models.cache":
        raise InputError(
            f"cache class {cls!r} at {where} is not supported; choose one of {', '.join(CLASSES)}"
        )
    if cls == "CacheList":
        subs = [layer_state(s, f"{where}.{i}") for i, s in enumerate(c.caches)]
        if any(s.cls == "CacheList" for s in subs):
            raise InputError(f"nested CacheList at {where} is not supported")
        meta = {"caches": [{"class": s.cls, "meta": s.meta} for s in subs]}
        tensors = {f"{i}.{k}": t for i, s in enumerate(subs) for k, t in s.tensors.items()}
        return LayerState(cls, meta, tensors)
    if c.keys is None:
        return LayerState(cls, _meta(c, cls) | {"empty": True}, {})
    if cls == "RotatingKVCache":  # the ring as it lies: slots past min(offset, buffer) are unused
        n = min(int(c.offset), int(c.keys.shape[2]))
        return LayerState(
            cls, _meta(c, cls) | {"tokens": n, "ring": True}, _kv_tensors(c.keys, c.values, n, False)
        )
    quantized = cls == "QuantizedKVCache"
    return LayerState(cls, _meta(c, cls), _kv_tensors(c.keys, c.values, c.offset, quantized))


def _meta(c: Any, cls: str) -> dict[str, Any]:
    if cls == "KVCache":
        return {"offset": int(c.offset)}
    if cls == "QuantizedKVCache":
        return {"offset": int(c.offset), "group_size": int(c.group_size), "bits": int(c.bits)}
    return {"offset": int(c.offset), "keep": int(c.keep), "max_size": int(c.max_size), "idx": int(c._idx)}


def cache_state(cache: list[Any]) -> list[LayerState]:
    """All layers of a prompt cache (a list of mlx-lm cache objects)."""
    return [layer_state(c, f"layer {i}") for i, c in enumerate(cache)]


# ---------------------------------------------------------------- restore


STORAGE = {n: getattr(mx, move.name) for n, (move, _) in DTYPES.items()}  # bfloat16 moves as uint16
MX_DTYPES = {n: getattr(mx, n) for n in DTYPES}


_STREAMS = threading.local()


def _streams(n: int) -> list[Any]:
    """``n`` CPU streams of this thread (mlx streams are per thread), each run by its own worker,
    so allocations on different streams run in parallel. Created once per thread; a stream and
    its worker live as long as the process, so a pool of T restoring threads keeps T*n of them."""
    have = getattr(_STREAMS, "list", None)
    if have is None:
        have = _STREAMS.list = []
    while len(have) < n:
        have.append(mx.new_stream(mx.cpu))
    return have[:n]


def cpu_stream() -> Any:
    """This thread's own CPU stream (the first of :func:`_streams`)."""
    return _streams(1)[0]


Buffer = tuple[mx.array | None, np.ndarray]


def alloc(specs: dict[str, tuple[str, list[int]]], *, streams: int = 1) -> dict[str, Buffer]:
    """New evaluated mlx arrays and writable flat uint8 numpy views of their memory, by name.

    Restores read straight into mlx-owned memory (numpy views of mlx arrays share their buffer,
    as the mlx docs describe), which saves a full copy of the cache. mlx has no uninitialised
    allocation (``mx.empty`` is ``mx.zeros``; ``from_dlpack`` refuses zero-copy CPU imports), so
    the arrays are zero-filled; on a fresh process that fill is mostly page faults, which this
    spreads over ``streams`` CPU streams (largest arrays first, each to the least-loaded stream).
    """
    pool = _streams(max(1, streams))
    load = [0] * len(pool)
    arrays: dict[str, mx.array] = {}
    for name, (dtype, shape) in sorted(specs.items(), key=lambda kv: -_nbytes(*kv[1])):
        i = load.index(min(load))
        load[i] += _nbytes(dtype, shape)
        arrays[name] = mx.zeros(shape, dtype=STORAGE[dtype], stream=pool[i])
    mx.eval(list(arrays.values()))
    out: dict[str, Buffer] = {}
    for name, (dtype, shape) in specs.items():
        a = arrays[name]
        view = np.array(a, copy=False)
        if not (view.flags["C_CONTIGUOUS"] and view.flags["WRITEABLE"]):
            # not seen with mlx 0.32; read into numpy and let finish() copy
            out[name] = (None, np.empty(_nbytes(dtype, shape), np.uint8))
        else:
            out[name] = (a, view.reshape(-1).view(np.uint8))
    return out


def _nbytes(dtype: str, shape: list[int]) -> int:
    return int(np.prod(shape)) * DTYPES[dtype][1]


def finish(dtype: str, a: mx.array | None, flat: np.ndarray, shape: list[int]) -> mx.array:
    """The restored array (reinterpreted as bfloat16 when needed)."""
    if a is None:
        a = mx.array(flat.view(DTYPES[dtype][0]).reshape(shape))
    return a.view(mx.bfloat16) if dtype == "bfloat16" else a


def settle(arrays: dict[str, mx.array]) -> None:
    """Evaluate restored arrays before they leave this thread: their pending views and casts are
    bound to this thread's streams, which another thread cannot evaluate."""
    mx.eval(list(arrays.values()))


def _unrotate(t: mx.array, keep: int, idx: int) -> mx.array:
    """Inverse of RotatingKVCache._temporal_order for a wrapped ring of length L."""
    n = t.shape[2]
    if n == idx:
        return t
    tail = n - idx
    return mx.concatenate([t[..., :keep, :], t[..., keep + tail :, :], t[..., keep : keep + tail, :]], axis=2)


def build_layer(cls: str, meta: dict[str, Any], arrays: dict[str, mx.array]) -> Any:
    """An mlx-lm cache object from meta and restored arrays (already validated)."""
    if cls == "CacheList":
        subs = []
        for i, sub in enumerate(meta["caches"]):
            prefix = f"{i}."
            mine = {k[len(prefix) :]: v for k, v in arrays.items() if k.startswith(prefix)}
            subs.append(build_layer(sub["class"], sub["meta"], mine))
        return C.CacheList(*subs)
    if cls == "KVCache":
        c = C.KVCache()
    elif cls == "QuantizedKVCache":
        c = C.QuantizedKVCache(group_size=meta["group_size"], bits=meta["bits"])
    else:
        c = C.RotatingKVCache(max_size=meta["max_size"], keep=meta["keep"])
    c.offset = meta["offset"]
    if meta.get("empty"):
        return c
    if cls == "QuantizedKVCache":
        c.keys = tuple(arrays[f"keys.{p}"] for p in QUANT_PARTS)
        c.values = tuple(arrays[f"values.{p}"] for p in QUANT_PARTS)
    elif cls == "KVCache":
        c.keys, c.values = arrays["keys"], arrays["values"]
    elif meta.get("ring"):
        c.keys, c.values = arrays["keys"], arrays["values"]
        c._idx = meta["idx"]
    else:  # temporal order (written before format 3)
        c.keys = _unrotate(arrays["keys"], meta["keep"], meta["idx"])
        c.values = _unrotate(arrays["values"], meta["keep"], meta["idx"])
        mx.eval(c.keys, c.values)  # not left lazy on this thread's stream (see settle)
        c._idx = meta["idx"]
    return c


def expected_tensors(cls: str, meta: dict[str, Any]) -> list[str]:
    """Tensor names a layer of this class and meta must carry (for header validation)."""
    if cls == "CacheList":
        return [
            f"{i}.{n}" for i, s in enumerate(meta["caches"]) for n in expected_tensors(s["class"], s["meta"])
        ]
    if meta.get("empty"):
        return []
    if cls == "QuantizedKVCache":
        return [f"{k}.{p}" for k in ("keys", "values") for p in QUANT_PARTS]
    return ["keys", "values"]


def valid_tokens(cls: str, meta: dict[str, Any]) -> int | None:
    """Token count every tensor of a leaf layer must have (None: checked elsewhere)."""
    if cls in ("KVCache", "QuantizedKVCache"):
        return meta["offset"]
    if cls == "RotatingKVCache":
        return meta.get("tokens")
    return None
