"""allocate.interactions, the rounds: measure, solve again, keep a plan only when the model's KL is
lower; and whether they run at all (nothing to gain, or more memory than there is).

Each round measures the steps nearest the knapsack's threshold in the planned, quantized model
(``interactions.near_threshold``, ``InModel.kl_with``), solves again with the costs they rescale
(``interactions.scaled_costs``, then ``measured_only``) and keeps the new plan only when the
model's KL is lower; the next round starts from it. The rounds' report goes to plan.json
(``"interactions"``). ``interactions.py`` holds the measuring and the cost curves.

Interactions hold the float32 model twice (original and fake-quantized weights) and one batch's
float64 logits, probabilities and their product (24 bytes per token and vocabulary entry):
:func:`interactions_batch` bounds the batch, :func:`interactions_skip_memory` says when that does
not fit.

Example:
    >>> sol, report = improve(paths, options, fixed, sol, resolve, in_model, decisions=16, rounds=2)
    >>> report["kl_after"] <= report["kl_before"]
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from mlxbun.host import available_memory
from mlxbun.progress import Progress, human_bytes
from mlxbun.quant.allocate.interactions import (
    BARRED,
    InModel,
    Option,
    Step,
    chosen,
    measured_only,
    near_threshold,
    scaled_costs,
)
from mlxbun.quant.allocate.knapsack import Solution
from mlxbun.quant.spec import QuantSpec


@dataclass
class Round:
    """One round: the plan's KL it started from, its measured steps (from options ``starts``),
    the KL of each re-solved plan tried, and whether the last one was kept."""

    kl_before: float
    steps: list[Step]
    starts: list[int]
    tried: list[float]
    kept: bool

    def to_json(self, options: Sequence[Sequence[Option]]) -> dict[str, Any]:
        return {
            "kl_before": self.kl_before,
            "tried": self.tried,
            "kept": self.kept,
            "median_ratio": statistics.median(s.ratio for s in self.steps) if self.steps else None,
            "steps": [s.to_json(options[s.item], j) for s, j in zip(self.steps, self.starts, strict=True)],
        }


def interactions_skip(
    settings: Collection[QuantSpec], *, largest: bool, hessians: bool = False
) -> str | None:
    """Why interactions cannot help a plan over these candidates (None: they can); ``hessians``:
    whether the modules' input Hessians are given (gptq's weights need them)."""
    methods = {s.method for s in settings}
    if rounding := sorted(methods - {"rtn", "clip", "gptq"}):
        return f"candidates round by {', '.join(rounding)}; interactions measure rtn, clip and gptq"
    if "gptq" in methods and not hessians:
        return "gptq candidates need quant.hessians to be measured"
    if largest:
        return "every module already takes its largest candidate"
    return None


def _measured(
    options: Sequence[Sequence[Option]], steps: list[Step], in_model: InModel, kl: float, progress: Progress
) -> list[Step]:
    """Each step's change of the model's KL, measured in block order (one pass of hidden states)."""
    order = sorted(range(len(steps)), key=lambda k: (in_model.start(steps[k].path), k))
    out = list(steps)
    for k in order:
        s = steps[k]
        out[k] = replace(s, measured=in_model.kl_with(s.path, options[s.item][s.to][0]) - kl)
        progress.update(1, work=_blocks_run(in_model, s.path))
    return out


def _blocks_run(in_model: InModel, path: str) -> int:
    """The blocks (and head) a measurement of ``path`` runs: its cost, as progress work."""
    return in_model.stack.n + 1 - in_model.start(path)


def _round_progress(progress: Progress, in_model: InModel, near: list[Step], *, r: int, rounds: int) -> None:
    """Count ``progress`` to the end of round ``r``: its steps, and the blocks they run (a step
    near the embedding runs the whole model, one at the head a block or two)."""
    progress.total = progress.done + len(near)
    progress.work_total = progress.work + sum(_blocks_run(in_model, s.path) for s in near)
    progress.desc = f"interactions (round {r + 1} of at most {rounds})"


def improve(
    paths: Sequence[str],
    options: Sequence[Sequence[Option]],
    fixed: Mapping[str, QuantSpec | None],
    sol: Solution,
    resolve: Callable[[list[list[Option]]], Solution | None],
    in_model: InModel,
    *,
    decisions: int,
    rounds: int,
) -> tuple[Solution, dict[str, Any]]:
    """Rounds of ``mlxbun.quant.allocate.interactions``: measure the steps nearest the threshold in the
    quantized model, solve with the rescaled costs, keep the new plan when its KL is lower.
    ``paths``/``options``: the knapsack items; ``resolve(options)`` solves them at other costs;
    ``fixed``: the unmeasured modules' settings as written (None where the group does not fit)."""
    first, done, spent = sol, [], in_model.forwards
    # The ETA runs to the end of the current round: a round that keeps nothing is the last one.
    progress = Progress(total=decisions, unit="steps", desc="interactions", heartbeat=True)
    try:
        kl = in_model.set({**fixed, **chosen(paths, options, sol.choice)})
        kl_before = kl
        sol, kl = _rounds(
            paths,
            options,
            fixed,
            sol,
            kl,
            resolve,
            in_model,
            done,
            progress,
            decisions=decisions,
            rounds=rounds,
        )
    finally:
        progress.close()
    cost = sum(opts[j][2] for opts, j in zip(options, sol.choice, strict=True))
    report: dict[str, Any] = {
        "decisions": decisions,
        "rounds": [r.to_json(options) for r in done],
        "kl_before": kl_before,
        "kl_after": kl,
        "forwards": in_model.forwards - spent,  # the reference's one pass is the InModel's
    }
    moved = sol is not first  # the optimum of other costs: not of the summed KL, LP bound still one
    return replace(sol, cost=cost, lower_bound=first.lower_bound, exact=first.exact and not moved), report


def _rounds(
    paths: Sequence[str],
    options: Sequence[Sequence[Option]],
    fixed: Mapping[str, QuantSpec | None],
    sol: Solution,
    kl: float,
    resolve: Callable[[list[list[Option]]], Solution | None],
    in_model: InModel,
    done: list[Round],
    progress: Progress,
    *,
    decisions: int,
    rounds: int,
) -> tuple[Solution, float]:
    """Up to ``rounds`` rounds from ``sol`` (model KL ``kl``); each is appended to ``done``."""
    for r in range(rounds):
        near = near_threshold(options, sol.choice, paths, decisions)
        _round_progress(progress, in_model, near, r=r, rounds=rounds)
        steps = _measured(options, near, in_model, kl, progress)
        tried: list[float] = []
        for costs in (scaled_costs, measured_only):
            new = resolve(costs(options, sol.choice, steps))
            if new is None or new.choice == sol.choice or new.cost >= BARRED:
                continue
            tried.append(in_model.set({**fixed, **chosen(paths, options, new.choice)}))
            if tried[-1] < kl:
                break
        kept = bool(tried) and tried[-1] < kl
        done.append(Round(kl, steps, [sol.choice[s.item] for s in steps], tried, kept))
        if not kept:
            break
        sol, kl = new, tried[-1]
    return sol, kl


# ------------------------------------------------------------------------------- memory

MEMORY_SHARE = 0.8  # what interactions may take of the available memory
LOGITS_BYTES = 1 << 30  # a batch's float64 logits and probabilities: at most this (>= 1 sample)


def interactions_batch(*, batch_size: int, seq_len: int, vocab: int) -> int:
    """Samples per forward: ``batch_size``, fewer when a batch's float64 logits, probabilities
    and their product would pass ``LOGITS_BYTES`` (large vocabularies)."""
    per_sample = 24 * seq_len * max(vocab, 1)
    return max(1, min(batch_size, LOGITS_BYTES // per_sample))


def interactions_skip_memory(*, parameters: int, batch: int, seq_len: int, vocab: int) -> str | None:
    """Why interactions would not fit in memory (None: they fit): the float32 model twice and one
    batch's float64 logits, probabilities and their product against ``MEMORY_SHARE`` of what is
    available."""
    logits = 24 * batch * seq_len * vocab
    need = 8 * parameters + logits
    avail = available_memory()
    if avail is None or need <= MEMORY_SHARE * avail:
        return None
    return (
        f"they need about {human_bytes(need)} and {human_bytes(avail)} is available;"
        " the plan minimises the summed KL alone (allocate.interactions=0 says so without this warning)"
    )
