"""Validating mmap reader for safetensors files and model directories (one tensor at a time).

A safetensors file::

    offset 0        8                      8 + N                                   EOF
           ┌────────┬──────────────────────┬──────────────────────────────────────┐
           │ u64 LE │ header: N bytes of   │ data section: raw little-endian      │
           │   N    │ UTF-8 JSON object    │ tensor bytes, row-major              │
           └────────┴──────────────────────┴──────────────────────────────────────┘
    header = {"__metadata__": {"format": "mlx", ...},            optional, string -> string
              "<name>": {"dtype": "BF16", "shape": [o, i],
                         "data_offsets": [begin, end]}, ...}     relative to the data section

The header may be padded with trailing spaces (writers pad it to a multiple of 8 bytes so that
the data section is aligned). A model directory is one of::

    <dir>/model.safetensors.index.json   {"metadata": {...}, "weight_map": {name: shard file}}
    <dir>/model-00001-of-0000N.safetensors ...   the shards it names
    <dir>/model.safetensors              (a single file, no index)
    <dir>/weights.safetensors            (mlx-whisper)
    <dir>/config.json                    optional; parsed into ModelDir.config

Every check happens when a file is opened (the header is read with ``read``; tensor bytes are
never touched), and every failure is an :class:`~mlxbun.errors.InputError` naming the file and
the tensor. Tensor bytes come from a read-only mmap: ``numpy(name)`` is a zero-copy view and
``array(name)`` copies just that tensor into MLX memory and drops its pages from the mapping, so
streaming a model tensor by tensor peaks at about the largest tensor.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import stat
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlxbun.errors import EnvironmentFailure, InputError
from mlxbun.io.dtypes import ITEMSIZE
from mlxbun.io.parameters import count_parameters, quantization_block

HEADER_CAP = 100 << 20  # bytes; real headers are < 10 MiB even for 100k-tensor checkpoints
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILES = ("model.safetensors", "weights.safetensors")

# safetensors dtype -> numpy dtype used to view the bytes (BF16 and FP8 have no numpy type).
NP_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype("<u1"),
    "I8": np.dtype("<i1"),
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "C64": np.dtype("<c8"),
    "F8_E4M3": np.dtype("<u1"),
    "F8_E5M2": np.dtype("<u1"),
}


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: ``start``/``end`` are absolute byte offsets in ``file``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int
    file: Path

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def _bad(path: Path, what: str) -> InputError:
    return InputError(f"{path}: {what}; not a valid safetensors file")


def _read_header(path: Path, f: Any, file_size: int) -> tuple[dict[str, Any], int]:
    """Return (parsed header object, byte offset of the data section)."""
    if file_size < 8:
        raise _bad(path, f"file is {file_size} bytes, shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", f.read(8))
    if n > HEADER_CAP:
        raise _bad(path, f"header length {n} exceeds the {HEADER_CAP}-byte cap")
    if 8 + n > file_size:
        raise _bad(path, f"header length {n} runs past the end of the {file_size}-byte file")
    raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise _bad(path, f"header is not valid UTF-8 JSON ({type(e).__name__}: {str(e)[:80]})") from None
    if not isinstance(header, dict):
        raise _bad(path, f"header is a JSON {type(header).__name__}, not an object")
    return header, 8 + n


def read_header(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON header of one safetensors file, framed and parsed as at open; no tensor byte is read.

    The one header reader for callers that want names, dtypes and shapes only (the registry's
    scan). Raises OSError when ``path`` is not a regular file (a FIFO or device is never
    opened) and InputError for a header that is not a safetensors header.

    Example:
        >>> read_header("model.safetensors")["model.embed_tokens.weight"]["shape"]
        [32000, 4096]
    """
    fd = open_regular(path)
    with os.fdopen(fd, "rb") as f:
        header, _ = _read_header(Path(path), f, os.fstat(fd).st_size)
    return header


def open_regular(path: str | os.PathLike) -> int:
    """A read-only descriptor of ``path``, or OSError when it is not a regular file (symlinks followed).

    Checked before opening (opening a FIFO would block until a writer came) and again on the
    descriptor, opened non-blocking, in case the entry was swapped in between.
    """
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise OSError(f"not a regular file: {os.fspath(path)}")
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"not a regular file: {os.fspath(path)}")
    return fd


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"duplicate key {dup!r}")
    return out


def _check_metadata(path: Path, meta: Any) -> dict[str, str]:
    if meta is None:  # mx.save_safetensors writes null when there is no metadata
        return {}
    if not isinstance(meta, dict):
        raise _bad(path, f"__metadata__ is a JSON {type(meta).__name__}, not an object of strings")
    for k, v in meta.items():
        if not isinstance(v, str):
            raise _bad(path, f"__metadata__[{k!r}] is {type(v).__name__} {str(v)[:40]!r}, not a string")
    return meta


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _tensor_info(path: Path, name: str, entry: Any, data_start: int, data_len: int) -> TensorInfo:
    """Validate one header entry; errors name the file and the tensor."""
    where = f"tensor {name!r}"
    if not isinstance(entry, dict):
        raise _bad(path, f"{where}: entry is a JSON {type(entry).__name__}, not an object")
    missing = {"dtype", "shape", "data_offsets"} - entry.keys()
    if missing:
        raise _bad(path, f"{where}: entry lacks {', '.join(sorted(missing))}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in NP_DTYPES:
        raise _bad(
            path, f"{where}: dtype {str(dtype)[:40]!r} unsupported; choose one of {', '.join(NP_DTYPES)}"
        )
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise _bad(path, f"{where}: shape {str(shape)[:80]} is not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
        raise _bad(path, f"{where}: data_offsets {str(offsets)[:80]} is not [begin, end] integers")
    begin, end = offsets
    if not 0 <= begin <= end:
        raise _bad(path, f"{where}: data_offsets [{begin}, {end}] are not 0 <= begin <= end")
    want = math.prod(shape) * ITEMSIZE[dtype]
    if end - begin != want:
        raise _bad(
            path, f"{where}: byte range {end - begin} != {want} = prod(shape {shape}) x {ITEMSIZE[dtype]}"
        )
    if end > data_len:
        raise _bad(path, f"{where}: data_offsets end {end} runs past the {data_len}-byte data section")
    return TensorInfo(name, dtype, tuple(shape), data_start + begin, data_start + end, path)


def _check_overlaps(path: Path, infos: dict[str, TensorInfo]) -> None:
    spans = sorted((i.start, i.end, i.name) for i in infos.values() if i.end > i.start)
    for (_, end_a, a), (start_b, _, b) in zip(spans, spans[1:], strict=False):
        if start_b < end_a:
            raise _bad(path, f"tensors {a!r} and {b!r} have overlapping byte ranges")


def _check_data_end(path: Path, infos: dict[str, TensorInfo], data_start: int, size: int) -> None:
    """The data section ends exactly where the header's largest offset says (as the reference
    reader requires): trailing bytes are data no tensor accounts for."""
    end, data_len = max((i.end for i in infos.values()), default=data_start) - data_start, size - data_start
    if data_len != end:
        raise _bad(path, f"data section is {data_len} bytes but the header's tensors end at byte {end}")


class SafetensorsFile:
    """One safetensors file: validated at open, tensors read lazily from a read-only mmap.

    Args:
        path: the ``.safetensors`` file.

    Example:
        >>> with SafetensorsFile("model.safetensors") as f:
        ...     for name in f.names():
        ...         w = f.array(name)      # mx.array, only this tensor in memory
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            fh = open(self.path, "rb")
        except OSError as e:
            raise InputError(f"{self.path}: cannot open ({e.strerror})") from None
        with fh:
            size = os.fstat(fh.fileno()).st_size
            header, data_start = _read_header(self.path, fh, size)
            self.metadata = _check_metadata(self.path, header.pop("__metadata__", {}))
            self._infos = {
                name: _tensor_info(self.path, name, entry, data_start, size - data_start)
                for name, entry in header.items()
            }
            _check_overlaps(self.path, self._infos)
            _check_data_end(self.path, self._infos, data_start, size)
            self._mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Unmap the file; numpy views still alive keep the mapping until they are dropped."""
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # a zero-copy view still exports the buffer; GC unmaps it later
            self._mm = None

    def names(self) -> list[str]:
        """Tensor names, sorted."""
        return sorted(self._infos)

    def __contains__(self, name: str) -> bool:
        return name in self._infos

    def info(self, name: str) -> TensorInfo:
        try:
            return self._infos[name]
        except KeyError:
            raise InputError(f"{self.path}: no tensor {name!r}") from None

    def infos(self) -> dict[str, TensorInfo]:
        """All tensor infos keyed by name, sorted by name."""
        return {n: self._infos[n] for n in self.names()}

    def numpy(self, name: str) -> np.ndarray:
        """A read-only zero-copy numpy view (BF16 as uint16, FP8 as uint8 bytes)."""
        info = self.info(name)
        if self._mm is None:
            raise InputError(f"{self.path}: file is closed; cannot read tensor {name!r}")
        dt = NP_DTYPES[info.dtype]
        if info.size == 0:  # may sit exactly at end of file, where frombuffer refuses an offset
            return np.empty(info.shape, dtype=dt)
        flat = np.frombuffer(self._mm, dtype=dt, count=info.size, offset=info.start)
        return flat.reshape(info.shape)

    def array(self, name: str) -> Any:
        """The tensor as an ``mx.array`` (BF16 stays bfloat16, F64 becomes float32), copied out of the mapping."""
        info = self.info(name)
        self._advise(info, mmap.MADV_WILLNEED)  # read ahead the whole tensor, not page by page
        view = self.numpy(name)
        # float64 is read as float32: MLX's GPUs have no float64, and no weight needs more
        arr = mx.array(view.astype(np.float32)) if info.dtype == "F64" else mx.array(view)
        if info.dtype == "BF16":
            arr = arr.view(mx.bfloat16)
        mx.eval(arr)
        del view
        self._advise(info, mmap.MADV_DONTNEED)  # drop its pages: streaming RSS stays ~one tensor
        return arr

    def release(self, name: str) -> None:
        """Drop a tensor's pages from the mapping after reading it through ``numpy``.

        Views stay valid (pages fault back in from the file); this only keeps RSS down when
        streaming zero-copy views.
        """
        self._advise(self.info(name), mmap.MADV_DONTNEED)

    def _advise(self, info: TensorInfo, advice: int) -> None:
        begin = info.start - info.start % mmap.PAGESIZE
        if info.end > begin and self._mm is not None and hasattr(self._mm, "madvise"):
            self._mm.madvise(advice, begin, info.end - begin)


class ModelDir:
    """All tensors of a model directory (sharded or single-file) behind one name space.

    Use :func:`open_model` to build one. ``files`` lists the weight files in shard order and
    ``config`` is the parsed ``config.json`` ({} when absent).

    Example:
        >>> with open_model("path/to/model") as m:
        ...     print(m.total_bytes, m.total_parameters)
        ...     w = m.array("model.embed_tokens.weight")
    """

    def __init__(self, path: Path, files: list[SafetensorsFile], owner: dict[str, SafetensorsFile]):
        self.path = path
        self._files = files
        self._owner = owner
        self.config = read_config(path)

    def __enter__(self) -> ModelDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for f in self._files:
            f.close()

    @property
    def files(self) -> list[Path]:
        return [f.path for f in self._files]

    @property
    def metadata(self) -> dict[str, str]:
        """The ``__metadata__`` of the first weight file."""
        return dict(self._files[0].metadata) if self._files else {}

    def names(self) -> list[str]:
        return sorted(self._owner)

    def stored_order(self) -> list[str]:
        """Tensor names as the data lies on disk: shard by shard, by offset within each."""
        return [n for f in self._files for n in sorted(f.names(), key=lambda n: f.info(n).start)]

    def __contains__(self, name: str) -> bool:
        return name in self._owner

    def _file(self, name: str) -> SafetensorsFile:
        try:
            return self._owner[name]
        except KeyError:
            raise InputError(f"{self.path}: the model has no tensor {name!r}") from None

    def info(self, name: str) -> TensorInfo:
        return self._file(name).info(name)

    def infos(self) -> dict[str, TensorInfo]:
        return {n: self.info(n) for n in self.names()}

    def array(self, name: str) -> Any:
        return self._file(name).array(name)

    def numpy(self, name: str) -> np.ndarray:
        return self._file(name).numpy(name)

    def release(self, name: str) -> None:
        self._file(name).release(name)

    def arrays(self) -> Iterator[tuple[str, Any]]:
        """(name, mx.array) for every tensor in sorted order, one tensor in memory at a time."""
        for name in self.names():
            yield name, self.array(name)

    @property
    def total_bytes(self) -> int:
        return sum(self.info(n).nbytes for n in self._owner)

    @property
    def total_parameters(self) -> int:
        """Parameters by mlx-lm's count (packed quantized weights at their logical size)."""
        shapes = {n: (i.dtype, i.shape) for n, i in self.infos().items()}
        return count_parameters(shapes, quantization=quantization_block(self.config), strict=False)


def read_config(path: Path) -> dict[str, Any]:
    """``<path>/config.json`` as a dict ({} when absent): the one reader, so every command names a
    broken file the same way (a corrupt file: exit 1, a recording command's run ends failed)."""
    cfg = path / "config.json"
    if not cfg.is_file():
        return {}
    try:
        data = json.loads(cfg.read_text())
    except (UnicodeDecodeError, ValueError) as e:
        raise EnvironmentFailure(f"{cfg}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise EnvironmentFailure(f"{cfg}: expected a JSON object, got {type(data).__name__}")
    return data


def _index_shards(path: Path) -> dict[str, str]:
    """weight_map of the index, validated (shard names must be plain files in ``path``)."""
    index = path / INDEX_FILE
    try:
        data = json.loads(index.read_text())
    except (UnicodeDecodeError, ValueError) as e:
        raise InputError(f"{index}: not valid JSON ({e})") from None
    wmap = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(wmap, dict) or not wmap:
        raise InputError(f"{index}: no 'weight_map' object of tensor name -> shard file")
    for name, shard in wmap.items():
        if not isinstance(shard, str) or Path(shard).name != shard or shard in ("", ".", ".."):
            raise InputError(f"{index}: tensor {name!r} maps to {shard!r}, not a file name in {path}")
    return wmap


def _open_indexed(path: Path) -> ModelDir:
    wmap = _index_shards(path)
    opened: dict[str, SafetensorsFile] = {}
    for shard in sorted(set(wmap.values())):
        if not (path / shard).is_file():
            raise InputError(f"{path / INDEX_FILE}: shard {shard!r} is listed but missing from {path}")
        opened[shard] = SafetensorsFile(path / shard)
    owner = {}
    for name, shard in wmap.items():
        if name not in opened[shard]:
            raise InputError(f"{path / INDEX_FILE}: tensor {name!r} is mapped to {shard!r} but not in it")
        owner[name] = opened[shard]
    return ModelDir(path, list(opened.values()), owner)


def _open_files(path: Path, files: list[Path]) -> ModelDir:
    opened = [SafetensorsFile(f) for f in files]
    owner: dict[str, SafetensorsFile] = {}
    for f in opened:
        for name in f.names():
            if name in owner:
                raise InputError(
                    f"{path}: tensor {name!r} is in both {owner[name].path.name} and {f.path.name}"
                )
            owner[name] = f
    return ModelDir(path, opened, owner)


def open_model(path: str | Path) -> ModelDir:
    """Open a model directory (index + shards, ``model.safetensors`` or ``weights.safetensors``).

    A single ``.safetensors`` file is accepted too. Without an index, several
    ``model*.safetensors`` files are read together (as mlx-lm does).

    Args:
        path: the model directory or one safetensors file.

    Example:
        >>> m = open_model("outputs/quantize/run/model")
        >>> m.info("lm_head.weight").shape
    """
    path = Path(path)
    if path.is_file():
        return _open_files(path.parent, [path])
    if not path.is_dir():
        raise InputError(
            f"model path {str(path)!r} does not exist; pass a model directory or .safetensors file"
        )
    if (path / INDEX_FILE).is_file():
        return _open_indexed(path)
    for single in SINGLE_FILES:
        if (path / single).is_file():
            return _open_files(path, [path / single])
    shards = sorted(p for p in path.glob("model*.safetensors") if p.is_file())
    if shards:
        return _open_files(path, shards)
    raise InputError(
        f"{path}: no weights found; expected {INDEX_FILE}, model.safetensors or weights.safetensors"
    )
