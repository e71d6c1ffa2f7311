"""The units a conversion is cut into, in mlx-lm's save order, and an ordered thread pool over them.

A unit is one quantized module (its weight, bias ... in, its packed weight, scales, biases out)
or one plain tensor. :func:`stream` converts units on worker threads and yields the results in
order, with at most ``threads + 1`` units in flight, so memory stays at a few modules.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from mlx.utils import tree_flatten

from mlxbun.quant.plan import Skeleton


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


def stream(units: list[Unit], convert: Any, *, threads: int) -> Iterator[tuple[Unit, list[tuple[str, Any]]]]:
    """Convert units on ``threads`` workers, yielding results in order; at most threads+1 in flight.

    ``convert``: called with a unit on a worker, returns its (name, array) results; its
    ``prefetch(unit)`` runs on this thread first (see :class:`mlxbun.quant.convert.Converter`).
    """
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="quantize") as pool:
        todo = iter(units)
        window: deque[tuple[Unit, Future]] = deque()
        try:
            for unit in todo:
                convert.prefetch(unit)
                window.append((unit, pool.submit(convert, unit)))
                if len(window) > threads:
                    break
            while window:
                unit, fut = window.popleft()
                nxt = next(todo, None)
                if nxt is not None:
                    convert.prefetch(nxt)
                    window.append((nxt, pool.submit(convert, nxt)))
                yield unit, fut.result()
        finally:
            for _, fut in window:
                fut.cancel()
