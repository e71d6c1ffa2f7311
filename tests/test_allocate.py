"""Tests for the allocator: knapsack optimality (brute force), exact size accounting, plans."""

from __future__ import annotations

import itertools
import random

import mlx.core as mx
import numpy as np
import pytest

from mlxbun.io.shards import write_sharded
from mlxbun.quant import budget
from mlxbun.quant.budget import Setting, TensorSpec
from mlxbun.quant.knapsack import lp_lower_bound, solve


def brute_force(items, capacity):
    """Optimal (cost, bytes) over every combination, or None when nothing fits."""
    best = None
    for choice in itertools.product(*[range(len(b)) for b, _ in items]):
        nbytes = sum(items[i][0][j] for i, j in enumerate(choice))
        cost = sum(items[i][1][j] for i, j in enumerate(choice))
        if nbytes <= capacity and (best is None or cost < best):
            best = cost
    return best


def random_instance(rng: random.Random, *, scale: int = 1):
    items = []
    for _ in range(rng.randint(1, 6)):
        k = rng.randint(1, 4)
        items.append(([scale * rng.randint(1, 40) for _ in range(k)], [rng.random() for _ in range(k)]))
    cap = scale * rng.randint(0, 40 * len(items))
    return items, cap


@pytest.mark.parametrize("seed", range(4))
def test_knapsack_matches_brute_force(seed):
    rng = random.Random(seed)
    for _ in range(100):
        items, cap = random_instance(rng, scale=rng.choice([1, 7, 1024]))
        best = brute_force(items, cap)
        sol = solve(items, cap)
        if best is None:
            assert sol is None
            continue
        assert sol.exact
        assert sol.nbytes <= cap
        assert sol.cost == pytest.approx(best, abs=1e-12)
        assert sol.lower_bound <= best + 1e-9


def test_knapsack_rounded_keeps_its_bound():
    """With few DP states the answer stays feasible and beats the optimum at capacity - n*unit."""
    rng = random.Random(11)
    for _ in range(200):
        items, cap = random_instance(rng)
        sol = solve(items, cap, max_states=5)
        best = brute_force(items, cap)
        if best is None:
            assert sol is None
            continue
        assert sol.nbytes <= cap
        assert sol.lower_bound - 1e-9 <= best <= sol.cost + 1e-12
        shrunk = brute_force(items, cap - sol.slack_bound)
        if shrunk is not None:
            assert sol.cost <= shrunk + 1e-12


def test_lp_bound_is_tight_on_convex_items():
    # One item, options on a line: the LP optimum at an option's bytes is that option's cost.
    items = [([10, 20, 30], [3.0, 2.0, 1.0])]
    assert lp_lower_bound(items, 20) == pytest.approx(2.0)
    assert lp_lower_bound(items, 25) == pytest.approx(1.5)
    assert lp_lower_bound(items, 9) == float("inf")


# ---------------------------------------------------------------- byte accounting

SETTINGS = [
    Setting(2, 64),
    Setting(3, 32),
    Setting(4, 64),
    Setting(5, 128),
    Setting(6, 64),
    Setting(8, 32),
    Setting(4, 32, "mxfp4"),
    Setting(4, 16, "nvfp4"),
    Setting(8, 32, "mxfp8"),
]


@pytest.mark.parametrize("setting", SETTINGS, ids=str)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_quantized_specs_match_mx_quantize(setting, dtype):
    w = mx.random.normal((48, 256)).astype(getattr(mx, dtype))
    out = mx.quantize(w, bits=setting.bits, group_size=setting.group_size, mode=setting.mode)
    code = budget.DTYPE_CODES[dtype]
    specs = budget.quantized_specs("m", (48, 256), setting, code)
    assert len(specs) == len(out)
    for spec, arr in zip(specs, out, strict=True):
        assert spec.shape == tuple(arr.shape)
        assert spec.nbytes == arr.nbytes
    assert budget.weight_bytes((48, 256), setting, code) == sum(a.nbytes for a in out)


def tiny_source(tmp_path, *, dtype=mx.bfloat16):
    """A llama-shaped set of tensors (one 2-D weight that no group size of 64 divides)."""
    rng = np.random.default_rng(0)
    shapes = {
        "model.embed_tokens.weight": (96, 64),
        "model.layers.0.input_layernorm.weight": (64,),
        "model.layers.0.self_attn.q_proj.weight": (64, 64),
        "model.layers.0.self_attn.o_proj.weight": (64, 64),
        "model.layers.0.mlp.down_proj.weight": (64, 128),
        "model.layers.0.mlp.up_proj.weight": (128, 64),
        "model.layers.0.mlp.odd_proj.weight": (64, 48),
        "model.layers.0.mlp.up_proj.bias": (128,),
        "model.norm.weight": (64,),
        "lm_head.weight": (96, 64),
    }
    tensors = {
        n: mx.array(rng.standard_normal(s).astype(np.float32)).astype(dtype) for n, s in shapes.items()
    }
    write_sharded(tmp_path / "src", tensors)
    return tmp_path / "src", tensors


def quantize_by_hand(tensors, *, default, layers, out_dtype):
    """Reference quantization with mx.quantize, following the plan rules of budget.resolve."""
    out = {}  # in the order a streaming writer gets them: source names sorted, weight first
    for name, w in sorted(tensors.items()):
        path = budget.module_of(name)
        setting = budget.resolve(path, tuple(w.shape), default, layers) if path else None
        w = w.astype(out_dtype) if mx.issubdtype(w.dtype, mx.floating) else w
        if setting is None:
            out[name] = w
            continue
        q = mx.quantize(w, bits=setting.bits, group_size=setting.group_size, mode=setting.mode)
        for suffix, arr in zip(("weight", "scales", "biases"), q, strict=False):
            out[f"{path}.{suffix}"] = arr
    return out


@pytest.mark.parametrize("out_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("shard_bytes", [5 << 30, 20_000])
def test_predicted_size_equals_written_size(tmp_path, out_dtype, shard_bytes):
    src, tensors = tiny_source(tmp_path)
    layers = {
        "model.layers.0.self_attn.q_proj": Setting(8, 32),
        "model.layers.0.mlp.down_proj": Setting(4, 32, "mxfp4"),
        "model.layers.0.self_attn.o_proj": None,
        "lm_head": Setting(6, 64),
    }
    default = Setting(3, 64)
    source = budget.read_specs(src)
    code = budget.DTYPE_CODES[out_dtype]
    pred = budget.predict(source, default=default, layers=layers, out_dtype=code, shard_bytes=shard_bytes)
    q = quantize_by_hand(tensors, default=default, layers=layers, out_dtype=getattr(mx, out_dtype))
    block = {**default.to_json(), **{p: s.to_json() if s else False for p, s in layers.items()}}
    written = write_sharded(tmp_path / "out", q, shard_bytes=shard_bytes, quantization=block)
    got = budget.measure(tmp_path / "out", parameters=pred.parameters)
    assert got == pred
    assert pred.tensor_bytes == written.total_size
    assert pred.parameters == written.total_parameters == sum(w.size for w in tensors.values())
    assert pred.shards == len(written.shards) and (shard_bytes > 1 << 20) == (pred.shards == 1)


def test_resolve_follows_the_plan_and_group_divisibility():
    shape = (64, 48)
    assert budget.resolve("a", shape, Setting(4, 64), {}) is None  # 48 % 64 != 0
    assert budget.resolve("a", shape, Setting(4, 64), {"a": Setting(4, 16)}) == Setting(4, 16)
    assert budget.resolve("a", (64, 64), Setting(4, 64), {"a": None}) is None
    assert budget.resolve("a", (64,), Setting(4, 64), {}) is None
    assert TensorSpec("x", "BF16", (3, 5)).nbytes == 30
