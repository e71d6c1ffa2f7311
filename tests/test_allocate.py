"""Tests for the allocator: knapsack optimality (brute force), exact size accounting, plans."""

from __future__ import annotations

import itertools
import json
import logging
import random

import mlx.core as mx
import numpy as np
import pytest

from mlxbun.io.dtypes import CODES
from mlxbun.io.shards import write_sharded
from mlxbun.quant.allocate import budget
from mlxbun.quant.allocate.budget import TensorSpec
from mlxbun.quant.allocate.knapsack import lp_lower_bound, solve
from mlxbun.quant.spec import QuantSpec, Rule


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
    QuantSpec(bits=2, group_size=64),
    QuantSpec(bits=3, group_size=32),
    QuantSpec(bits=4, group_size=64),
    QuantSpec(bits=5, group_size=128),
    QuantSpec(bits=6, group_size=64),
    QuantSpec(bits=8, group_size=32),
    QuantSpec(bits=4, group_size=32, mode="mxfp4"),
    QuantSpec(bits=4, group_size=16, mode="nvfp4"),
    QuantSpec(bits=8, group_size=32, mode="mxfp8"),
]


@pytest.mark.parametrize("setting", SETTINGS, ids=str)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_quantized_specs_match_mx_quantize(setting, dtype):
    w = mx.random.normal((48, 256)).astype(getattr(mx, dtype))
    out = mx.quantize(w, bits=setting.bits, group_size=setting.group_size, mode=setting.mode)
    code = CODES[dtype]
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
        "model.layers.0.self_attn.q_proj": QuantSpec(bits=8, group_size=32),
        "model.layers.0.mlp.down_proj": QuantSpec(bits=4, group_size=32, mode="mxfp4"),
        "model.layers.0.self_attn.o_proj": None,
        "lm_head": QuantSpec(bits=6, group_size=64),
    }
    default = QuantSpec(bits=3, group_size=64)
    source = budget.Source.from_specs(budget.read_specs(src))
    code = CODES[out_dtype]
    pred = budget.predict(source, default=default, layers=layers, out_dtype=code, shard_bytes=shard_bytes)
    q = quantize_by_hand(tensors, default=default, layers=layers, out_dtype=getattr(mx, out_dtype))
    block = {**default.to_dict(), **{p: s.to_dict() if s else False for p, s in layers.items()}}
    written = write_sharded(tmp_path / "out", q, shard_bytes=shard_bytes, quantization=block)
    got = budget.measure(tmp_path / "out", parameters=pred.parameters)
    assert got == pred
    assert pred.tensor_bytes == written.total_size
    assert pred.parameters == written.total_parameters == sum(w.size for w in tensors.values())
    assert pred.shards == len(written.shards) and (shard_bytes > 1 << 20) == (pred.shards == 1)


def test_resolve_follows_the_plan_and_group_divisibility():
    shape = (64, 48)
    assert budget.resolve("a", shape, QuantSpec(bits=4, group_size=64), {}) is None  # 48 % 64 != 0
    assert budget.resolve(
        "a", shape, QuantSpec(bits=4, group_size=64), {"a": QuantSpec(bits=4, group_size=16)}
    ) == QuantSpec(bits=4, group_size=16)
    assert budget.resolve("a", (64, 64), QuantSpec(bits=4, group_size=64), {"a": None}) is None
    assert budget.resolve("a", (64,), QuantSpec(bits=4, group_size=64), {}) is None
    assert TensorSpec("x", "BF16", (3, 5)).nbytes == 30


# ---------------------------------------------------------------- allocation on a real model skeleton

from mlxbun.errors import InputError  # noqa: E402
from mlxbun.io.atomic import atomic_write_json  # noqa: E402
from mlxbun.quant.allocate import allocation, rounds  # noqa: E402
from mlxbun.quant.allocate import command as al  # noqa: E402
from mlxbun.quant.sensitivity import file as sf  # noqa: E402

MEASURED = [
    "lm_head",
    "model.layers.0.mlp.down_proj",
    "model.layers.1.self_attn.q_proj",
    "model.layers.1.mlp.down_proj",
]
BITS = (2, 4, 8)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from mlxbun.synth import write as synth_write

    cache = tmp_path_factory.mktemp("alloc-synth")
    return synth_write.ensure_synthetic(cache_dir=cache, arch="llama", preset="tiny", tie_embeddings=False)


def fake_sensitivity(paths, *, seed=0, bits=BITS, group_size=64):
    """KL falling with bits, at random per-layer scales (what matters is that layers differ)."""
    rng = random.Random(seed)
    layers = {}
    for p in paths:
        scale = rng.uniform(0.1, 10)
        kl = {
            QuantSpec(bits=b, group_size=group_size): scale * 2.0 ** (-b) * rng.uniform(0.8, 1.2)
            for b in bits
        }
        layers[p] = sf.LayerSensitivity(p, 0, kl)
    return sf.Sensitivity(layers)


def brute_force_plan(model, sens, *, fits, fixed=None):
    """Lowest summed KL over every combination of measured settings whose full size fits."""
    source = budget.read_source(model)
    paths = sorted(sens.layers)
    best = None
    for combo in itertools.product(*[sorted(sens.layers[p].kl) for p in paths]):
        layers = {**(fixed or {}), **dict(zip(paths, combo, strict=True))}
        size = budget.predict(source, default=allocation.DEFAULT, layers=layers)
        kl = sum(sens.layers[p].kl[s] for p, s in zip(paths, combo, strict=True))
        if fits(size) and (best is None or kl < best):
            best = kl
    return best


@pytest.mark.parametrize("bpw", [3.9, 4.3, 4.6, 5.2])
def test_allocate_bpw_is_optimal_by_brute_force(model, bpw):
    sens = fake_sensitivity(MEASURED, seed=int(bpw * 10))
    plan = allocation.allocate(sens, model_dir=model, budget_bpw=bpw)
    assert plan.size.bpw <= bpw
    assert plan.size.tensor_bytes <= bpw * plan.size.parameters / 8
    best = brute_force_plan(model, sens, fits=lambda s: s.tensor_bytes * 8 <= bpw * s.parameters)
    assert plan.kl_sum == pytest.approx(best, rel=1e-12)
    assert plan.solver["exact"] and plan.solver["lower_bound"] <= plan.kl_sum + 1e-12
    # Unmeasured modules keep the default and are listed explicitly.
    assert (
        plan.layers["model.embed_tokens"] == allocation.DEFAULT
        and plan.choices["model.embed_tokens"].kl is None
    )


def test_allocate_bytes_budget_is_optimal_and_counts_headers(model):
    sens = fake_sensitivity(MEASURED, seed=3)
    source = budget.read_source(model)
    lo, hi = (
        budget.predict(
            source, default=allocation.DEFAULT, layers={p: QuantSpec(bits=b, group_size=64) for p in MEASURED}
        )
        for b in (2, 8)
    )
    for frac in (0.3, 0.6):
        limit = int(lo.file_bytes + frac * (hi.file_bytes - lo.file_bytes))
        plan = allocation.allocate(sens, model_dir=model, budget_bytes=limit)
        assert plan.size.file_bytes <= limit
        assert plan.size.file_bytes > plan.size.tensor_bytes  # headers are counted
        best = brute_force_plan(model, sens, fits=lambda s, limit=limit: s.file_bytes <= limit)
        assert plan.kl_sum == pytest.approx(best, rel=1e-12)


def test_infeasible_budget_names_the_range(model, caplog):
    sens = fake_sensitivity(MEASURED)
    with pytest.raises(
        InputError, match=r"allocate.budget_bpw=1.0 cannot be met.*between [0-9.]+ and [0-9.]+ bpw"
    ):
        allocation.allocate(sens, model_dir=model, budget_bpw=1.0)
    with pytest.raises(InputError, match="allocate.budget_bytes=1000 cannot be met"):
        allocation.allocate(sens, model_dir=model, budget_bytes=1000)
    with pytest.raises(InputError, match="exactly one"):
        allocation.allocate(sens, model_dir=model)
    # A generous budget is not an error: every module takes its lowest-KL setting, and says so.
    with caplog.at_level(logging.WARNING, logger="mlxbun"):
        plan = allocation.allocate(sens, model_dir=model, budget_bpw=16)
    assert all(plan.layers[p].bits == 8 for p in MEASURED)
    assert "allocate.budget_bpw=16 is more than the largest plan needs" in caplog.text


def test_protection_rules(model):
    sens = fake_sensitivity(MEASURED, seed=5)
    tight = allocation.allocate(sens, model_dir=model, budget_bpw=3.9)
    assert tight.layers["lm_head"].bits < 8 or tight.layers["model.layers.1.mlp.down_proj"].bits < 8
    rules = ["lm_head:8", "layers.last.mlp.down_proj:4", "embed_tokens:6"]
    plan = allocation.allocate(sens, model_dir=model, budget_bpw=6.0, protect=rules)
    assert plan.layers["lm_head"].bits == 8
    assert plan.layers["model.layers.1.mlp.down_proj"].bits >= 4
    assert plan.layers["model.embed_tokens"] == QuantSpec(bits=6, group_size=64)  # unmeasured: default raised
    # Optimal among the settings the rules leave, with the protected embedding counted.
    need = {"lm_head": 8, "model.layers.1.mlp.down_proj": 4}
    allowed = sf.Sensitivity(
        {
            p: sf.LayerSensitivity(p, 0, {s: v for s, v in layer.kl.items() if s.bits >= need.get(p, 0)})
            for p, layer in sens.layers.items()
        }
    )
    best = brute_force_plan(
        model,
        allowed,
        fits=lambda s: s.tensor_bytes * 8 <= 6.0 * s.parameters,
        fixed={"model.embed_tokens": QuantSpec(bits=6, group_size=64)},
    )
    assert plan.kl_sum == pytest.approx(best, rel=1e-12)
    with pytest.raises(InputError, match="no candidate setting is left for 'lm_head'"):
        allocation.allocate(sens, model_dir=model, budget_bpw=6, protect=["lm_head:9"])


def test_rule_matching():
    r = Rule.parse("layers.first.mlp.down_proj:6")
    assert r.min_bits == 6
    assert r.matches("model.layers.0.mlp.down_proj", n_blocks=4)
    assert not r.matches("model.layers.3.mlp.down_proj", n_blocks=4)
    last = Rule.parse("layers.last.mlp.down_proj:6")
    assert last.matches("model.layers.3.mlp.down_proj", n_blocks=4)
    assert Rule.parse("layers.1:5").matches("model.layers.1.mlp.up_proj", n_blocks=12)
    assert not Rule.parse("layers.1:5").matches("model.layers.10.mlp.up_proj", n_blocks=12)
    assert Rule.parse("*.self_attn.?_proj:5").matches("model.layers.2.self_attn.q_proj", n_blocks=4)
    for bad in ("lm_head", "lm_head:x", ":6"):
        with pytest.raises(InputError, match="PATTERN:BITS"):
            Rule.parse(bad)


def test_plan_quantizes_to_the_predicted_bytes(model, tmp_path):
    """The project's quantize writes exactly the predicted bytes (headers and all)."""
    from mlxbun.quant.plan import load_plan
    from mlxbun.quant.quantize.command import quantize_model_dir

    sens = fake_sensitivity(sorted(budget.read_source(model).shapes), seed=9, bits=(2, 3, 4, 6, 8))
    plan = allocation.allocate(sens, model_dir=model, budget_bpw=4.25, protect=["lm_head:6"])
    atomic_write_json(tmp_path / "plan.json", plan.to_json())
    assert load_plan(tmp_path / "plan.json").layers.keys() == plan.layers.keys()
    assert load_plan(tmp_path / "plan.json") == plan.plan  # the writer's and the reader's Plan are one
    res = quantize_model_dir(model, tmp_path / "out", plan=tmp_path / "plan.json", dtype="bfloat16")
    assert budget.measure(res.out, parameters=plan.size.parameters) == plan.size
    index = json.loads((res.out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == plan.size.tensor_bytes
    assert index["metadata"]["total_parameters"] == plan.size.parameters
    # Sizes are also exact for a multi-shard layout.
    small = allocation.allocate(sens, model_dir=model, budget_bpw=4.25, shard_bytes=30_000)
    atomic_write_json(tmp_path / "small.json", small.to_json())
    res = quantize_model_dir(
        model, tmp_path / "out2", plan=tmp_path / "small.json", dtype="bfloat16", shard_bytes=30_000
    )
    assert small.size.shards > 1 and budget.measure(res.out, parameters=small.size.parameters) == small.size


# ---------------------------------------------------------------- the command


def command_cfg(tmp_path, model, **allocate):
    from mlxbun.config import schema

    cfg = schema.Config()
    cfg.command.name = "allocate"
    cfg.model.name = str(model)
    cfg.paths.run_dir = str(tmp_path / "run")
    cfg.paths.cache = str(tmp_path / "cache")
    cfg.sensitivity.calib = schema.CalibCfg(samples=2, seq_len=32)
    cfg.allocate = schema.AllocateCfg(**allocate)
    return cfg


@pytest.fixture(scope="module")
def measured(model, tmp_path_factory):
    """A real sensitivity.json of the tiny model (2 samples x 32 tokens)."""
    from mlxbun.quant.sensitivity.command import sensitivity

    out = tmp_path_factory.mktemp("sens")
    sensitivity(
        model_dir=model,
        out_dir=out,
        work_dir=out / "work",
        bits=[2, 4, 8],
        samples=2,
        seq_len=32,
        batch_size=2,
    )
    return out / "sensitivity.json"


def test_run_writes_a_plan_and_checks_it(model, measured, tmp_path):
    cfg = command_cfg(
        tmp_path, model, sensitivity=str(measured.parent), budget_bpw=4.5, protect=["lm_head:8"]
    )
    result = al.run(cfg)
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    check = json.loads((tmp_path / "run" / "check.json").read_text())
    assert result.provides == {"quant.plan": str(tmp_path / "run" / "plan.json")}
    assert plan["version"] == 1 and plan["layers"]["lm_head"]["bits"] == 8
    assert plan["predicted_bpw"] <= 4.5 and plan["solver"]["exact"]
    assert check["size_exact"] and check["measured"]["file_bytes"] == plan["predicted_bytes"]
    assert check["calibration_matches_sensitivity"]
    assert check["measured_kl"] > 0 and plan["predicted_kl_sum"] > 0
    assert "interactions: KL of the quantized model on the calibration text" in result.message
    assert result.metrics["interactions_kl_after"] <= result.metrics["interactions_kl_before"]
    it = plan["interactions"]  # on by default, measured on sensitivity.calib
    assert it["decisions"] == 16 and it["kl_after"] <= it["kl_before"] and it["rounds"]
    assert check["measured_kl"] == pytest.approx(it["kl_after"], rel=0.05)  # RTN in both, bf16 on disk
    # Same inputs in another run directory (sensitivity given as file, not dir): same bytes.
    cfg2 = command_cfg(
        tmp_path / "again", model, sensitivity=str(measured), budget_bpw=4.5, protect=["lm_head:8"]
    )
    al.run(cfg2)
    for name in ("plan.json", "check.json", "model/model.safetensors"):
        assert (tmp_path / "again" / "run" / name).read_bytes() == (tmp_path / "run" / name).read_bytes()
    assert check["model"] == "model"


def test_run_skips_interactions_that_would_not_fit_in_memory(model, measured, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(rounds, "available_memory", lambda: 1000)
    cfg = command_cfg(tmp_path, model, sensitivity=str(measured.parent), budget_bpw=4.5, check=False)
    al.run(cfg)
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert plan["interactions"]["skipped"].startswith("they need about")
    assert "allocate.interactions=16 skipped" in caplog.text
    assert "interactions: skipped (they need about" in al.run(cfg).message
    off = command_cfg(
        tmp_path / "off", model, sensitivity=str(measured.parent), budget_bpw=4.5, check=False, interactions=0
    )
    al.run(off)
    plain = json.loads((tmp_path / "off" / "run" / "plan.json").read_text())
    assert "interactions" not in plain and plain["layers"] == plan["layers"]


def test_run_rejects_bad_input_before_writing(model, measured, tmp_path):
    from mlxbun.synth import write as synth_write

    other = synth_write.ensure_synthetic(cache_dir=tmp_path / "synth", arch="llama", preset="tiny", seed=1)
    doc = json.loads(measured.read_text())
    sharded = tmp_path / "sharded.json"
    sharded.write_text(json.dumps(doc | {"shard": {"index": 0, "count": 2, "groups": [0]}}))
    cases = [
        ({"budget_bpw": 4.5}, model, "allocate.sensitivity is not set"),
        ({"sensitivity": str(measured)}, model, "both unset"),
        ({"sensitivity": str(measured), "budget_bpw": 4.5}, other, "measured on another model"),
        ({"sensitivity": str(sharded), "budget_bpw": 4.5}, model, "sensitivity_merge"),
        ({"sensitivity": str(tmp_path / "nope.json"), "budget_bpw": 4.5}, model, "does not exist"),
        (
            {"sensitivity": str(measured), "budget_bpw": 4.5, "default_bits": 7},
            model,
            "allocate.default.bits=7",
        ),
    ]
    for fields, model_dir, message in cases:
        with pytest.raises(InputError, match=message):
            al.run(command_cfg(tmp_path, model_dir, **fields))
    assert not (tmp_path / "run").exists()


def test_config_validation():
    from mlxbun.config.schema import AllocateCfg

    with pytest.raises(InputError, match="both set"):
        AllocateCfg(budget_bpw=4.5, budget_bytes=10)
    with pytest.raises(InputError, match="allocate.bits=7"):
        AllocateCfg(bits=[4, 7])
    with pytest.raises(InputError, match="PATTERN:BITS"):
        AllocateCfg(protect=["lm_head"])


def test_extra_sensitivity_adds_group_size_candidates(model, measured, tmp_path):
    from mlxbun.quant.sensitivity.command import sensitivity

    sensitivity(
        model_dir=model, out_dir=tmp_path / "g32", work_dir=tmp_path / "work", bits=[3, 4], group_size=32,
        samples=2, seq_len=32, batch_size=2,
    )  # fmt: skip
    merged = sf.merge_sensitivities([sf.load_sensitivity(measured), sf.load_sensitivity(tmp_path / "g32")])
    assert {s.group_size for s in merged.layers["lm_head"].kl} == {32, 64}
    cfg = command_cfg(tmp_path, model, sensitivity=str(measured), budget_bpw=4.0)
    cfg.allocate.extra_sensitivity = [str(tmp_path / "g32")]
    al.run(cfg)
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    check = json.loads((tmp_path / "run" / "check.json").read_text())
    assert check["size_exact"]
    assert any(v and v["group_size"] == 32 for v in plan["layers"].values())
    other = sf.Sensitivity(merged.layers, "another-model", merged.calibration_fingerprint)
    with pytest.raises(InputError, match="another model fingerprint"):
        sf.merge_sensitivities([merged, other])


def test_rounded_dp_stays_within_budget_and_reports_its_bound(model):
    sens = fake_sensitivity(MEASURED, seed=2)
    exact = allocation.allocate(sens, model_dir=model, budget_bpw=4.6)
    rough = allocation.allocate(sens, model_dir=model, budget_bpw=4.6, max_states=3)
    assert not rough.solver["exact"] and rough.solver["slack_bound_bytes"] > 0
    assert rough.size.bpw <= 4.6
    assert exact.kl_sum <= rough.kl_sum
    assert rough.solver["lower_bound"] <= exact.kl_sum + 1e-12


def test_load_sensitivity_rejects_other_files(tmp_path):
    (tmp_path / "v2.json").write_text(json.dumps({"version": 2, "layers": []}))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(InputError, match="schema version 2"):
        sf.load_sensitivity(tmp_path / "v2.json")
    with pytest.raises(InputError, match="is not a sensitivity.json"):
        sf.load_sensitivity(tmp_path / "bad.json")


@pytest.mark.parametrize("limit", [1434895, 1849647, 1887533])
def test_file_budget_met_when_headers_overshoot_by_less_than_the_slack(limit):
    """Headers a few bytes over the budget used to be cut 4 bytes at a time from a capacity with
    hundreds of bytes of slack under the choice, giving up after 16 tries."""
    from pathlib import Path

    fixture = Path(__file__).parent / "fixtures" / "llama-text-3m"
    paths = sorted(p for p in budget.read_source(fixture).shapes if p.endswith(("proj", "embed_tokens")))
    layers = {
        p: sf.LayerSensitivity(
            p, 0, {QuantSpec(bits=b, group_size=g): (1 + i % 7) * 4.0**-b * (1 + g / 200 + (i % 3) / 10)
                   for b in (2, 3, 4, 5, 6, 8) for g in (32, 64, 128)},
        )
        for i, p in enumerate(paths)
    }  # fmt: skip
    plan = allocation.allocate(
        sf.Sensitivity(layers, None, None, None, {}), model_dir=fixture, budget_bytes=limit
    )
    assert limit - 4096 < plan.size.file_bytes <= limit
