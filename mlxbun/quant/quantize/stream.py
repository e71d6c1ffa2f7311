"""The units a conversion is cut into, in mlx-lm's save order, and an ordered thread pool over them.

A unit is one quantized module (its weight, bias ... in, its packed weight, scales, biases out)
or one plain tensor. :func:`stream` converts units (or scores modules: any work) on worker threads
and yields the results in order, with at most ``threads + 1`` in flight, so memory stays at a few
modules.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from mlx.utils import tree_flatten

from mlxbun.quant.skeleton import Skeleton

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class Unit:
    """One step of the stream: a quantized module (its weight, bias...) or one plain tensor."""

    path: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    quant: dict[str, Any] | None
    nbytes: int


def plan_units(sk: Skeleton) -> list[Unit]:
    """The stream in mlx-lm's save order: the quantized skeleton's parameters, grouped by module."""
    units: list[Unit] = []
    for name, _ in tree_flatten(sk.model.parameters()):
        owner = name.rpartition(".")[0]
        if owner in sk.decisions:
            if units and units[-1].path == owner:
                last = units[-1]
                units[-1] = Unit(last.path, last.inputs, (*last.outputs, name), last.quant, last.nbytes)
                continue
            inputs = tuple(f"{owner}.{k}" for k, _ in tree_flatten(sk.originals[owner].parameters()))
            nbytes = sum(sk.weights[k].nbytes for k in inputs)
            units.append(Unit(owner, inputs, (name,), sk.decisions[owner], nbytes))
        else:
            units.append(Unit(name, (name,), (name,), None, sk.weights[name].nbytes))
    return units


def stream(items: Sequence[T], work: Callable[[T], R], *, threads: int) -> Iterator[tuple[T, R]]:
    """``work(item)`` on ``threads`` workers, yielding (item, result) in order; at most threads+1 in
    flight. A failure is raised when its item's turn comes; the items not started are cancelled.

    ``work.prefetch(item)``, when it has one, runs on this thread first (MLX streams are per
    thread: see :class:`mlxbun.quant.quantize.convert.Converter`).
    """
    prefetch = getattr(work, "prefetch", None)
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="mlxbun") as pool:
        todo = iter(items)
        window: deque[tuple[T, Future]] = deque()

        def submit(item: T) -> None:
            if prefetch is not None:
                prefetch(item)
            window.append((item, pool.submit(work, item)))

        try:
            for item in todo:
                submit(item)
                if len(window) > threads:
                    break
            while window:
                item, fut = window.popleft()
                nxt = next(todo, None)
                if nxt is not None:
                    submit(nxt)
                yield item, fut.result()
        finally:
            for _, fut in window:
                fut.cancel()
