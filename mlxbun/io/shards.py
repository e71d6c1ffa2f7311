"""Streaming sharded safetensors writer in mlx-lm's layout: bounded memory, resumable, deterministic.

The writer, its journal and its resume are one staged protocol over the same files; the layout
they write (packing, names, headers) is :mod:`mlxbun.io.layout`, which size prediction shares.

While a :class:`ShardedWriter` runs, ``out_dir`` holds only hidden names::

    out_dir/
        .mlxbun-shards.json                   journal: settings + one entry per completed shard
                                              {file, nbytes, digest, digests: {kind: hex},
                                              mtime_ns, tensors: {name: [dtype, shape]}}
        .mlxbun-shard-00001.safetensors       completed shards (fsync'd, then journaled)
        ..mlxbun-shard-00003.safetensors.tmp-<pid>-<rand>
                                              the shard being written (removed on resume)

``finish()`` renames the shards and writes the index, after which ``out_dir`` holds::

    model.safetensors                                       one shard: no index
    model-00001-of-0000N.safetensors ...                    N > 1 shards, and
    model.safetensors.index.json                            {"metadata": {"total_parameters",
                                                            "total_size"}, "weight_map": sorted}

Shards are filled greedily in insertion order up to ``shard_bytes`` of tensor data and a tensor
is never split (an oversize tensor gets its own shard), as ``mlx_lm.utils.make_shards`` does.
Inside a shard, data is laid out in insertion order; the header JSON is compact with sorted keys
(as ``mx.save_safetensors`` writes it) and padded with spaces to a multiple of 8 bytes (aligned
data, as the safetensors library pads), so the same tensors in the same order give the same
bytes. ``mx.save_safetensors`` lays data out in hash-map order and does not pad; a one-tensor
file is byte-identical to it apart from the padding.

A writer told every tensor in advance (``tensors=``: names, dtypes and shapes in order) knows
each shard's header before its data: it writes and hashes every tensor the moment it is added
and holds none. Without it, a shard's tensors are held until the shard is full.
"""

from __future__ import annotations

import json
import math
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxbun.errors import InputError
from mlxbun.io.atomic import TMP_MARK, atomic_write_json, fsync_dir, tmp_sibling
from mlxbun.io.digest import HASH_CHUNK, file_digest, new_hash
from mlxbun.io.direct import DirectFile
from mlxbun.io.dtypes import ITEMSIZE
from mlxbun.io.layout import (
    DEFAULT_SHARD_BYTES,
    ShardLayout,
    check_metadata,
    declared_shards,
    final_names,
    header_bytes,
    opens_shard,
    tensor_bytes,
)
from mlxbun.io.parameters import count_parameters
from mlxbun.io.safetensors import INDEX_FILE, SafetensorsFile

JOURNAL = ".mlxbun-shards.json"
PART_PREFIX = ".mlxbun-shard-"
JOURNAL_VERSION = 2  # 2: data in insertion order (1: sorted by name)


class WriterStateError(RuntimeError):
    """A ShardedWriter call out of order (add after finish, finish twice, ...)."""


@dataclass
class _Shard:
    """A completed shard as recorded in the journal."""

    file: str
    nbytes: int
    digest: str
    tensors: dict[str, list[Any]] = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict)  # extra kinds; absent in older journals
    mtime_ns: int | None = None  # at journaling: a later change of the file shows without a read

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "nbytes": self.nbytes,
            "digest": self.digest,
            "digests": self.digests,
            "mtime_ns": self.mtime_ns,
            "tensors": self.tensors,
        }


class _Hashes:
    """Several hashes fed in one pass over the bytes (each block hashed while still in cache)."""

    def __init__(self, kinds: tuple[str, ...]) -> None:
        self.hashes = {k: new_hash(k) for k in kinds}

    def update(self, data: Any) -> None:
        for h in self.hashes.values():
            h.update(data)

    def hexdigests(self) -> dict[str, str]:
        return {k: h.hexdigest() for k, h in self.hashes.items()}


CHECKSUMS = ("crc32", "sha256", "none")
EXTRA_DIGESTS = ("sha256", "xxh3_128")


def part_name(k: int) -> str:
    return f"{PART_PREFIX}{k:05d}.safetensors"


@dataclass
class _OpenShard:
    """A shard being written under its temporary name."""

    final: Path
    tmp: Path
    file: DirectFile
    hashes: _Hashes
    entries: list[tuple[str, str, tuple[int, ...], int]]

    def discard(self) -> None:
        self.file.abandon()
        self.tmp.unlink(missing_ok=True)


class ShardedWriter:
    """Write tensors one by one into mlx-lm-style shards with bounded memory and resume.

    ``add`` evaluates each array and keeps it until its shard is full; the full shard is then
    written, fsync'd, journaled and its arrays released. Peak memory is one shard plus the tensor
    in flight (two shards with ``overlap=True``, which writes a full shard on a background thread
    while the producer fills the next). Given ``tensors``, ``add`` writes each array at once and
    peak memory is the tensor in flight. ``finish`` publishes the shards under their final names;
    until then nothing in ``out_dir`` looks like a finished model.

    Args:
        out_dir: directory to write into (created if missing).
        shard_bytes: ceiling of tensor bytes per shard (mlx-lm: 5 << 30).
        metadata: the safetensors ``__metadata__`` of every shard (default {"format": "mlx"}).
        resume: keep the completed shards a previous writer journaled in ``out_dir``; their
            tensors are in ``done_names`` and ``add`` skips them (returns False).
        quantization: the config.json ``quantization`` block, to count packed weights'
            parameters exactly (see ``mlxbun.io.parameters.count_parameters``).
        overlap: write full shards on a background thread (at most one at a time).
        progress: an object with ``update(nbytes)`` called as tensor bytes reach the disk.
        verify: on resume, re-read and re-hash completed shards and drop any that do not match
            the journal. False: trust a shard whose size, mtime and header match its entry (no
            read of its data; for outputs whose digests are checked again later).
        checksum: digest of each shard in the journal: "crc32" (default), "sha256", or "none"
            (resume then checks sizes and headers only; fastest on a CPU-bound machine).
        extra_digests: more digest kinds (of EXTRA_DIGESTS) computed in the same pass as
            ``checksum``, e.g. ("xxh3_128",) for a record that verifies outputs fast.
        tensors: every tensor that will be added, in the order of the ``add`` calls, as (name,
            safetensors dtype code, shape). ``add`` then streams each tensor to disk as it comes
            and refuses one that differs from its declaration (a resumed writer's kept tensors
            are skipped in that order).

    Example:
        >>> with ShardedWriter(out, shard_bytes=1 << 30, resume=True) as w:
        ...     for name in names:
        ...         if name not in w.done_names:
        ...             w.add(name, transform(src.array(name)))
        ...     layout = w.finish()
    """

    def __init__(
        self,
        out_dir: str | Path,
        *,
        shard_bytes: int = DEFAULT_SHARD_BYTES,
        metadata: Mapping[str, str] | None = None,
        resume: bool = False,
        quantization: dict[str, Any] | None = None,
        overlap: bool = False,
        progress: Any = None,
        verify: bool = True,
        checksum: str = "crc32",
        extra_digests: tuple[str, ...] = (),
        tensors: Sequence[tuple[str, str, tuple[int, ...]]] | None = None,
    ) -> None:
        if not isinstance(shard_bytes, int) or shard_bytes <= 0:
            raise InputError(f"shard_bytes={shard_bytes!r} must be a positive integer")
        self.out_dir = Path(out_dir)
        self.shard_bytes = shard_bytes
        self.metadata = check_metadata({"format": "mlx"} if metadata is None else metadata)
        self.quantization = quantization
        self.progress = progress
        if checksum not in CHECKSUMS:
            raise InputError(f"checksum={checksum!r} is not allowed; choose one of {', '.join(CHECKSUMS)}")
        self.checksum = checksum
        if bad := [k for k in extra_digests if k not in EXTRA_DIGESTS]:
            raise InputError(f"extra_digests={bad!r} is not allowed; choose from {', '.join(EXTRA_DIGESTS)}")
        self.extra_digests = tuple(extra_digests)
        self._state = "open"
        self._pending: list[tuple[str, Any]] = []
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self._shards: list[_Shard] = []
        self._inflight: Future | None = None
        self._pool = ThreadPoolExecutor(max_workers=1) if overlap else None
        self._hasher = ThreadPoolExecutor(max_workers=1)
        self._plan = None if tensors is None else declared_shards(tensors, shard_bytes)
        self._open: _OpenShard | None = None  # the shard being streamed (declared tensors)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._refuse_finished_model()
        self._remove_stray_tmp()
        if resume:
            self._load_journal(verify=verify)
        else:
            self._discard_journaled()
        self.done_names: frozenset[str] = frozenset(n for s in self._shards for n in s.tensors)
        self._seen: set[str] = set(self.done_names)
        self._next = len(self._shards) + 1  # number of the next shard to be started
        self._cursor = 0  # position of the next declared tensor in shard ``self._next``

    # ---------------------------------------------------------------- public API

    def __enter__(self) -> ShardedWriter:
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        if self._state == "open":
            # An exception leaves completed shards and the journal for a resume, nothing else.
            self._stop(keep_shards=exc_type is not None)
            if exc_type is None:
                self._state = "aborted"

    def add(self, name: str, array: Any) -> bool:
        """Queue one tensor; returns False (and ignores it) if a resumed shard already holds it."""
        self._require_open("add")
        if not isinstance(name, str) or name == "__metadata__":
            raise InputError(f"tensor name {name!r} is not allowed; use a non-reserved string")
        if name in self.done_names:
            return False
        if name in self._seen:
            raise InputError(f"tensor {name!r} was already added to this writer; names must be unique")
        dtype, shape, buf = tensor_bytes(array, name)
        if self._plan is not None:
            self._stream(name, dtype, shape, buf)
            self._seen.add(name)
            return True
        self._seen.add(name)
        if opens_shard(self._pending_bytes, len(self._pending), buf.nbytes, self.shard_bytes):
            self._flush()
        self._pending.append((name, (dtype, shape, buf)))
        self._pending_bytes += buf.nbytes
        return True

    def finish(self) -> ShardLayout:
        """Write the last shard, rename all shards to their final names, write the index."""
        self._require_open("finish")
        if self._plan is not None and self._next <= len(self._plan):
            missing = self._plan[self._next - 1][self._cursor][0]
            raise WriterStateError(f"finish() before every declared tensor was added ({missing!r} is next)")
        if self._pending:
            self._flush()
        self._wait()
        if not self._shards:
            raise InputError(f"no tensors were added to the writer for {self.out_dir}; nothing to write")
        self._state = "finished"
        self._shutdown_pools()
        layout = self._layout()
        self._publish(layout)
        return layout

    def abort(self) -> None:
        """Discard everything this writer (and a journal it resumed) put in ``out_dir``."""
        if self._state == "finished":
            raise WriterStateError(f"abort() after finish(): {self.out_dir} is already published")
        self._stop(keep_shards=False)
        self._state = "aborted"

    # ---------------------------------------------------------------- shard writing

    def _require_open(self, call: str) -> None:
        if self._state != "open":
            raise WriterStateError(f"{call}() on a writer that is already {self._state} ({self.out_dir})")
        if self._inflight is not None and self._inflight.done() and self._inflight.exception():
            raise self._inflight.exception()

    def _flush(self) -> None:
        items, k = self._pending, self._next
        self._pending, self._pending_bytes = [], 0
        self._next += 1
        if self._pool is None:
            self._write_shard(k, items)
            return
        self._wait()  # at most one shard being written
        self._inflight = self._pool.submit(self._write_shard, k, items)

    def _wait(self) -> None:
        if self._inflight is not None:
            fut, self._inflight = self._inflight, None
            fut.result()

    def _write_shard(self, k: int, items: list[tuple[str, Any]]) -> None:
        shard = self._start_shard(k, [(n, d, s, b.nbytes) for n, (d, s, b) in items])
        try:
            for i, (_, (_, _, buf)) in enumerate(items):
                self._write_data(shard, buf)
                items[i] = (items[i][0], None)  # release the array once on disk
                del buf
        except BaseException:
            shard.discard()
            raise
        self._end_shard(shard)

    def _stream(self, name: str, dtype: str, shape: tuple[int, ...], buf: memoryview) -> None:
        """Write one declared tensor at once: open its shard (header first) and close it when full."""
        assert self._plan is not None
        if self._next > len(self._plan):
            raise WriterStateError(f"add({name!r}): every declared tensor was already added")
        entries = self._plan[self._next - 1]
        want = entries[self._cursor]
        if (name, dtype, shape, buf.nbytes) != want:
            raise WriterStateError(
                f"add({name!r}): got {dtype} {list(shape)}; the declared next tensor is"
                f" {want[0]!r} {want[1]} {list(want[2])}"
            )
        if self._open is None:
            self._open = self._start_shard(self._next, entries)
        try:
            self._write_data(self._open, buf)
        except BaseException:
            self._open.discard()
            self._open = None
            raise
        self._cursor += 1
        if self._cursor == len(entries):
            shard, self._open = self._open, None
            self._end_shard(shard)
            self._next, self._cursor = self._next + 1, 0

    def _start_shard(self, k: int, entries: list[tuple[str, str, tuple[int, ...], int]]) -> _OpenShard:
        final = self.out_dir / part_name(k)
        tmp = tmp_sibling(final)
        shard = _OpenShard(
            final, tmp, DirectFile(tmp), _Hashes((self.checksum, *self.extra_digests)), entries
        )
        try:
            self._write_hashed(shard.file, memoryview(header_bytes(entries, self.metadata)), shard.hashes)
        except BaseException:
            shard.discard()
            raise
        return shard

    def _write_data(self, shard: _OpenShard, buf: memoryview) -> None:
        self._write_hashed(shard.file, buf, shard.hashes)
        if self.progress is not None:
            self.progress.update(buf.nbytes)

    def _end_shard(self, shard: _OpenShard) -> None:
        """fsync (past the page cache: the shard is not read back), rename, journal."""
        try:
            shard.file.close()
            size, mtime = shard.file.size, os.stat(shard.tmp).st_mtime_ns
            os.replace(shard.tmp, shard.final)
        except BaseException:
            shard.discard()
            raise
        fsync_dir(self.out_dir)
        tensors = {n: [d, list(s)] for n, d, s, _ in shard.entries}
        digests = shard.hashes.hexdigests()
        digest = digests.pop(self.checksum)
        if self.checksum in self.extra_digests:
            digests[self.checksum] = digest
        with self._lock:
            self._shards.append(_Shard(shard.final.name, size, digest, tensors, digests, mtime))
            self._write_journal()

    def _write_hashed(self, f: Any, buf: memoryview, h: Any) -> None:
        """Write ``buf`` while another thread hashes it (both release the GIL)."""
        if self.checksum == "none" and not self.extra_digests:
            f.write(buf)
            return
        for i in range(0, buf.nbytes, HASH_CHUNK):
            chunk = buf[i : i + HASH_CHUNK]
            fut = self._hasher.submit(h.update, chunk)
            f.write(chunk)
            fut.result()

    # ---------------------------------------------------------------- journal and resume

    def _journal(self, finishing: int | None = None) -> dict[str, Any]:
        return {
            "version": JOURNAL_VERSION,
            "shard_bytes": self.shard_bytes,
            "metadata": self.metadata,
            "checksum": self.checksum,
            "finishing": finishing,
            "shards": [s.to_json() for s in self._shards],
        }

    def _write_journal(self, finishing: int | None = None) -> None:
        atomic_write_json(self.out_dir / JOURNAL, self._journal(finishing))

    def _load_journal(self, *, verify: bool) -> None:
        path = self.out_dir / JOURNAL
        if not path.is_file():
            self._clear_previous()
            return
        try:
            data = json.loads(path.read_text())
            shards = [_Shard(**s) for s in data["shards"]]
        except (ValueError, KeyError, TypeError) as e:
            raise InputError(
                f"{path}: unreadable shard journal ({e}); delete {self.out_dir} to start over"
            ) from None
        if data.get("version") != JOURNAL_VERSION:  # another data order: start over
            self._discard_journaled()
            return
        settings = (
            ("shard_bytes", self.shard_bytes),
            ("metadata", self.metadata),
            ("checksum", self.checksum),
        )
        for key, mine in settings:
            if data.get(key) != mine:
                raise InputError(
                    f"resume: {path} was written with {key}={data.get(key)!r}, now {key}={mine!r};"
                    " use the same settings or delete the directory"
                )
        if data.get("finishing"):
            self._unpublish(data["finishing"], len(shards))
        self._shards = self._valid_prefix(shards, verify=verify)
        self._remove_unjournaled()
        self._write_journal()

    def _unpublish(self, n: int, count: int) -> None:
        """A finish() was interrupted mid-rename: move published names back to part names."""
        (self.out_dir / INDEX_FILE).unlink(missing_ok=True)
        for k, name in enumerate(final_names(n)[:count], start=1):
            if (self.out_dir / name).exists():
                os.replace(self.out_dir / name, self.out_dir / part_name(k))
        fsync_dir(self.out_dir)

    def _valid_prefix(self, shards: list[_Shard], *, verify: bool) -> list[_Shard]:
        """Completed shards up to the first one that is missing or does not match the journal."""
        good = []
        for k, s in enumerate(shards, start=1):
            p = self.out_dir / s.file
            if s.file != part_name(k) or not p.is_file():
                break
            if self._plan is not None and (
                k > len(self._plan) or s.tensors != {n: [d, list(sh)] for n, d, sh, _ in self._plan[k - 1]}
            ):
                break  # kept shards must be the declared ones
            st = p.stat()
            if st.st_size != s.nbytes or s.mtime_ns not in (None, st.st_mtime_ns):
                break
            if not _header_matches(p, s.tensors):
                break
            if verify and self.checksum != "none" and file_digest(p, self.checksum) != s.digest:
                break
            good.append(s)
        return good

    def _remove_unjournaled(self) -> None:
        keep = {s.file for s in self._shards}
        for p in self.out_dir.glob(f"{PART_PREFIX}*"):
            if p.name not in keep:
                p.unlink()

    def _remove_stray_tmp(self) -> None:
        for p in self.out_dir.glob(f".*{TMP_MARK}*"):
            if p.name.startswith((PART_PREFIX, f".{PART_PREFIX}", f".{JOURNAL}", f".{INDEX_FILE}")):
                p.unlink(missing_ok=True)

    def _discard_journaled(self) -> None:
        """Not resuming: undo a previous writer's interrupted finish, then delete its shards."""
        try:
            finishing = json.loads((self.out_dir / JOURNAL).read_text()).get("finishing")
        except (OSError, ValueError, AttributeError):
            finishing = None
        if isinstance(finishing, int) and finishing > 0:
            self._unpublish(finishing, finishing)
        self._clear_previous()

    def _clear_previous(self) -> None:
        (self.out_dir / JOURNAL).unlink(missing_ok=True)
        for p in self.out_dir.glob(f"{PART_PREFIX}*"):
            p.unlink()

    def _refuse_finished_model(self) -> None:
        if (self.out_dir / JOURNAL).is_file():
            return
        done = [p.name for p in self.out_dir.glob("model*.safetensors*") if not p.name.startswith(".")]
        if done:
            raise InputError(
                f"{self.out_dir} already holds a model ({sorted(done)[0]}); write into an empty directory"
            )

    # ---------------------------------------------------------------- publish

    def _layout(self) -> ShardLayout:
        names = final_names(len(self._shards))
        shards = {n: sorted(s.tensors) for n, s in zip(names, self._shards, strict=True)}
        tensors = {t: (d, tuple(shape)) for s in self._shards for t, (d, shape) in s.tensors.items()}
        total_size = sum(math.prod(shape) * ITEMSIZE[d] for d, shape in tensors.values())
        # Never fail a finished write over an odd packed shape: count its words instead.
        params = count_parameters(tensors, quantization=self.quantization, strict=False)
        weight_map = {t: n for n, ts in shards.items() for t in ts}
        index = {
            "metadata": {"total_size": total_size, "total_parameters": params},
            "weight_map": dict(sorted(weight_map.items())),
        }
        digests = {n: s.digest for n, s in zip(names, self._shards, strict=True)}
        extra = {n: dict(s.digests) for n, s in zip(names, self._shards, strict=True) if s.digests}
        return ShardLayout(self.out_dir, shards, total_size, params, index, digests, extra)

    def _publish(self, layout: ShardLayout) -> None:
        self._write_journal(finishing=len(layout.shards))
        for k, name in enumerate(layout.shards, start=1):
            os.replace(self.out_dir / part_name(k), self.out_dir / name)
        fsync_dir(self.out_dir)
        if layout.index_written:
            atomic_write_json(self.out_dir / INDEX_FILE, layout.index)
        (self.out_dir / JOURNAL).unlink()
        fsync_dir(self.out_dir)

    def _shutdown_pools(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._hasher.shutdown(wait=True)

    def _stop(self, *, keep_shards: bool) -> None:
        try:
            self._wait()
        except BaseException:
            pass  # the shard being written is discarded either way
        if self._open is not None:
            self._open.discard()
            self._open = None
        self._shutdown_pools()
        self._pending, self._pending_bytes = [], 0
        self._remove_stray_tmp()
        if not keep_shards:
            self._clear_previous()


def _header_matches(path: Path, tensors: dict[str, list[Any]]) -> bool:
    """Does the shard at ``path`` parse and hold exactly the journaled names, dtypes and shapes?"""
    try:
        with SafetensorsFile(path) as f:
            return {n: [i.dtype, list(i.shape)] for n, i in f.infos().items()} == tensors
    except InputError:
        return False


def write_sharded(
    out_dir: str | Path,
    tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
    *,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    metadata: Mapping[str, str] | None = None,
    quantization: dict[str, Any] | None = None,
) -> ShardLayout:
    """Write ``tensors`` (name -> mx/numpy array, in order) as mlx-lm-style shards in ``out_dir``.

    Args:
        out_dir: target directory (must not already hold a model).
        tensors: a mapping or (name, array) pairs; packing follows this order.
        shard_bytes: ceiling of tensor bytes per shard (default 5 GiB, as mlx-lm).
        metadata: safetensors ``__metadata__`` (default {"format": "mlx"}).
        quantization: config.json ``quantization`` block for the parameter count.

    Example:
        >>> layout = write_sharded(out, dict(tree_flatten(model.parameters())), shard_bytes=2 << 30)
        >>> layout.files, layout.total_parameters
    """
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    writer = ShardedWriter(out_dir, shard_bytes=shard_bytes, metadata=metadata, quantization=quantization)
    try:
        for name, array in items:
            writer.add(name, array)
        return writer.finish()
    except BaseException:
        if writer._state == "open":
            writer.abort()
        raise
