"""The architectures synth writes: HF config fields, size presets, the spec records, the tokenizer.

Data only, plus the two config files and the byte-level BPE tokenizer built offline from it;
:mod:`mlxbun.synth.command` resolves a spec against these tables and :mod:`mlxbun.synth.values`
generates the tensors.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from mlxbun.io.atomic import dumps_json
from mlxbun.io.dtypes import CODES, ITEMSIZE

FORMAT_VERSION = 2  # bump when the bytes for a given spec change

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text")
# Model dimensions a synth spec may set explicitly (each overrides the preset's value).
SYNTH_DIMS = (
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "vocab_size",
)

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


def _dims(
    hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, head_dim: int, **more: Any
) -> dict[str, Any]:
    """One preset row: the six dims in this order, then any other field (vocab, ties, HF config)."""
    return dict(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        **more,
    )


# preset -> {"*": dims for every arch, arch: that arch's real model}; "config" holds extra HF keys.
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "tiny": {
        "*": _dims(64, 128, 2, 4, 2, 16, vocab_size=512, tie_embeddings=True),
    },
    "small": {
        "*": _dims(512, 1536, 8, 8, 2, 64, vocab_size=8192, tie_embeddings=True),
    },
    "1b": {  # Llama 3.2 1B, Qwen2.5 1.5B, Qwen3 1.7B, Gemma 3 1B
        "*": _dims(2048, 8192, 16, 32, 8, 64, tie_embeddings=True),
        "qwen2": _dims(1536, 8960, 28, 12, 2, 128),
        "qwen3": _dims(2048, 6144, 28, 16, 8, 128),
        "gemma3_text": _dims(
            1152, 6912, 26, 4, 1, 256, config={"query_pre_attn_scalar": 256, "sliding_window": 512}
        ),
    },
    "4b": {  # Llama 3.2 3B, Qwen2.5 3B, Qwen3 4B, Gemma 3 4B (text)
        "*": _dims(3072, 8192, 28, 24, 8, 128, tie_embeddings=True),
        "qwen2": _dims(2048, 11008, 36, 16, 2, 128),
        "qwen3": _dims(2560, 9728, 36, 32, 8, 128),
        "gemma3_text": _dims(
            2560,
            10240,
            34,
            8,
            4,
            256,
            vocab_size=262208,
            config={"query_pre_attn_scalar": 256, "sliding_window": 1024, **_GEMMA_LONG},
        ),
    },
    "8b": {  # Llama 3.1 8B, Mistral 7B v0.3, Qwen2.5 7B, Qwen3 8B; gemma3: the generic shape
        "*": _dims(4096, 14336, 32, 32, 8, 128, tie_embeddings=False),
        "qwen2": _dims(3584, 18944, 28, 28, 4, 128, vocab_size=152064),
        "qwen3": dict(intermediate_size=12288, num_layers=36),
        "gemma3_text": dict(
            vocab_size=262208, config={"query_pre_attn_scalar": 128, "sliding_window": 1024, **_GEMMA_LONG}
        ),
    },
    "27b": {  # Gemma 3 27B; the other archs get its dims
        "*": _dims(5376, 21504, 62, 32, 16, 128, tie_embeddings=False),
        "qwen2": dict(head_dim=168),
        "gemma3_text": dict(
            vocab_size=262208,
            tie_embeddings=True,
            config={"query_pre_attn_scalar": 168, "sliding_window": 1024, **_GEMMA_LONG},
        ),
    },
}
PRESETS["1.5b"] = PRESETS["1b"]


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
    dtype: str
    seed: int
    outlier_channels: int
    outlier_scale: float
    outlier_target: str
    norm_jitter: float
    config: dict[str, Any]  # extra HF config keys of the preset

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
        return self.numel * ITEMSIZE[CODES[self.dtype]]


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
