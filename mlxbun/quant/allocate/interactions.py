"""allocate.interactions: re-measure a plan's closest decisions in the quantized model, then solve again.

The allocator minimises summed KL: each module's KL measured (or estimated) with the rest of the
model at full precision. In a quantized model modules interact, and unevenly: a plan's KL is
not its sum, and one step of one module can cost several times its summed value
(``bench/plan_interactions.py`` measures both). Whichever side of the knapsack's threshold such
a step falls on decides the plan. So, after the first solve:

1. every module is fake-quantized as planned (``InModel.set``) and the model's KL against the
   full-precision reference is measured on the calibration set;
2. the ``decisions`` steps nearest the threshold (the cheapest downgrades by KL added per byte
   saved, the most valuable upgrades by KL saved per byte, alternately; :func:`near_threshold`)
   are each measured in that model: one module moved one step along its front, a forward from
   its block (``InModel.kl_with``);
3. each measured step's ratio to its summed change scales its module's cost curve on that side
   of the planned option; every other curve is scaled by the median ratio, so measured and
   unmeasured modules stay on one scale (:func:`scaled_costs`);
4. the knapsack is solved again and the new plan measured; when the model's KL is not lower, it
   is solved once more allowing only the measured steps, at their measured costs
   (:func:`measured_only`). A plan is kept only when the model's KL is lower, and the next round
   starts from it (the loop: ``interaction_rounds.py``).

Each module gets the weight quantize would write for its setting (``probe.fake_quant``):
round-to-nearest, or the clip / gptq rounding with the module's input Hessian (``quant.hessians``),
dequantized to float32, so every forward is a float32 matmul through the BLAS (never bf16 on the
CPU). awq candidates are not measured (their scales fold across modules). Cost per round: one partial forward per decision and two whole forwards, over the
calibration set; the report in plan.json (``"interactions"``) counts them.

Example:
    >>> with InModel(src, tokens) as m:
    ...     plan = allocate(sens, model_dir=src, budget_bytes=1_600_000, in_model=m)
    >>> plan.interactions["kl_after"] <= plan.interactions["kl_before"]
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import islice, zip_longest
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlxbun.kl import kl_from_stats, log_probs
from mlxbun.quant.allocate.knapsack import pareto
from mlxbun.quant.hessian import Hessians
from mlxbun.quant.plan import hessians_file
from mlxbun.quant.probe import (
    Spill,
    Stack,
    block_of,
    fake_quant,
    find_blocks,
    load_model,
    module_at,
    source_dtypes,
)
from mlxbun.quant.spec import QuantSpec

RATIO_RANGE = (1 / 4, 32.0)  # a measured step against its summed change, clipped: below, luck, not signal
Option = tuple[QuantSpec, int, float]  # setting, bytes, summed KL
BARRED = 1e30  # the cost of an option a re-solve may not take (finite: the DP adds costs)


@dataclass(frozen=True)
class Step:
    """Module ``path`` (knapsack item ``item``) moved from its planned option to option ``to``.

    ``summed`` is the change of the summed objective (> 0: worse), ``measured`` the change of the
    quantized model's KL."""

    item: int
    path: str
    to: int
    summed: float
    measured: float | None = None

    @property
    def down(self) -> bool:
        return self.summed > 0

    @property
    def ratio(self) -> float:
        r = (self.measured or 0.0) / self.summed
        return min(max(r, RATIO_RANGE[0]), RATIO_RANGE[1])

    def to_json(self, options: Sequence[Option], start: int) -> dict[str, Any]:
        frm, to = options[start][0], options[self.to][0]
        return {
            "path": self.path,
            "from": frm.to_dict(),
            "to": to.to_dict(),
            "summed": self.summed,
            "measured": self.measured,
            "ratio": self.ratio,
        }


def chosen(
    paths: Sequence[str], options: Sequence[Sequence[Option]], choice: Sequence[int]
) -> dict[str, QuantSpec]:
    """The setting each knapsack item (module ``paths[i]``) takes under ``choice``."""
    return {p: options[i][j][0] for i, (p, j) in enumerate(zip(paths, choice, strict=True))}


def near_threshold(
    options: Sequence[Sequence[Option]], choice: Sequence[int], paths: Sequence[str], n: int
) -> list[Step]:
    """The ``n`` one-step moves the summed objective finds closest to worthwhile.

    Downgrades by KL added per byte saved (ascending) and upgrades by KL saved per byte
    (descending), taken alternately; steps run along each module's Pareto front."""
    downs, ups = [], []
    for i, (opts, j) in enumerate(zip(options, choice, strict=True)):
        front = pareto([o[1] for o in opts], [o[2] for o in opts])
        if j not in front:
            continue
        k = front.index(j)
        for other, into in (
            (front[k - 1] if k else None, downs),
            (front[k + 1] if k + 1 < len(front) else None, ups),
        ):
            if other is None:
                continue
            summed = opts[other][2] - opts[j][2]
            per_byte = abs(summed) / abs(opts[other][1] - opts[j][1])
            into.append((per_byte, Step(i, paths[i], other, summed)))
    downs.sort(key=lambda e: (e[0], e[1].path))
    ups.sort(key=lambda e: (-e[0], e[1].path))
    alternate = (e[1] for pair in zip_longest(downs, ups) for e in pair if e is not None)
    return list(islice(alternate, n))


def scaled_costs(
    options: Sequence[Sequence[Option]], choice: Sequence[int], steps: Sequence[Step]
) -> list[list[Option]]:
    """Every module's costs around its planned option: a measured step scaled by its own ratio,
    any change beyond it (and every unmeasured one) by the median of the measured ratios."""
    measured = [s for s in steps if s.measured is not None]
    if not measured:
        return [list(o) for o in options]
    median = statistics.median(s.ratio for s in measured)
    side = {(s.item, s.down): s for s in measured}
    out = []
    for i, (opts, j) in enumerate(zip(options, choice, strict=True)):
        base_bytes, base = opts[j][1], opts[j][2]
        row = []
        for spec, nbytes, cost in opts:
            step = side.get((i, nbytes < base_bytes)) if nbytes != base_bytes else None
            if step is None:
                row.append((spec, nbytes, base + median * (cost - base)))
                continue
            edge_bytes, edge = opts[step.to][1], opts[step.to][2]
            if abs(nbytes - base_bytes) <= abs(edge_bytes - base_bytes):
                row.append((spec, nbytes, base + step.ratio * (cost - base)))
            else:
                row.append((spec, nbytes, base + step.ratio * (edge - base) + median * (cost - edge)))
        out.append(row)
    return out


def measured_only(
    options: Sequence[Sequence[Option]], choice: Sequence[int], steps: Sequence[Step]
) -> list[list[Option]]:
    """Costs that allow only the measured steps: each at its planned option's cost plus its
    measured change (clipped by ``RATIO_RANGE``); every other option costs ``BARRED``."""
    moves = {(s.item, s.to): s.summed * s.ratio for s in steps if s.measured is not None}
    out = []
    for i, (opts, j) in enumerate(zip(options, choice, strict=True)):
        base = opts[j][2]
        out.append(
            [
                (spec, nbytes, base if k == j else base + moves[(i, k)] if (i, k) in moves else BARRED)
                for k, (spec, nbytes, _) in enumerate(opts)
            ]
        )
    return out


# ------------------------------------------------------------------------------- the quantized model


class InModel:
    """The model with every module fake-quantized as a plan says, and its KL against the reference.

    The reference's probabilities (float32: samples x tokens x vocab x 4 bytes, 7.5 GB for a
    150k vocabulary at 24 x 512) are computed once per calibration batch and spilled to a
    temporary directory; ``set`` installs a plan, ``kl_with`` moves one module and runs the
    blocks from its own (the hidden state entering that block is kept for the plan in place).
    ``forwards`` counts forward-pass equivalents over the calibration set."""

    def __init__(
        self, model_dir: str | Path, tokens: Any, *, batch_size: int = 8, hessians: str | Path | None = None
    ) -> None:
        self.hessians = None if hessians is None else Hessians(hessians_file(hessians))
        self._rounded: dict[tuple[str, QuantSpec], Any] = {}  # clip/gptq weights: made once
        self.model, _, _ = load_model(model_dir)
        self.stack = Stack(self.model)
        owner_path = find_blocks(self.model)[1]
        self._prefix = f"{owner_path}.layers." if owner_path else "layers."
        self.dtypes = source_dtypes(model_dir)
        self.batches = [mx.array(tokens[i : i + batch_size]) for i in range(0, len(tokens), batch_size)]
        self.n_samples = len(tokens)
        self.refs = Spill()
        for j, b in enumerate(self.batches):
            logp = log_probs(self.model(b))
            p = np.exp(logp).astype(np.float32)  # half the spill; the entropy term uses the same p,
            self.refs.put(f"p{j}", p)  # so the reference itself still scores 0
            self.refs.put(f"negent{j}", (p * logp).sum(axis=-1))
        self.forwards = 1.0
        self._original: dict[str, Any] = {}
        self._layers: dict[str, QuantSpec | None] = {}
        self._entry: tuple[int, list | None] = (0, None)  # (block, hidden states entering it)

    def __enter__(self) -> InModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.refs.close()

    def set(self, layers: Mapping[str, QuantSpec | None]) -> float:
        """Install ``layers`` (path -> setting, None: full precision); the whole model's KL."""
        for path in {*layers, *self._layers}:
            if path not in self._layers or self._layers.get(path) != layers.get(path):
                self._put(path, layers.get(path))
        self._layers = dict(layers)
        self._entry = (0, None)
        self.forwards += 1.0
        return self._kl(0, None)

    def kl_with(self, path: str, spec: QuantSpec | None) -> float:
        """The model's KL with ``path`` at ``spec`` and everything else as set; then put back."""
        start = self.start(path)
        hs = self._advance(start)
        self._put(path, spec)
        try:
            self.forwards += (self.stack.n + 1 - start) / (self.stack.n + 1)
            return self._kl(start, hs)
        finally:
            self._put(path, self._layers.get(path))

    def start(self, path: str) -> int:
        """The first block a change of ``path`` runs (the head's index for the head)."""
        return min(block_of(path, prefix=self._prefix, n_blocks=self.stack.n), self.stack.n)

    def _put(self, path: str, spec: QuantSpec | None) -> None:
        mod = module_at(self.model, path)
        original = self._original.setdefault(path, mod.weight)
        mod.weight = original if spec is None else self._quantized(path, original, spec)
        mx.eval(mod.weight)

    def _quantized(self, path: str, original: Any, spec: QuantSpec) -> Any:
        """The float32 weight ``path`` has at ``spec``; a clip/gptq one is kept (its rounding is slow)."""
        dtype = self.dtypes.get(path, "bfloat16")
        if spec.method == "rtn":
            return fake_quant(original, spec, dtype=dtype)
        key = (path, spec)
        if key not in self._rounded:
            h = self.hessians.get(path) if self.hessians is not None else None
            self._rounded[key] = fake_quant(original, spec, dtype=dtype, hessian=h)
        return self._rounded[key]

    def _advance(self, to: int) -> list | None:
        """Hidden states entering block ``to`` under the plan in place (kept for the next call)."""
        at, hs = self._entry
        if to < at:
            at, hs = 0, None
        if to > at:
            hs = [
                self.stack.forward(b, start=at, h=None if hs is None else hs[j], stop=to)
                for j, b in enumerate(self.batches)
            ]
            mx.eval(hs)
            self.forwards += (to - at) / (self.stack.n + 1)
        self._entry = (to, hs)
        return hs

    def kl_of(self, model_dir: str | Path) -> float:
        """The KL of another model (the plan as written) against this reference, on the same
        batches: no second reference pass. The last call: the in-model weights are dropped first,
        so memory holds one model."""
        self.model = self.stack = None
        self._original, self._rounded = {}, {}
        cur, _, _ = load_model(model_dir)
        total = 0.0
        for j, b in enumerate(self.batches):
            logits = cur(b).astype(mx.float32)
            mx.eval(logits)
            total += float(kl_from_stats(self._stats(j), logits).sum())
        self.forwards += 1.0
        return total / self.n_samples

    def _stats(self, j: int) -> tuple[Any, Any]:
        return self.refs.get(f"p{j}", mmap=True), self.refs.get(f"negent{j}")

    def _kl(self, start: int, hs: list | None) -> float:
        total = 0.0
        for j, b in enumerate(self.batches):
            logits = self.stack.forward(b, start=start, h=None if hs is None else hs[j]).astype(mx.float32)
            mx.eval(logits)
            total += float(kl_from_stats(self._stats(j), logits).sum())
        return total / self.n_samples
