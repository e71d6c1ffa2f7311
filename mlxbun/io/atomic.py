"""Atomic publication of files and directories: temp name in the same directory, fsync, rename.

A reader never sees a half-written file under its final name: data goes to a hidden
``.<name>.tmp-<pid>-<rand>`` sibling, is fsync'd, renamed over the final name, and the parent
directory is fsync'd so the rename itself survives a power loss.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

TMP_MARK = ".tmp-"


def tmp_sibling(path: Path) -> Path:
    """A hidden temporary name beside ``path`` that no reader mistakes for the final file."""
    return path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}")


def fsync_dir(path: Path) -> None:
    """fsync a directory so that renames and creations inside it are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_open(path: str | Path, mode: str = "wb") -> Iterator[IO[Any]]:
    """Open a temp sibling of ``path``; on clean exit fsync it, rename it over ``path``, fsync dir.

    On an exception the temp file is removed and ``path`` is left as it was.

    Example:
        >>> with atomic_open(out / "config.json", "w") as f:
        ...     f.write("{}")
    """
    path = Path(path)
    tmp = tmp_sibling(path)
    f = open(tmp, mode)
    try:
        yield f
        f.flush()
        os.fsync(f.fileno())
        f.close()
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        f.close()
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically."""
    with atomic_open(path, "wb") as f:
        f.write(data)


def atomic_save(path: str | Path, save: Callable[[str], None]) -> None:
    """``save(name)`` writes a file (e.g. ``mx.save_safetensors``, which appends ``.safetensors``
    to a name without it) under a temp name ending like ``path``; then fsync, rename over ``path``,
    fsync the directory. On an exception the temp file is removed and ``path`` is left as it was."""
    path = Path(path)
    tmp = Path(f"{tmp_sibling(path)}{path.suffix}")
    try:
        save(str(tmp))
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def dumps_json(obj: Any) -> str:
    """Canonical JSON for artifacts: sorted keys, 2-space indent, trailing newline."""
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def atomic_write_json(path: str | Path, obj: Any) -> None:
    """Write ``obj`` as canonical JSON to ``path`` atomically."""
    atomic_write_bytes(path, dumps_json(obj).encode())


def publish_dir(tmp_dir: Path, final_dir: Path) -> None:
    """Rename a fully written (and fsync'd) directory to its final name, then fsync the parent."""
    os.replace(tmp_dir, final_dir)
    fsync_dir(final_dir.parent)


FICLONE = 0x40049409  # Linux ioctl: share src's extents copy-on-write (btrfs, XFS, bcachefs)


def publish_copy(src: Path, dst: Path) -> None:
    """Put a copy of ``src`` at ``dst`` atomically: a reflink where the file system has them (no
    second copy of the bytes, yet a write to either file leaves the other as it was), else a
    copy in the kernel. Never a hard link: a cache entry and a run's output must not be one file,
    or damage to one is damage to both."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(dst) as f, open(src, "rb") as data:
        try:
            fcntl.ioctl(f.fileno(), FICLONE, data.fileno())
            return
        except OSError:  # no reflinks here, or across file systems
            pass
        size, done = os.fstat(data.fileno()).st_size, 0
        try:
            while done < size and (n := os.copy_file_range(data.fileno(), f.fileno(), size - done)):
                done += n
        except OSError:  # an older kernel or a file system without it
            f.seek(done)
            data.seek(done)
            shutil.copyfileobj(data, f, 16 << 20)


@contextlib.contextmanager
def file_lock(path: str | Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing) for the duration of the block.

    Two processes building the same output (same spec, same conversion) serialise on it; the
    second then finds the first one's result.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
