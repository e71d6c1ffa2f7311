"""Deterministic synthetic checkpoints of real architectures (llama, mistral, qwen2, qwen3, gemma3_text).

Run ``python -m mlxbun command=synth synth.arch=qwen3 synth.preset=tiny`` (or ``+recipe=quickstart``).
Random weights with real shapes and Hugging Face tensor names, written tensor by tensor through
:class:`mlxbun.io.shards.ShardedWriter` (memory stays near one shard), plus a byte-level BPE
tokenizer built offline, so ``mlx_lm.load`` and ``generate`` work on the result::

    <out>/                                  built as .<out>.partial/, renamed when complete
        synth.json                          resolved spec, planted channels, format version
        config.json                         HF config (model_type, dims, rope, eps, torch_dtype, ...)
        generation_config.json              bos / eos / pad ids
        model.safetensors                   one shard, or model-0000i-of-0000N.safetensors
        model.safetensors.index.json        + this index when there are several shards
        tokenizer.json                      byte-level BPE with exactly vocab_size tokens
        tokenizer_config.json               special tokens and a chat template

What the weights are (every value is a function of the spec; chunk ``i`` of tensor ``name``
draws raw PCG64 output seeded with sha256(seed, name, i): bytes do not depend on order or threads):

- linear weights ~ N(0, 1/fan_in) (activations keep unit scale through the layers);
  ``embed_tokens`` and an untied ``lm_head`` ~ N(0, 9/hidden) so logits have std ≈ 3;
  qwen2's q/k/v biases ~ N(0, 0.02²).
- RMSNorm gains are 1; gemma stores ``w`` and applies ``1 + w``, so its stored gains are 0.
  ``norm_jitter=s`` adds N(0, s²) to every gain (input/post-attention/pre/post-feedforward,
  q_norm/k_norm, final norm).
- gemma3_text scales embeddings by sqrt(hidden) on input, so its ``embed_tokens`` is
  N(0, 9/hidden²) (else the residual stays a copy of the input token and the output is one-hot)
  and, with tied embeddings, its final norm gain is sqrt(hidden) (stored sqrt(hidden) - 1) to
  give the tied head its logit scale back.
- Normal values come from a 65536-entry table of exact N(0, 1) quantiles indexed by random
  uint16 (tails end at ±4.3σ); in bf16 this is indistinguishable from sampling and several
  times faster than numpy's normal sampler plus a bf16 cast.

Planted outliers, ``outlier_channels=k`` > 0: k hidden channels C are drawn from the seed
(``synth.json`` lists them). ``outlier_target`` picks what is multiplied by ``outlier_scale``:

- ``weights``: input columns C of every q/k/v/gate/up projection and of an untied lm_head (the
  groups of input weights that hold them get large quantization scales);
- ``activations``: columns C of ``embed_tokens`` and output rows C of every o_proj and
  down_proj, so the residual stream carries large values in channels C at every layer; the
  final norm's gains at C are divided by ``outlier_scale`` (as real LLMs damp their massive
  activations) so the logits stay spread out;
- ``both`` (default): all of the above.

Measured (``preset=small``: 8 layers, hidden 512; KL(bf16 ‖ every linear 4-bit g64 RTN) in nats
on one 40-token prompt; llama / qwen3 / gemma3_text): no outliers 0.59 / 0.66 / 0.54;
k=4 scale 20 ``weights`` 4.49 / 2.30 / 0.71, ``activations`` 0.16 / 0.16 / 0.30, ``both``
1.16 / 0.75 / 0.52. Output entropy stays 4-5 nats (vocab 8192) in every case.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mlxbun.errors import InputError
from mlxbun.io.atomic import atomic_write_json, dumps_json, file_lock, fsync_dir, publish_dir
from mlxbun.io.dtypes import OUTPUT_DTYPES as DTYPES
from mlxbun.schema import ARCHS, SYNTH_DIMS

log = logging.getLogger("mlxbun")

FORMAT_VERSION = 2  # bump when the bytes for a given spec change
SPEC_FILE = "synth.json"
OUTLIER_TARGETS = ("weights", "activations", "both")
CHUNK = 1 << 22  # elements drawn per RNG stream
THREADS = max(1, min(2, os.cpu_count() or 1))
TABLE_BITS = 16
SAFETENSORS_METADATA = {"format": "pt"}  # what Hugging Face checkpoints carry

SPECIALS = ("<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")
PAD_ID, BOS_ID, EOS_ID, IM_START_ID, IM_END_ID = range(len(SPECIALS))
MIN_VOCAB = len(SPECIALS) + 256
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Byte-level characters merged into longer tokens, roughly by English frequency; no '<', '>'
# or '|', so a merged token can never spell a special token.
MERGE_CHARS = "Ġetaoinshrdlcumwfgypbvkjxqz" + "ETAOINSHRDLCUMWFGYPBVKJXQZ" + "0123456789" + ".,'-:Ċ"

# Per architecture: HF config fields that are not dims, and the vocabulary of presets >= 1b.
ARCH_CONFIG: dict[str, dict[str, Any]] = {
    "llama": {
        "architectures": ["LlamaForCausalLM"],
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 131072,
    },
    "mistral": {
        "architectures": ["MistralForCausalLM"],
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "sliding_window": None,
    },
    "qwen2": {
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "use_sliding_window": False,
        "sliding_window": 32768,
    },
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
    },
    "gemma3_text": {
        "architectures": ["Gemma3ForCausalLM"],
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "max_position_embeddings": 32768,
        "sliding_window": 512,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
    },
}
ARCH_VOCAB = {"llama": 128256, "mistral": 32768, "qwen2": 151936, "qwen3": 151936, "gemma3_text": 262144}

_GEMMA_LONG = {"rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "max_position_embeddings": 131072}
# preset -> {"*": dims for every arch, arch: that arch's real model}; "config" holds extra HF keys.
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "tiny": {
        "*": dict(
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            vocab_size=512,
            tie_embeddings=True,
        )
    },
    "small": {
        "*": dict(
            hidden_size=512,
            intermediate_size=1536,
            num_layers=8,
            num_heads=8,
            num_kv_heads=2,
            head_dim=64,
            vocab_size=8192,
            tie_embeddings=True,
        )
    },
    "1b": {  # Llama 3.2 1B, Qwen2.5 1.5B, Qwen3 1.7B, Gemma 3 1B
        "*": dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_layers=16,
            num_heads=32,
            num_kv_heads=8,
            head_dim=64,
            tie_embeddings=True,
        ),
        "qwen2": dict(
            hidden_size=1536,
            intermediate_size=8960,
            num_layers=28,
            num_heads=12,
            num_kv_heads=2,
            head_dim=128,
        ),
        "qwen3": dict(
            hidden_size=2048,
            intermediate_size=6144,
            num_layers=28,
            num_heads=16,
            num_kv_heads=8,
            head_dim=128,
        ),
        "gemma3_text": dict(
            hidden_size=1152,
            intermediate_size=6912,
            num_layers=26,
            num_heads=4,
            num_kv_heads=1,
            head_dim=256,
            config={"query_pre_attn_scalar": 256, "sliding_window": 512},
        ),
    },
    "4b": {  # Llama 3.2 3B, Qwen2.5 3B, Qwen3 4B, Gemma 3 4B (text)
        "*": dict(
            hidden_size=3072,
            intermediate_size=8192,
            num_layers=28,
            num_heads=24,
            num_kv_heads=8,
            head_dim=128,
            tie_embeddings=True,
        ),
        "qwen2": dict(
            hidden_size=2048,
            intermediate_size=11008,
            num_layers=36,
            num_heads=16,
            num_kv_heads=2,
            head_dim=128,
        ),
        "qwen3": dict(
            hidden_size=2560,
            intermediate_size=9728,
            num_layers=36,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
        ),
        "gemma3_text": dict(
            hidden_size=2560,
            intermediate_size=10240,
            num_layers=34,
            num_heads=8,
            num_kv_heads=4,
            head_dim=256,
            vocab_size=262208,
            config={"query_pre_attn_scalar": 256, "sliding_window": 1024, **_GEMMA_LONG},
        ),
    },
    "8b": {  # Llama 3.1 8B, Mistral 7B v0.3, Qwen2.5 7B, Qwen3 8B; gemma3: the generic shape
        "*": dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_layers=32,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            tie_embeddings=False,
        ),
        "qwen2": dict(
            hidden_size=3584,
            intermediate_size=18944,
            num_layers=28,
            num_heads=28,
            num_kv_heads=4,
            head_dim=128,
            vocab_size=152064,
        ),
        "qwen3": dict(intermediate_size=12288, num_layers=36),
        "gemma3_text": dict(
            vocab_size=262208, config={"query_pre_attn_scalar": 128, "sliding_window": 1024, **_GEMMA_LONG}
        ),
    },
    "27b": {  # Gemma 3 27B; the other archs get its dims
        "*": dict(
            hidden_size=5376,
            intermediate_size=21504,
            num_layers=62,
            num_heads=32,
            num_kv_heads=16,
            head_dim=128,
            tie_embeddings=False,
        ),
        "qwen2": dict(head_dim=168),  # qwen2 derives head_dim = hidden / heads
        "gemma3_text": dict(
            vocab_size=262208,
            tie_embeddings=True,
            config={"query_pre_attn_scalar": 168, "sliding_window": 1024, **_GEMMA_LONG},
        ),
    },
}
PRESETS["1.5b"] = PRESETS["1b"]
DIMS = SYNTH_DIMS


@dataclass(frozen=True)
class Shape:
    """The dimensions of a decoder-only transformer."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_embeddings: bool


@dataclass(frozen=True)
class Spec:
    """Everything that determines a synthetic checkpoint's bytes (hashed for the cache)."""

    arch: str
    shape: Shape
    dtype: str = "bfloat16"
    seed: int = 0
    outlier_channels: int = 0
    outlier_scale: float = 20.0
    outlier_target: str = "both"
    norm_jitter: float = 0.0
    config: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"format_version": FORMAT_VERSION, **asdict(self)}

    @property
    def hash(self) -> str:
        return hashlib.sha256(dumps_json(self.to_dict()).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class TensorPlan:
    """One tensor to generate: stored values ``f * (base + std * z) - offset``, z ~ N(0, 1).

    ``f`` is ``outlier_factor`` on the planted channels (input columns when ``outlier_axis``
    is 1, output rows when 0; a 1-D tensor is one row) and 1 elsewhere; ``offset`` is 1 for
    gemma's norms, which store ``w`` and apply ``1 + w``.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    std: float
    base: float = 0.0
    offset: float = 0.0
    outlier_axis: int | None = None
    outlier_factor: float = 1.0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * (4 if self.dtype == "float32" else 2)


# ---------------------------------------------------------------------------- spec


def _check_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InputError(f"synth.{key}={value!r} is out of range; it must be an integer > 0")
    return value


def _preset_dims(arch: str, preset: str) -> dict[str, Any]:
    if preset not in PRESETS:
        raise InputError(f"synth.preset={preset!r} is not allowed; choose one of {', '.join(PRESETS)}")
    dims = {"vocab_size": ARCH_VOCAB[arch], **PRESETS[preset]["*"], **PRESETS[preset].get(arch, {})}
    return dims


def resolve_shape(arch: str, preset: str, **overrides: Any) -> tuple[Shape, dict[str, Any]]:
    """The preset's dims for ``arch`` with explicit (non-None) ``overrides`` on top.

    When hidden_size or num_heads is overridden and head_dim is not, head_dim becomes
    hidden_size // num_heads. Returns the shape and the preset's extra HF config keys.

    Example:
        >>> resolve_shape("gemma3_text", "27b")[0].hidden_size
        5376
    """
    if arch not in ARCHS:
        raise InputError(f"synth.arch={arch!r} is not allowed; choose one of {', '.join(ARCHS)}")
    dims = _preset_dims(arch, preset)
    extra = dict(dims.pop("config", {}))
    given = {k: v for k, v in overrides.items() if v is not None}
    if given.keys() & {"hidden_size", "num_heads"} and "head_dim" not in given:
        dims["head_dim"] = None
    dims.update(given)
    for key in DIMS:
        if dims[key] is not None:
            _check_int(key, dims[key])
    if dims["head_dim"] is None or arch == "qwen2":
        dims["head_dim"] = _derived_head_dim(arch, dims, given)
    shape = Shape(**dims)
    _check_shape(arch, shape)
    return shape, extra


def _derived_head_dim(arch: str, dims: dict[str, Any], given: dict[str, Any]) -> int:
    hidden, heads = dims["hidden_size"], dims["num_heads"]
    if hidden % heads:
        raise InputError(
            f"synth.hidden_size={hidden} is not divisible by synth.num_heads={heads}; "
            "pass synth.head_dim or a hidden_size that divides"
        )
    if arch == "qwen2" and given.get("head_dim") not in (None, hidden // heads):
        raise InputError(
            f"synth.head_dim={given['head_dim']} is not allowed for qwen2, which uses "
            f"hidden_size / num_heads = {hidden // heads}; leave synth.head_dim unset"
        )
    return hidden // heads


def _check_shape(arch: str, s: Shape) -> None:
    if s.num_heads % s.num_kv_heads:
        raise InputError(
            f"synth.num_kv_heads={s.num_kv_heads} does not divide synth.num_heads={s.num_heads}; "
            f"choose a divisor of {s.num_heads}"
        )
    if s.vocab_size < MIN_VOCAB:
        raise InputError(
            f"synth.vocab_size={s.vocab_size} is too small; it must be >= {MIN_VOCAB} "
            f"(256 byte tokens + {len(SPECIALS)} special tokens)"
        )
    if s.head_dim % 2:
        raise InputError(f"synth.head_dim={s.head_dim} must be even (rotary embeddings rotate pairs)")


def _check_knobs(shape: Shape, dtype: str, target: str, channels: Any, scale: Any, jitter: Any) -> None:
    if dtype not in DTYPES:
        raise InputError(f"synth.dtype={dtype!r} is not allowed; choose one of {', '.join(DTYPES)}")
    if target not in OUTLIER_TARGETS:
        raise InputError(
            f"synth.outlier_target={target!r} is not allowed; choose one of {', '.join(OUTLIER_TARGETS)}"
        )
    if isinstance(channels, bool) or not isinstance(channels, int) or not 0 <= channels <= shape.hidden_size:
        raise InputError(
            f"synth.outlier_channels={channels!r} is out of range; it must be in 0..{shape.hidden_size}"
        )
    if not scale > 0:
        raise InputError(f"synth.outlier_scale={scale!r} is out of range; it must be > 0")
    if not jitter >= 0:
        raise InputError(f"synth.norm_jitter={jitter!r} is out of range; it must be >= 0")


def resolve_spec(
    *,
    arch: str = "llama",
    preset: str = "tiny",
    seed: int = 0,
    dtype: str = "bfloat16",
    outlier_channels: int = 0,
    outlier_scale: float = 20.0,
    outlier_target: str = "both",
    norm_jitter: float = 0.0,
    **dims: Any,
) -> Spec:
    """Validate the synth fields (names as in ``SynthCfg``) and resolve them into a :class:`Spec`.

    Args:
        dims: hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, head_dim,
            vocab_size, tie_embeddings; None keeps the preset's value.

    Example:
        >>> resolve_spec(arch="qwen3", preset="tiny", hidden_size=128).shape.head_dim
        32
    """
    unknown = set(dims) - set(DIMS) - {"tie_embeddings"}
    if unknown:
        raise InputError(
            f"unknown synth field(s) {sorted(unknown)}; allowed: {', '.join(DIMS)}, tie_embeddings"
        )
    shape, extra = resolve_shape(arch, preset, **dims)
    _check_knobs(shape, dtype, outlier_target, outlier_channels, outlier_scale, norm_jitter)
    return Spec(
        arch=arch,
        shape=shape,
        dtype=dtype,
        seed=int(seed),
        outlier_channels=outlier_channels,
        outlier_scale=float(outlier_scale),
        outlier_target=outlier_target,
        norm_jitter=float(norm_jitter),
        config=extra,
    )


# ---------------------------------------------------------------------------- config files


def _sliding_pattern(num_layers: int) -> int:
    # mlx-lm's gemma3 indexes cache[pattern - 1]: the pattern cannot exceed the layer count.
    return min(6, num_layers)


def hf_config(spec: Spec) -> dict[str, Any]:
    """The ``config.json`` Hugging Face (and mlx-lm's model class for ``spec.arch``) reads."""
    s = spec.shape
    cfg: dict[str, Any] = {
        "model_type": spec.arch,
        **ARCH_CONFIG[spec.arch],
        "hidden_size": s.hidden_size,
        "intermediate_size": s.intermediate_size,
        "num_hidden_layers": s.num_layers,
        "num_attention_heads": s.num_heads,
        "num_key_value_heads": s.num_kv_heads,
        "head_dim": s.head_dim,
        "vocab_size": s.vocab_size,
        "tie_word_embeddings": s.tie_embeddings,
        "torch_dtype": spec.dtype,
        "bos_token_id": BOS_ID,
        "eos_token_id": [EOS_ID, IM_END_ID],
        "pad_token_id": PAD_ID,
        **spec.config,
    }
    if spec.arch == "qwen2":
        cfg["max_window_layers"] = s.num_layers
    if spec.arch == "gemma3_text":
        pattern = _sliding_pattern(s.num_layers)
        cfg.setdefault("query_pre_attn_scalar", s.head_dim)
        cfg["sliding_window_pattern"] = pattern
        cfg["layer_types"] = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(s.num_layers)
        ]
    return dict(sorted(cfg.items()))


def generation_config() -> dict[str, Any]:
    return {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, IM_END_ID], "pad_token_id": PAD_ID}


# ---------------------------------------------------------------------------- tensor plan


def planted_channels(spec: Spec) -> list[int]:
    """The hidden channels that carry planted outliers (sorted; empty when none are asked)."""
    if spec.outlier_channels == 0:
        return []
    keys = np.random.PCG64(_stream_seed(spec.seed, "outlier_channels", 0)).random_raw(spec.shape.hidden_size)
    return sorted(int(c) for c in np.argsort(keys, kind="stable")[: spec.outlier_channels])


def plan(spec: Spec) -> list[TensorPlan]:
    """Every tensor of the checkpoint, in model order (the order shards are filled).

    Example:
        >>> [t.name for t in plan(resolve_spec(arch="llama"))][:2]
        ['model.embed_tokens.weight', 'model.layers.0.input_layernorm.weight']
    """
    s, dt = spec.shape, spec.dtype
    acts = spec.outlier_target in ("activations", "both")
    weights = spec.outlier_target in ("weights", "both")
    head_std = 3.0 / math.sqrt(s.hidden_size)
    emb = (s.vocab_size, s.hidden_size)
    scale = spec.outlier_scale
    out = [TensorPlan("model.embed_tokens.weight", emb, dt, _embed_std(spec), **_planted(acts, 1, scale))]
    for i in range(s.num_layers):
        out += _layer_plan(spec, i, acts=acts, weights=weights)
    out.append(_final_norm(spec, acts=acts))
    if not s.tie_embeddings:
        out.append(TensorPlan("lm_head.weight", emb, dt, head_std, **_planted(weights, 1, scale)))
    return out


def _embed_std(spec: Spec) -> float:
    # Gemma multiplies embeddings by sqrt(hidden) on input: divide it out so the input scale
    # matches the other archs (else the residual stream stays a copy of the input token).
    std = 3.0 / math.sqrt(spec.shape.hidden_size)
    return std / math.sqrt(spec.shape.hidden_size) if spec.arch == "gemma3_text" else std


def _final_norm(spec: Spec, *, acts: bool) -> TensorPlan:
    h = spec.shape.hidden_size
    # Gemma with a tied head: the logit scale comes back through the final gain (sqrt(hidden)).
    base = math.sqrt(h) if spec.arch == "gemma3_text" and spec.shape.tie_embeddings else 1.0
    # Massive activations are damped by the final norm in real LLMs, so logits stay spread out.
    planted = _planted(acts, 1, 1.0 / spec.outlier_scale)
    return TensorPlan("model.norm.weight", (h,), spec.dtype, spec.norm_jitter, base, _offset(spec), **planted)


def _planted(planted: bool, axis: int, factor: float) -> dict[str, Any]:
    return {"outlier_axis": axis, "outlier_factor": factor} if planted else {}


def _offset(spec: Spec) -> float:
    return 1.0 if spec.arch == "gemma3_text" else 0.0


def _gain(spec: Spec, name: str, n: int) -> TensorPlan:
    return TensorPlan(name, (n,), spec.dtype, spec.norm_jitter, 1.0, _offset(spec))


def _linear(spec: Spec, name: str, out_f: int, in_f: int, axis: int | None) -> TensorPlan:
    planted = _planted(axis is not None, axis or 0, spec.outlier_scale)
    return TensorPlan(name, (out_f, in_f), spec.dtype, 1.0 / math.sqrt(in_f), **planted)


def _layer_plan(spec: Spec, i: int, *, acts: bool, weights: bool) -> list[TensorPlan]:
    s, p = spec.shape, f"model.layers.{i}."
    h, q, kv = s.hidden_size, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    cols, rows = (1 if weights else None), (0 if acts else None)
    out = [_gain(spec, p + "input_layernorm.weight", h)]
    out += [
        _linear(spec, p + "self_attn.q_proj.weight", q, h, cols),
        _linear(spec, p + "self_attn.k_proj.weight", kv, h, cols),
        _linear(spec, p + "self_attn.v_proj.weight", kv, h, cols),
    ]
    if spec.arch == "qwen2":
        out += [TensorPlan(p + f"self_attn.{m}.bias", (n,), spec.dtype, 0.02) for m, n in _qkv(q, kv)]
    out.append(_linear(spec, p + "self_attn.o_proj.weight", h, q, rows))
    if spec.arch in ("qwen3", "gemma3_text"):
        out += [_gain(spec, p + f"self_attn.{m}.weight", s.head_dim) for m in ("q_norm", "k_norm")]
    out.append(_gain(spec, p + "post_attention_layernorm.weight", h))
    if spec.arch == "gemma3_text":
        out += [
            _gain(spec, p + f"{m}.weight", h)
            for m in ("pre_feedforward_layernorm", "post_feedforward_layernorm")
        ]
    return out + [
        _linear(spec, p + "mlp.gate_proj.weight", s.intermediate_size, h, cols),
        _linear(spec, p + "mlp.up_proj.weight", s.intermediate_size, h, cols),
        _linear(spec, p + "mlp.down_proj.weight", h, s.intermediate_size, rows),
    ]


def _qkv(q: int, kv: int) -> list[tuple[str, int]]:
    return [("q_proj", q), ("k_proj", kv), ("v_proj", kv)]


# ---------------------------------------------------------------------------- values


def _stream_seed(seed: int, name: str, chunk: int) -> int:
    digest = hashlib.sha256(f"mlxbun-synth\0{seed}\0{name}\0{chunk}".encode()).digest()
    return int.from_bytes(digest[:16], "little")


_QUANTILES: np.ndarray | None = None


def _quantiles() -> np.ndarray:
    """N(0, 1) quantiles at the midpoints of 2**16 equal-probability bins (float64)."""
    global _QUANTILES
    if _QUANTILES is None:
        from statistics import NormalDist

        n, inv = 1 << TABLE_BITS, NormalDist().inv_cdf
        _QUANTILES = np.array([inv((k + 0.5) / n) for k in range(n)], dtype=np.float64)
    return _QUANTILES


def _mx_dtype(dtype: str) -> Any:
    import mlx.core as mx

    return getattr(mx, dtype)


def _bits_dtype(dtype: str) -> Any:
    import mlx.core as mx

    return mx.uint32 if dtype == "float32" else mx.uint16


def _table(t: TensorPlan, factor: float) -> np.ndarray:
    """The 2**16 possible stored values (raw bits) of ``t`` with factor ``f``, z a quantile."""
    import mlx.core as mx

    vals = factor * (t.base + t.std * _quantiles()) - t.offset
    return np.array(mx.array(vals.astype(np.float32)).astype(_mx_dtype(t.dtype)).view(_bits_dtype(t.dtype)))


def tensor_array(t: TensorPlan, *, spec: Spec, channels: list[int]) -> Any:
    """Generate one planned tensor as an ``mx.array`` of ``t.dtype`` (memory: the tensor once).

    Example:
        >>> spec = resolve_spec(arch="llama")
        >>> tensor_array(plan(spec)[0], spec=spec, channels=planted_channels(spec)).shape
        (512, 64)
    """
    import mlx.core as mx

    planted = bool(channels) and t.outlier_axis is not None
    if t.std == 0 and not planted:
        return mx.full(t.shape, t.base - t.offset, dtype=_mx_dtype(t.dtype))
    rows = t.shape[0] if len(t.shape) > 1 else 1
    cols = t.numel // rows
    out = mx.zeros((rows, cols), dtype=_bits_dtype(t.dtype))
    mx.eval(out)
    buf = np.array(out, copy=False)  # writable view of the mx buffer: no second copy
    normal = _table(t, 1.0)
    scaled = _table(t, t.outlier_factor) if planted else None
    step = max(1, CHUNK // cols)
    starts = range(0, rows, step)
    fill = _Filler(t, spec.seed, normal, scaled, np.asarray(channels, dtype=np.int64))
    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(lambda k: fill(buf, k, starts[k], step), range(len(starts))))
    return out.view(_mx_dtype(t.dtype)).reshape(t.shape)


@dataclass(frozen=True)
class _Filler:
    """Fills rows [r0, r0 + step) of a tensor's buffer from that chunk's own RNG stream."""

    t: TensorPlan
    seed: int
    normal: np.ndarray
    scaled: np.ndarray | None
    channels: np.ndarray

    def __call__(self, buf: np.ndarray, k: int, r0: int, step: int) -> None:
        block = buf[r0 : r0 + step]
        # Raw PCG64 output (a fixed algorithm, unlike Generator methods), 4 indices per draw.
        raw = np.random.PCG64(_stream_seed(self.seed, self.t.name, k)).random_raw((block.size + 3) // 4)
        idx = raw.view("<u2")[: block.size].reshape(block.shape)
        block[...] = self.normal[idx]
        if self.scaled is None:
            return
        if self.t.outlier_axis == 1:
            block[:, self.channels] = self.scaled[idx[:, self.channels]]
        else:
            local = self.channels[(self.channels >= r0) & (self.channels < r0 + block.shape[0])] - r0
            block[local] = self.scaled[idx[local]]


# ---------------------------------------------------------------------------- tokenizer


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by byte-level BPE."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    keep += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _merges() -> Iterator[tuple[str, str]]:
    """BPE merges: token + character, level by level, cheapest rank sum first (diagonals)."""
    chars = list(MERGE_CHARS)
    prev = chars
    while True:
        level = []
        for d in range(len(prev) + len(chars) - 1):
            for i in range(max(0, d - len(chars) + 1), min(d + 1, len(prev))):
                pair = (prev[i], chars[d - i])
                level.append(pair[0] + pair[1])
                yield pair
        prev = level


def build_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE ``PreTrainedTokenizerFast`` with exactly ``vocab_size`` tokens.

    Ids 0-4 are ``<pad> <s> </s> <|im_start|> <|im_end|>``, then the 256 byte tokens, then
    merges; ``<s>`` is prepended on encode and the chat template uses the im markers.

    Example:
        >>> len(build_tokenizer(512))
        512
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in bytes_to_unicode().values():
        vocab[ch] = len(vocab)
    merges = list(itertools.islice(_merges(), vocab_size - len(vocab)))
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    tok.add_special_tokens(list(SPECIALS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=list(SPECIALS[3:]),
        chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 20,
    )


# ---------------------------------------------------------------------------- writing


def _fsync_tree(root: Path) -> None:
    for p in sorted(root.rglob("*")):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fsync_dir(root)


def _spec_record(spec: Spec) -> dict[str, Any]:
    return {**spec.to_dict(), "planted_channels": planted_channels(spec)}


def _prepare_partial(partial: Path, spec: Spec) -> None:
    """Keep a partial build of the same spec (its finished shards are resumed); else start over."""
    record = partial / SPEC_FILE
    same = record.is_file() and json.loads(record.read_text()) == _spec_record(spec)
    if partial.exists() and not same:
        shutil.rmtree(partial)
    partial.mkdir(parents=True, exist_ok=True)
    if not same:
        atomic_write_json(record, _spec_record(spec))


def _weights_done(partial: Path) -> bool:
    # The writer deletes its journal last in finish(): shards without a journal are complete.
    from mlxbun.io.shards import JOURNAL

    return not (partial / JOURNAL).exists() and any(partial.glob("model*.safetensors"))


def _write_weights(spec: Spec, partial: Path, *, shard_bytes: int, overlap: bool) -> None:
    from mlxbun.io.shards import ShardedWriter
    from mlxbun.progress import Progress

    if _weights_done(partial):
        return
    tensors, channels = plan(spec), planted_channels(spec)
    progress = Progress(total=sum(t.nbytes for t in tensors), unit="B", desc=f"synth {spec.arch}")
    meta = SAFETENSORS_METADATA
    with ShardedWriter(
        partial, shard_bytes=shard_bytes, metadata=meta, resume=True, overlap=overlap
    ) as writer:
        if writer.done_names:
            log.info(
                "synth: resuming %s, %d of %d tensors already written",
                partial,
                len(writer.done_names),
                len(tensors),
            )
        for t in tensors:
            if t.name not in writer.done_names:
                writer.add(t.name, tensor_array(t, spec=spec, channels=channels))
            progress.update(t.nbytes)  # generation is the slow part: count it, not shard writes
        writer.finish()
    progress.close()


def _write_side_files(spec: Spec, partial: Path) -> None:
    atomic_write_json(partial / "config.json", hf_config(spec))
    atomic_write_json(partial / "generation_config.json", generation_config())
    build_tokenizer(spec.shape.vocab_size).save_pretrained(str(partial))
    # transformers 5 writes its own class name; the 4.x name loads in both.
    tok_cfg = json.loads((partial / "tokenizer_config.json").read_text())
    atomic_write_json(
        partial / "tokenizer_config.json", {**tok_cfg, "tokenizer_class": "PreTrainedTokenizerFast"}
    )


def _refuse_existing(out_dir: Path) -> None:
    if out_dir.exists():
        raise InputError(f"synth.out={str(out_dir)!r} already exists; remove it or choose a new directory")


def write_spec(
    spec: Spec,
    out_dir: str | Path,
    *,
    shard_bytes: int = 5 << 30,
    overlap: bool = False,
    partial_root: str | Path | None = None,
) -> Path:
    """Write ``spec`` into ``out_dir`` (must not exist) through a hidden partial directory.

    The partial directory ``.<name>.partial-<spec hash>`` lives in ``partial_root`` (default:
    beside ``out_dir``; same filesystem) under a lock; a killed build of the same spec resumes
    from its finished shards, and the directory is renamed to ``out_dir`` when complete.
    """
    out_dir = Path(out_dir).expanduser().absolute()
    _refuse_existing(out_dir)
    root = Path(partial_root).expanduser().absolute() if partial_root else out_dir.parent
    root.mkdir(parents=True, exist_ok=True)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    partial = root / f".{out_dir.name}.partial-{spec.hash}"
    lock = partial.with_name(partial.name + ".lock")
    with file_lock(lock):
        _refuse_existing(out_dir)
        _prepare_partial(partial, spec)
        _write_weights(spec, partial, shard_bytes=shard_bytes, overlap=overlap)
        _write_side_files(spec, partial)
        _fsync_tree(partial)
        publish_dir(partial, out_dir)
        lock.unlink()  # safe once published: a waiter re-checks out_dir before building
    return out_dir


def synthesize(
    out_dir: str | Path,
    *,
    arch: str = "llama",
    preset: str = "tiny",
    seed: int = 0,
    dtype: str = "bfloat16",
    outlier_channels: int = 0,
    outlier_scale: float = 20.0,
    outlier_target: str = "both",
    norm_jitter: float = 0.0,
    shard_bytes: int = 5 << 30,
    overlap: bool = False,
    **dims: Any,
) -> Path:
    """Write a random-weight checkpoint of ``arch`` at ``preset`` size into ``out_dir``.

    Args:
        out_dir: the model directory to create (must not exist; built under a hidden name).
        arch: llama, mistral, qwen2, qwen3 or gemma3_text.
        preset: tiny, small, 1b (= 1.5b), 4b, 8b or 27b (see PRESETS).
        seed: the seed every tensor's values derive from.
        dtype: bfloat16, float16 or float32.
        outlier_channels, outlier_scale, outlier_target: planted outliers (module docstring).
        norm_jitter: std of the noise added to RMSNorm gains.
        shard_bytes: shard ceiling (mlx-lm's default 5 GiB).
        overlap: write a full shard on a background thread while the next is generated
            (faster; peak memory two shards instead of one).
        dims: hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, head_dim,
            vocab_size, tie_embeddings overriding the preset (None keeps it).

    Example:
        >>> synthesize(tmp / "m", arch="gemma3_text", preset="tiny", outlier_channels=4)
        >>> mlx_lm.load(str(tmp / "m"))
    """
    spec = resolve_spec(
        arch=arch,
        preset=preset,
        seed=seed,
        dtype=dtype,
        outlier_channels=outlier_channels,
        outlier_scale=outlier_scale,
        outlier_target=outlier_target,
        norm_jitter=norm_jitter,
        **dims,
    )
    return write_spec(spec, Path(out_dir), shard_bytes=shard_bytes, overlap=overlap)


def ensure_synthetic(*, cache_dir: str | Path, shard_bytes: int = 5 << 30, **fields: Any) -> Path:
    """The cached checkpoint for these synth fields, built once into ``cache_dir/<spec hash>/``.

    Concurrent callers (sweep jobs) wait on a lock file and reuse the first build.

    Example:
        >>> ensure_synthetic(cache_dir=Path("~/.cache/mlxbun/synth").expanduser(), arch="qwen3")
    """
    fields.pop("out", None)
    spec = resolve_spec(**fields)
    cache_dir = Path(cache_dir).expanduser()
    final = cache_dir / spec.hash
    if (final / "config.json").is_file():
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    with file_lock(cache_dir / f".{spec.hash}.lock"):
        if not final.exists():
            write_spec(spec, final, shard_bytes=shard_bytes)
    return final


def _stable_partial_root(outputs: Path, out: Path) -> Path:
    """``<outputs>/.partial`` when it is on ``out``'s filesystem (the final step is a rename)."""
    root = outputs.expanduser().absolute() / ".partial"
    root.mkdir(parents=True, exist_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    return root if os.stat(root).st_dev == os.stat(out.parent).st_dev else out.parent


def run(cfg: Any) -> Any:
    """command=synth: write the model into ``synth.out`` or ``<run_dir>/model``."""
    from mlxbun.provenance import RunResult

    fields = {k: v for k, v in asdict(cfg.synth).items() if k != "out"}
    spec = resolve_spec(**fields)
    out = Path(cfg.synth.out).expanduser() if cfg.synth.out else Path(cfg.paths.run_dir) / "model"
    # Into a fresh run dir: keep the partial build at a stable place so a re-run resumes it.
    root = None if cfg.synth.out else _stable_partial_root(Path(cfg.paths.outputs), out)
    start = time.perf_counter()
    path = write_spec(spec, out, shard_bytes=cfg.io.shard_bytes, overlap=cfg.io.overlap, partial_root=root)
    seconds = time.perf_counter() - start
    tensors = plan(spec)
    nbytes, params = sum(t.nbytes for t in tensors), sum(t.numel for t in tensors)
    s = spec.shape
    return RunResult(
        outputs=[path],
        metrics={"params": params, "bytes": nbytes, "seconds": round(seconds, 3), "spec_hash": spec.hash},
        message=(
            f"synth {spec.arch} {s.num_layers}x{s.hidden_size} vocab {s.vocab_size}: {params / 1e6:,.1f}M params,"
            f" {nbytes / 1e6:,.1f} MB in {seconds:.1f}s -> {path}"
        ),
        provides={"model.name": str(path)},
    )
