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
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import numpy as np

from mlxbun import blas, device
from mlxbun.quant import rounding

# Below this many weights to round, the work stays on threads: the processes' start-up would cost
# more than they save.
MIN_WEIGHTS = 1 << 27


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
        yield ex


def sent(w: Any) -> tuple[np.ndarray, str]:
    """An mx array as float32 numpy and its dtype's name (bfloat16 has no numpy dtype; the
    float32 round trip is exact)."""
    return np.asarray(w.astype(mx.float32)), str(w.dtype).rpartition(".")[2]


def received(a: np.ndarray, dtype: str) -> Any:
    return mx.array(a).astype(getattr(mx, dtype))


def _quantize(w: np.ndarray, dtype: str, hessian: np.ndarray | None, kw: dict) -> tuple[np.ndarray, ...]:
    packed, s, b = rounding.quantize(received(w, dtype), hessian=hessian, **kw)
    mx.eval(packed, s, b)
    return np.asarray(packed), np.asarray(s.astype(mx.float32)), np.asarray(b.astype(mx.float32))


def quantize(ex: ProcessPoolExecutor, w: Any, *, hessian: Any, **kw: Any) -> tuple[Any, Any, Any]:
    """``rounding.quantize(w, hessian=hessian, **kw)`` on a worker (``kw``: bits, group_size, method)."""
    a, dtype = sent(w)
    h = None if hessian is None else np.asarray(hessian)
    packed, s, b = ex.submit(_quantize, a, dtype, h, kw).result()
    return mx.array(packed), received(s, dtype), received(b, dtype)
