"""Will a model fit in memory: weights (MoE: the active experts' share), vision sidecar, KV cache."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from mlxbun.registry.database import GB
from mlxbun.registry.index import record_for
from mlxbun.registry.query import resolve


@dataclass(frozen=True)
class FitReport:
    """Memory needed to run a model at a context length, against a budget (bytes)."""

    name: str
    path: str
    budget_bytes: int
    context: int
    weight_bytes: int  # every language weight on disk
    active_weight_bytes: int  # what decode touches: dense weights + active experts' share
    expert_bytes: int
    active_expert_bytes: int
    vision_bytes: int  # the sidecar, counted only when asked
    kv_bytes: int | None  # None when the config lacks the KV shape
    total_bytes: int
    fits: bool
    notes: tuple[str, ...] = ()


def kv_cache_bytes(rec: Any, context: int) -> int | None:
    """K and V for ``context`` tokens: layers x kv_heads x head_dim x 2 x dtype bytes, windows honoured."""
    if not (rec.num_layers and rec.num_kv_heads and rec.head_dim):
        return None
    per_token_layer = rec.num_kv_heads * rec.head_dim * 2 * rec.kv_dtype_bytes
    sliding = min(rec.num_sliding_layers or 0, rec.num_layers)
    window = min(context, rec.sliding_window) if rec.sliding_window else context
    return per_token_layer * ((rec.num_layers - sliding) * context + sliding * window)


def fit_record(rec: Any, *, budget_bytes: int, context: int, vision: bool = False) -> FitReport:
    """Does ``rec`` (a ModelRecord or anything with its fields) fit ``budget_bytes``?"""
    notes = []
    active_experts = rec.expert_bytes
    if rec.expert_bytes and rec.num_experts and rec.experts_per_tok:
        active_experts = rec.expert_bytes * rec.experts_per_tok // rec.num_experts
        notes.append(f"MoE: {rec.experts_per_tok} of {rec.num_experts} experts active per token")
    elif rec.expert_bytes:
        notes.append("expert tensors found but no num_experts/num_experts_per_tok: all counted")
    active = rec.weight_bytes - rec.expert_bytes + active_experts
    kv = kv_cache_bytes(rec, context)
    if kv is None:
        notes.append("KV cache unknown: config lacks layers / KV heads / head_dim")
    if rec.num_sliding_layers:
        notes.append(f"{rec.num_sliding_layers} sliding-window layers keep {rec.sliding_window} tokens")
    vis = rec.vision_bytes if vision else 0
    if vision and not rec.vision_bytes:
        notes.append("no vision sidecar")
    total = active + vis + (kv or 0)
    return FitReport(
        name=rec.repo_id or rec.name, path=rec.path, budget_bytes=budget_bytes, context=context,
        weight_bytes=rec.weight_bytes, active_weight_bytes=active, expert_bytes=rec.expert_bytes,
        active_expert_bytes=active_experts, vision_bytes=vis, kv_bytes=kv, total_bytes=total,
        fits=total <= budget_bytes, notes=tuple(notes),
    )  # fmt: skip


def fit(
    model: str | os.PathLike,
    *,
    budget_gb: float = 16.0,
    context: int = 8192,
    vision: bool = False,
    hub_cache: str | os.PathLike | None = None,
    paths: Iterable[str | os.PathLike] = (),
) -> FitReport:
    """Does ``model`` (anything :func:`resolve` takes) fit ``budget_gb`` at ``context`` tokens?

    Example:
        >>> r = fit("Qwen3-30B-A3B", budget_gb=24, context=32768)
        >>> r.fits, r.active_weight_bytes, r.kv_bytes
    """
    path = resolve(str(model), hub_cache=hub_cache, paths=paths)
    return fit_record(record_for(path), budget_bytes=int(budget_gb * GB), context=context, vision=vision)
