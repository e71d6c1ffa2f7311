"""The keyspace of a server's prompt caches: the model, tokenizer, chat template and KV cache
setting every entry is made under (mlxbun.kv.tiers.Keyspace), checked before the first request."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlxbun.errors import InputError
from mlxbun.kv import tiers
from mlxbun.quant.spec import KV_GROUPS


def keyspace(
    loaded: Any, *, kv_bits: int | None, kv_group_size: int, float32: bool = False
) -> tiers.Keyspace:
    """The keyspace of this model, tokenizer, chat template and cache configuration (and of
    float32 compute, ``serve.float32``, whose caches are another dtype: hashed with the template,
    so entries of either never meet)."""

    if kv_bits:
        check_kv_group(loaded.model, kv_group_size)
    classes = [type(c).__name__ for c in tiers.leaf_caches(make_prompt_cache(loaded.model))]
    if kv_bits:  # mlx-lm turns each KVCache into a QuantizedKVCache at the first step
        classes = ["QuantizedKVCache" if c == "KVCache" else c for c in classes]
    template = getattr(loaded.tokenizer, "chat_template", None) or ""
    if not isinstance(template, str):
        template = json.dumps(template, sort_keys=True)
    return tiers.Keyspace(
        model=loaded.model_fp,
        tokenizer=loaded.tokenizer_fp,
        template=hashlib.sha256((template + ("\0compute=float32" if float32 else "")).encode()).hexdigest(),
        cache=tiers.cache_kind(classes, bits=kv_bits, group_size=kv_group_size),
    )


def check_kv_group(model: Any, group_size: int) -> None:
    """Refuse a KV group size that does not divide the model's head width (one token's step
    tells it), before a request fails on it."""

    cache = make_prompt_cache(model)
    model(mx.array([[0]]), cache=cache)
    widths = {int(s.keys.shape[-1]) for s in tiers.leaf_caches(cache) if getattr(s, "keys", None) is not None}
    bad = sorted(w for w in widths if w % group_size)
    if not bad:
        return
    fits = [str(g) for g in KV_GROUPS if all(w % g == 0 for w in widths)]
    fix = (
        f"choose one of {', '.join(fits)}" if fits else "no KV group size fits it: leave serve.kv_bits unset"
    )
    raise InputError(
        f"serve.kv_group_size={group_size} does not divide the model's KV head width {bad[0]}; {fix}"
    )
