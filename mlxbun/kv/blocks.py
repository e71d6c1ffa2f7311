"""Content-addressed KV blocks: ``blocks/<sha256>`` written once, plus one small manifest per snapshot.

Cutting rule. Every cache tensor ``(B, H, T, W)`` is a set of rows — one per (layer, K/V part,
batch, head) — of ``T`` tokens each, taken from offset-trimmed data. Block ``j`` holds tokens
``[j*P, (j+1)*P)`` of every row, row after row in manifest order (a row shorter than that span
contributes what it has). ``P`` (``block_tokens``) is chosen so a block is about ``block_kib``.
Because the cut is on the token grid and per row, appending tokens leaves every earlier full
block byte-identical, and a growing conversation rewrites only its last, partial block.

    <store>/blocks/<64 lower-case hex>    raw bytes; the name is the sha256 of the content
    <store>/snapshots/<name>.kvm          framed header (mlxbun.kv.format) with the block list

A block is published with ``link(tmp, final)``: it fails if the block exists, so an existing
block is never rewritten and two writers of the same block both succeed. New blocks are
fdatasync'd, then the directory, before the manifest that references them is published.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mlxbun.io.atomic import fsync_dir, tmp_sibling
from mlxbun.kv import format as fmt
from mlxbun.kv import state
from mlxbun.kv.snapshot import _write, layer_entries
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


def _block_bytes(j: int, order: list[state.Tensor], p: int) -> bytes:
    parts = [t.row(r, j * p, (j + 1) * p) for t in order for r in range(t.rows)]
    return b"".join(parts)


def _existing(path: Path, nbytes: int) -> bool:
    """True if a regular file of the right size is already published under this name."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode):
        raise fmt.CorruptError(f"block {path.name} in {path.parent} is not a regular file (symlink?)")
    return st.st_size == nbytes


def put_block(blocks: Path, data: bytes) -> tuple[str, int]:
    """Store ``data`` under its sha256 unless present; returns (name, bytes written)."""
    name = hashlib.sha256(data).hexdigest()
    final = blocks / name
    if _existing(final, len(data)):
        return name, 0
    tmp = tmp_sibling(final)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _write(fd, data, 0)
        os.fdatasync(fd)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    try:
        try:
            os.link(tmp, final)
        except FileExistsError:
            if not _existing(final, len(data)):
                os.replace(tmp, final)  # a wrong-sized (damaged) block: replace it atomically
                return name, len(data)
            return name, 0
    finally:
        tmp.unlink(missing_ok=True)
    return name, len(data)


def write_blocks(
    blocks: Path,
    layers: list[LayerState],
    base: dict[str, Any],
    *,
    block_bytes: int,
    threads: int = 2,
    on_bytes: Callable[[int], None] | None = None,
) -> tuple[dict[str, Any], int]:
    """Store all blocks of ``layers``; returns (manifest header, bytes actually written)."""
    header = dict(base, layout="blocks", layers=layer_entries(layers))
    p = choose_block_tokens(layers, block_bytes)
    order = [s.tensors[n] for s in layers for n in sorted(s.tensors)]
    geo = geometry(header, p)

    def one(j: int) -> tuple[str, int, int]:
        data = _block_bytes(j, order, p)
        name, wrote = put_block(blocks, data)
        if on_bytes:
            on_bytes(len(data))
        return name, len(data), wrote

    with ThreadPoolExecutor(max(1, threads)) as pool:
        done = list(pool.map(one, range(geo.n_blocks)))
    fsync_dir(blocks)
    header["block_tokens"] = p
    header["blocks"] = [{"sha256": n, "nbytes": nb} for n, nb, _ in done]
    return header, sum(w for _, _, w in done)


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
        check_name(b.get("sha256"), what=f"{what} block {j}")
        if b.get("nbytes") != geo.block_nbytes(j):
            fmt._fail(
                what,
                f"block {j} ({b['sha256']}): nbytes={b.get('nbytes')} but the shapes give {geo.block_nbytes(j)}",
            )
    return geo


def read_block(blocks: Path, name: str, nbytes: int, *, verify: bool, what: str) -> bytearray:
    """Read one block refusing symlinks, wrong sizes and (when verifying) wrong content."""
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
        buf = bytearray(nbytes)
        view, pos = memoryview(buf), 0
        while pos < nbytes:
            n = os.preadv(fd, [view[pos:]], pos)
            if n == 0:
                raise fmt.CorruptError(f"{where} is truncated")
            pos += n
    finally:
        os.close(fd)
    if verify and hashlib.sha256(buf).hexdigest() != name:
        raise fmt.CorruptError(f"{where} hash mismatch (corrupt content)")
    return buf


def read_blocks(
    blocks: Path, header: dict[str, Any], geo: Geometry, *, verify: bool, threads: int, what: str
) -> dict[str, np.ndarray]:
    """Reassemble every tensor's raw bytes (shape (B, H, T, row-bytes), uint8) from its blocks."""
    out = {name: np.empty((rows, t, rb), dtype=np.uint8) for name, rows, t, rb in geo.tensors}

    def one(j: int) -> None:
        entry = header["blocks"][j]
        buf = np.frombuffer(
            read_block(blocks, entry["sha256"], entry["nbytes"], verify=verify, what=what), np.uint8
        )
        pos, lo = 0, j * geo.block_tokens
        for name, rows, t, rb in geo.tensors:
            n = geo.span(j, t)
            size = rows * n * rb
            out[name][:, lo : lo + n, :] = buf[pos : pos + size].reshape(rows, n, rb)
            pos += size

    with ThreadPoolExecutor(max(1, threads)) as pool:
        list(pool.map(one, range(geo.n_blocks)))
    return {name: a.reshape(-1) for name, a in out.items()}
