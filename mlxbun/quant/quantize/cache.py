"""Rounded modules kept on disk: a weight's clip or GPTQ rounding is computed once per setting and
Hessians, then read back by every quantize that asks for it again.

The range search and GPTQ are most of a quantize's time at real sizes, and one ``+recipe=best``
run rounds the same modules at the same settings more than once: the sensitivity's probes write
the model with a plan's quantizers, then quantize writes the final plan, which keeps most of their
settings (and a run at another budget keeps most again). :class:`Rounded` is what
:class:`mlxbun.quant.quantize.convert.Converter` looks in before it rounds::

    <paths.cache>/rounded/<sha256 of the Hessians file, 16 hex>/<key[:2]>/<key>.safetensors
        key = sha256 of (FORMAT, rounding.VERSION, mlx's version, module path, method, bits, group size,
              the weight's dtype, shape and bytes, as quantize rounds it)
        tensors: weight (packed codes), scales, biases; metadata "sha256": of their bytes, and the
        setting ("path", "method", "bits", "group_size": what :meth:`Rounded.kept` lists)

A file is written atomically (temporary name, fsync, rename) and read only when its digest
verifies: one that does not read or verify is a miss, rounded again and replaced. The same inputs
give the same bytes whether rounded here or read back (tests/test_rounded.py).

Example:
    >>> cache = Rounded(Path("~/.cache/mlxbun/rounded").expanduser(), hessians_sha256)
    >>> file = cache.file("model.layers.0.mlp.down_proj", w, bits=4, group_size=64, method="gptq")
    >>> cache.get(file, "model.layers.0.mlp.down_proj")  # None: round it, then cache.put(file, out, path, ...)
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxbun.errors import InputError
from mlxbun.io.atomic import atomic_save
from mlxbun.io.safetensors import read_header
from mlxbun.quant import rounding

FORMAT = 1
NAMES = ("weight", "scales", "biases")
log = logging.getLogger("mlxbun")


def _feed(h: Any, a: Any) -> None:
    """Hash an mlx array's bytes into ``h`` without copying them (bfloat16 as its bit pattern:
    numpy has no bfloat16)."""
    import numpy as np

    if a.dtype == mx.bfloat16:
        a = mx.view(a, mx.uint16)
    h.update(np.ascontiguousarray(np.asarray(a)).data)


def _digest(arrays: tuple[Any, ...]) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(str((a.dtype, a.shape)).encode())
        _feed(h, a)
    return h.hexdigest()


class Rounded:
    """The rounded modules of one Hessians file (``hessians``: its sha256) under ``root``."""

    def __init__(self, root: str | Path, hessians: str) -> None:
        self.dir = Path(root).expanduser() / hessians[:16]
        self.hits = self.misses = 0

    def file(self, path: str, w: Any, *, bits: int, group_size: int, method: str) -> Path:
        """Where module ``path``'s weight ``w`` rounded at this setting is kept (hashed once per
        rounding: :meth:`get` and :meth:`put` take it)."""
        # mlx's version too: the roundings go through its quantize, reductions and matmuls
        head = json.dumps(
            [FORMAT, rounding.VERSION, mx.__version__, path, method, bits, group_size, str(w.dtype), w.shape]
        )
        h = hashlib.sha256(head.encode() + b"\0")
        _feed(h, w)
        key = h.hexdigest()
        return self.dir / key[:2] / f"{key}.safetensors"

    def get(self, file: Path, path: str) -> tuple[Any, ...] | None:
        """(weight, scales, biases) as ``rounding.quantize`` gave them for module ``path``'s input
        kept in ``file``, or None."""
        if not file.is_file():
            self.misses += 1
            return None
        try:
            arrays, meta = mx.load(str(file), return_metadata=True)
            out = tuple(arrays[n] for n in NAMES)
            if meta.get("sha256") != _digest(out):
                raise ValueError("its digest does not match its tensors")
        except Exception as e:  # any unreadable file is a miss: rounded again and replaced
            log.warning("quantize: rounded module %s is unusable (%s); rounding %s again", file, e, path)
            self.misses += 1
            return None
        self.hits += 1
        return out

    def kept(self) -> set[tuple[str, str, int, int]]:
        """The (module path, method, bits, group size) of every rounding kept here, from the files'
        headers (no tensor is read): quantize's progress weighs the modules still to round, not
        those it will read back in a moment (one with the same setting but other weight bytes
        reads as kept here and is rounded all the same)."""
        found = set()
        for file in self.dir.glob("*/*.safetensors"):
            try:
                meta = read_header(file).get("__metadata__", {})
                found.add((meta["path"], meta["method"], int(meta["bits"]), int(meta["group_size"])))
            except (OSError, InputError, KeyError, ValueError, AttributeError):
                continue  # an older file (no setting recorded) or an unreadable one: rounded again
        return found

    def put(
        self, file: Path, out: tuple[Any, ...], path: str, *, method: str, bits: int, group_size: int
    ) -> None:
        """Keep module ``path``'s ``out`` (weight, scales, biases) in ``file`` with its setting;
        written atomically (a write that fails, e.g. a full disk, is
        logged with the path and skipped)."""
        arrays = dict(zip(NAMES, out, strict=True))
        setting = {"method": method, "bits": str(bits), "group_size": str(group_size)}
        meta = {"sha256": _digest(out), "path": path} | setting
        try:
            file.parent.mkdir(parents=True, exist_ok=True)
            atomic_save(file, lambda name: mx.save_safetensors(name, arrays, metadata=meta))
        except (OSError, RuntimeError) as e:  # (mlx's save raises RuntimeError) costs time, not the model
            log.warning("quantize: cannot keep the rounded %s in %s (%s)", path, file.parent, e)
