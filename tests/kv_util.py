"""Helpers for the kv tests: a tiny random llama built in code and caches filled by real prefill."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as C
from mlx_lm.models import llama

VOCAB = 100


def tiny_model(seed: int = 0, *, layers: int = 2) -> Any:
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=128,
        num_hidden_layers=layers,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB,
    )
    mx.random.seed(seed)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def tokens(n: int, *, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1, VOCAB, size=n)]


def make_cache(kind: str, layers: int = 2) -> list[Any]:
    if kind == "kv":
        return [C.KVCache() for _ in range(layers)]
    if kind == "rotating":
        return [C.RotatingKVCache(max_size=48, keep=4) for _ in range(layers)]
    if kind == "quantized":
        return [C.QuantizedKVCache(group_size=32, bits=4) for _ in range(layers)]
    if kind == "list":
        return [C.CacheList(C.KVCache(), C.RotatingKVCache(max_size=48, keep=2)) for _ in range(layers)]
    raise ValueError(kind)


class ListModel:
    """Run the llama with CacheList caches: each layer feeds its inputs to both sub-caches."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def __call__(self, x: mx.array, cache: list[Any]) -> mx.array:
        first = [c.caches[0] for c in cache]
        out = self.model(x, cache=first)
        for c in cache:
            k, v = c.caches[0].state[0], c.caches[0].state[1]
            n = x.shape[1]
            off = c.caches[0].offset
            c.caches[1].update_and_fetch(k[..., off - n : off, :], v[..., off - n : off, :])
        return out


def step(model: Any, cache: list[Any], toks: list[int], *, kind: str = "kv") -> mx.array:
    """Feed ``toks`` (one call for prefill-sized input) and return the last logits."""
    m = ListModel(model) if kind == "list" else model
    out = m(mx.array(toks)[None], cache=cache)
    mx.eval(out)
    return out[0, -1]


def filled(model: Any, kind: str, n: int, *, decode: int = 0, seed: int = 0) -> tuple[list[Any], list[int]]:
    """A cache of ``kind`` after prefilling n tokens then decoding ``decode`` single tokens."""
    toks = tokens(n + decode, seed=seed)
    cache = make_cache(kind, len(model.layers))
    step(model, cache, toks[:n], kind=kind)
    for t in toks[n:]:
        step(model, cache, [t], kind=kind)
    return cache, toks


def continue_logits(model: Any, cache: list[Any], toks: list[int], *, kind: str = "kv") -> np.ndarray:
    """Logits after feeding ``toks`` one at a time (exercises ring rotation and quantized appends)."""
    out = None
    for t in toks:
        out = step(model, cache, [t], kind=kind)
    return np.array(out)


def state_arrays(cache: list[Any]) -> list[np.ndarray]:
    """Every valid (offset-trimmed, temporal-order) array of a cache, as numpy, for equality checks."""
    from mlxbun.kv.state import cache_state

    out = []
    for s in cache_state(cache):
        for name in sorted(s.tensors):
            t = s.tensors[name]
            out.append(np.array(t.buf[:, :, : t.shape[2]]))
    return out
