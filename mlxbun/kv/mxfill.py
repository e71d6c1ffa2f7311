"""Fill a new mlx buffer in one pass: ``mx.load`` reads a synthesized .npy stream whose data we write.

``mx.load(file_object, format="npy")`` allocates the array and calls ``readinto`` with its own
memory, so a restore can read and hash tensor bytes straight into mlx-owned memory: no zero-fill
pass (``mx.zeros`` costs about as much as the whole read here) and no extra copy
(``mx.array(numpy)``). Tensors are then zero-copy views of the one buffer.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

ALIGN = 64
MX_DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32, "uint32": mx.uint32}


class _Feed(io.RawIOBase):
    """An .npy stream: header bytes, then data produced by ``fill(dest)`` on the first data read."""

    def __init__(self, total: int, fill: Callable[[np.ndarray], None]) -> None:
        buf = io.BytesIO()
        np.lib.format.write_array_header_1_0(buf, {"descr": "|u1", "fortran_order": False, "shape": (total,)})
        self.head, self.total, self.fill = buf.getvalue(), total, fill
        self.pos, self.staging, self.error = 0, None, None

    def readable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = (
            pos if whence == 0 else (self.pos + pos if whence == 1 else len(self.head) + self.total + pos)
        )
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b: Any) -> int:
        m = memoryview(b).cast("B")
        if self.pos < len(self.head):
            n = min(len(m), len(self.head) - self.pos)
            m[:n] = self.head[self.pos : self.pos + n]
        else:
            n = self._data(m, self.pos - len(self.head))
        self.pos += n
        return n

    def _data(self, m: memoryview, off: int) -> int:
        n = min(len(m), self.total - off)
        try:
            if off == 0 and n == self.total and self.staging is None:
                self.fill(np.frombuffer(m, np.uint8, count=n))  # the common case: mlx's own memory
            else:  # mlx reads in pieces: fill a staging buffer once, copy out
                if self.staging is None:
                    self.staging = np.empty(self.total, np.uint8)
                    self.fill(self.staging)
                m[:n] = memoryview(self.staging)[off : off + n]
        except BaseException as e:  # surfaced by load_filled(); mlx would wrap it
            self.error = e
            return 0
        return n


def layout(entries: list[tuple[str, int]]) -> tuple[dict[str, int], int]:
    """Offsets (aligned) of named byte ranges packed into one buffer, and its total size."""
    offsets, pos = {}, 0
    for name, nbytes in entries:
        offsets[name] = pos
        pos = -(-(pos + nbytes) // ALIGN) * ALIGN
    return offsets, pos


def load_filled(total: int, fill: Callable[[np.ndarray], None]) -> mx.array:
    """A new uint8 mlx array of ``total`` bytes whose contents ``fill(dest)`` writes."""
    feed = _Feed(total, fill)
    try:
        out = mx.load(feed, format="npy")
        mx.eval(out)
    except Exception:
        if feed.error is not None:
            raise feed.error from None
        raise
    if feed.error is not None:
        raise feed.error
    return out


def view(buf: mx.array, offset: int, dtype: str, shape: list[int]) -> mx.array:
    """A zero-copy typed view of ``buf[offset:]``."""
    n = int(np.prod(shape)) * np.dtype(np.uint16 if dtype == "bfloat16" else dtype).itemsize
    return buf[offset : offset + n].view(MX_DTYPES[dtype]).reshape(shape)
