"""mlx-lm as mlxbun reaches it: its model classes and config rules without ``transformers``, and
its loaders, which import ``transformers``, only when one is called.

A conversion needs mlx-lm's model classes, not its tokenizers: ``mlxbun`` registers the
``mlx_lm`` package with its ``__init__`` (which imports ``transformers``) deferred, so
:func:`model_classes` imports ``mlx_lm.models.<type>`` alone. ``mlx_lm.utils``,
``mlx_lm.tokenizer_utils`` and ``mlx_lm.convert`` import ``transformers`` (seconds): :func:`load`,
:func:`load_model`, :func:`load_tokenizer`, :func:`dequantize_model` and
:func:`mixed_quant_predicate_builder` import them on first use, so a command that never loads a
tokenizer, or stops at bad input, never pays for it. The remapping tables are read from
``mlx_lm/utils.py`` itself (``ast``), and ``load_config`` / the tagged-float rules mirror
``mlx_lm.utils`` (tests compare our config.json with mlx-lm's byte for byte).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import math
from functools import cache
from pathlib import Path
from typing import Any

from mlxbun.errors import InputError
from mlxbun.io.safetensors import read_config

_FLOAT_TAGS = {"Infinity": float("inf"), "-Infinity": float("-inf"), "NaN": float("nan")}


@cache
def _utils_constant(name: str) -> Any:
    """A literal table (e.g. MODEL_REMAPPING) from mlx_lm/utils.py, without importing it."""
    spec = importlib.util.find_spec("mlx_lm")
    source = Path(next(iter(spec.submodule_search_locations))) / "utils.py"
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    return {}


def model_type_module(config: dict[str, Any]) -> str:
    """The mlx_lm.models module name for a config (mlx-lm's ``_get_classes`` remapping)."""
    model_type = config["model_type"]
    archs = config.get("architectures") or ()
    archs = (archs,) if isinstance(archs, str) else archs
    by_arch = _utils_constant("MODEL_ARCHITECTURE_REMAPPING")
    for arch in archs:
        if (model_type, arch) in by_arch:
            return by_arch[(model_type, arch)]
    return _utils_constant("MODEL_REMAPPING").get(model_type, model_type)


def model_classes(config: dict[str, Any]) -> tuple[Any, Any]:
    """(Model, ModelArgs) of mlx-lm for ``config``; InputError for an unsupported model_type."""
    name = model_type_module(config)
    try:
        module = importlib.import_module(f"mlx_lm.models.{name}")
    except ImportError:
        raise InputError(
            f"model_type={config['model_type']!r} is not supported by the installed mlx-lm"
        ) from None
    return module.Model, module.ModelArgs


def decode_tagged_floats(obj: Any) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {"__float__"} and obj["__float__"] in _FLOAT_TAGS:
            return _FLOAT_TAGS[obj["__float__"]]
        return {k: decode_tagged_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_tagged_floats(v) for v in obj]
    return obj


def encode_tagged_floats(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return {"__float__": "NaN" if math.isnan(obj) else ("Infinity" if obj > 0 else "-Infinity")}
    if isinstance(obj, dict):
        return {k: encode_tagged_floats(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [encode_tagged_floats(v) for v in obj]
    return obj


def load_config(model_path: Path) -> dict[str, Any]:
    """config.json as mlx-lm reads it: tagged floats decoded, generation_config's eos_token_id."""
    config = decode_tagged_floats(read_config(model_path))
    gen = model_path / "generation_config.json"
    if gen.exists():
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id", False)
        except json.JSONDecodeError:
            eos = False
        if eos:
            config["eos_token_id"] = eos
    return config


def load(path: str | Path, **kwargs: Any) -> tuple[Any, Any]:
    """``mlx_lm.utils.load``: the model and its tokenizer."""
    from mlx_lm.utils import load as mlx_lm_load

    return mlx_lm_load(str(path), **kwargs)


def load_model(path: str | Path, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
    """``mlx_lm.utils.load_model``: the model and its config, no tokenizer."""
    from mlx_lm.utils import load_model as mlx_lm_load_model

    return mlx_lm_load_model(Path(path), **kwargs)


def load_tokenizer(path: str | Path) -> Any:
    """``mlx_lm.tokenizer_utils.load``: the tokenizer of a model directory."""
    from mlx_lm.tokenizer_utils import load as mlx_lm_load_tokenizer

    return mlx_lm_load_tokenizer(Path(path))


def dequantize_model(model: Any) -> Any:
    """``mlx_lm.utils.dequantize_model``."""
    from mlx_lm.utils import dequantize_model as mlx_lm_dequantize_model

    return mlx_lm_dequantize_model(model)


def mixed_quant_predicate_builder(rule: str, model: Any, group_size: int) -> Any:
    """``mlx_lm.convert.mixed_quant_predicate_builder``: mlx-lm's mixed-bit rule ``rule``."""
    from mlx_lm.convert import mixed_quant_predicate_builder as builder

    return builder(rule, model, group_size)
