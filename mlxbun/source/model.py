"""Where a command's model comes from: a synthetic spec, a local directory, or the registry.

Every command that reads a model calls :func:`model_dir` with its config; ``model.name`` may be a
path, a registry name or an HF repo id in the local cache (resolved by ``mlxbun.registry``), and
``model.synthetic=true`` builds (once, cached) a random checkpoint shaped by the ``synth`` section.

A command that streams tensors (quantize) calls :func:`model_source` instead: with
``model.synthetic=true`` it gets a :class:`mlxbun.synth.values.SyntheticSource` whose tensors are
generated when read, so no weight file is ever written. Both kinds of source are read through
the same few calls (:func:`open_tensors`; :class:`FileTensors` for files)::

    array(name)            one tensor as an mx.array
    rows(name, r0, r1)     rows [r0, r1) of a tensor (big weights are read block by block)
    row_step(name)         rows per natural block (1 for files; a synthetic RNG stream)

and described by :func:`lazy_weights` (shapes for the model skeleton) and :func:`identity`.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlxbun import registry
from mlxbun.errors import InputError
from mlxbun.io.dtypes import NAMES
from mlxbun.io.safetensors import open_model
from mlxbun.synth import write as synth_write


def expand(path: str) -> Path:
    return Path(path).expanduser()


def model_dir(cfg: Any) -> Path:
    """The model directory named by ``cfg.model`` (and ``cfg.synth`` when synthetic)."""
    if cfg.model.synthetic:
        spec = {k: v for k, v in asdict(cfg.synth).items() if k != "out"}
        return synth_write.ensure_synthetic(cache_dir=expand(cfg.paths.cache) / "synth", **spec)
    name = cfg.model.name
    if not name:
        raise InputError(
            "model.name is not set; pass model.name=<dir | registry name | org/repo> or model.synthetic=true"
        )
    return named_dir(name, reg=cfg.registry)


def named_dir(name: str, *, reg: Any, key: str = "model.name") -> Path:
    """A model directory from a path, a registry name or an HF repo id (``reg``: the registry config)."""
    path = expand(name)
    if path.is_dir():
        return path.resolve()
    if path.exists():
        raise InputError(f"{key}={name!r} is a file; pass the model directory that holds it")

    registry.open_db(url=reg.url, path=reg.path)
    return registry.resolve(name, key=key, hub_cache=reg.hub_cache, paths=reg.paths)


def model_source(cfg: Any) -> Any:
    """A model directory (:class:`pathlib.Path`), or a synthetic source that writes no weights."""
    if not cfg.model.synthetic:
        return model_dir(cfg)

    spec = {k: v for k, v in asdict(cfg.synth).items() if k != "out"}
    return synth_write.ensure_synthetic_source(cache_dir=expand(cfg.paths.cache) / "synth", **spec)


# safetensors dtype -> mx dtype name, for tensors read raw into mx buffers (the others, F64
# and FP8, go through ModelDir.array)
PREAD_DTYPES = {c: NAMES[c] for c in ("BF16", "F16", "F32", "I8", "U8", "I16", "U16", "I32", "U32", "I64")}


class FileTensors:
    """The tensors of a model directory, read with the source calls above (see the module doc).

    Example:
        >>> with FileTensors(Path("hf/llama")) as src:
        ...     block = src.rows("model.embed_tokens.weight", 0, 1024)
    """

    def __init__(self, path: Path) -> None:

        self.path = path
        self.model = open_model(path)

    def __enter__(self) -> FileTensors:
        return self

    def __exit__(self, *exc: object) -> None:
        self.model.close()

    def array(self, name: str) -> Any:
        info = self.model.info(name)
        if info.dtype not in PREAD_DTYPES or not info.shape or info.size == 0:
            return self.model.array(name)
        return self.rows(name, 0, info.shape[0])

    def rows(self, name: str, r0: int, r1: int) -> Any:
        """Rows [r0, r1) of a tensor, read with pread straight into an mx buffer: one copy from the
        page cache, no mapped pages to fault in or leave behind."""
        info = self.model.info(name)
        row = info.nbytes // info.shape[0]
        out = mx.zeros(((r1 - r0) * row,), dtype=mx.uint8)
        mx.eval(out)
        view = np.array(out, copy=False)
        fd = os.open(info.file, os.O_RDONLY)
        try:
            done, want, start = 0, view.nbytes, info.start + r0 * row
            while done < want:
                n = os.preadv(fd, [view[done:]], start + done)
                if n <= 0:
                    raise InputError(f"{info.file}: file ends inside tensor {name!r}; the file is truncated")
                done += n
        finally:
            os.close(fd)
        return out.view(getattr(mx, PREAD_DTYPES[info.dtype])).reshape(r1 - r0, *info.shape[1:])

    def row_step(self, name: str) -> int:
        return 1


def source_dir(source: Any) -> Path:
    """The directory with config.json (and tokenizer) of a model directory or synthetic source."""
    if isinstance(source, (str, Path)):
        return Path(source).expanduser().resolve()
    return Path(source.path)


def lazy_weights(source: Any) -> dict[str, Any] | None:
    """name -> unevaluated array for the model skeleton; None for files (mapped by the skeleton)."""
    return None if isinstance(source, (str, Path)) else source.lazy()


def identity(source: Any) -> str:
    """What a conversion's fingerprint records about the tensors: the weight files' names,
    sizes and mtimes (a changed file changes its mtime), or the synthetic spec's hash."""
    if not isinstance(source, (str, Path)):
        return source.identity()
    lines = []
    for f in sorted(source_dir(source).glob("model*.safetensors*")):
        st = f.stat()
        lines.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}\n")
    return "".join(lines)


def open_tensors(source: Any) -> Any:
    """The tensor reader of ``source``, for a ``with``: a synthetic source reads itself."""
    return FileTensors(source_dir(source)) if isinstance(source, (str, Path)) else source
