"""The values of synthetic tensors: the tensor plan of a spec, each tensor's bytes, and the in-memory source.

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
"""

from __future__ import annotations

import hashlib
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from statistics import NormalDist
from typing import Any

import mlx.core as mx
import numpy as np

from mlxbun.synth.arch import Spec, TensorPlan

CHUNK = 1 << 22  # elements drawn per RNG stream
THREADS = max(1, min(2, os.cpu_count() or 1))
TABLE_BITS = 16

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
        n, inv = 1 << TABLE_BITS, NormalDist().inv_cdf
        _QUANTILES = np.array([inv((k + 0.5) / n) for k in range(n)], dtype=np.float64)
    return _QUANTILES


def _mx_dtype(dtype: str) -> Any:
    return getattr(mx, dtype)


def _bits_dtype(dtype: str) -> Any:
    return mx.uint32 if dtype == "float32" else mx.uint16


def _table(t: TensorPlan, factor: float) -> np.ndarray:
    """The 2**16 possible stored values (raw bits) of ``t`` with factor ``f``, z a quantile."""
    vals = factor * (t.base + t.std * _quantiles()) - t.offset
    return np.array(mx.array(vals.astype(np.float32)).astype(_mx_dtype(t.dtype)).view(_bits_dtype(t.dtype)))


def tensor_array(t: TensorPlan, *, spec: Spec, channels: list[int]) -> Any:
    """Generate one planned tensor as an ``mx.array`` of ``t.dtype`` (memory: the tensor once).

    Example:
        >>> spec = resolve_spec(arch="llama")
        >>> tensor_array(plan(spec)[0], spec=spec, channels=planted_channels(spec)).shape
        (512, 64)
    """
    if _constant(t, channels):
        return mx.full(t.shape, t.base - t.offset, dtype=_mx_dtype(t.dtype))
    rows = t.shape[0] if len(t.shape) > 1 else 1
    return tensor_rows(t, 0, rows, spec=spec, channels=channels).reshape(t.shape)


def row_step(t: TensorPlan) -> int:
    """Rows per RNG stream of ``t``: :func:`tensor_rows` is cheapest on multiples of this."""
    rows = t.shape[0] if len(t.shape) > 1 else 1
    return max(1, CHUNK // (t.numel // rows))


def tensor_rows(t: TensorPlan, r0: int, r1: int, *, spec: Spec, channels: list[int]) -> Any:
    """Rows [r0, r1) of a planned tensor (a 1-D tensor is one row): the same bytes as
    ``tensor_array(t)[r0:r1]``, generating only the RNG streams that cover them.

    Example:
        >>> t = plan(spec)[0]
        >>> tensor_rows(t, 8, 16, spec=spec, channels=[]).shape
        (8, 64)
    """
    rows = t.shape[0] if len(t.shape) > 1 else 1
    if not 0 <= r0 < r1 <= rows:
        raise ValueError(f"rows [{r0}, {r1}) are outside {t.name!r} of {rows} rows")
    cols = t.numel // rows
    if _constant(t, channels):
        return mx.full((r1 - r0, cols), t.base - t.offset, dtype=_mx_dtype(t.dtype))
    out = mx.zeros((r1 - r0, cols), dtype=_bits_dtype(t.dtype))
    mx.eval(out)
    buf = np.array(out, copy=False)  # writable view of the mx buffer: no second copy
    planted = bool(channels) and t.outlier_axis is not None
    normal = _table(t, 1.0)
    scaled = _table(t, t.outlier_factor) if planted else None
    fill = _Filler(t, spec.seed, normal, scaled, np.asarray(channels, dtype=np.int64))
    step = row_step(t)
    chunks = range(r0 // step, (r1 - 1) // step + 1)
    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(lambda k: fill.rows(buf, r0, r1, k, step), chunks))
    return out.view(_mx_dtype(t.dtype))


def _constant(t: TensorPlan, channels: list[int]) -> bool:
    return t.std == 0 and not (channels and t.outlier_axis is not None)


@dataclass(frozen=True)
class _Filler:
    """Fills the rows of one chunk (RNG stream) of a tensor."""

    t: TensorPlan
    seed: int
    normal: np.ndarray
    scaled: np.ndarray | None
    channels: np.ndarray

    def rows(self, buf: np.ndarray, r0: int, r1: int, k: int, step: int) -> None:
        """Write the rows of chunk ``k`` (rows [k*step, (k+1)*step)) that lie in [r0, r1) into
        ``buf``, whose first row is row ``r0``. A stream's prefix does not depend on its length,
        so a chunk starting in range is filled in place, and only its first rows are drawn."""
        c0 = k * step
        lo, hi = max(c0, r0), min(c0 + step, r1)
        if lo == c0:
            self(buf[lo - r0 : hi - r0], k, c0)
            return
        block = np.empty((hi - c0, buf.shape[1]), dtype=buf.dtype)
        self(block, k, c0)
        buf[lo - r0 : hi - r0] = block[lo - c0 :]

    def __call__(self, block: np.ndarray, k: int, r0: int) -> None:
        """Fill ``block``, the first rows of chunk ``k``, which starts at row ``r0``."""
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


@dataclass(frozen=True)
class SyntheticSource:
    """A synthetic checkpoint read without its weight files: ``path`` holds config.json, the
    tokenizer and synth.json; every tensor is generated when it is asked for, with the bytes
    :func:`write_spec` would have written (so a conversion of it equals one of the files).

    Example:
        >>> src = ensure_synthetic_source(cache_dir=tmp, arch="gemma3_text", preset="27b")
        >>> src.rows("model.embed_tokens.weight", 0, 780).shape
        (780, 5376)
    """

    spec: Spec
    path: Path

    def __enter__(self) -> SyntheticSource:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    @cached_property
    def tensors(self) -> dict[str, TensorPlan]:
        return {t.name: t for t in plan(self.spec)}

    @cached_property
    def channels(self) -> list[int]:
        return planted_channels(self.spec)

    def lazy(self) -> dict[str, Any]:
        """name -> an unevaluated array of the tensor's shape and dtype (a placeholder that holds
        no memory; the converter reads values through :meth:`array` and :meth:`rows`)."""
        return {n: mx.zeros(t.shape, dtype=_mx_dtype(t.dtype)) for n, t in self.tensors.items()}

    def array(self, name: str) -> Any:
        return tensor_array(self.tensors[name], spec=self.spec, channels=self.channels)

    def rows(self, name: str, r0: int, r1: int) -> Any:
        t = self.tensors[name]
        shape = (r1 - r0, *t.shape[1:]) if len(t.shape) > 1 else t.shape  # 1-D: one row
        return tensor_rows(t, r0, r1, spec=self.spec, channels=self.channels).reshape(shape)

    def row_step(self, name: str) -> int:
        return row_step(self.tensors[name])

    def identity(self) -> str:
        return f"synthetic:{self.spec.hash}"
