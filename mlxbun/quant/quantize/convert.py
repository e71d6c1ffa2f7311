"""A quantize unit's tensors: read, cast to the output dtype and quantized (``Converter``).

A unit (``mlxbun.quant.quantize.stream``) is one module's tensors, or one unquantized tensor. The
converter reads them from the source, applies mlx-lm's dtype rule (:func:`resolve_dtype`),
quantizes a module by its plan entry (``mx.quantize``, or a rounding method of
``mlxbun.quant.rounding`` with its Hessians), and tells the writer every output tensor's name,
dtype and shape in advance (:meth:`Converter.planned`). Plain Linear/Embedding weights over
``BIG_TENSOR`` bytes are read and quantized in row blocks of ``CHUNK_BYTES``. Thread-safe: each
thread converts one unit at a time.

Example:
    >>> convert = Converter(sk, tensors, "bfloat16")
    >>> names = convert.planned(units)  # [(tensor name, safetensors dtype, shape), ...]
    >>> tensors = convert(units[0])  # [(tensor name, array), ...]
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from mlxbun.io.dtypes import CODES as ST_CODES
from mlxbun.io.dtypes import OUTPUT_DTYPES as CONVERSION_DTYPES
from mlxbun.quant import hessian, rounding, workers
from mlxbun.quant.quantize.stream import Unit
from mlxbun.quant.skeleton import Skeleton

# Plain Linear/Embedding weights larger than this are read and quantized in row blocks of
# CHUNK_BYTES (quantization groups never cross a row, so the bytes are the same).
BIG_TENSOR = 128 << 20
CHUNK_BYTES = 32 << 20


def piece_rows(rows: int, cols: int, itemsize: int, natural: int = 1) -> int | None:
    """Rows per block a (rows, cols) weight of ``itemsize``-byte source values is quantized in
    (None: whole, up to :data:`BIG_TENSOR` bytes): about :data:`CHUNK_BYTES` of float32, a multiple
    of ``natural``. The probes round a big weight in the same blocks, so a clip or GPTQ rounding
    kept by one (:class:`mlxbun.quant.quantize.cache.Rounded`, keyed by the block's bytes) is read
    back by the other."""
    if rows * cols * itemsize <= BIG_TENSOR:
        return None
    step = max(1, CHUNK_BYTES // max(1, cols * 4))
    return max(natural, step - step % natural)


_build_lock = threading.Lock()  # to_quantized draws from MLX's global PRNG: build graphs one at a time


def resolve_dtype(dtype: str | None, config: dict[str, Any]) -> str | None:
    """mlx-lm's dtype rule: the given one, else config ``torch_dtype``, else text_config ``dtype``."""
    if dtype is None:
        dtype = config.get("torch_dtype")
    if dtype is None and (text := config.get("text_config")):
        dtype = text.get("dtype")
    if dtype is not None and dtype not in CONVERSION_DTYPES:
        return None  # mlx-lm leaves the weights' own dtype for anything else
    return dtype


class Converter:
    """Reads, casts and quantizes units; safe to call from several threads (one unit each)."""

    def __init__(
        self,
        sk: Skeleton,
        tensors: Any,
        dtype: str | None,
        method: str = "rtn",
        hessians: Mapping | None = None,
        fold: Any = None,
        *,
        hessians_file: Path | None = None,
        rounded: Any = None,
    ) -> None:
        """``tensors``: the source's tensor reader (``mlxbun.source.model``); ``fold``: an
        :class:`mlxbun.quant.awq.Fold` applied to every tensor as it is read; ``hessians_file``:
        where ``hessians`` came from, to name in errors; ``rounded``: a
        :class:`mlxbun.quant.quantize.cache.Rounded` of those Hessians, where clip and GPTQ roundings
        are looked up before and kept after (not with a fold: its Hessians are not the file's).
        ``pool``, when set: worker processes the clip and GPTQ roundings run on
        (:mod:`mlxbun.quant.workers`)."""
        self.sk, self.src, self.method, self.hessians = sk, tensors, method, hessians or {}
        self.pool: Any = None
        self.hessians_file = hessians_file
        self.rounded = rounded if fold is None else None
        self.fold = fold
        self.dtype = getattr(mx, dtype) if dtype else None
        self.cast_ok = getattr(sk.model, "cast_predicate", lambda _: True)

    def read(self, name: str) -> Any:
        lazy = self.sk.weights.pop(name)
        src = self.sk.sources.get(name)
        if src is not None:
            return self.folded(name, self.src.array(src))
        mx.eval(lazy)  # already evaluated by prefetch, on the thread that built it
        return self.folded(name, lazy)

    def folded(self, name: str, a: Any, row0: int = 0) -> Any:
        return a if self.fold is None else self.fold.apply(name, a, row0=row0)

    def prefetch(self, unit: Unit) -> None:
        """Evaluate tensors sanitize built from others (e.g. stacked experts) on this thread:
        MLX streams are per thread, so a graph built here cannot be evaluated by a worker."""
        built = [self.sk.weights[n] for n in unit.inputs if n not in self.sk.sources]
        if built:
            mx.eval(built)

    def cast(self, name: str, a: Any) -> Any:
        dtype = self.stored_dtype(name, a.dtype)
        return a if dtype == a.dtype else a.astype(dtype)

    def stored_dtype(self, name: str, dtype: Any) -> Any:
        """The dtype tensor ``name`` of ``dtype`` is cast to: the output dtype if it is floating
        point and the model's ``cast_predicate`` allows it."""
        if self.dtype is not None and self.cast_ok(name) and mx.issubdtype(dtype, mx.floating):
            return self.dtype
        return dtype

    def planned(self, units: list[Unit]) -> list[tuple[str, str, tuple[int, ...]]]:
        """What converting ``units`` yields, in order, as (name, safetensors dtype, shape), from
        the quantized skeleton's shapes and the source's dtypes: the writer is told it in advance.

        A quantized module's scales and biases take the dtype its weight is cast to; its packed
        weight (and uint8 scales) keep the skeleton's."""
        shapes = dict(tree_flatten(self.sk.model.parameters()))
        out = []
        for unit in units:
            for name in unit.outputs:
                leaf = name.rpartition(".")[2]
                dtype = shapes[name].dtype
                if unit.quant is None or leaf not in ("weight", "scales", "biases"):
                    dtype = self.stored_dtype(name, self.sk.weights[name].dtype)
                elif mx.issubdtype(dtype, mx.floating):
                    weight = f"{unit.path}.weight"
                    dtype = self.stored_dtype(weight, self.sk.weights[weight].dtype)
                out.append((name, ST_CODES[str(dtype).rpartition(".")[2]], tuple(shapes[name].shape)))
        return out

    def chunkable(self, unit: Unit) -> bool:
        """A plain Linear/Embedding whose weight is big and stored as is in the source."""
        if unit.quant is None or type(self.sk.originals.get(unit.path)) not in (nn.Linear, nn.Embedding):
            return False
        name = f"{unit.path}.weight"
        return name in self.sk.sources and self.step(name) is not None

    def step(self, name: str) -> int | None:
        """Rows per block of a big weight (:func:`piece_rows`; a multiple of the source's natural
        block: a synthetic tensor's RNG stream); None: whole."""
        w = self.sk.weights[name]
        natural = self.src.row_step(self.sk.sources[name])
        return piece_rows(w.shape[0], w.shape[-1], w.nbytes // max(w.size, 1), natural)

    def quantize_rows(self, unit: Unit) -> dict[str, Any]:
        """mx.quantize of a big weight, block of rows by block of rows.

        The packed weight (the bulk) is assembled in one preallocated uint32 numpy array, so
        memory holds the output once, not parts plus their concatenation.
        """
        name, q = f"{unit.path}.weight", unit.quant
        step, src = self.step(name), self.sk.sources[name]
        rows, width = self.sk.weights.pop(name).shape
        packed: Any = None
        small: list[list[Any]] = []
        factor: dict[str, Any] = {}  # GPTQ's factor of the module's H: once for all its blocks
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            chunk = self.cast(name, self.folded(name, self.src.rows(src, r0, r1), r0))
            w, *rest = self.quantize_weight(chunk, q, unit.path, factor)
            mx.eval(w, *rest)
            if packed is None:
                packed = np.empty((rows, w.shape[1]), dtype=np.uint32)
            packed[r0:r1] = np.asarray(w)
            small.append(rest)
        keys = ("scales", "biases")[: len(small[0])]
        result = {f"{unit.path}.{k}": mx.concatenate([p[i] for p in small]) for i, k in enumerate(keys)}
        result[name] = packed
        for n in unit.inputs:
            if n != name:
                result[n] = self.cast(n, self.read(n))
        self.sk.originals.pop(unit.path)
        return result

    def __call__(self, unit: Unit) -> list[tuple[str, Any]]:
        if self.chunkable(unit):
            return self.finish(unit, self.quantize_rows(unit))
        arrays = {n: self.cast(n, self.read(n)) for n in unit.inputs}
        if unit.quant is None:
            out = arrays
        else:
            prefix = unit.path + "."
            module = self.sk.originals.pop(unit.path)
            with _build_lock:
                module.update(tree_unflatten([(n[len(prefix) :], a) for n, a in arrays.items()]))
                qm = module.to_quantized(**unit.quant)
            if self.varies(unit.quant, unit.path) and (w := arrays.get(prefix + "weight")) is not None:
                qm.weight, qm.scales, qm.biases = self.quantize_weight(w, unit.quant, unit.path)
            out = {prefix + k: v for k, v in tree_flatten(qm.parameters())}
            del module, qm
        del arrays
        return self.finish(unit, out)

    def method_of(self, path: str) -> str:
        """The module's rounding method: its plan entry's, else the run's ``quant.method``."""
        return self.sk.methods.get(path, self.method)

    def varies(self, q: dict[str, Any], path: str) -> bool:
        return self.method_of(path) != "rtn" and q.get("mode", "affine") == "affine"

    def quantize_weight(
        self, w: Any, q: dict[str, Any], path: str, factor: dict[str, Any] | None = None
    ) -> tuple[Any, ...]:
        """The hook where a quantizer variant (``mlxbun.quant.rounding``) replaces mx.quantize.
        ``factor``: GPTQ's factor of the module's H, kept there by the first block of its rows
        that needs it (a worker process factors its own)."""
        if not self.varies(q, path):
            return tuple(mx.quantize(w, q["group_size"], q["bits"], mode=q.get("mode", "affine")))
        setting = {"bits": q["bits"], "group_size": q["group_size"], "method": self.method_of(path)}
        file = None if self.rounded is None else self.rounded.file(path, w, **setting)
        if file is not None and (kept := self.rounded.get(file, path)) is not None:
            return kept
        try:
            if self.pool is None:
                h = self.hessians.get(path)
                if factor is not None and h is not None and setting["method"] == "gptq" and "f" not in factor:
                    factor["f"] = rounding.gptq_factor(h)
                f = None if factor is None else factor.get("f")
                out = rounding.quantize(w, hessian=h, factor=f, **setting)
            else:
                out = workers.quantize(
                    self.pool, w, hessian=workers.hessian_for(self.hessians, path), **setting
                )
        except rounding.NotPositiveDefinite as e:
            raise hessian.refused(self.hessians_file, path, str(e)) from None
        if file is not None:
            mx.eval(*out)
            rounding.check_finite(path, dict(zip((f"{path}.scales", f"{path}.biases"), out[1:], strict=True)))
            self.rounded.put(file, out, path, **setting)
        return out

    def finish(self, unit: Unit, out: dict[str, Any]) -> list[tuple[str, Any]]:
        mx.eval([v for v in out.values() if isinstance(v, mx.array)])
        if set(out) != set(unit.outputs):
            raise RuntimeError(f"{unit.path}: produced {sorted(out)}, expected {sorted(unit.outputs)}")
        if unit.quant is not None:
            rounding.check_finite(unit.path, out)
        return [(n, out[n]) for n in unit.outputs]
