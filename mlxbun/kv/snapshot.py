"""Single-file snapshots (``snapshots/<name>.safetensors``): mlx-lm prompt-cache files with a hashed
mlxbun header in their metadata (format 3, drawn in :mod:`mlxbun.kv.promptcache`); ``.kvs`` files of
formats 1-2 (:mod:`mlxbun.kv.format`) are still read.

A snapshot is written to a hidden temporary sibling: the K/V data first (hashed on worker
threads while the main thread writes), then the scalars, then the header with the hashes over
the reserved space at offset 0; the file is fsync'd, renamed over the final name, and the
directory is fsync'd (:data:`STEPS` names these points for fault tests).

Readers open the file once and validate its header fully (and re-derive its safetensors table)
before reading any data. A restore hands the file to ``mx.load`` (mlx reads each tensor straight
into fresh memory, in parallel) and then checks every tensor's XXH3-128; format-1 files are read
into zero-filled mlx arrays instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlxbun.io.atomic import fsync_dir, tmp_sibling
from mlxbun.kv import format as fmt
from mlxbun.kv import promptcache as pc
from mlxbun.kv import state
from mlxbun.kv.state import LayerState, Tensor


def _write(fd: int, data: memoryview | bytes, offset: int) -> None:
    """pwrite all of ``data`` (one place to fail for disk-full tests)."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


_LIBC: list[Any] = []


def kick_writeback(fd: int, offset: int = 0, nbytes: int = 0) -> None:
    """Start writing dirty pages to disk now (Linux sync_file_range), so the final fsync is short."""
    if not _LIBC:
        try:
            _LIBC.append(ctypes.CDLL(None, use_errno=True).sync_file_range)
        except (OSError, AttributeError):
            _LIBC.append(None)
    if _LIBC[0] is not None:
        _LIBC[0](fd, ctypes_off(offset), ctypes_off(nbytes), 2)  # SYNC_FILE_RANGE_WRITE


def ctypes_off(n: int) -> Any:
    return ctypes.c_longlong(n)


def _hash_tensor(t: Tensor, name: str) -> str:
    h = fmt.new_checker(name)
    for r in range(t.rows):
        h.update(t.row(r))
    return h.hexdigest()


def layer_entries(layers: list[LayerState]) -> list[dict[str, Any]]:
    return [
        {
            "class": s.cls,
            "meta": s.meta,
            "tensors": {n: {"dtype": t.dtype, "shape": list(t.shape)} for n, t in s.tensors.items()},
        }
        for s in layers
    ]


def plan_header(layers: list[LayerState], base: dict[str, Any]) -> tuple[dict[str, Any], list[Tensor]]:
    """Format-3 header with offsets and placeholder hashes (hashes have fixed length, so its size
    is final), and the tensors in storage order."""
    header = dict(base, layout="snapshot", hash=fmt.CHECK, layers=layer_entries(layers))
    header.setdefault("model_name", "")
    header.setdefault("tokenizer_config", pc.TOKENIZER_CONFIG)
    placeholder = "0" * fmt.TENSOR_HASHES[fmt.CHECK]
    order = [layers[int(q.split(".", 1)[0])].tensors[q.split(".", 1)[1]] for q, _ in fmt.tensors_of(header)]
    for _, entry in fmt.tensors_of(header):
        entry["hash"] = placeholder
    pc.plan(header, [t.nbytes for t in order])
    return header, order


STEPS = ("data", "tail", "header", "fsync", "rename", "dir_fsync")  # named points of a save


def write_snapshot(
    path: Path,
    layers: list[LayerState],
    base: dict[str, Any],
    *,
    threads: int = 2,
    on_bytes: Callable[[int], None] | None = None,
    on_step: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Write ``layers`` to ``path`` (a format-3 ``.safetensors``) atomically; returns the header.

    Args:
        path: final file name (``snapshots/<name>.safetensors``).
        layers: from :func:`mlxbun.kv.state.cache_state`.
        base: header fields other than layout/layers (model, tokenizer, tokens, tokens_sha256,
            model_name, tokenizer_config).
        threads: hashing threads (XXH3 and file I/O release the GIL).
        on_bytes: called with the number of bytes written, for progress.
        on_step: called with each name of :data:`STEPS` as that step starts (fault tests).
    """
    step = on_step or (lambda _: None)
    header, order = plan_header(layers, base)
    start = header["data_start"]
    tmp = tmp_sibling(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        step("data")
        with ThreadPoolExecutor(max(1, threads)) as pool:
            hashes = [pool.submit(_hash_tensor, t, header["hash"]) for t in order]
            for t, entry in zip(order, fmt.tensors_of(header), strict=True):
                pos = start + entry[1]["offset"]
                for r in range(t.rows):
                    row = t.row(r)
                    _write(fd, row, pos)
                    pos += len(row)
                kick_writeback(fd, start + entry[1]["offset"], t.nbytes)
                if on_bytes:
                    on_bytes(t.nbytes)
            for fut, (_, entry) in zip(hashes, fmt.tensors_of(header), strict=True):
                entry["hash"] = fut.result()
        step("tail")
        rest = pc.tail(header)
        _write(fd, rest, start + header["data_bytes"] - len(rest))
        os.ftruncate(fd, start + header["data_bytes"])
        step("header")
        _write(fd, pc.encode(header), 0)
        step("fsync")
        os.fsync(fd)
        os.close(fd)
        fd = -1
        step("rename")
        os.replace(tmp, path)
        step("dir_fsync")
        fsync_dir(path.parent)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    return header


def check_layout(h: dict[str, Any], size: int, version: int, *, what: str) -> None:
    """Offsets, sizes and alignment of a snapshot header against the file size (before allocating)."""
    start, total = h.get("data_start"), h.get("data_bytes")
    fmt._int(start, what, "data_start")
    fmt._int(total, what, "data_bytes")
    if version < pc.VERSION and (start % fmt.ALIGN or start < 8):
        fmt._fail(what, f"data_start={start} is not a multiple of {fmt.ALIGN}")
    if start + total != size:
        fmt._fail(what, f"file is {size} bytes but the header says {start + total} (truncated or extended)")
    digits = fmt.TENSOR_HASHES[h["hash"]]
    hex_hash = re.compile(f"[0-9a-f]{{{digits}}}")
    spans = []
    for name, t in fmt.tensors_of(h):
        off, nb = t.get("offset"), t.get("nbytes")
        fmt._int(off, what, f"{name}.offset")
        if nb != fmt.entry_nbytes(t):
            fmt._fail(
                what,
                f"tensor {name!r}: nbytes={nb} but dtype {t['dtype']} x shape {t['shape']} is {fmt.entry_nbytes(t)}",
            )
        if (version < pc.VERSION and off % fmt.TENSOR_ALIGN) or off + nb > total:
            fmt._fail(what, f"tensor {name!r}: offset={off} is unaligned or runs past data_bytes={total}")
        if not isinstance(t.get("hash"), str) or not hex_hash.fullmatch(t["hash"]):
            fmt._fail(what, f"tensor {name!r}: hash is not {digits} lower-case hex digits ({h['hash']})")
        spans.append((off, off + nb, name))
    spans.sort()
    for (_, end, a), (off, _, b) in zip(spans, spans[1:], strict=False):
        if off < end:
            fmt._fail(what, f"tensors {a!r} and {b!r} overlap")
    if version == pc.VERSION:
        pc.check_layout(h, size, what=what)


def read_header_fd(fd: int, *, what: str) -> tuple[dict[str, Any], int]:
    """Validated header of the snapshot open as ``fd`` (any format version), and its version."""
    if pc.is_v3(os.pread(fd, 8 + len(pc.MAGIC), 0)):
        header, size, version = (
            pc.decode(fd, os.fstat(fd).st_size, what=what),
            os.fstat(fd).st_size,
            pc.VERSION,
        )
    else:
        header, size, version = fmt.read_header_fd(fd, what=what)
    fmt.check_header(header, what=what)
    if header["layout"] != "snapshot":
        fmt._fail(what, f"layout {header['layout']!r} in a snapshot file")
    check_layout(header, size, version, what=what)
    encoded = {fmt.KVS_VERSION: fmt.encode_kvs, pc.VERSION: pc.encode}.get(version)
    if encoded and encoded(header) != os.pread(fd, header["data_start"], 0):
        fmt._fail(what, "its safetensors tensor table does not match its header")
    return header, version


@contextlib.contextmanager
def opened(path: Path, *, what: str) -> Iterator[tuple[int, dict[str, Any], int]]:
    """``path`` open read-only (never through a symlink) with its validated header and format
    version: one descriptor, so what is checked is what is read."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        header, version = read_header_fd(fd, what=what)
        yield fd, header, version
    finally:
        os.close(fd)


def read_header(path: Path, *, what: str) -> dict[str, Any]:
    with opened(path, what=what) as (_, header, _):
        return header


def _read_one(
    fd: int,
    start: int,
    name: str,
    t: dict[str, Any],
    check: str | None,
    what: str,
    buf: np.ndarray | None,
) -> np.ndarray:
    """Read one tensor into ``buf``; ``check`` names the tensor hash to verify (None: no check)."""
    buf = np.empty(t["nbytes"], dtype=np.uint8) if buf is None else buf
    view, pos = memoryview(buf), start + t["offset"]
    while view:
        n = os.preadv(fd, [view], pos)
        if n == 0:
            fmt._fail(what, f"tensor {name!r} is truncated")
        view, pos = view[n:], pos + n
    if check and fmt.check_digest(buf, check) != t["hash"]:
        fmt._fail(what, f"tensor {name!r} hash mismatch (corrupt data)")
    return buf


def read_data(
    fd: int,
    header: dict[str, Any],
    *,
    verify: bool,
    threads: int,
    what: str,
    out: dict[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Raw bytes of every tensor of the .kvs open as ``fd``, keyed 'layer.name', hashed when ``verify``.

    ``out`` supplies flat uint8 destination buffers (e.g. views of mlx arrays); else allocated.
    """
    out = out or {}
    start, check = header["data_start"], header["hash"] if verify else None
    with ThreadPoolExecutor(max(1, threads)) as pool:
        futs = {
            name: pool.submit(_read_one, fd, start, name, t, check, what, out.get(name))
            for name, t in fmt.tensors_of(header)
        }
        return {name: f.result() for name, f in futs.items()}


def _fd_path(fd: int) -> str:
    """A path that opens the same file as ``fd`` (so a rename in between cannot swap it)."""
    for base in ("/dev/fd", "/proc/self/fd"):
        if os.path.isdir(base):
            return f"{base}/{fd}"
    raise OSError(f"no /dev/fd here to reopen descriptor {fd}")


def check_tail(fd: int, header: dict[str, Any], version: int, *, what: str) -> None:
    """The scalars after the K/V tensors of a format-3 file are the ones its meta derives."""
    if version != pc.VERSION:
        return
    want = pc.tail(header)
    if os.pread(fd, len(want), header["data_start"] + header["data_bytes"] - len(want)) != want:
        fmt._fail(what, "its scalars (offsets, ring positions) do not match its header (corrupt data)")


def file_names(header: dict[str, Any], version: int) -> dict[str, str]:
    """mlxbun qualified tensor name -> the name in the file (mlx-lm's state names since format 3)."""
    if version == pc.VERSION:
        return {q: name for name, q in pc.entries(header)[0]}
    return {q: q for q, _ in fmt.tensors_of(header)}


def _mx_load(fd: int, header: dict[str, Any], version: int, *, what: str) -> dict[str, mx.array]:
    """Lazy mlx arrays of every K/V tensor of a safetensors snapshot (format 2 or 3), read by
    mlx's loader on this thread's CPU stream; checked against the (validated) header first."""
    loaded = mx.load(_fd_path(fd), format="safetensors", stream=state.cpu_stream())
    arrays = {}
    names = file_names(header, version)
    for name, t in fmt.tensors_of(header):
        a = loaded.get(names[name])
        if a is None or list(a.shape) != t["shape"] or a.dtype != state.MX_DTYPES[t["dtype"]]:
            fmt._fail(
                what, f"tensor {name!r}: mlx reads {a if a is None else (a.dtype, a.shape)}, not the header's"
            )
        arrays[name] = a
    return arrays


def _check_array(name: str, a: mx.array, t: dict[str, Any], check: str, what: str) -> None:
    if fmt.check_digest(np.array(a, copy=False).reshape(-1).view(np.uint8), check) != t["hash"]:
        fmt._fail(what, f"tensor {name!r} hash mismatch (corrupt data)")


EVAL_BATCH = 64 << 20  # bytes mlx reads before their hashing starts


def _batches(items: list[tuple[str, mx.array]], nbytes: int) -> list[list[tuple[str, mx.array]]]:
    """Consecutive runs of ``items`` of about ``nbytes`` each."""
    out: list[list[tuple[str, mx.array]]] = [[]]
    size = 0
    for item in items:
        if out[-1] and size >= nbytes:
            out.append([])
            size = 0
        out[-1].append(item)
        size += item[1].nbytes
    return out


def restore(
    fd: int, header: dict[str, Any], version: int, *, verify: bool, threads: int, what: str
) -> dict[str, mx.array]:
    """Evaluated mlx arrays of every tensor of the validated .kvs open as ``fd``, keyed 'layer.name'.

    Versions 2 and 3: ``mx.load`` reads the tensors straight into new memory, ~64 MiB at a time,
    and when ``verify`` each batch is hashed on ``threads`` threads while mlx reads the next.
    Version 1: arrays are allocated (zero-filled), and the data is read into them and hashed on
    ``threads`` threads.
    """
    specs = dict(fmt.tensors_of(header))
    if verify:
        check_tail(fd, header, version, what=what)
    if version in (fmt.KVS_VERSION, pc.VERSION):
        arrays = _mx_load(fd, header, version, what=what)
        raw = {n: a.view(mx.uint16) if a.dtype == mx.bfloat16 else a for n, a in arrays.items()}
        if not verify:
            mx.eval(list(raw.values()))
            return arrays
        with ThreadPoolExecutor(max(1, threads)) as pool:  # hash each batch while mlx reads the next
            futs: list[Any] = []
            for batch in _batches(list(raw.items()), EVAL_BATCH):
                mx.eval([a for _, a in batch])
                futs += [pool.submit(_check_array, n, a, specs[n], header["hash"], what) for n, a in batch]
            for f in futs:
                f.result()
        return arrays
    bufs = state.alloc({n: (t["dtype"], t["shape"]) for n, t in specs.items()}, streams=threads)
    out = {n: flat for n, (_, flat) in bufs.items()}
    read_data(fd, header, verify=verify, threads=threads, what=what, out=out)
    arrays = {n: state.finish(t["dtype"], *bufs[n], t["shape"]) for n, t in specs.items()}
    state.settle(arrays)
    return arrays
