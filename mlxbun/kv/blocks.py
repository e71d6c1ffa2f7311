"""Content-addressed KV blocks: ``blocks/<blake3>`` written once, plus one small manifest per snapshot.

Cutting rule. Every cache tensor ``(B, H, T, W)`` is a set of rows — one per (layer, K/V part,
batch, head) — of ``T`` tokens each, taken from offset-trimmed data. Block ``j`` holds tokens
``[j*P, (j+1)*P)`` of every row, row after row in manifest order (a row shorter than that span
contributes what it has). ``P`` (``block_tokens``) is chosen so a block is about ``block_kib``.
Because the cut is on the token grid and per row, appending tokens leaves every earlier full
block byte-identical, and a growing conversation rewrites only its last, partial block.

    <store>/blocks/<64 lower-case hex>    raw bytes; the name is the BLAKE3-256 of the content
    <store>/snapshots/<name>.kvm          framed header (mlxbun.kv.format) with the block list

A block is published with ``link(tmp, final)``: it fails if the block exists, so an intact
block is never rewritten and two writers of the same block both succeed. A block already under
its name is read and compared before it is trusted (a read instead of a write): one of the right
size and other bytes (damaged) is replaced atomically, as a block of the wrong size is. New blocks are
fdatasync'd, then the directory, before the manifest that references them is published.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mlxbun.io.atomic import fsync_dir, tmp_sibling
from mlxbun.kv import format as fmt
from mlxbun.kv import state
from mlxbun.kv.snapshot import _write, kick_writeback, layer_entries
from mlxbun.kv.state import LayerState


@dataclass(frozen=True)
class Geometry:
    """Where each tensor's bytes sit inside each block, computed from a header alone."""

    block_tokens: int
    # (qualified name, rows, tokens, bytes per row-token) in manifest order
    tensors: tuple[tuple[str, int, int, int], ...]

    @property
    def n_blocks(self) -> int:
        longest = max((t for _, _, t, _ in self.tensors), default=0)
        return -(-longest // self.block_tokens)

    def span(self, j: int, tokens: int) -> int:
        """Tokens a row of length ``tokens`` contributes to block ``j``."""
        return max(0, min(tokens, (j + 1) * self.block_tokens) - j * self.block_tokens)

    def block_nbytes(self, j: int) -> int:
        return sum(rows * self.span(j, t) * rb for _, rows, t, rb in self.tensors)


def geometry(header: dict[str, Any], block_tokens: int) -> Geometry:
    items = []
    for name, t in fmt.tensors_of(header):
        b, h, n, w = t["shape"]
        items.append((name, b * h, n, w * state.DTYPES[t["dtype"]][1]))
    return Geometry(block_tokens=block_tokens, tensors=tuple(items))


def choose_block_tokens(layers: list[LayerState], block_bytes: int) -> int:
    per_token = sum(t.rows * t.row_token_bytes for s in layers for t in s.tensors.values())
    return max(1, block_bytes // max(1, per_token))


def check_name(name: str, *, what: str) -> str:
    """A block name must be exactly 64 lower-case hex digits (no paths, no upper case)."""
    if not isinstance(name, str) or not fmt.HEX64.fullmatch(name):
        raise fmt.CorruptError(f"{what}: block name {name!r} is not 64 lower-case hex digits")
    return name


# ---------------------------------------------------------------- write

STEPS = ("stage", "sync", "link", "dir_fsync")  # named points of a blocks write


_SCRATCH = threading.local()


def scratch(nbytes: int) -> mmap.mmap:
    """A per-thread reusable buffer: fresh 1 MiB allocations cost more than the copies here.

    It is page-aligned (an anonymous mapping), as block files are read from offset 0: copying
    page-aligned file data into a buffer just past a page boundary is slower on x86 (see
    ``format.SKEW``).
    """
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or len(buf) < nbytes:
        buf = _SCRATCH.buf = mmap.mmap(-1, max(nbytes, 1))
    return buf


def _rows(t: state.Tensor) -> np.ndarray:
    """``t``'s buffer as uint8 rows ``(B*H, buffer tokens, row-token bytes)`` (a view, no copy)."""
    b, h, _, w = t.shape
    return t.buf.view(np.uint8).reshape(b * h, t.buf.shape[2], w * t.buf.itemsize)


def _block_bytes(j: int, rows: list[np.ndarray], geo: Geometry) -> memoryview:
    """Block j: tokens [j*P, (j+1)*P) of every row, tensor after tensor, gathered by numpy.

    Consecutive tensors with the same row width and token span are gathered by one
    ``np.concatenate`` into the block (their rows lie back to back there). The view is of a
    per-thread scratch buffer, valid until this thread's next call.
    """
    nbytes = geo.block_nbytes(j)
    dst, lo = np.frombuffer(scratch(nbytes), np.uint8, count=nbytes), j * geo.block_tokens
    pos, group, key = 0, [], None

    def flush() -> int:
        if not group:
            return 0
        n, rb = key
        count = sum(g.shape[0] for g in group)
        out = dst[pos : pos + count * n * rb].reshape(count, n, rb)
        np.concatenate([g[:, lo : lo + n, :] for g in group], axis=0, out=out)
        return count * n * rb

    for r, (_, _, t, rb) in zip(rows, geo.tensors, strict=True):
        n = geo.span(j, t)
        if n == 0:
            continue
        if (n, rb) != key:
            pos += flush()
            group, key = [], (n, rb)
        group.append(r)
    pos += flush()
    return memoryview(dst)


def _found(path: Path, data: Any) -> str:
    """What is published under a block's name: "none", "same" (these bytes) or "other" (another
    size or other bytes: a damaged block). An existing block is read and compared, never trusted
    by its size: a damaged one would otherwise be kept and every later restore would miss."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return "none"
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        fd = None
    try:
        st = None if fd is None else os.fstat(fd)
        if st is None or not stat.S_ISREG(st.st_mode):
            raise fmt.CorruptError(f"block {path.name} in {path.parent} is not a regular file (symlink?)")
        if st.st_size != len(data):
            return "other"
        got = bytearray(len(data))
        view, pos = memoryview(got), 0
        while pos < len(got) and (n := os.preadv(fd, [view[pos:]], pos)):
            pos += n
    finally:
        if fd is not None:
            os.close(fd)
    return "same" if got == data else "other"


@dataclass(frozen=True)
class Staged:
    """A hashed block: already published (tmp None) or written to a temporary sibling;
    ``replace``: a damaged block holds its name, to be replaced."""

    name: str
    nbytes: int
    tmp: Path | None
    replace: bool = False


def stage_block(blocks: Path, data: bytes | bytearray) -> Staged:
    """Hash ``data``; unless the block exists with these bytes, write it to a temp file and start
    its writeback."""
    name = fmt.digest(data)
    found = _found(blocks / name, data)
    if found == "same":
        return Staged(name, len(data), None)
    tmp = tmp_sibling(blocks / name)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _write(fd, data, 0)
        kick_writeback(fd)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    return Staged(name, len(data), tmp, replace=found == "other")


def sync_staged(s: Staged) -> None:
    if s.tmp is not None:
        fd = os.open(s.tmp, os.O_RDONLY)
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)


def _intact(blocks: Path, name: str, nbytes: int) -> bool:
    try:
        read_block(blocks, name, nbytes, verify=True, what=str(blocks))
    except fmt.CorruptError:
        return False
    return True


def publish_block(blocks: Path, s: Staged) -> int:
    """Link a synced temp block to its name (never over an intact block); bytes written. A
    damaged block under the name is replaced atomically."""
    if s.tmp is None:
        return 0
    final = blocks / s.name
    try:
        os.link(s.tmp, final)
    except FileExistsError:
        if not s.replace and _intact(blocks, s.name, s.nbytes):
            return 0  # another writer published the same block first
        os.replace(s.tmp, final)
    finally:
        s.tmp.unlink(missing_ok=True)
    return s.nbytes


def _discard(futs: list) -> None:
    for f in futs:
        if not f.cancel() and f.exception() is None and f.result().tmp is not None:
            f.result().tmp.unlink(missing_ok=True)


def write_blocks(
    blocks: Path,
    layers: list[LayerState],
    base: dict[str, Any],
    *,
    block_bytes: int,
    threads: int = 2,
    on_bytes: Callable[[int], None] | None = None,
    on_step: Callable[[str], None] | None = None,
) -> tuple[dict[str, Any], int]:
    """Store all blocks of ``layers``; returns (manifest header, bytes actually written).
    ``on_step`` is called with each name of :data:`STEPS` as that step starts.

    Three phases so that one flush covers many blocks: stage (gather, hash, write new blocks to
    temp files, start writeback) on worker threads; fdatasync every new temp file; link them to
    their names and fsync blocks/. Only then may a manifest reference them.
    """
    header = dict(base, layout="blocks", hash=fmt.HASH, layers=layer_entries(layers))
    p = choose_block_tokens(layers, block_bytes)
    rows = [_rows(s.tensors[n]) for s in layers for n in sorted(s.tensors)]
    geo = geometry(header, p)

    def one(j: int) -> Staged:
        staged = stage_block(blocks, _block_bytes(j, rows, geo))
        if on_bytes:
            on_bytes(staged.nbytes)
        return staged

    step = on_step or (lambda _: None)
    step("stage")
    with ThreadPoolExecutor(max(1, threads)) as pool:
        futs = [pool.submit(one, j) for j in range(geo.n_blocks)]
        try:
            staged = [f.result() for f in futs]
            step("sync")
            list(pool.map(sync_staged, staged))
        except BaseException:
            _discard(futs)
            raise
    step("link")
    written = sum(publish_block(blocks, s) for s in staged)
    step("dir_fsync")
    fsync_dir(blocks)
    header["block_tokens"] = p
    header["blocks"] = [{"hash": s.name, "nbytes": s.nbytes} for s in staged]
    return header, written


# ---------------------------------------------------------------- read


def check_manifest(h: dict[str, Any], *, what: str) -> Geometry:
    """Validate the block list against the tensor shapes (names, count, sizes) before allocating."""
    if h["layout"] != "blocks":
        fmt._fail(what, f"layout {h['layout']!r} in a .kvm manifest")
    p = fmt._int(h.get("block_tokens"), what, "block_tokens", lo=1)
    geo = geometry(h, p)
    blocks = h.get("blocks")
    if not isinstance(blocks, list) or len(blocks) != geo.n_blocks:
        fmt._fail(
            what,
            f"lists {len(blocks) if isinstance(blocks, list) else blocks!r} blocks; the shapes need {geo.n_blocks}",
        )
    for j, b in enumerate(blocks):
        if not isinstance(b, dict):
            fmt._fail(what, f"block entry {j} is not an object")
        check_name(b.get("hash"), what=f"{what} block {j}")
        if b.get("nbytes") != geo.block_nbytes(j):
            fmt._fail(
                what,
                f"block {j} ({b['hash']}): nbytes={b.get('nbytes')} but the shapes give {geo.block_nbytes(j)}",
            )
    return geo


def read_block(blocks: Path, name: str, nbytes: int, *, verify: bool, what: str) -> memoryview:
    """Read one block refusing symlinks, wrong sizes and (when verifying) wrong content.

    Returns a view of this thread's scratch buffer, valid until its next read.
    """
    where = f"{what}: block {name}"
    try:
        fd = os.open(blocks / check_name(name, what=what), os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise fmt.CorruptError(f"{where} is missing") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise fmt.CorruptError(f"{where} is a symlink; blocks must be regular files") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise fmt.CorruptError(f"{where} is not a regular file")
        if st.st_size != nbytes:
            kind = "truncated" if st.st_size < nbytes else "extended"
            raise fmt.CorruptError(f"{where} is {kind}: {st.st_size} bytes, expected {nbytes}")
        buf = memoryview(scratch(nbytes))[:nbytes]
        view, pos = buf, 0
        while pos < nbytes:
            n = os.preadv(fd, [view[pos:]], pos)
            if n == 0:
                raise fmt.CorruptError(f"{where} is truncated")
            pos += n
    finally:
        os.close(fd)
    if verify and fmt.digest(buf) != name:
        raise fmt.CorruptError(f"{where} hash mismatch (corrupt content)")
    return buf


# Consecutive tensors that share a token count, row width and dtype are restored into one buffer
# of at most this many bytes, so a block is scattered with a few strided copies, not one per tensor.
# A piece is freed when the last of its tensors is, so when generation moves the caches to new
# buffers layer by layer, up to one piece more than the cache stays alive: keep it modest.
PIECE_BYTES = 64 << 20


@dataclass(frozen=True)
class Piece:
    """Tensors ``first .. first+count-1`` of the geometry, stacked row-wise in one buffer."""

    first: int
    count: int
    rows: int
    tokens: int
    row_bytes: int
    dtype: str
    width: int

    @property
    def shape(self) -> list[int]:
        return [self.rows, self.tokens, self.width]


def pieces(header: dict[str, Any], geo: Geometry) -> list[Piece]:
    """Group the geometry's tensors (manifest order) into pieces; a block holds each piece's rows
    back to back, because it holds its tensors back to back with equal token spans."""
    out: list[Piece] = []
    for i, ((_, t), (_, rows, n, rb)) in enumerate(zip(fmt.tensors_of(header), geo.tensors, strict=True)):
        key = (n, rb, t["dtype"], t["shape"][3])
        last = out[-1] if out else None
        if last and (last.tokens, last.row_bytes, last.dtype, last.width) == key:
            if (last.rows + rows) * n * rb <= PIECE_BYTES:
                out[-1] = Piece(last.first, last.count + 1, last.rows + rows, *key)
                continue
        out.append(Piece(i, 1, rows, *key))
    return out


def read_blocks(
    blocks: Path,
    header: dict[str, Any],
    geo: Geometry,
    parts: list[Piece],
    dests: list[np.ndarray],
    *,
    verify: bool,
    threads: int,
    what: str,
) -> None:
    """Fill each piece's flat uint8 buffer in ``dests`` from the blocks (hashed when ``verify``)."""
    dest = [d.reshape(p.rows, p.tokens, p.row_bytes) for p, d in zip(parts, dests, strict=True)]

    def one(j: int) -> None:
        entry = header["blocks"][j]
        buf = np.frombuffer(
            read_block(blocks, entry["hash"], entry["nbytes"], verify=verify, what=what), np.uint8
        )
        pos, lo = 0, j * geo.block_tokens
        for p, d in zip(parts, dest, strict=True):
            n = geo.span(j, p.tokens)
            size = p.rows * n * p.row_bytes
            if size:
                d[:, lo : lo + n, :] = buf[pos : pos + size].reshape(p.rows, n, p.row_bytes)
            pos += size

    with ThreadPoolExecutor(max(1, threads)) as pool:
        list(pool.map(one, range(geo.n_blocks)))


def restore(
    blocks: Path, header: dict[str, Any], geo: Geometry, *, verify: bool, threads: int, what: str
) -> dict[str, Any]:
    """Every tensor of a validated manifest as an mlx array, keyed 'layer.name'.

    Each piece is one mlx buffer that the blocks are read into; its tensors are row slices of
    it (views: no copy), reinterpreted as bfloat16 where needed.
    """
    parts = pieces(header, geo)
    bufs = state.alloc({str(k): (p.dtype, p.shape) for k, p in enumerate(parts)}, streams=threads)
    flats = [bufs[str(k)][1] for k in range(len(parts))]
    read_blocks(blocks, header, geo, parts, flats, verify=verify, threads=threads, what=what)
    specs = list(fmt.tensors_of(header))
    out = {}
    for k, p in enumerate(parts):
        a, flat = bufs[str(k)]
        whole = state.finish(p.dtype, a, flat, p.shape)
        r = 0
        for name, t in specs[p.first : p.first + p.count]:
            b, h = t["shape"][:2]
            out[name] = whole[r : r + b * h].reshape(t["shape"])
            r += b * h
    state.settle(out)
    return out
