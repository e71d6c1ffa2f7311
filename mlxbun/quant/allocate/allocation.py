"""The allocation: the knapsack problem a sensitivity and the source model make, solved under the
budget, and the plan it gives (:class:`Allocation`, which plan.json records).

Each measured module is an item whose options are its candidate settings, with their bytes
(:mod:`mlxbun.quant.allocate.budget`) and KL; unmeasured modules take the default setting, raised by
the ``allocate.protect`` rules (:mod:`mlxbun.quant.allocate.protect`). The multiple-choice knapsack
(:mod:`mlxbun.quant.allocate.knapsack`) picks one option per item within the budget; with a model
to measure in, the rounds of :mod:`mlxbun.quant.allocate.rounds` then re-measure the closest
decisions. The command around it is :mod:`mlxbun.quant.allocate.command`.

Example:
    >>> plan = allocate(load_sensitivity(run), model_dir=src, budget_bpw=4.5, protect=["lm_head:6"])
    >>> plan.size.bpw <= 4.5, plan.kl_sum
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mlxbun.errors import InputError
from mlxbun.io.dtypes import CODES
from mlxbun.io.safetensors import read_config
from mlxbun.quant.allocate import budget
from mlxbun.quant.allocate.budget import SizeReport, Source
from mlxbun.quant.allocate.interactions import InModel, Option, chosen
from mlxbun.quant.allocate.knapsack import Solution, solve
from mlxbun.quant.allocate.protect import count_blocks, fixed_setting, min_bits
from mlxbun.quant.allocate.rounds import improve, interactions_skip
from mlxbun.quant.plan import Plan
from mlxbun.quant.quantize.convert import resolve_dtype
from mlxbun.quant.sensitivity.file import LayerSensitivity, Sensitivity
from mlxbun.quant.spec import QuantSpec, Rule, check_budget

log = logging.getLogger("mlxbun")

DEFAULT = QuantSpec(bits=4, group_size=64, mode="affine")


@dataclass(frozen=True)
class Choice:
    """The setting one module gets (None: unquantized), its KL (None: not measured) and bytes."""

    setting: QuantSpec | None
    kl: float | None
    nbytes: int

    def to_json(self) -> dict[str, Any]:
        head = self.setting.to_dict() if self.setting else {"bits": None, "group_size": None, "mode": None}
        return {**head, "kl": self.kl, "bytes": self.nbytes, "measured": self.kl is not None}


@dataclass(frozen=True)
class Allocation:
    """A per-layer plan with its predicted size and KL: plan.json is its :meth:`to_json`."""

    default: QuantSpec
    choices: Mapping[str, Choice]
    size: SizeReport
    kl_sum: float
    budget: Mapping[str, Any] = field(default_factory=dict)
    solver: Mapping[str, Any] = field(default_factory=dict)
    source: Mapping[str, Any] = field(default_factory=dict)
    interactions: Mapping[str, Any] = field(default_factory=dict)

    @property
    def layers(self) -> dict[str, QuantSpec | None]:
        return {p: c.setting for p, c in self.choices.items()}

    @property
    def plan(self) -> Plan:
        """What ``quantize`` reads (:class:`mlxbun.quant.plan.Plan`)."""
        return Plan(default=self.default, layers=self.layers)

    def to_json(self) -> dict[str, Any]:
        """plan.json: the plan's keys, and the report beside them (which plan readers ignore)."""
        return {
            **self.plan.to_dict(),
            "predicted_bytes": self.size.file_bytes,
            "predicted_bpw": self.size.bpw,
            "predicted_kl_sum": self.kl_sum,
            "predicted": self.size.to_json(),
            "budget": dict(self.budget),
            "solver": dict(self.solver),
            "source": dict(self.source),
            "choices": {p: c.to_json() for p, c in sorted(self.choices.items())},
            **({"interactions": dict(self.interactions)} if self.interactions else {}),
        }


@dataclass(frozen=True)
class SourceModel:
    """The model a plan is made for, opened once: its directory, its config.json, and its tensors
    as quantize will write them (:class:`budget.Source`, from the safetensors headers)."""

    path: Path
    config: Mapping[str, Any]
    tensors: Source

    @classmethod
    def of(cls, model: str | Path | SourceModel) -> SourceModel:
        """``model`` itself when already opened, else the model directory it names, opened."""
        if isinstance(model, SourceModel):
            return model
        path = Path(model)
        return cls(path, read_config(path), budget.read_source(path))

    def out_dtype(self, dtype: str | None) -> str | None:
        """The safetensors code of the dtype quantize will write for ``quant.dtype=dtype``, by its rule."""
        resolved = resolve_dtype(dtype, self.config)
        return CODES[resolved] if resolved else None

    @property
    def vocab(self) -> int:
        return int(self.config.get("vocab_size", 0))


@dataclass
class _Problem:
    """The knapsack items (measured modules) and what is fixed around them."""

    paths: list[str]
    options: list[list[tuple[QuantSpec, int, float]]]
    fixed: dict[str, QuantSpec | None]


def _problem(
    sens: Sensitivity,
    source: Source,
    *,
    candidates: Collection[QuantSpec] | None,
    rules: Sequence[Rule],
    default: QuantSpec,
    out_dtype: str | None,
) -> _Problem:
    shapes, dtypes = source.shapes, source.weight_dtypes(out_dtype)
    unknown = sorted(set(sens.layers) - set(shapes))
    if unknown:
        raise InputError(
            f"allocate.sensitivity has module {unknown[0]!r}, which is not a quantizable module of the"
            f" model ({len(unknown)} such); pass the sensitivity of this model"
        )
    n_blocks = count_blocks(shapes)
    paths, options, fixed = [], [], {}
    for path, shape in sorted(shapes.items()):
        need = min_bits(path, rules, n_blocks=n_blocks)
        if path not in sens.layers:
            fixed[path] = fixed_setting(path, shape, default, need)
            continue
        opts = [
            (s, budget.weight_bytes(shape, s, dtypes[path]), kl)
            for s, kl in sorted(sens.layers[path].kl.items())
            if (candidates is None or s in candidates) and s.fits(shape) and s.bits >= need
        ]
        if not opts:
            measured = ", ".join(f"{s.mode}:{s.bits}:{s.group_size}" for s in sorted(sens.layers[path].kl))
            raise InputError(
                f"no candidate setting is left for {path!r} (measured {measured}; needs >= {need} bits,"
                f" in_features={shape[-1]}); widen allocate.bits/group_sizes/modes or probe more bits"
            )
        paths.append(path)
        options.append(opts)
    return _Problem(paths, options, fixed)


def _predict(
    source: Source, default: QuantSpec, layers: Mapping[str, QuantSpec | None], **kw: Any
) -> SizeReport:
    return budget.predict(source, default=default, layers=layers, **kw)


def _range_error(key: str, value: float, lo: SizeReport, hi: SizeReport) -> InputError:
    return InputError(
        f"{key}={value} cannot be met: the candidates give between {lo.bpw:.4f} and {hi.bpw:.4f} bpw"
        f" ({lo.tensor_bytes} to {hi.tensor_bytes} tensor bytes, {lo.file_bytes} to {hi.file_bytes} bytes"
        " on disk); choose a budget in that range or add lower-bit candidates"
    )


def allocate(
    sens: Sensitivity,
    *,
    model_dir: str | Path | SourceModel,
    candidates: Collection[QuantSpec] | None = None,
    budget_bpw: float | None = None,
    budget_bytes: int | None = None,
    protect: Sequence[str | Rule] = (),
    default: QuantSpec = DEFAULT,
    out_dtype: str | None = "bfloat16",
    shard_bytes: int = 5 << 30,
    max_states: int = 1 << 16,
    in_model: InModel | None = None,
    decisions: int = 16,
    rounds: int = 2,
) -> Allocation:
    """Choose one setting per measured module, minimising summed KL within the budget.

    Modules absent from ``sens`` (embeddings, an unprobed lm_head) take ``default`` (raised by
    ``protect`` rules) and count in the budget like everything else.

    Args:
        sens: per-module KL (see :func:`load_sensitivity`).
        model_dir: the source model the sensitivity was measured on (a directory, or a
            :class:`SourceModel` already opened).
        candidates: settings allowed (None: every measured one).
        budget_bpw: bits per weight over all stored tensors (``budget.SizeReport.bpw``).
        budget_bytes: bytes of the ``.safetensors`` files on disk, headers included.
        protect: ``"pattern:min_bits"`` rules (see :class:`Rule`).
        default: setting of unmeasured modules and the plan's ``default``.
        out_dtype: dtype quantize writes (scales, biases and unquantized tensors); None follows
            config.json as ``quantize`` does.
        shard_bytes: the writer's shard limit (headers are per shard).
        max_states: knapsack DP states before sizes are rounded (see ``knapsack``).
        in_model: the model to measure how modules interact in (``mlxbun.quant.allocate.interactions``);
            None: the summed objective alone.
        decisions: steps near the threshold measured per round in ``in_model``.
        rounds: re-solves at most (each kept only when the model's KL is lower).

    Example:
        >>> plan = allocate(load_sensitivity(run), model_dir=src, budget_bpw=4.5, protect=["lm_head:6"])
        >>> plan.size.bpw <= 4.5, plan.kl_sum
    """
    check_budget(budget_bpw, budget_bytes)
    model = SourceModel.of(model_dir)
    kw = {"out_dtype": model.out_dtype(out_dtype), "shard_bytes": shard_bytes}
    rules = [r if isinstance(r, Rule) else Rule.parse(r) for r in protect]
    prob = _problem(
        sens, model.tensors, candidates=candidates, rules=rules, default=default, out_dtype=kw["out_dtype"]
    )
    limit = _Budget.of(
        prob, model.tensors, default, kw, bpw=budget_bpw, nbytes=budget_bytes, max_states=max_states
    )
    sol = limit.solve(prob)
    if sol is None:
        raise _range_error(limit.key, limit.value, limit.lo, limit.hi)
    limit.warn_when_loose()
    largest = all(j == _pick_index(opts, max) for opts, j in zip(prob.options, sol.choice, strict=True))
    report: dict[str, Any] = {}
    if in_model is not None and decisions > 0:
        sol, report = _in_model(
            prob, sol, limit, in_model, largest=largest, decisions=decisions, rounds=rounds
        )
    plan = _plan(prob, sol, model.tensors, default, kw, sens, limits=limit.record(), interactions=report)
    return replace(plan, solver={**plan.solver, "largest": largest})


@dataclass(frozen=True)
class _Budget:
    """The budget as the knapsack meets it: the key it was given as, its limit in bytes (tensor
    bytes for ``budget_bpw``, file bytes for ``budget_bytes``), and the smallest (``lo``) and
    largest (``hi``) plans the candidates give."""

    key: str
    value: float
    limit: int
    source: Source
    default: QuantSpec
    kw: Mapping[str, Any]
    max_states: int
    lo: SizeReport
    hi: SizeReport

    @classmethod
    def of(
        cls,
        prob: _Problem,
        source: Source,
        default: QuantSpec,
        kw: Mapping[str, Any],
        *,
        bpw: float | None,
        nbytes: int | None,
        max_states: int,
    ) -> _Budget:
        lo = _predict(source, default, {**prob.fixed, **_pick(prob, min)}, **kw)
        hi = _predict(source, default, {**prob.fixed, **_pick(prob, max)}, **kw)
        if bpw is not None:
            key, value, limit = "allocate.budget_bpw", bpw, math.floor(bpw * source.parameters / 8)
        else:
            key, value, limit = "allocate.budget_bytes", nbytes, nbytes
        return cls(key, value, limit, source, default, dict(kw), max_states, lo, hi)

    @property
    def in_tensor_bytes(self) -> bool:
        """Bits per weight count stored tensor bytes; a bytes budget counts the files."""
        return self.key == "allocate.budget_bpw"

    def solve(self, prob: _Problem) -> Solution | None:
        """The knapsack's best choice for ``prob`` within the budget (None: nothing fits)."""
        fixed_bytes = self.lo.tensor_bytes - sum(min(o[1] for o in opts) for opts in prob.options)
        if not self.in_tensor_bytes:
            return _solve_file_budget(
                prob, self.source, self.default, self.limit, fixed_bytes, self.lo, self.max_states, self.kw
            )
        capacity = self.limit - fixed_bytes
        return solve(_items(prob), capacity, max_states=self.max_states) if capacity >= 0 else None

    def warn_when_loose(self) -> None:
        """Say so when even every module's largest candidate stays under the budget."""
        if (self.hi.tensor_bytes if self.in_tensor_bytes else self.hi.file_bytes) < self.limit:
            log.warning(
                "%s=%s is more than the largest plan needs (%.4f bpw, %d bytes on disk): every module takes"
                " its lowest-KL candidate and the plan is smaller than the budget",
                self.key, self.value, self.hi.bpw, self.hi.file_bytes,
            )  # fmt: skip

    def record(self) -> dict[str, Any]:
        """plan.json's "budget"."""
        unit = "tensor" if self.in_tensor_bytes else "file"
        return {"key": self.key, "value": self.value, "limit_bytes": self.limit, "unit": unit}


def _in_model(
    prob: _Problem,
    sol: Solution,
    limit: _Budget,
    in_model: InModel,
    *,
    largest: bool,
    decisions: int,
    rounds: int,
) -> tuple[Solution, dict[str, Any]]:
    """``sol`` improved by measuring its closest decisions in the quantized model
    (``allocate.interactions``), with the rounds' report; or ``sol`` and why that was skipped."""
    settings = {o[0] for opts in prob.options for o in opts}
    if why := interactions_skip(settings, largest=largest, hessians=in_model.hessians is not None):
        log.warning("allocate.interactions skipped: %s", why)
        return sol, {"skipped": why}
    fixed = {p: budget.resolve(p, limit.source.shapes[p], s, {}) for p, s in prob.fixed.items()}

    def resolve(options: list[list[Option]]) -> Solution | None:
        return limit.solve(_Problem(prob.paths, options, prob.fixed))

    return improve(
        prob.paths, prob.options, fixed, sol, resolve, in_model, decisions=decisions, rounds=rounds
    )


def check_reachable(
    settings: Collection[QuantSpec],
    *,
    model_dir: str | Path | SourceModel,
    budget_bpw: float | None,
    budget_bytes: int | None,
    default: QuantSpec = DEFAULT,
    out_dtype: str | None = "bfloat16",
    shard_bytes: int = 5 << 30,
) -> None:
    """Refuse, before anything is measured, a budget below the smallest plan ``settings`` can give:
    every module at its smallest fitting setting (others at ``default``; protection rules only add
    bytes, so they are left out), from the safetensors headers alone. Raises :func:`allocate`'s error."""
    model = SourceModel.of(model_dir)
    source, code = model.tensors, model.out_dtype(out_dtype)
    layers = {}
    for path, shape in source.shapes.items():
        if fitting := {s: 0.0 for s in settings if s.fits(shape)}:
            layers[path] = LayerSensitivity(path, 0, fitting)
    prob = _problem(Sensitivity(layers), source, candidates=None, rules=[], default=default, out_dtype=code)
    kw = {"out_dtype": code, "shard_bytes": shard_bytes}
    lo = _predict(source, default, {**prob.fixed, **_pick(prob, min)}, **kw)
    if budget_bpw is not None and lo.tensor_bytes > math.floor(budget_bpw * source.parameters / 8):
        key, value = "allocate.budget_bpw", budget_bpw
    elif budget_bytes is not None and lo.file_bytes > budget_bytes:
        key, value = "allocate.budget_bytes", budget_bytes
    else:
        return
    raise _range_error(key, value, lo, _predict(source, default, {**prob.fixed, **_pick(prob, max)}, **kw))


def _pick_index(opts: list[tuple[QuantSpec, int, float]], by: Any) -> int:
    return by(range(len(opts)), key=lambda k: (opts[k][1], -opts[k][2]))


def _pick(prob: _Problem, by: Any) -> dict[str, QuantSpec]:
    """Each item's cheapest (min) or largest (max) option by bytes."""
    return {
        p: by(opts, key=lambda o: (o[1], -o[2]))[0] for p, opts in zip(prob.paths, prob.options, strict=True)
    }


def _items(prob: _Problem) -> list[tuple[list[int], list[float]]]:
    return [([o[1] for o in opts], [o[2] for o in opts]) for opts in prob.options]


def _solve_file_budget(
    prob: _Problem,
    source: Source,
    default: QuantSpec,
    budget_bytes: int,
    fixed_bytes: int,
    lo: SizeReport,
    max_states: int,
    kw: dict[str, Any],
) -> Solution | None:
    """Headers depend (by a few bytes) on the choice: solve, measure the overshoot, tighten, repeat."""
    capacity = budget_bytes - fixed_bytes - (lo.file_bytes - lo.tensor_bytes)
    for _ in range(16):
        sol = solve(_items(prob), capacity, max_states=max_states) if capacity >= 0 else None
        if sol is None:
            return None
        layers = {**prob.fixed, **_chosen(prob, sol)}
        over = _predict(source, default, layers, **kw).file_bytes - budget_bytes
        if over <= 0:
            return sol
        # Below this choice's own bytes: a cut smaller than the slack under capacity would
        # return the same choice again.
        capacity = min(capacity, sol.nbytes) - over
    return None


def _chosen(prob: _Problem, sol: Solution) -> dict[str, QuantSpec]:
    return chosen(prob.paths, prob.options, sol.choice)


def _plan(
    prob: _Problem,
    sol: Solution,
    source: Source,
    default: QuantSpec,
    kw: dict[str, Any],
    sens: Sensitivity,
    *,
    limits: Mapping[str, Any],
    interactions: Mapping[str, Any],
) -> Allocation:
    shapes, dtypes = source.shapes, source.weight_dtypes(kw["out_dtype"])
    choices: dict[str, Choice] = {}
    for i, (path, j) in enumerate(zip(prob.paths, sol.choice, strict=True)):
        setting, nbytes, kl = prob.options[i][j]
        choices[path] = Choice(setting, kl, nbytes)
    for path, setting in prob.fixed.items():
        real = budget.resolve(path, shapes[path], setting, {})
        choices[path] = Choice(real, None, budget.weight_bytes(shapes[path], real, dtypes[path]))
    size = _predict(source, default, {p: c.setting for p, c in choices.items()}, **kw)
    solver = {
        "exact": sol.exact,
        "unit_bytes": sol.unit,
        "lower_bound": sol.lower_bound,
        "gap_bound": sol.cost - sol.lower_bound,
        "slack_bound_bytes": sol.slack_bound,
        "items": len(prob.paths),
    }
    src = {  # fingerprints, not paths: the same inputs give the same plan.json bytes anywhere
        "model_fingerprint": sens.model_fingerprint,
        "calibration_fingerprint": sens.calibration_fingerprint,
        "out_dtype": kw["out_dtype"],
        "shard_bytes": kw["shard_bytes"],
    }
    return Allocation(default, choices, size, sol.cost, dict(limits), solver, src, dict(interactions))


def candidate_filter(
    sens: Sensitivity,
    *,
    bits: Collection[int],
    group_sizes: Collection[int],
    modes: Collection[str],
    methods: Collection[str] = (),
) -> set[QuantSpec]:
    """Measured settings allowed by the config lists (an empty list allows any)."""
    measured = {s for layer in sens.layers.values() for s in layer.kl}
    return {
        s
        for s in measured
        if (not bits or s.bits in bits)
        and (not group_sizes or s.group_size in group_sizes)
        and (not modes or s.mode in modes)
        and (not methods or s.method in methods)
    }
