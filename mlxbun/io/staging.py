"""Staging protocol: build an output directory under a hidden name and a lock, publish it by rename.

synth, quantize and rotate write through it, so a killed run never leaves something that looks
finished, a re-run of the same job resumes its progress, and runs of other jobs never touch it::

    <root>/                                beside <out>, or a stable root (see stable_root) so
                                           that a re-run into a new run directory finds it
        .<out name>.partial-<key16>/       the staging dir of one job (key: the job's identity)
            .mlxbun-stage.json             marker, written first: {"version", "kind", "key",
                                           "target"}; target is the absolute <out> of the run
                                           that last claimed it (the marker is never published)
            ...                            the job's own files: ShardedWriter journal and
                                           shards, side files, the job's record
        .<out name>.partial-<key16>.lock   flock held while a run works on that staging dir
    <out>/                                 the staging dir renamed, without the marker

A run goes through these steps; :func:`reached` names each one (fault-injection tests kill the
process there and check that a re-run gives the same bytes):

    locked     lock held, nothing written
    created    staging dir exists, no marker yet
    claimed    marker written; the job writes its files
    weights    (called by the job) its ShardedWriter finished: final shard names, no journal
    built      every file written; the marker is removed next
    unmarked   marker removed, rename next
    published  <out> exists; the lock file is removed next

What a re-run finds and does, holding the lock:

- a staging dir with this job's marker: resumed (unless ``resume=False``: emptied), without
  the unfinished atomic writes (``.<name>.tmp-*``) a kill left in it;
- a staging dir without a readable marker (a kill at ``created``, while the marker was being
  written, or at ``unmarked``): its name carries this job's key, so it is emptied and reused;
- a staging dir of the same kind and target with another key whose lock a live run holds:
  this job is refused before any work (only one of the two could publish ``<out>``);
- staging dirs of the same kind and target with another key and a free lock (an earlier job
  into this same ``<out>``): kept, so that job can still resume, until this one publishes; then
  removed (they can never be published now). Staging dirs of other targets are other runs'
  resumable progress and are never touched.
- at publish, an ``<out>`` that appeared meanwhile (a job that slipped past the check): nothing
  is published, the staging dir is removed, and the error names ``<out>``.

Scratch space (fisher's spills) follows the same idea without a target: a :class:`ScratchDir`
``$TMPDIR/<prefix><pid>-<random>/`` holds its own ``.lock`` while its process lives; making one
removes those of dead processes whose lock is free.

A job that may reuse an existing ``<out>`` (quantize) records :func:`digest_files` of its files
in its own record before publishing and reuses ``<out>`` only when :func:`damaged_files` finds
nothing; a damaged ``<out>`` of its own is removed with :func:`discard_dir` and built again.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import tempfile
import weakref
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

from mlxbun.errors import EnvironmentFailure, InputError
from mlxbun.io.atomic import TMP_MARK, atomic_write_json, fsync_dir, publish_dir
from mlxbun.io.digest import file_digest
from mlxbun.io.shards import JOURNAL

log = logging.getLogger("mlxbun")

STAGE_MARKER = ".mlxbun-stage.json"
MARKER_VERSION = 1
STEPS = ("locked", "created", "claimed", "weights", "built", "unmarked", "published")
KEY_CHARS = 16
DIGEST = "xxh3_128"


def reached(step: str) -> None:
    """A named step of the protocol (one of STEPS); fault-injection tests kill the process here."""


def stable_root(outputs: str | Path, out: Path) -> Path:
    """``<outputs>/.partial`` when it is on ``out``'s filesystem (publishing is a rename), else
    ``out``'s parent: a stable place, so a re-run into a new run directory resumes."""
    root = Path(outputs).expanduser().absolute() / ".partial"
    root.mkdir(parents=True, exist_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    return root if os.stat(root).st_dev == os.stat(out.parent).st_dev else out.parent


def staging_dir(out: Path, key: str, root: str | Path | None = None) -> Path:
    """Where the job ``key`` builds ``out``."""
    base = Path(root).expanduser().absolute() if root else out.parent
    return base / f".{out.name}.partial-{key[:KEY_CHARS]}"


def weights_written(d: Path) -> bool:
    """Did a ShardedWriter finish in ``d``? It deletes its journal last, after the final names."""
    return not (d / JOURNAL).exists() and any(d.glob("model*.safetensors"))


# ---------------------------------------------------------------------------- locks


def _open_locked(path: Path, *, wait: bool) -> IO[str] | None:
    """Open and flock ``path``; None if ``wait`` is False and another process holds it.

    The lock file is unlinked after a publish, so after taking the lock check that the name
    still points at the locked file; otherwise a newcomer could lock a fresh file beside us.
    """
    while True:
        f = open(path, "a")
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            f.close()
            return None
        try:
            if os.stat(path).st_ino == os.fstat(f.fileno()).st_ino:
                return f
        except FileNotFoundError:
            pass
        f.close()


def read_json_object(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``, or None when it is missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_marker(d: Path) -> dict[str, Any] | None:
    """The stage marker of staging dir ``d``, or None when missing or unreadable."""
    return read_json_object(d / STAGE_MARKER)


# ---------------------------------------------------------------------------- digests


def _visible_files(d: Path) -> list[Path]:
    return sorted(p for p in d.rglob("*") if p.is_file() and not p.name.startswith("."))


def digest_files(d: Path, *, known: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """{relative name: {"xxh3_128", "size"}} of every visible file under ``d`` (sorted).

    ``known`` (relative name -> xxh3_128) gives digests computed while the files were written
    (a ShardedWriter's ``extra_digests``): those files are not read again.
    """
    known = known or {}
    files = _visible_files(d)
    todo = [p for p in files if p.relative_to(d).as_posix() not in known]
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        hashed = dict(zip(todo, pool.map(lambda p: file_digest(p, DIGEST), todo), strict=True))
    return {
        (rel := p.relative_to(d).as_posix()): {DIGEST: known.get(rel) or hashed[p], "size": p.stat().st_size}
        for p in files
    }


def damaged_files(d: Path, files: dict[str, dict[str, Any]]) -> list[str]:
    """Files of ``files`` (as :func:`digest_files` wrote them) that are missing or differ in ``d``.

    Each entry says what is wrong, e.g. ``"model-00002-of-00003.safetensors: missing"``.
    """
    bad = []
    for name, want in sorted(files.items()):
        p = d / name
        if ".." in Path(name).parts or not p.is_file():
            bad.append(f"{name}: missing")
        elif p.stat().st_size != want.get("size"):
            bad.append(f"{name}: size {p.stat().st_size}, recorded {want.get('size')}")
        elif file_digest(p, DIGEST) != want.get(DIGEST):
            bad.append(f"{name}: {DIGEST} differs from the one recorded at publish")
    return bad


def discard_dir(d: Path) -> None:
    """Delete a directory of ours: renamed to a hidden name first, so a kill mid-way never leaves
    a half-deleted directory under its real name."""
    trash = d.with_name(f".{d.name}.discard")
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(d, trash)
    fsync_dir(d.parent)
    shutil.rmtree(trash)


# ---------------------------------------------------------------------------- the stage


class Stage:
    """One job's staging dir, held under its lock; calls in order: claim, (write), publish.

    Args:
        out: the directory to publish.
        kind: the command ("quantize", "synth", "rotate"); stale dirs are swept per kind.
        key: hex identity of the job (what must match for a resume).
        root: where staging dirs live (default: beside ``out``); same filesystem as ``out``.

    Example:
        >>> with Stage.locked(out, kind="synth", key=spec_hash) as stage:
        ...     stage.claim()
        ...     write_files(stage.dir)
        ...     stage.publish()
    """

    def __init__(self, out: Path, *, kind: str, key: str, root: str | Path | None) -> None:
        self.out = Path(out).absolute()
        self.kind, self.key = kind, key
        self.dir = staging_dir(self.out, key, root)
        self.lock = self.dir.with_name(self.dir.name + ".lock")
        self.resumed = False
        self.setting: str | None = None
        self._state = "locked"

    @classmethod
    @contextlib.contextmanager
    def locked(
        cls, out: Path, *, kind: str, key: str, root: str | Path | None = None, setting: str | None = None
    ) -> Iterator[Stage]:
        """Hold the lock of the staging dir for ``key`` (waiting for a run that holds it).

        ``setting``: the config key that named ``out`` (``quant.out``), to name when the
        directory cannot be written."""
        stage = cls(out, kind=kind, key=key, root=root)
        stage.setting = setting
        f = stage._take_lock(setting)
        try:
            reached("locked")
            yield stage
        finally:
            if not stage.dir.exists():  # published, discarded or never claimed: nothing to guard
                stage.lock.unlink(missing_ok=True)  # a waiter re-checks the name after locking
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
            f.close()

    def _take_lock(self, setting: str | None) -> IO[str]:
        """The lock, or an error naming the directory the user gave (not the hidden lock file)."""
        try:
            self.dir.parent.mkdir(parents=True, exist_ok=True)
            f = _open_locked(self.lock, wait=True)
        except OSError as e:
            raise EnvironmentFailure(
                f"{self._named()}: cannot write in {self.dir.parent} ({e.strerror or e}); choose a writable"
                " directory"
            ) from None
        return f  # waited for it: never None

    def claim(self, *, resume: bool = True) -> bool:
        """Sweep stale dirs, then keep (resume) or empty the staging dir and mark it ours.

        Returns whether a previous run's progress is kept.
        """
        self._require("locked", "claim")
        self._refuse_live_others()
        marker = read_marker(self.dir)
        self.resumed = (
            resume and marker is not None and (marker.get("kind"), marker.get("key")) == (self.kind, self.key)
        )
        if not self.resumed and self.dir.exists():
            shutil.rmtree(self.dir)
        if self.resumed:
            drop_temp_files(self.dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        reached("created")
        mine = {"version": MARKER_VERSION, "kind": self.kind, "key": self.key, "target": str(self.out)}
        if marker != mine:
            atomic_write_json(self.dir / STAGE_MARKER, mine)
        reached("claimed")
        self._state = "claimed"
        return self.resumed

    def publish(self) -> Path:
        """fsync every file, drop the marker, rename the staging dir to ``out``.

        The lock file goes when the lock is released, as for any stage without a staging dir.
        """
        self._require("claimed", "publish")
        for p in sorted(self.dir.rglob("*")):
            if p.is_file():
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        reached("built")
        (self.dir / STAGE_MARKER).unlink()
        fsync_dir(self.dir)
        reached("unmarked")
        self.out.parent.mkdir(parents=True, exist_ok=True)
        if os.path.lexists(self.out):  # another job published here while this one ran
            self.discard()
            raise EnvironmentFailure(
                f"{self._named()}: another job published {self.out} while this one ran; nothing of this"
                " job was published and its staging dir was removed"
            )
        publish_dir(self.dir, self.out)
        reached("published")
        self._state = "published"
        sweep_stale(self.dir.parent, out=self.out, kind=self.kind, keep=self.dir)
        return self.out

    def _named(self) -> str:
        """The output as the user named it: ``quant.out='<dir>'``, or the path alone."""
        return f"{self.setting}={str(self.out)!r}" if self.setting else str(self.out)

    def _refuse_live_others(self) -> None:
        """Another job of this kind building the same ``out`` with other settings, still running:
        only one of the two could publish, so this one stops before any work."""
        for d in _same_target(self.dir.parent, out=self.out, kind=self.kind, keep=self.dir):
            f = _open_locked(d.with_name(d.name + ".lock"), wait=False)
            if f is None:
                raise InputError(
                    f"{self._named()} is being built by another {self.kind} job with other settings"
                    f" (its staging dir {d} is locked by a running process); wait for it, or choose"
                    f" another {self.setting or 'output directory'}"
                )
            f.close()

    def discard(self) -> None:
        """Delete the staging dir (the job failed in a way a resume would repeat)."""
        shutil.rmtree(self.dir, ignore_errors=True)
        self._state = "discarded"

    def _require(self, state: str, call: str) -> None:
        if self._state != state:
            raise RuntimeError(f"{call}() on a stage that is {self._state} ({self.dir})")


def drop_temp_files(d: Path) -> None:
    """Remove unfinished atomic writes (``.<name>.tmp-*``) a killed run left in ``d``: a resumed
    staging dir never adopts them (they would be published with it)."""
    for p in sorted(d.rglob(f".*{TMP_MARK}*")):
        if p.is_file() or p.is_symlink():
            p.unlink(missing_ok=True)


def _same_target(root: Path, *, out: Path, kind: str, keep: Path) -> list[Path]:
    """Staging dirs in ``root`` of jobs of ``kind`` into ``out`` other than ``keep``."""
    name = re.compile(re.escape(f".{out.name}.partial-") + f"[0-9a-f]{{{KEY_CHARS}}}")
    found = []
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        if d == keep or not name.fullmatch(d.name) or not d.is_dir():
            continue
        marker = read_marker(d)
        if marker is not None and (marker.get("kind"), marker.get("target")) == (kind, str(out)):
            found.append(d)
    return found


def sweep_stale(root: Path, *, out: Path, kind: str, keep: Path) -> list[Path]:
    """Remove staging dirs in ``root`` of the same ``kind`` and target ``out`` but another key.

    Those jobs can never be published to ``out`` once this one is; dirs whose lock is held by a
    live run, dirs of other targets (other runs' resumable progress) and dirs without a readable
    marker are kept.
    """
    removed = []
    for d in _same_target(root, out=out, kind=kind, keep=keep):
        lock = d.with_name(d.name + ".lock")
        f = _open_locked(lock, wait=False)
        if f is None:
            continue
        try:
            shutil.rmtree(d)
            lock.unlink(missing_ok=True)
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
            f.close()
        log.info("removed %s: an earlier %s into %s that was never finished", d, kind, out)
        removed.append(d)
    return removed


# ---------------------------------------------------------------------------- scratch dirs

SCRATCH_LOCK = ".lock"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class ScratchDir:
    """A private temporary directory, ``$TMPDIR/<prefix><pid>-<random>/``, locked (``.lock``
    inside, flock held) for as long as this object lives. Making one first removes the ones
    left by processes that are gone (a SIGKILL never runs a cleanup): see :func:`sweep_scratch`.

    Example:
        >>> scratch = ScratchDir("mlxbun-fisher-")
        >>> np.save(Path(scratch.name) / "1.npy", a)
        >>> scratch.cleanup()
    """

    def __init__(self, prefix: str) -> None:
        sweep_scratch(prefix)
        self.name = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-")
        self._lock = _open_locked(Path(self.name) / SCRATCH_LOCK, wait=True)
        self._finalizer = weakref.finalize(self, _remove_scratch, self.name, self._lock)

    def cleanup(self) -> None:
        self._finalizer()


def _remove_scratch(name: str, lock: IO[str] | None) -> None:
    shutil.rmtree(name, ignore_errors=True)
    if lock is not None:
        lock.close()


def sweep_scratch(prefix: str) -> list[Path]:
    """Remove ``$TMPDIR/<prefix><pid>-*`` dirs whose process is gone and whose lock is free
    (the lock keeps a live process of another pid namespace's dir)."""
    name = re.compile(re.escape(prefix) + r"(\d+)-")
    removed = []
    for d in sorted(Path(tempfile.gettempdir()).glob(f"{prefix}*")):
        m = name.match(d.name)
        if m is None or not d.is_dir() or d.is_symlink() or _alive(int(m[1])):
            continue
        try:
            f = _open_locked(d / SCRATCH_LOCK, wait=False)
        except OSError:  # removed meanwhile by another sweeper
            continue
        if f is None:
            continue
        try:
            size = sum(p.stat().st_size for p in d.rglob("*") if p.is_file())
            shutil.rmtree(d, ignore_errors=True)
        finally:
            f.close()
        log.info("removed %s (%d bytes): scratch of process %s, which is gone", d, size, m[1])
        removed.append(d)
    return removed
