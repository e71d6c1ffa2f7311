"""Worker processes for the rounding searches (clip, GPTQ) and the candidates' errors.

MLX's CPU work from two Python threads of one process runs about one at a time, while two
processes run side by side (BENCHMARKS.md has the timings). So on MLX's CPU backend a big model's
rounding goes to
``threads`` processes (each started with the same BLAS, ``mlxbun.blas``), fed by the threads that
stream its modules; a small one's stays on threads, where a process's start-up (importing mlx)
would cost more than it saves.
A worker runs exactly the in-process code on the same inputs, so the results are the same bits.

Example:
    >>> with workers.pool(threads=2, weights=n) as pool:
    ...     packed, scales, biases = workers.quantize(pool, w, hessian=h, bits=4, group_size=64, method="gptq")
    ...     errs = pool.submit(task, *workers.sent(w)).result()  # task: a module-level function
    >>> h = workers.hessian_for(hessians, path)  # a file's H is read by the worker, not sent
"""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from mlxbun import blas, device
from mlxbun.quant import rounding
from mlxbun.quant.hessian import Hessians

# Below this many weights to round, the work stays on threads: the processes' start-up would cost
# more than they save.
MIN_WEIGHTS = 1 << 27
# A task whose H is at least this many bytes (float32) runs while no other such task does: GPTQ's
# factorization holds three H-sized arrays (5.5 GB at a 21,504-wide MLP), and two workers on two
# such modules at once set the candidate scores' peak at Gemma-3-27B's width.
BIG_H_BYTES = 256 << 20


@contextmanager
def pool(*, threads: int, weights: int) -> Iterator[ProcessPoolExecutor | None]:
    """``threads`` worker processes when there are several and ``weights`` reaches
    :data:`MIN_WEIGHTS`, else None (the callers round in this process). Never on a GPU: each
    process would hold the device and its own copy of what it works on, while one process's
    streams keep the device busy."""
    if threads <= 1 or weights < MIN_WEIGHTS or device.name() == "gpu":
        yield None
        return
    loaded = blas.load()
    library = loaded["library"] if loaded.get("loaded") else "off"
    ctx = multiprocessing.get_context("spawn")  # never fork a process that has MLX's threads
    # the initializer lives in mlx-free mlxbun.blas: a worker loads the BLAS before this module
    # (and with it mlx.core) is imported for its first task
    with ProcessPoolExecutor(
        max_workers=threads, mp_context=ctx, initializer=blas.load, initargs=(library,)
    ) as ex:
        ex.big = threading.Lock()  # type: ignore[attr-defined]  # see :func:`run`
        yield ex


def run(ex: Any, fn: Any, *args: Any, width: int) -> Any:
    """``fn(*args)`` on a worker of ``ex`` (:func:`pool`'s), its result; a task for a module whose
    H is ``width`` wide waits while another task at least :data:`BIG_H_BYTES` big runs, when it is
    one too."""
    big = getattr(ex, "big", None) if 4 * width * width >= BIG_H_BYTES else None
    with big or nullcontext():
        return ex.submit(fn, *args).result()


@dataclass(frozen=True)
class HessianRef:
    """A module's H as a worker is sent it: its hessians file and key. The worker reads it from the
    file, so neither this process's copy nor its pickled bytes exist (at a 21,504-wide MLP each
    is 1.85 GB)."""

    file: str
    key: str

    def read(self) -> np.ndarray:
        return Hessians(self.file)[self.key]


def hessian_for(hessians: Mapping[str, Any], key: str) -> HessianRef | np.ndarray | None:
    """What a worker is sent for module ``key``'s H in ``hessians``: a :class:`HessianRef` when
    they are a hessians file, else the array (None: there is none)."""
    if isinstance(hessians, Hessians):
        return HessianRef(str(hessians.path), key) if key in hessians else None
    h = hessians.get(key)
    return None if h is None else np.asarray(h)


def received_hessian(h: HessianRef | np.ndarray | None) -> np.ndarray | None:
    return h.read() if isinstance(h, HessianRef) else h


def sent(w: Any) -> tuple[np.ndarray, str]:
    """An mx array as float32 numpy and its dtype's name (bfloat16 has no numpy dtype; the
    float32 round trip is exact)."""
    return np.asarray(w.astype(mx.float32)), str(w.dtype).rpartition(".")[2]


def received(a: np.ndarray, dtype: str) -> Any:
    return mx.array(a).astype(getattr(mx, dtype))


def _quantize(w: np.ndarray, dtype: str, hessian: Any, kw: dict) -> tuple[np.ndarray, ...]:
    packed, s, b = rounding.quantize(received(w, dtype), hessian=received_hessian(hessian), **kw)
    mx.eval(packed, s, b)
    return np.asarray(packed), np.asarray(s.astype(mx.float32)), np.asarray(b.astype(mx.float32))


def quantize(ex: ProcessPoolExecutor, w: Any, *, hessian: Any, **kw: Any) -> tuple[Any, Any, Any]:
    """``rounding.quantize(w, hessian=H, **kw)`` on a worker (``kw``: bits, group_size, method;
    ``hessian``: :func:`hessian_for`'s)."""
    a, dtype = sent(w)
    packed, s, b = run(ex, _quantize, a, dtype, hessian, kw, width=a.shape[-1])
    return mx.array(packed), received(s, dtype), received(b, dtype)
