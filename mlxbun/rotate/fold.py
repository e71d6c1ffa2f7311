"""The fold math of rotate: the seeded R1, which tensors a family has and how each one folds.

Pure functions of a source's tensors (float64 arithmetic, results stored in the source's dtype);
:mod:`mlxbun.rotate.command` writes the rotated directory and its record, :mod:`mlxbun.rotate.verify`
checks the result computes the same function. The algebra is drawn in :mod:`mlxbun.rotate.command`.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlxbun.errors import InputError
from mlxbun.io.dtypes import OUTPUT_CODES as OUT_DTYPES
from mlxbun.io.safetensors import NP_DTYPES
from mlxbun.rotate.hadamard import HadamardSpec, apply_rows, plan

SIGNS = "shake256(b'mlxbun-r1:<seed>'), bit i (LSB first) -> s_i = 1 - 2*bit"
WEIGHT_DTYPES = tuple(OUT_DTYPES.values())  # rotate reads what a conversion may write
CHUNK_ELEMS = 1 << 22  # float64 elements per transform chunk (32 MiB)
# Per-layer tensors (after "model.layers.<i>."): (role, norm feeding it). Roles: "in" (input
# side, gain folded), "out"/"out_bias" (output side), "norm" (folded, set to unit), "uniform"
# (gemma post-norms: must be uniform), "keep" (not on the residual stream: q/k/v and gate/up
# biases, per-head q/k norms on head_dim, rope tables).
_COMMON = {
    "self_attn.o_proj.weight": ("out", None),
    "self_attn.o_proj.bias": ("out_bias", None),
    "mlp.down_proj.weight": ("out", None),
    "mlp.down_proj.bias": ("out_bias", None),
    "input_layernorm.weight": ("norm", None),
    **{f"self_attn.{p}_proj.weight": ("in", "input_layernorm") for p in "qkv"},
    **{f"self_attn.{p}_proj.bias": ("keep", None) for p in "qkv"},
    **{f"mlp.{p}_proj.bias": ("keep", None) for p in ("gate", "up")},
    "self_attn.q_norm.weight": ("keep", None),
    "self_attn.k_norm.weight": ("keep", None),
    "self_attn.rotary_emb.inv_freq": ("keep", None),
}
_LLAMA = {
    **_COMMON,
    "post_attention_layernorm.weight": ("norm", None),
    **{f"mlp.{p}_proj.weight": ("in", "post_attention_layernorm") for p in ("gate", "up")},
}
_GEMMA3 = {
    **_COMMON,
    "pre_feedforward_layernorm.weight": ("norm", None),
    **{f"mlp.{p}_proj.weight": ("in", "pre_feedforward_layernorm") for p in ("gate", "up")},
    "post_attention_layernorm.weight": ("uniform", None),
    "post_feedforward_layernorm.weight": ("uniform", None),
}
FAMILIES = {"llama": _LLAMA, "mistral": _LLAMA, "qwen2": _LLAMA, "qwen3": _LLAMA, "gemma3_text": _GEMMA3}
TOP = {
    "model.embed_tokens.weight": ("embed", None),
    "model.norm.weight": ("norm", None),
    "lm_head.weight": ("in", "model.norm"),
}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")

# ---------------------------------------------------------------------------- the rotation


def signs(seed: int, n: int) -> np.ndarray:
    """The ±1 sign vector s of R1 (float64), from SHAKE-256 so it never depends on numpy's RNG."""
    raw = hashlib.shake_256(f"mlxbun-r1:{seed}".encode()).digest((n + 7) // 8)
    bits = np.unpackbits(np.frombuffer(raw, dtype=np.uint8), bitorder="little")[:n]
    return 1.0 - 2.0 * bits.astype(np.float64)


@dataclass(frozen=True, eq=False)
class Rotation:
    """R1 = diag(s)·H/√n applied to row vectors.

    Example:
        >>> r = Rotation.build(seed=0, n=64)
        >>> np.allclose(r.rows_t(r.rows(np.eye(64))), np.eye(64))
        True
    """

    seed: int
    spec: HadamardSpec
    s: np.ndarray

    @classmethod
    def build(cls, *, seed: int, n: int, spec: HadamardSpec | None = None) -> Rotation:
        return cls(seed=seed, spec=spec or plan(n), s=signs(seed, n))

    def rows(self, x: np.ndarray) -> np.ndarray:
        """x @ R1 for float64 rows x [r, n]."""
        return apply_rows(x * self.s, self.spec) / math.sqrt(self.spec.n)

    def rows_t(self, x: np.ndarray) -> np.ndarray:
        """x @ R1ᵀ for float64 rows x [r, n]."""
        return apply_rows(x, self.spec, transpose=True) * self.s / math.sqrt(self.spec.n)


# ---------------------------------------------------------------------------- dtype helpers


def to_f64(a: Any) -> np.ndarray:
    """An mx.array (any float dtype) as a float64 numpy array."""
    return np.asarray(a.astype(mx.float32), dtype=np.float64)


def _store(x: np.ndarray, dtype: str) -> np.ndarray:
    """float64 -> the storage array of safetensors ``dtype`` (BF16 as uint16 bits, round to nearest even)."""
    if dtype == "F32":
        return x.astype(np.float32)
    if dtype == "F16":
        return x.astype(np.float16)
    u = x.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def to_stored(x: np.ndarray, dtype: str) -> Any:
    """A storage array as something ShardedWriter stores with the right dtype."""
    return mx.array(x).view(mx.bfloat16) if dtype == "BF16" else x


_STORE_NP = {c: NP_DTYPES[c] for c in WEIGHT_DTYPES}  # BF16 moves as its uint16 bits


# ---------------------------------------------------------------------------- checking the source


@dataclass(frozen=True, eq=False)
class FoldPlan:
    """Everything checked about a source before anything is written.

    Args:
        model_type: the family (a key of FAMILIES).
        hidden_size: n.
        roles: output tensor name -> (role, norm feeding it, source tensor name), sorted by name.
        gains: norm prefix (e.g. "model.layers.0.input_layernorm") -> float64 gain.
        untie: the source head is the embedding and the fold writes a separate lm_head.
        config: the config.json to write.
    """

    model_type: str
    hidden_size: int
    roles: dict[str, tuple[str, str | None, str]]
    gains: dict[str, np.ndarray]
    untie: bool
    config: dict[str, Any]

    @property
    def gemma(self) -> bool:
        return self.model_type.startswith("gemma")

    @property
    def final_gain(self) -> np.ndarray:
        return self.gains["model.norm"]


def _role(name: str, table: dict[str, tuple[str, str | None]]) -> tuple[str, str | None] | None:
    if name in TOP:
        return TOP[name]
    match = _LAYER.fullmatch(name)
    if match is None or match.group(2) not in table:
        return None
    role, feeder = table[match.group(2)]
    return role, None if feeder is None else f"model.layers.{match.group(1)}.{feeder}"


def _check_family(m: Any) -> tuple[str, int]:
    model_type = m.config.get("model_type")
    if model_type not in FAMILIES:
        raise InputError(
            f"{m.path}: model_type={model_type!r} is not supported by rotate; choose one of {', '.join(FAMILIES)}"
        )
    if "quantization" in m.config or any(n.endswith(".scales") for n in m.names()):
        raise InputError(f"{m.path} is quantized; rotate needs an unquantized (bf16/f16/f32) checkpoint")
    hidden = int(m.config.get("hidden_size", 0))
    try:
        plan(hidden)
    except InputError as e:
        raise InputError(f"{m.path}: {e}") from None
    return model_type, hidden


def _check_tensors(m: Any, table: dict[str, tuple[str, str | None]], hidden: int) -> None:
    for name in m.names():
        info, role = m.info(name), _role(name, table)
        if role is None:
            raise InputError(
                f"{m.path}: tensor {name!r} is not part of a {m.config['model_type']} checkpoint as rotate knows it;"
                " rotating around it would change the model's function"
            )
        if info.dtype not in WEIGHT_DTYPES:
            raise InputError(
                f"{m.path}: tensor {name!r} is {info.dtype}; rotate reads {', '.join(WEIGHT_DTYPES)}"
            )
        axis = {"embed": -1, "in": -1, "out": 0, "out_bias": 0, "norm": 0, "uniform": 0}.get(role[0])
        if axis is not None and info.shape[axis] != hidden:
            raise InputError(
                f"{m.path}: tensor {name!r} has shape {list(info.shape)}; expected hidden_size={hidden} on axis {axis}"
            )


def _gains(m: Any, table: dict[str, tuple[str, str | None]], gemma: bool) -> dict[str, np.ndarray]:
    """float64 gain of every folded norm (gemma stores w and applies 1 + w)."""
    gains = {}
    for name in m.names():
        role = _role(name, table)[0]
        if role in ("norm", "uniform"):
            w = to_f64(m.array(name))
            gain = 1.0 + w if gemma else w
            if role == "uniform" and not np.all(gain == gain[0]):
                raise InputError(_post_norm_reason(m.path, name, gain))
            gains[name.removesuffix(".weight")] = gain
    if "model.norm" not in gains:
        raise InputError(f"{m.path}: no model.norm.weight; rotate needs the final norm to fold into lm_head")
    return gains


def _post_norm_reason(path: Path, name: str, gain: np.ndarray) -> str:
    return (
        f"{path}: {name} has a non-uniform gain (min {gain.min():.4g}, max {gain.max():.4g}); gemma3_text applies "
        "this norm to the attention/MLP output before the residual add, where no linear layer follows to absorb "
        "it, and an RMSNorm commutes with R1 only when its gain is uniform; rotate refuses this model rather "
        "than change its function"
    )


def _is_tied(m: Any, model_type: str) -> bool:
    """Whether the head mlx-lm uses is the embedding (mlx-lm's own rule per family)."""
    if "lm_head.weight" not in m:
        return True
    return model_type != "gemma3_text" and bool(m.config.get("tie_word_embeddings", True))


def check_source(m: Any) -> FoldPlan:
    """Validate an open source model (``mlxbun.io.safetensors.ModelDir``) and plan the fold."""
    model_type, hidden = _check_family(m)
    table = FAMILIES[model_type]
    _check_tensors(m, table, hidden)
    gains = _gains(m, table, model_type.startswith("gemma"))
    tied = _is_tied(m, model_type)
    # A tied head with unit final gain stays tied: lm_head = embedding·R1 exactly.
    untie = tied and not np.all(gains["model.norm"] == 1.0)
    names = [n for n in m.names() if not (tied and n == "lm_head.weight")]
    roles = {n: (*_role(n, table), n) for n in names}
    if untie:
        roles["lm_head.weight"] = ("in", "model.norm", "model.embed_tokens.weight")
    config = dict(m.config)
    if untie:
        config["tie_word_embeddings"] = False
    return FoldPlan(model_type, hidden, dict(sorted(roles.items())), gains, untie, config)


# ---------------------------------------------------------------------------- folding tensors


def _rotate_rows(a: Any, fn: Any, gain: np.ndarray | None, dtype: str) -> np.ndarray:
    """fn(a · diag(gain)) row chunk by row chunk, for a [rows, n] tensor."""
    rows, n = a.shape
    out = np.empty((rows, n), dtype=_STORE_NP[dtype])
    step = max(1, CHUNK_ELEMS // n)
    for r0 in range(0, rows, step):
        x = to_f64(a[r0 : r0 + step])
        out[r0 : r0 + step] = _store(fn(x if gain is None else x * gain), dtype)
    return out


def _rotate_cols(a: Any, rot: Rotation, dtype: str) -> np.ndarray:
    """R1ᵀ · a for an [n, cols] tensor, column chunk by column chunk: (R1ᵀ a)ᵀ = aᵀ R1."""
    n, cols = a.shape
    out = np.empty((n, cols), dtype=_STORE_NP[dtype])
    step = max(1, CHUNK_ELEMS // n)
    for c0 in range(0, cols, step):
        out[:, c0 : c0 + step] = _store(rot.rows(to_f64(a[:, c0 : c0 + step]).T).T, dtype)
    return out


def fold_tensor(
    a: Any, role: str, gain: np.ndarray | None, rot: Rotation, *, dtype: str, gemma: bool
) -> np.ndarray:
    """One tensor of the rotated model from its source tensor ``a`` (an mx.array).

    Returns the storage array (float32/float16, or the uint16 bits of bfloat16); wrap it with
    ``_wrap`` after dropping ``a`` so that at most two tensors are alive at once.

    Args:
        a: the source tensor.
        role: "embed", "in", "out", "out_bias", "norm", "uniform" or "keep" (see FAMILIES).
        gain: the gain of the norm feeding an "in" tensor (None otherwise).
        rot: R1.
        dtype: safetensors dtype of the result ("BF16", "F16", "F32").
        gemma: norms store w and apply 1 + w (a unit gain is then w = 0).
    """
    if role == "norm":
        return _store(np.full(a.shape, 0.0 if gemma else 1.0), dtype)
    if role in ("uniform", "keep"):
        return _store(to_f64(a), dtype)
    if role == "out":
        return _rotate_cols(a, rot, dtype)
    if role == "out_bias":
        return _store(rot.rows(to_f64(a)[None, :])[0], dtype)
    return _rotate_rows(a, rot.rows, gain, dtype)
