"""DirectFile: the same bytes as a buffered write at every size around its block and buffer edges,
through O_DIRECT where the filesystem allows it and through the page cache where it does not."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest

from mlxbun.io import direct
from mlxbun.io.direct import ALIGN, BUFFER, DirectFile

SIZES = [0, 1, ALIGN - 1, ALIGN, ALIGN + 1, BUFFER - 1, BUFFER, BUFFER + ALIGN + 3, 2 * BUFFER + 17]


def _pieces(total: int, seed: int) -> list[bytes]:
    """``total`` random bytes cut into pieces of random, unaligned lengths."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, total, dtype=np.uint8).tobytes()
    cuts = sorted(set(rng.integers(0, total + 1, 5).tolist())) if total else []
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, total], strict=True)]


@pytest.mark.parametrize("total", SIZES)
def test_bytes_and_size_match_the_writes(tmp_path: Path, total: int) -> None:
    pieces = _pieces(total, total)
    with DirectFile(tmp_path / "f") as f:
        for p in pieces:
            f.write(memoryview(p))
    assert f.size == total and (tmp_path / "f").read_bytes() == b"".join(pieces)


def test_a_filesystem_without_o_direct_gets_a_buffered_write(tmp_path: Path, monkeypatch) -> None:
    real = os.open

    def no_direct(path, flags, *a):
        if flags & direct.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real(path, flags, *a)

    monkeypatch.setattr(os, "open", no_direct)
    pieces = _pieces(BUFFER + 5, 1)
    with DirectFile(tmp_path / "f") as f:
        assert not f.direct
        for p in pieces:
            f.write(p)
    assert (tmp_path / "f").read_bytes() == b"".join(pieces)


@pytest.mark.skipif(not direct.O_DIRECT or not Path("/dev/shm").is_dir(), reason="Linux O_DIRECT, tmpfs")
def test_tmpfs_with_or_without_o_direct_gets_the_bytes(tmp_path: Path) -> None:
    target = Path("/dev/shm") / f"mlxbun-direct-{os.getpid()}"
    try:
        with DirectFile(target) as f:
            f.write(b"x" * (ALIGN + 1))
        assert target.read_bytes() == b"x" * (ALIGN + 1)
    finally:
        target.unlink(missing_ok=True)


def test_an_error_mid_write_closes_the_file(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), DirectFile(tmp_path / "f") as f:
        f.write(b"y" * 10)
        raise RuntimeError("producer failed")
    assert f.fd == -1 and f.buf is None


@pytest.mark.parametrize("error", [OSError(errno.EFBIG, "File too large"), KeyboardInterrupt()])
def test_an_error_inside_a_write_is_the_error_raised(tmp_path: Path, monkeypatch, error) -> None:
    """A write that fails (full disk, a signal) while a view of the buffer is still alive in
    the traceback: closing the buffer must not replace the error with a BufferError."""
    f = DirectFile(tmp_path / "f")
    if not f.direct:
        f.abandon()
        pytest.skip("no O_DIRECT on this filesystem")

    def failing(fd: int, data: memoryview) -> None:
        raise error

    monkeypatch.setattr(direct, "_write_all", failing)
    with pytest.raises(type(error)) as raised, f:
        f.write(b"z" * (BUFFER + ALIGN))  # fills the buffer: a drain, which fails
    assert f.fd == -1 and f.buf is None
    if isinstance(error, OSError):  # os.write's error names no file: the file is named
        assert raised.value.errno == errno.EFBIG and raised.value.filename == str(tmp_path / "f")
