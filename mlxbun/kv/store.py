"""A directory of persisted prompt KV caches: save, load, longest-prefix lookup, list, verify.
Why one module: one Store object owns the lock, both layouts' publish order and the recovery that reads them.

Layout::

    <store>/
        .lock                  flock: savers and loaders hold it shared, GC holds it exclusive
        .gate                  flock turnstile: GC holds it while it waits, so a stream of
                               overlapping savers cannot starve GC of the exclusive lock
        snapshots/<name>.safetensors  single-file snapshot (layout=snapshot, format 3: an mlx-lm
                               prompt-cache file, mlxbun.kv.promptcache; formats 1-2: <name>.kvs)
        snapshots/<name>.kvm   block manifest         (layout=blocks,   mlxbun.kv.blocks)
        blocks/<blake3>        content-addressed blocks, written once, shared by manifests
        used/<name>            empty file; its mtime is the snapshot's last use (LRU for kv_gc)
        models/<fingerprint>   the model directory (or repo id) a fingerprint was made from

Hidden ``.*.tmp-*`` files are unfinished writes; nothing reads them and GC removes them. Last-use
times live in ``used/`` rather than in the artifacts, so snapshots stay byte-deterministic.

Example:
    >>> store = Store("~/.cache/mlxbun/kv")
    >>> store.save("system", cache, tokens=ids, model=fp)
    >>> hit = store.lookup(new_ids, model=fp)
    >>> cache = store.load(hit.name, model=fp, tokens=new_ids).cache
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mlxbun.errors import InputError
from mlxbun.io.atomic import TMP_MARK, atomic_write_bytes, tmp_sibling
from mlxbun.kv import blocks as blk
from mlxbun.kv import format as fmt
from mlxbun.kv import snapshot as snap
from mlxbun.kv import state

log = logging.getLogger("mlxbun")

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
SUFFIX = {"snapshot": ".safetensors", "blocks": ".kvm"}  # written now
SNAPSHOT_FILES = (".safetensors", ".kvs")  # single-file snapshots: format 3; formats 1-2
FILES = (*SNAPSHOT_FILES, ".kvm")  # every file a snapshot name may have


# named steps of a save, in order (``on_stage``); a kill at any of them leaves the previous
# version or the new one, and a rerun writes the same bytes
STEPS = {
    "snapshot": (*snap.STEPS, "data_written", "cleanup"),
    "blocks": (*blk.STEPS, "data_written", "manifest", "cleanup"),
}


class MismatchError(InputError):
    """A snapshot exists but belongs to another model, tokenizer or prompt."""


class StoreBusy(InputError):
    """The store lock could not be taken in time (another writer or GC is running)."""


@dataclass(frozen=True)
class SnapshotInfo:
    name: str
    layout: str
    path: Path
    tokens: int
    data_bytes: int
    file_bytes: int
    model: str
    tokenizer: str
    last_used: float
    blocks: tuple[str, ...] = ()
    written_bytes: int = 0
    model_name: str = ""
    chat_template: bool | None = None  # the tokens came through the chat template (None: not recorded)


@dataclass(frozen=True)
class Match:
    name: str
    tokens: int


@dataclass
class Restored:
    cache: list[Any]
    tokens: list[int]
    info: SnapshotInfo


def check_snapshot_name(name: str) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name) or TMP_MARK in name:
        raise InputError(
            f"kv.name={name!r} is not a valid snapshot name; use letters, digits, '.', '_' or '-' (max 128)"
        )
    return name


class Store:
    """One KV store directory (created on first write).

    Args:
        root: the store directory (``kv.store``).
        block_kib: target block size for the blocks layout.
        threads: worker threads for hashing and block I/O (BLAKE3 and file I/O release the GIL).
        lock_timeout: seconds to wait for the store lock before raising StoreBusy.
    """

    def __init__(
        self, root: str | Path, *, block_kib: int = 1024, threads: int = 2, lock_timeout: float = 600.0
    ) -> None:
        self.root = Path(root).expanduser()
        self.block_bytes = block_kib << 10
        self.threads = threads
        self.lock_timeout = lock_timeout
        self._worker: ThreadPoolExecutor | None = None
        self._worker_lock = threading.Lock()

    # ------------------------------------------------------------ paths and lock
    @property
    def snapshots(self) -> Path:
        return self.root / "snapshots"

    @property
    def blocks(self) -> Path:
        return self.root / "blocks"

    @property
    def used(self) -> Path:
        return self.root / "used"

    def _mkdirs(self) -> None:
        for d in (self.snapshots, self.blocks, self.used):
            d.mkdir(parents=True, exist_ok=True)

    def check_writable(self) -> None:
        """Raise an InputError naming the directory unless a save can write here (checked up
        front, so a read-only store fails before a prefill, not after)."""
        d = self.root
        try:
            self._mkdirs()
            for d in (self.root, self.snapshots, self.blocks, self.used):
                probe = tmp_sibling(d / "write-probe")
                os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
                probe.unlink()
        except OSError as e:
            raise InputError(
                f"kv.store={self.root} is not writable ({d}: {e.strerror or e}); "
                "pass kv.store=<a writable directory>"
            ) from None

    @contextlib.contextmanager
    def locked(self, *, exclusive: bool, timeout: float | None = None) -> Iterator[None]:
        """Hold the store lock: shared for savers/loaders, exclusive for GC.

        Both pass the ``.gate`` turnstile first. A shared holder lets go of the gate as soon as
        it holds ``.lock``; GC keeps the gate while it waits for the savers already inside to
        finish, so new savers queue behind it instead of overlapping it out forever.
        """
        deadline = time.monotonic() + (self.lock_timeout if timeout is None else timeout)
        gate = _lock_file(self.root, ".gate")
        fd = -1
        try:
            self._flock(gate, fcntl.LOCK_EX, deadline)
            fd = _lock_file(self.root, ".lock")
            self._flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH, deadline)
            if not exclusive:
                os.close(gate)
                gate = -1
            yield
        finally:
            for f in (fd, gate):
                if f >= 0:
                    os.close(f)

    def _flock(self, fd: int, mode: int, deadline: float) -> None:
        if fd < 0:
            return  # a read-only store without lock files: nothing of ours can write it
        while True:
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise StoreBusy(
                        f"kv.store={self.root} is busy (lock held by another writer or GC); retry later"
                    ) from None
                time.sleep(0.02)

    # ------------------------------------------------------------ save
    def save(
        self,
        name: str,
        cache: list[Any],
        *,
        on_bytes: Callable[[int], None] | None = None,
        on_stage: Callable[[str], None] | None = None,
        **fields: Any,
    ) -> SnapshotInfo:
        """Persist ``cache`` (mlx-lm cache objects) as snapshot ``name``, replacing it atomically.

        Args:
            fields: tokens, model, tokenizer, layout, model_name, chat_template as below (checked by one
                function for :meth:`save` and :meth:`save_async`).
            tokens: the token ids the cache holds (checked against the cache's length).
            model, tokenizer: fingerprints (see mlxbun.source.fingerprint); loads must match.
            layout: "snapshot" (one mlx-lm prompt-cache file) or "blocks" (deduplicated).
            model_name: what ``mlx_lm generate --prompt-cache-file`` loads when no ``--model``
                is given (a path or an HF repo id); kept in snapshot files, shown by kv_ls.
            chat_template: whether ``tokens`` came through the tokenizer's chat template
                (recorded in the header when given, None for a tokenizer without one;
                kv_generate names a snapshot encoded the other way, kv_export tells
                mlx_lm generate how to continue it).
            on_bytes: progress callback; on_stage: called with the name of each step as it
                starts (:data:`STEPS`); "data_written" once the data is durable (blocks layout:
                before the manifest that publishes it is written).
        """
        return self._persist(*self._prepare(name, cache, **fields), on_bytes=on_bytes, on_stage=on_stage)

    def save_async(self, name: str, cache: list[Any], **kw: Any) -> Future[SnapshotInfo]:
        """Like :meth:`save` on a background worker thread; returns a Future.

        The mlx arrays are evaluated and referenced now, in the caller's thread; the Future keeps
        those (immutable) buffers alive until the write is acknowledged, so the caller may keep
        generating into its cache meanwhile.
        """
        on_bytes, on_stage = kw.pop("on_bytes", None), kw.pop("on_stage", None)
        job = self._prepare(name, cache, **kw)
        with self._worker_lock:
            if self._worker is None:
                self._worker = ThreadPoolExecutor(1, thread_name_prefix="kv-save")
        return self._worker.submit(self._persist, *job, on_bytes=on_bytes, on_stage=on_stage)

    def close(self) -> None:
        """Wait for background saves and stop the worker."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None

    def _prepare(
        self,
        name: str,
        cache: list[Any],
        *,
        tokens: list[int],
        model: str,
        tokenizer: str = "",
        layout: str = "snapshot",
        model_name: str = "",
        chat_template: bool | None = None,
    ) -> tuple:
        check_snapshot_name(name)
        if layout not in SUFFIX:
            raise InputError(f"kv.layout={layout!r} is not allowed; choose one of {', '.join(SUFFIX)}")
        layers = state.cache_state(cache)
        tokens = [int(t) for t in tokens]
        offsets = {s.meta["offset"] for s in layers if "offset" in s.meta and not s.meta.get("empty")}
        if offsets and offsets != {len(tokens)}:
            raise InputError(f"tokens has {len(tokens)} ids but the cache holds offset(s) {sorted(offsets)}")
        base = {
            "model": model,
            "tokenizer": tokenizer,
            "tokens": tokens,
            "tokens_sha256": fmt.tokens_sha256(tokens),
        }
        base["model_name"] = model_name
        if chat_template is not None:
            base["chat_template"] = bool(chat_template)
        return name, layers, base, layout

    def _persist(
        self, name: str, layers: list, base: dict, layout: str, *, on_bytes: Any = None, on_stage: Any = None
    ) -> SnapshotInfo:
        try:
            return self._publish(name, layers, base, layout, on_bytes=on_bytes, on_stage=on_stage)
        except OSError as e:
            if e.errno is None:
                raise
            raise OSError(
                e.errno,
                f"saving KV snapshot {name!r} in {self.root} failed ({e.strerror}); the previous version is untouched",
            ) from e

    def _publish(
        self, name: str, layers: list, base: dict, layout: str, *, on_bytes: Any = None, on_stage: Any = None
    ) -> SnapshotInfo:
        with self.locked(exclusive=False):
            self._mkdirs()
            target = self.snapshots / f"{name}{SUFFIX[layout]}"
            step = on_stage or (lambda _: None)
            if layout == "snapshot":
                header = snap.write_snapshot(
                    target, layers, base, threads=self.threads, on_bytes=on_bytes, on_step=step
                )
                written = target.stat().st_size
                step("data_written")
            else:
                header, written = blk.write_blocks(
                    self.blocks,
                    layers,
                    base,
                    block_bytes=self.block_bytes,
                    threads=self.threads,
                    on_bytes=on_bytes,
                    on_step=step,
                )
                step("data_written")
                step("manifest")
                data = fmt.encode(header)
                atomic_write_bytes(target, data)
                written += len(data)
            step("cleanup")
            for suffix in FILES:
                if suffix != target.suffix:
                    (self.snapshots / f"{name}{suffix}").unlink(missing_ok=True)
            self.touch(name)
        return self._info(name, target, header, written=written)

    def remember_model(self, fingerprint: str, where: str) -> None:
        """Record which model (directory or repo id) has ``fingerprint``, beside the snapshots
        (``models/<fingerprint>``), for kv_ls and kv_export; snapshots stay path-free."""
        if fmt.HEX64.fullmatch(fingerprint):
            (self.root / "models").mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(self.root / "models" / fingerprint, where.encode())

    def model_of(self, fingerprint: str) -> str:
        """The model recorded for ``fingerprint`` ("" when none)."""
        p = self.root / "models" / fingerprint
        if not fmt.HEX64.fullmatch(fingerprint) or not p.is_file():
            return ""
        return p.read_bytes()[:4096].decode(errors="replace")

    # ------------------------------------------------------------ read
    def touch(self, name: str) -> None:
        """Record a use of ``name`` now (LRU order for kv_gc's size cap)."""
        self.used.mkdir(parents=True, exist_ok=True)
        p = self.used / name
        p.touch()
        os.utime(p)

    def path_of(self, name: str) -> Path:
        """The snapshot file of ``name`` (the newer one if a crash left both layouts)."""
        check_snapshot_name(name)
        found = [p for p in (self.snapshots / f"{name}{s}" for s in FILES) if p.is_file()]
        if not found:
            have = ", ".join(self.names()) or "none"
            raise InputError(f"kv.name={name!r}: no such snapshot in kv.store={self.root}; stored: {have}")
        return max(found, key=lambda p: p.stat().st_mtime_ns)

    def names(self) -> list[str]:
        """Stored snapshot names; an entry that is no regular file (a FIFO, a directory) is a
        warning and skipped, never opened."""
        if not self.snapshots.is_dir():
            return []
        entries = [p for p in self.snapshots.iterdir() if p.suffix in FILES and not p.name.startswith(".")]
        for p in entries:
            if not p.is_file():
                log.warning("kv.store: %s is not a regular file; skipped", p)
        return sorted({p.stem for p in entries if p.is_file()})

    def header(self, name: str) -> tuple[Path, dict[str, Any]]:
        """Validated header of ``name`` (no tensor data read)."""
        path = self.path_of(name)
        what = f"snapshot {name!r}"
        if path.suffix in SNAPSHOT_FILES:
            return path, snap.read_header(path, what=what)
        h, _ = fmt.read_header(path, what=what)
        fmt.check_header(h, what=what)
        blk.check_manifest(h, what=what)
        return path, h

    def _info(self, name: str, path: Path, h: dict[str, Any], *, written: int = 0) -> SnapshotInfo:
        used = self.used / name
        last = used.stat().st_mtime if used.exists() else path.stat().st_mtime
        data = sum(fmt.entry_nbytes(t) for _, t in fmt.tensors_of(h))
        names = tuple(b["hash"] for b in h.get("blocks", ()))
        file_bytes = path.stat().st_size + sum(b["nbytes"] for b in h.get("blocks", ()))
        return SnapshotInfo(
            name,
            h["layout"],
            path,
            len(h["tokens"]),
            data,
            file_bytes,
            h["model"],
            h["tokenizer"],
            last,
            names,
            written,
            h.get("model_name", "") if isinstance(h.get("model_name"), str) else "",
            h["chat_template"] if isinstance(h.get("chat_template"), bool) else None,
        )

    def info(self, name: str) -> SnapshotInfo:
        path, h = self.header(name)
        return self._info(name, path, h)

    def list(self) -> tuple[list[SnapshotInfo], list[str]]:
        """All readable snapshots, and one warning line per unreadable one (the scan goes on)."""
        out, bad = [], []
        for n in self.names():
            try:
                out.append(self.info(n))
            except (fmt.CorruptError, fmt.UnsupportedError, OSError) as e:
                bad.append(str(e))
        return out, bad

    def _check(
        self, name: str, h: dict[str, Any], *, model: str | None, tokenizer: str, tokens: list[int] | None
    ) -> None:
        if model is not None and h["model"] != model:
            raise MismatchError(
                f"snapshot {name!r} was saved for model {h['model'][:16]}, not {model[:16]}; refusing to restore it"
            )
        if tokenizer and h["tokenizer"] and h["tokenizer"] != tokenizer:
            raise MismatchError(
                f"snapshot {name!r} was saved with tokenizer {h['tokenizer'][:16]}, not {tokenizer[:16]}"
            )
        if tokens is not None:
            have = h["tokens"]
            if len(have) > len(tokens) or list(tokens[: len(have)]) != have:
                shared = common_prefix(have, tokens)
                raise MismatchError(
                    f"snapshot {name!r} holds {len(have)} tokens that are not a prefix of the prompt "
                    f"({len(tokens)} tokens, {shared} shared); refusing to restore it"
                )

    def load(
        self,
        name: str,
        *,
        model: str | None,
        tokenizer: str = "",
        tokens: list[int] | None = None,
        verify: bool = True,
    ) -> Restored:
        """Restore ``name`` as new mlx-lm cache objects (nothing of the caller's is touched).

        The header is validated and matched against ``model``/``tokenizer``/``tokens`` (the
        snapshot's tokens must be a prefix of ``tokens``; ``model=None`` skips the model check,
        for exports) before any data is read; all data is
        hashed when ``verify``; caches are built off to the side and returned only when complete.
        """
        what = f"snapshot {name!r}"
        with self.locked(exclusive=False):
            path = self.path_of(name)
            if path.suffix in SNAPSHOT_FILES:
                with snap.opened(path, what=what) as (fd, h, version):
                    self._check(name, h, model=model, tokenizer=tokenizer, tokens=tokens)
                    arrays = snap.restore(fd, h, version, verify=verify, threads=self.threads, what=what)
            else:
                path, h = self.header(name)
                self._check(name, h, model=model, tokenizer=tokenizer, tokens=tokens)
                geo = blk.check_manifest(h, what=what)
                arrays = blk.restore(self.blocks, h, geo, verify=verify, threads=self.threads, what=what)
        cache = _build(h, arrays)
        self.touch(name)
        return Restored(cache=cache, tokens=list(h["tokens"]), info=self._info(name, path, h))

    def lookup(
        self,
        tokens: list[int],
        *,
        model: str,
        tokenizer: str = "",
        unreadable: Callable[[str, Exception], None] | None = None,
    ) -> Match | None:
        """The snapshot for ``model`` whose tokens are the longest prefix of ``tokens``; a snapshot
        whose header cannot be read is skipped, and passed to ``unreadable`` when given."""
        best: Match | None = None
        tokens = list(tokens)
        for n in self.names():
            try:
                _, h = self.header(n)
            except (fmt.CorruptError, fmt.UnsupportedError, OSError) as e:
                if unreadable is not None:
                    unreadable(n, e)
                continue
            have = h["tokens"]
            ok = h["model"] == model and (not tokenizer or not h["tokenizer"] or h["tokenizer"] == tokenizer)
            if (
                ok
                and len(have) <= len(tokens)
                and tokens[: len(have)] == have
                and (best is None or len(have) > best.tokens)
            ):
                best = Match(n, len(have))
        return best

    # ------------------------------------------------------------ verify
    def verify(self, names: list[str] | None = None) -> tuple[int, list[str]]:
        """Re-hash snapshots (all by default) and check blocks/ names; (bytes checked, problems)."""
        problems, checked = self.scan_blocks_dir(), 0
        for n in names or self.names():
            try:
                checked += self._verify_one(n)
            except (fmt.CorruptError, fmt.UnsupportedError, InputError, OSError) as e:
                problems.append(str(e))
        return checked, problems

    def _verify_one(self, name: str) -> int:
        with self.locked(exclusive=False):
            what = f"snapshot {name!r}"
            path = self.path_of(name)
            if path.suffix in SNAPSHOT_FILES:
                with snap.opened(path, what=what) as (fd, h, version):
                    snap.check_tail(fd, h, version, what=what)
                    snap.read_data(fd, h, verify=True, threads=self.threads, what=what)
                    return os.fstat(fd).st_size
            path, h = self.header(name)
            blk.check_manifest(h, what=what)
            for b in h["blocks"]:
                blk.read_block(self.blocks, b["hash"], b["nbytes"], verify=True, what=what)
            return sum(b["nbytes"] for b in h["blocks"]) + path.stat().st_size

    def scan_blocks_dir(self) -> list[str]:
        """Entries of blocks/ that are not regular files named by 64 lower-case hex digits."""
        if not self.blocks.is_dir():
            return []
        bad = []
        for p in sorted(self.blocks.iterdir()):
            if TMP_MARK in p.name and p.name.startswith("."):
                continue
            if not fmt.HEX64.fullmatch(p.name):
                bad.append(f"blocks/{p.name}: not a block name (64 lower-case hex digits)")
            elif p.is_symlink() or not p.is_file():
                bad.append(f"blocks/{p.name}: is a symlink or not a regular file")
        return bad


def _lock_file(root: Path, name: str) -> int:
    """A descriptor to flock ``root/name`` (created if possible); read-only when the store is
    read-only (flock works on those); -1 when it cannot exist there."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        return os.open(root / name, os.O_RDWR | os.O_CREAT, 0o644)
    except (PermissionError, OSError) as e:
        if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
    try:
        return os.open(root / name, os.O_RDONLY)
    except FileNotFoundError:
        return -1


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share (vectorized: a server compares every prompt
    with every entry)."""
    m = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:m], dtype=np.int64) != np.asarray(b[:m], dtype=np.int64))
    return int(differ[0]) if differ.size else m


def _build(h: dict[str, Any], arrays: dict[str, Any]) -> list[Any]:
    """mlx-lm cache objects from validated, filled arrays keyed 'layer.name'."""
    return [
        state.build_layer(
            layer["class"], layer["meta"], {n: arrays.pop(f"{i}.{n}") for n in layer["tensors"]}
        )
        for i, layer in enumerate(h["layers"])
    ]
