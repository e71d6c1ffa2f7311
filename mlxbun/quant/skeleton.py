"""Which module gets quantized how: the model skeleton, quantized lazily by a setting, plan or mixed rule.

The structure comes from mlx-lm's own model class for the source's ``model_type``, built from
``config.json`` without materializing a weight: parameters are lazy MLX arrays that are never
evaluated, and the source tensors are lazy ``mx.load`` views (headers only). The model's
``sanitize`` runs on those views, so renames, drops (tied ``lm_head``, rotary ``inv_freq``) and
stacking (MoE experts) follow mlx-lm exactly; ``nn.quantize`` then runs on the skeleton with
the same predicate as ``mlx_lm.utils.quantize_model``, which gives the output tensor names, their
order (``tree_flatten`` of the parameters, as ``mlx_lm.utils.save_model`` writes them) and the
config ``quantization`` block, all before any weight is read.

The setting type and the tables of what MLX supports live in ``mlxbun.quant.spec``, plan.json in
``mlxbun.quant.plan``.

Example:
    >>> sk, spec = prepare("path/to/hf_model", mode="affine", bits=4)
    >>> sorted(sk.decisions)[:2], sk.quantization["bits"]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxbun.errors import InputError
from mlxbun.io.safetensors import open_model
from mlxbun.quant.mlxlm import load_config, mixed_quant_predicate_builder, model_classes
from mlxbun.quant.plan import Plan, load_plan
from mlxbun.quant.spec import QuantSpec, check_mixed, spec_for

# ------------------------------------------------------------------------------- skeleton


@dataclass
class Skeleton:
    """A model class instance with lazy parameters, and the sanitized lazy source tensors.

    Args:
        model: the mlx-lm model (quantized in place by :func:`apply_quantization`).
        config: config.json as ``mlx_lm.utils.load_config`` reads it.
        weights: parameter name -> lazy array after ``sanitize`` (never evaluated here).
        sources: parameter name -> source tensor name, when sanitize passed the tensor through
            unchanged (possibly renamed); absent for tensors sanitize built from others.
        originals: module path -> the unquantized leaf module (for ``to_quantized``).
        decisions: module path -> ``to_quantized`` kwargs, for every quantized module.
        quantization: the config.json ``quantization`` block.
        methods: module path -> rounding method (``mlxbun.quant.rounding``) a plan gives it,
            for modules whose method is not ``rtn``.
    """

    model: Any
    config: dict[str, Any]
    weights: dict[str, Any]
    sources: dict[str, str]
    originals: dict[str, Any] = field(default_factory=dict)
    decisions: dict[str, dict[str, Any]] = field(default_factory=dict)
    quantization: dict[str, Any] | None = None
    methods: dict[str, str] = field(default_factory=dict)


def check_source(src: Path) -> dict[str, Any]:
    """The source's config (mlx-lm's ``load_config``); errors for what cannot be converted."""
    if not (src / "config.json").is_file():
        raise InputError(f"model {src} has no config.json; pass a Hugging Face model directory")
    config = load_config(src)
    if "model_type" not in config:
        raise InputError(f"{src / 'config.json'} has no model_type; mlx-lm cannot pick a model class")
    if "quantization" in config or "quantization_config" in config:
        raise InputError(
            f"model {src} is already quantized (config.json has a quantization block); pass a"
            " full-precision checkpoint"
        )
    return config


def _lazy_source(src: Path) -> dict[str, Any]:
    files = sorted(src.glob("model*.safetensors"))
    if not files:
        raise InputError(f"model {src} has no model*.safetensors files")
    with open_model(src):  # validates every header (InputError naming file and tensor)
        pass
    weights: dict[str, Any] = {}
    for f in files:
        weights.update(mx.load(str(f)))
    return weights


def build_skeleton(src: str | Path, *, weights: dict[str, Any] | None = None) -> Skeleton:
    """Instantiate the model class for ``src`` and sanitize lazy views of its tensors
    (``weights``: those views when they come from elsewhere, e.g. a synthetic source)."""
    src = Path(src)
    config = check_source(src)
    model_class, args_class = model_classes(config)
    raw = _lazy_source(src) if weights is None else weights
    by_id = {id(v): k for k, v in raw.items()}
    try:
        model = model_class(args_class.from_dict(config))
        weights = model.sanitize(dict(raw)) if hasattr(model, "sanitize") else dict(raw)
    except (KeyError, TypeError, ValueError) as e:
        raise InputError(
            f"model {src}: config.json and tensors do not fit mlx-lm's {model_class.__module__} ({type(e).__name__}: {e})"
        ) from None
    sources = {k: by_id[id(v)] for k, v in weights.items() if id(v) in by_id and raw[by_id[id(v)]] is v}
    _check_strict(src, type(model).__module__, dict(tree_flatten(model.parameters())), weights)
    return Skeleton(model=model, config=config, weights=weights, sources=sources)


def _check_strict(src: Path, cls: str, params: dict[str, Any], weights: dict[str, Any]) -> None:
    """mlx-lm's strict load: the sanitized tensors are exactly the model's parameters."""
    missing = sorted(set(params) - set(weights))
    extra = sorted(set(weights) - set(params))
    if missing or extra:
        what = f"missing {missing[:3]}" if missing else f"unexpected {extra[:3]}"
        raise InputError(f"model {src}: tensors do not match the {cls} model class ({what})")
    for k, v in weights.items():
        if tuple(v.shape) != tuple(params[k].shape):
            raise InputError(
                f"model {src}: tensor {k!r} has shape {tuple(v.shape)}, the model expects {tuple(params[k].shape)}"
            )


# ------------------------------------------------------------------------------- predicates


def plan_predicate(plan: Plan) -> Callable[[str, Any], bool | dict[str, Any]]:
    """Listed paths get their own setting (or stay unquantized); the rest use the default."""

    def predicate(path: str, module: Any) -> bool | dict[str, Any]:
        if path not in plan.layers:
            return True
        spec = plan.layers[path]
        if spec is None:
            return False
        width = module.weight.shape[-1]
        if width % spec.group_size:
            raise InputError(
                f"group_size={spec.group_size} does not divide in_features={width} of {path!r} in"
                f" quant.plan; choose a group size that divides {width}"
            )
        return spec.mlx_dict()

    return predicate


def mixed_predicate(rule: str, model: Any, group_size: int) -> Callable[[str, Any], bool | dict[str, Any]]:
    """mlx-lm's own mixed-bit rule (``mlx_lm.convert.mixed_quant_predicate_builder``)."""
    try:
        return mixed_quant_predicate_builder(rule, model, group_size)
    except ValueError as e:
        raise InputError(f"quant.mixed={rule!r}: {e}") from None


def apply_quantization(
    sk: Skeleton,
    spec: QuantSpec,
    predicate: Callable[[str, Any], bool | dict[str, Any]] | None,
    *,
    plan: Plan | None = None,
) -> None:
    """Quantize the skeleton (lazily) as ``mlx_lm.utils.quantize_model`` does; record decisions.

    With ``plan=True`` a module the model's own ``quant_predicate`` refuses stays unquantized and
    listed plan entries are not subject to the default group size check (they check their own).
    """
    model_pred = getattr(sk.model, "quant_predicate", None)
    user_pred = predicate if predicate is not None else model_pred
    params = spec.mlx_dict()
    block: dict[str, Any] = dict(params)
    sk.originals = dict(tree_flatten(sk.model.leaf_modules(), is_leaf=nn.Module.is_module))

    def wrapped(path: str, module: Any) -> bool | dict[str, Any]:
        if not hasattr(module, "to_quantized"):
            return False
        listed = plan is not None and path in plan.layers
        if not listed and module.weight.shape[-1] % spec.group_size != 0:
            return False
        if plan is not None and model_pred is not None and not model_pred(path, module):
            return False
        decision = user_pred(path, module) if user_pred is not None else True
        if isinstance(decision, dict):
            block[path] = decision
            sk.decisions[path] = dict(decision)
        elif decision is False and listed:
            block[path] = False
        elif decision:
            sk.decisions[path] = dict(params)
        return decision

    nn.quantize(sk.model, spec.group_size, spec.bits, mode=spec.mode, class_predicate=wrapped)
    sk.quantization = block


def prepare(
    src: str | Path,
    *,
    mode: str = "affine",
    bits: int | None = None,
    group_size: int | None = None,
    plan: Plan | str | Path | None = None,
    mixed: str | None = None,
    weights: dict[str, Any] | None = None,
) -> tuple[Skeleton, QuantSpec]:
    """Build the skeleton of ``src`` and quantize it lazily by a uniform setting, a plan or a rule."""
    check_mixed(mixed, mode=mode, plan=plan)
    if plan is not None and not isinstance(plan, Plan):
        plan = load_plan(plan)
    spec = plan.default if plan is not None else spec_for(mode, bits, group_size)
    sk = build_skeleton(src, weights=weights)
    predicate = None
    if plan is not None:
        predicate = plan_predicate(plan)
    elif mixed is not None:
        predicate = mixed_predicate(mixed, sk.model, spec.group_size)
    if plan is not None:
        _check_plan_paths(plan, sk, src)
    apply_quantization(sk, spec, predicate, plan=plan)
    if plan is not None:
        sk.methods = plan_methods(plan, sk.decisions)
    if not sk.decisions:
        raise InputError(
            f"quant.group_size={spec.group_size} divides the input width of no quantizable layer of"
            f" {src}; choose a smaller group size"
        )
    return sk, spec


def plan_methods(plan: Plan, decisions: dict[str, Any]) -> dict[str, str]:
    """Each quantized module's rounding method from the plan (its entry, else the default), when not rtn."""
    out = {}
    for path, decision in decisions.items():
        spec = plan.layers.get(path) or plan.default
        if spec.method != "rtn" and decision.get("mode", "affine") == "affine":
            out[path] = spec.method
    return out


def _check_plan_paths(plan: Plan, sk: Skeleton, src: str | Path) -> None:
    """A plan naming a module the model does not have is a typo or a plan for another model."""
    known = {
        p
        for p, m in tree_flatten(sk.model.leaf_modules(), is_leaf=nn.Module.is_module)
        if hasattr(m, "to_quantized")
    }
    unknown = sorted(set(plan.layers) - known)
    if unknown:
        raise InputError(
            f"quant.plan names {len(unknown)} module(s) that {src} does not have or cannot quantize"
            f" (e.g. {unknown[0]!r}); a plan's layers are module paths like 'model.layers.0.mlp.down_proj'"
        )
