"""Activation-aware scaling (AWQ, Lin et al. 2023), folded exactly into the preceding norm or linear.

A linear layer ``y = x W^T`` computes the same thing as ``(x / s) (W s)^T`` for any positive
per-input-channel ``s``. Scaling up the columns that see large activations before rounding moves
rounding error away from them. The ``x / s`` is folded into whatever produced ``x``:

- an RMSNorm gain (``input_layernorm`` -> q/k/v, ``post_attention_layernorm`` -> gate/up,
  the final ``model.norm`` -> an untied ``lm_head``): ``g / s``;
- a linear's output rows (``up_proj`` -> ``down_proj``, since ``down`` sees ``act(gate) * up``;
  ``v_proj`` -> ``o_proj`` when there are as many key/value heads as query heads): rows ``/ s``.

Every fold is exact in float arithmetic, so the output is a stock mlx-lm model: only weights
change, no new tensors or config keys. Folds that are not exact are skipped and named in
:attr:`Fold.skipped`: a tied head (the final norm would also scale the embedding), ``v -> o``
under grouped-query attention, and model types whose blocks differ from llama's (Gemma's
``1 + w`` norms and post-norms): there every module is rounded as ``clip``.

Search, per fold group (deterministic, no randomness): the activation size per channel is
``a = sqrt(diag(H))`` (relative RMS) from the captured input Hessians (:mod:`mlxbun.quant.hessian`);
for ``r`` in 0, 1/20, ... 19/20, ``s = a**r`` normalised to ``sqrt(max * min) = 1``; each
member is rounded as ``mx.quantize(W s)`` at its own (bits, group size) and scored by its
output error ``trace(dW H dW^T)``, ``dW = deq / s - W``; the ``s`` with the smallest summed error
wins. The scaled weights are then rounded by the range search of :mod:`mlxbun.quant.rounding`
weighted by the scaled inputs' ``diag(H / s s^T)``; when that rounds the group with more output
error than the range search without scales, the group keeps s = 1 (so on the calibration error
awq never loses to ``clip``). Groups are searched in block order, ``up -> down``
before ``post_attention_layernorm`` so that up's scaled rows are the ones rounded (as mlx-lm).

Use as a plan candidate: :func:`search` takes a ``quant(path)`` callable giving each module's
(bits, group_size, mode) setting, so a planner can search the folds for a candidate plan and read
each member's output error from :meth:`Fold.errors`; ``quantize_model_dir(..., method="awq",
hessians=...)`` applies it while streaming.

Example:
    >>> fold = search(names=names, config=config, read=lambda n: weights[n], hessians=h,
    ...               quant=lambda p: {"bits": 3, "group_size": 64})
    >>> w = fold.apply("model.layers.0.self_attn.q_proj.weight", w)   # columns * s
    >>> h_q = fold.hessian("model.layers.0.self_attn.q_proj", h_q)     # H / s s^T
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from mlxbun.quant import rounding

log = logging.getLogger("mlxbun")

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")  # blocks as llama's: RMSNorm gain x * g
GRID = 20
MIN_SCALE = 1e-4


@dataclass(frozen=True)
class Group:
    """``prev``'s output channels are divided by s; the input columns of ``layers`` multiplied."""

    prev: str  # module path of the norm or linear
    layers: tuple[str, ...]  # module paths


@dataclass
class Fold:
    """Per-tensor column (input) and row (output) multipliers, and what was searched."""

    cols: dict[str, np.ndarray] = field(default_factory=dict)  # module path -> s
    rows: dict[str, np.ndarray] = field(default_factory=dict)  # tensor name -> 1 / s
    ratios: dict[str, float] = field(default_factory=dict)  # group prev -> chosen exponent r
    errors: dict[str, float] = field(default_factory=dict)  # module path -> output error (plain rtn)
    skipped: list[str] = field(default_factory=list)

    def apply(self, name: str, a: Any, *, row0: int = 0) -> Any:
        """Tensor ``name`` (or its rows from ``row0``) with its multipliers; float32 math, same dtype."""
        col = self.cols.get(name.rpartition(".")[0]) if name.endswith(".weight") and a.ndim == 2 else None
        row = self.rows.get(name)
        if col is None and row is None:
            return a
        out = a.astype(mx.float32)
        if col is not None:
            out = out * mx.array(col)
        if row is not None:
            r = row[row0 : row0 + a.shape[0]]
            out = out * mx.array(r.reshape(-1, *([1] * (a.ndim - 1))))
        return out.astype(a.dtype)

    def add(self, g: Group, s: np.ndarray, names: set[str]) -> None:
        """Fold ``s`` for group ``g``: its members' columns times s, ``prev``'s weight (and bias) / s."""
        inv = (1.0 / s.astype(np.float64)).astype(np.float32)
        for m in g.layers:
            self.cols[m] = s
        for t in (f"{g.prev}.weight", f"{g.prev}.bias"):
            if t in names:
                prev = self.rows.get(t)
                self.rows[t] = inv if prev is None else (prev * inv).astype(np.float32)

    def hessians(self, base: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        """``base`` with every lookup passed through :meth:`hessian` (nothing read ahead)."""
        return _Scaled(self, base)

    def hessian(self, path: str, h: np.ndarray) -> np.ndarray:
        """The Hessian of module ``path``'s inputs once they are divided by its s."""
        s = self.cols.get(path)
        return h if s is None else (h / np.outer(s, s)).astype(np.float32)


class _Scaled(Mapping):
    def __init__(self, fold: Fold, base: Mapping[str, np.ndarray]) -> None:
        self.fold, self.base = fold, base

    def __getitem__(self, path: str) -> np.ndarray:
        return self.fold.hessian(path, self.base[path])

    def __iter__(self) -> Iterator[str]:
        return iter(self.base)

    def __len__(self) -> int:
        return len(self.base)


def groups(names: set[str], config: dict[str, Any]) -> tuple[list[Group], list[str]]:
    """The exact folds of a checkpoint with these parameter names, in block order; and skipped ones."""
    model_type = config.get("model_type", "")
    if model_type not in FAMILIES:
        return [], [f"model_type {model_type!r}: no exact fold known (folds for {', '.join(FAMILIES)})"]
    has = lambda p: f"{p}.weight" in names  # noqa: E731
    out, skipped = [], []
    layer_ids = sorted({int(m.group(1)) for n in names if (m := re.match(r"model\.layers\.(\d+)\.", n))})
    gqa = config.get("num_key_value_heads", config.get("num_attention_heads")) != config.get(
        "num_attention_heads"
    )
    for i in layer_ids:
        p = f"model.layers.{i}."
        attn, mlp = f"{p}self_attn.", f"{p}mlp."
        candidates = [
            Group(f"{p}input_layernorm", tuple(f"{attn}{x}_proj" for x in "qkv")),
            Group(f"{attn}v_proj", (f"{attn}o_proj",)),
            Group(f"{mlp}up_proj", (f"{mlp}down_proj",)),
            Group(f"{p}post_attention_layernorm", (f"{mlp}gate_proj", f"{mlp}up_proj")),
        ]
        for g in candidates:
            if not (has(g.prev) and all(has(m) for m in g.layers)):
                continue
            if g.prev.endswith("v_proj") and gqa:
                skipped.append(
                    f"{g.prev} -> o_proj: grouped-query attention (one v channel feeds several heads)"
                )
                continue
            out.append(g)
    if has("lm_head") and has("model.norm"):
        if config.get("tie_word_embeddings", False):
            skipped.append("model.norm -> lm_head: the head is tied to the embedding")
        else:
            out.append(Group("model.norm", ("lm_head",)))
    elif has("model.norm"):
        skipped.append("model.norm -> head: the head is the tied embedding")
    return out, skipped


def _rounded(w: Any, q: dict[str, Any]) -> Any:
    """``w`` through plain affine rounding at ``q``'s setting (float32)."""
    parts = mx.quantize(w, group_size=q["group_size"], bits=q["bits"])
    return mx.dequantize(*parts, group_size=q["group_size"], bits=q["bits"])


def _error(dw: Any, h: Any) -> Any:
    return mx.sum((dw @ h) * dw)


def search_group(
    ws: list[Any], qs: list[dict[str, Any] | None], h: np.ndarray, *, dtype: Any = mx.bfloat16
) -> tuple[np.ndarray, float, list[float]]:
    """Best s for members ``ws`` (float32, (out, in)) with settings ``qs`` (None: not rounded) that
    share the input Hessian ``h``; returns (s, its exponent r, each member's error at s)."""
    hm = mx.array(h.astype(np.float32))
    d = np.maximum(np.diag(h).astype(np.float64), 0)
    act = np.sqrt(d / max(d.mean(), 1e-30))  # relative RMS per channel: independent of token count
    live = [(w, q) for w, q in zip(ws, qs, strict=True) if q is not None]
    best: tuple[float, np.ndarray, float, list[float]] | None = None
    for k in range(GRID):
        r = k / GRID
        s = np.maximum(act**r, MIN_SCALE)
        s = (s / np.sqrt(s.max() * s.min())).astype(np.float32)
        sm = mx.array(s)
        errs = [_error(_rounded((w * sm).astype(dtype), q) / sm - w, hm) for w, q in live]
        mx.eval(errs)
        vals = [float(e) for e in errs]
        if best is None or sum(vals) < best[0]:
            best = (sum(vals), s, r, vals)
    assert best is not None
    return best[1], best[2], best[3]


def _clip_errors(live: list, h: np.ndarray, s: np.ndarray, dtype: Any) -> list[float]:
    """Each member's output error once rounded as it will be written: range search on ``W s``."""
    sm, hs = mx.array(s), h / np.outer(s, s)
    errs = []
    for w, q in live:
        parts = rounding.quantize(
            (w * sm).astype(dtype), bits=q["bits"], group_size=q["group_size"], hessian=hs
        )
        deq = mx.dequantize(*parts, group_size=q["group_size"], bits=q["bits"]).astype(mx.float32)
        errs.append(float(_error(deq / sm - w, mx.array(h.astype(np.float32)))))
    return errs


def _against_plain(live: list, h: np.ndarray, s: np.ndarray, r: float, dtype: Any) -> tuple:
    """The searched s, unless the range search alone (s = 1) rounds the group with less error."""
    scaled = _clip_errors(live, h, s, dtype)
    if r == 0:
        return s, r, scaled
    ones = np.ones_like(s)
    plain = _clip_errors(live, h, ones, dtype)
    return (s, r, scaled) if sum(scaled) < sum(plain) else (ones, 0.0, plain)


def _affine(q: dict[str, Any] | None, width: int) -> dict[str, Any] | None:
    """``q`` when it rounds affinely (the only setting searched), else None."""
    if q is None or q.get("mode", "affine") != "affine" or width % q["group_size"]:
        return None
    return q


def _check_dims(g: Group, ws: list[Any], width: int) -> None:
    for m, w in zip(g.layers, ws, strict=True):
        if w.shape[-1] != width:
            raise ValueError(f"{m}: input width {w.shape[-1]} differs from {g.prev}'s {width} channels")


def search(
    *,
    names: set[str],
    config: dict[str, Any],
    read: Callable[[str], Any],
    hessians: Mapping[str, np.ndarray],
    quant: Callable[[str], dict[str, Any] | None],
) -> Fold:
    """Search the scales of every exact fold of a checkpoint (module docstring).

    Args:
        names: the checkpoint's parameter names (after mlx-lm's sanitize).
        config: its config.json (``model_type``, head counts, ``tie_word_embeddings``).
        read: parameter name -> array (read once per fold group, one group in memory at a time).
        hessians: module path -> input Hessian (numpy), as :func:`mlxbun.quant.hessian.load`.
        quant: module path -> ``{"bits", "group_size", "mode"}`` or None (not quantized).
    """
    todo, skipped = groups(names, config)
    fold = Fold(skipped=list(skipped))
    for g in todo:
        h = next((hessians[m] for m in g.layers if m in hessians), None)
        qs = [_affine(quant(m), h.shape[0]) for m in g.layers]
        if h is None or all(q is None for q in qs):
            fold.skipped.append(f"{g.prev}: {'no Hessian' if h is None else 'no member is affine-quantized'}")
            continue
        raw = {m: read(f"{m}.weight") for m in g.layers}
        ws = [fold.apply(f"{m}.weight", raw[m].astype(mx.float32)) for m in g.layers]
        _check_dims(g, ws, h.shape[0])
        dtype = raw[g.layers[0]].dtype
        s, r, _ = search_group(ws, qs, h, dtype=dtype)
        s, r, errs = _against_plain(
            [(w, q) for w, q in zip(ws, qs, strict=True) if q is not None], h, s, r, dtype
        )
        del raw, ws
        fold.ratios[g.prev] = r
        fold.errors.update(
            zip([m for m, q in zip(g.layers, qs, strict=True) if q is not None], errs, strict=True)
        )
        fold.add(g, s, names)
    for line in fold.skipped:
        log.info("awq: skipped %s", line)
    return fold
