"""allocate.interactions: steps near the threshold measured in the quantized model, then solved again."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mlxbun import blas

blas.load()

from mlxbun.quant.allocate import allocation, rounds  # noqa: E402
from mlxbun.quant.allocate import command as al  # noqa: E402
from mlxbun.quant.allocate import interactions as ia  # noqa: E402
from mlxbun.quant.sensitivity import file as sf  # noqa: E402
from mlxbun.quant.spec import QuantSpec  # noqa: E402


def q(bits: int) -> QuantSpec:
    return QuantSpec(bits=bits, group_size=64)


# ---------------------------------------------------------------- the choice of steps and the costs


OPTIONS = [  # (setting, bytes, summed KL) per module; each is at 4 bits in the plan below
    [(q(2), 100, 8.0), (q(4), 200, 2.0), (q(8), 400, 1.0)],  # down: 6.0/100, up: 1.0/200
    [(q(2), 100, 3.0), (q(4), 200, 1.0), (q(8), 400, 0.2)],  # down: 2.0/100, up: 0.8/200
    [(q(2), 100, 5.0), (q(4), 200, 4.0), (q(8), 400, 0.4)],  # down: 1.0/100, up: 3.6/200
]
PLAN = (1, 1, 1)
PATHS = ["a", "b", "c"]


def test_near_threshold_alternates_cheapest_downgrades_and_best_upgrades():
    steps = ia.near_threshold(OPTIONS, PLAN, PATHS, 4)
    assert [(s.path, s.down) for s in steps] == [("c", True), ("c", False), ("b", True), ("a", False)]
    assert steps[0].summed == pytest.approx(1.0) and steps[1].summed == pytest.approx(-3.6)
    assert ia.near_threshold(OPTIONS, PLAN, PATHS, 0) == []
    assert len(ia.near_threshold(OPTIONS, PLAN, PATHS, 99)) == 6


def test_near_threshold_moves_along_the_front_only():
    dominated = [[(q(2), 100, 8.0), (q(3), 150, 9.0), (q(4), 200, 2.0)]]  # 3 bits costs more than 2
    (down,) = ia.near_threshold(dominated, (2,), ["a"], 4)
    assert down.to == 0 and down.summed == pytest.approx(6.0)


def test_scaled_costs_scales_each_side_by_its_ratio_and_the_rest_by_the_median():
    steps = [
        ia.Step(0, "a", 0, 6.0, measured=24.0),  # a's downgrade costs 4x its sum
        ia.Step(1, "b", 2, -0.8, measured=-0.4),  # b's upgrade saves half its sum
        ia.Step(2, "c", 0, 1.0, measured=2.0),
    ]
    out = ia.scaled_costs(OPTIONS, PLAN, steps)
    assert [o[2] for o in out[0]] == pytest.approx([2.0 + 4 * 6.0, 2.0, 2.0 - 2 * 1.0])  # median 2
    assert [o[2] for o in out[1]] == pytest.approx([1.0 + 2 * 2.0, 1.0, 1.0 - 0.5 * 0.8])
    assert [o[2] for o in out[2]] == pytest.approx([4.0 + 2 * 1.0, 4.0, 4.0 - 2 * 3.6])
    assert [[o[:2] for o in row] for row in out] == [[o[:2] for o in row] for row in OPTIONS]


def test_scaled_costs_scale_beyond_a_measured_step_by_the_median():
    wide = [[(q(2), 100, 9.0), (q(3), 150, 5.0), (q(4), 200, 2.0)], [(q(2), 100, 4.0), (q(4), 200, 1.0)]]
    steps = [
        ia.Step(0, "a", 1, 3.0, measured=12.0),
        ia.Step(1, "b", 0, 3.0, measured=3.0),
    ]  # 4x, 1x: median 2.5
    out = ia.scaled_costs(wide, (2, 1), steps)
    assert [o[2] for o in out[0]] == pytest.approx([2.0 + 4 * 3.0 + 2.5 * 4.0, 2.0 + 4 * 3.0, 2.0])


def test_measured_only_allows_the_measured_steps_at_their_measured_cost():
    steps = [ia.Step(0, "a", 0, 6.0, measured=24.0), ia.Step(2, "c", 2, -3.6, measured=-0.1)]
    out = ia.measured_only(OPTIONS, PLAN, steps)
    assert [o[2] for o in out[0]] == pytest.approx([26.0, 2.0, ia.BARRED])
    assert [o[2] for o in out[1]] == pytest.approx([ia.BARRED, 1.0, ia.BARRED])
    assert [o[2] for o in out[2]] == pytest.approx([ia.BARRED, 4.0, 4.0 - 3.6 * ia.RATIO_RANGE[0]])


def test_a_step_measured_as_harmless_or_harmful_keeps_a_positive_bounded_ratio():
    assert ia.Step(0, "a", 0, 2.0, measured=-1.0).ratio == ia.RATIO_RANGE[0]
    assert ia.Step(0, "a", 2, -2.0, measured=1.0).ratio == ia.RATIO_RANGE[0]
    assert ia.Step(0, "a", 0, 1e-9, measured=1.0).ratio == ia.RATIO_RANGE[1]


# ---------------------------------------------------------------- the quantized model


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model(arch="llama", preset="tiny", tie_embeddings=False)


@pytest.fixture(scope="module")
def tokens(model):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from mlxbun.quant.calibration import load_calibration

    return load_calibration(tokenizer=load_tokenizer(model), samples=3, seq_len=32, seed=0).tokens


def uniform(model, bits):
    from mlxbun.quant.allocate import budget

    return {p: q(bits) for p in budget.read_source(model).shapes}


def test_in_model_partial_forward_equals_the_whole_model(model, tokens):
    layers = uniform(model, 4)
    with ia.InModel(model, tokens, batch_size=2) as m:
        assert m.set({p: None for p in layers}) == pytest.approx(0.0, abs=1e-6)  # float32 reference p
        base = m.set(layers)
        assert base > 0
        for path in [
            "model.embed_tokens",
            "model.layers.0.mlp.down_proj",
            "model.layers.1.self_attn.q_proj",
            "lm_head",
        ]:
            for spec in (q(2), None):
                partial = m.kl_with(path, spec)
                whole = m.set({**layers, path: spec})
                m.set(layers)
                assert partial == pytest.approx(whole, rel=1e-5), (path, spec)
        assert m.set(layers) == pytest.approx(base, rel=1e-6)  # every move was put back


def test_in_model_counts_forward_equivalents(model, tokens):
    with ia.InModel(model, tokens, batch_size=2) as m:
        assert m.forwards == 1.0
        m.set(uniform(model, 4))
        m.kl_with("lm_head", q(2))  # the head alone: 1 / (blocks + 1), plus the blocks to reach it
        assert m.forwards == pytest.approx(3.0)


# ---------------------------------------------------------------- allocate with interactions


def sensitivity_of(model, out, **kw):
    """Exact sensitivity of ``model`` at bits 2/4/8 on the calibration of ``tokens`` (3 x 32)."""
    from mlxbun.quant.sensitivity.command import sensitivity

    sensitivity(
        model_dir=model,
        out_dir=out,
        work_dir=out / "work",
        bits=[2, 4, 8],
        samples=3,
        seq_len=32,
        batch_size=2,
        **kw,
    )
    return sf.load_sensitivity(out / "sensitivity.json")


@pytest.fixture(scope="module")
def measured(model, tmp_path_factory):
    return sensitivity_of(model, tmp_path_factory.mktemp("sens"))


def understated(sens, path, factor):
    """The sensitivity with one module's KLs divided by ``factor``: a wrong summed objective."""
    layers = dict(sens.layers)
    old = layers[path]
    layers[path] = sf.LayerSensitivity(path, old.params, {s: v / factor for s, v in old.kl.items()})
    return sf.Sensitivity(
        layers, sens.model_fingerprint, sens.calibration_fingerprint, sens.path, sens.calibration
    )


def test_interactions_correct_a_step_the_sum_got_wrong(model, tokens, measured):
    """The sum says one module is 10x less sensitive than it is: the first plan drops it to 2 bits;
    measured in the model, that step is put back, within the same budget, and the KL falls to
    that of the plan the true sum gives."""
    path = "model.layers.0.mlp.down_proj"
    wrong = understated(measured, path, 10)
    plain = allocation.allocate(wrong, model_dir=model, budget_bpw=4.5)
    assert plain.layers[path].bits == 2
    with ia.InModel(model, tokens, batch_size=2) as m:
        fixed = allocation.allocate(wrong, model_dir=model, budget_bpw=4.5, in_model=m, decisions=8)
        assert m.set(fixed.layers) == pytest.approx(fixed.interactions["kl_after"], rel=1e-6)
    it = fixed.interactions
    assert fixed.layers[path].bits > 2
    assert fixed.size.bpw <= 4.5 and it["kl_after"] < it["kl_before"]
    first = it["rounds"][0]
    assert first["kept"] and len(first["steps"]) <= 8
    step = next(s for s in first["steps"] if s["path"] == path)
    assert step["ratio"] > 5  # the 10x understatement
    true = allocation.allocate(measured, model_dir=model, budget_bpw=4.5)
    assert fixed.layers == true.layers
    assert fixed.kl_sum == pytest.approx(sum(c.kl for c in fixed.choices.values() if c.kl is not None))
    doc = fixed.to_json()
    assert (
        doc["interactions"] == it
        and json.loads(json.dumps(doc))["interactions"]["kl_after"] == it["kl_after"]
    )


def test_interactions_never_keep_a_worse_plan(model, tokens, measured):
    with ia.InModel(model, tokens, batch_size=2) as m:
        for bpw in (3.0, 4.5, 6.0):
            plan = allocation.allocate(
                measured, model_dir=model, budget_bpw=bpw, in_model=m, decisions=4, rounds=3
            )
            it = plan.interactions
            assert plan.size.bpw <= bpw
            assert it["kl_after"] <= it["kl_before"]
            for r in it["rounds"]:
                assert r["kept"] == bool(r["tried"] and r["tried"][-1] < r["kl_before"])
                assert all(t >= r["kl_before"] for t in r["tried"][:-1])
            assert m.set(plan.layers) == pytest.approx(it["kl_after"], rel=1e-6)


def test_no_in_model_or_zero_decisions_is_the_summed_plan(model, tokens, measured):
    plain = allocation.allocate(measured, model_dir=model, budget_bpw=4.5)
    with ia.InModel(model, tokens, batch_size=2) as m:
        off = allocation.allocate(measured, model_dir=model, budget_bpw=4.5, in_model=m, decisions=0)
    assert off.to_json() == plain.to_json() and "interactions" not in plain.to_json()


def test_spill_of_references_is_removed(model, tokens):
    with ia.InModel(model, tokens, batch_size=2) as m:
        where = m.refs._dir.name
        assert np.load(next(iter(m.refs._names.values()))).size
    import os

    assert not os.path.exists(where)


def test_modules_the_default_group_does_not_fit_stay_unquantized_in_the_model(model, tokens, tmp_path):
    """At group 128 the 64-wide projections are not probed and keep the default, which they
    cannot take: the plan leaves them unquantized and so must the model interactions measure."""
    sens = sensitivity_of(model, tmp_path, group_size=128)
    default = QuantSpec(bits=4, group_size=128)
    with ia.InModel(model, tokens, batch_size=2) as m:
        plan = allocation.allocate(
            sens, model_dir=model, budget_bpw=14.7, default=default, in_model=m, decisions=4
        )
        unfit = [p for p, c in plan.choices.items() if c.setting is None]
        assert unfit and plan.interactions["kl_after"] <= plan.interactions["kl_before"]
        assert m.set(plan.layers) == pytest.approx(plan.interactions["kl_after"], rel=1e-6)


def command_cfg(tmp_path, model, **allocate):
    from mlxbun.config import schema

    cfg = schema.Config()
    cfg.command.name = "allocate"
    cfg.model.name = str(model)
    cfg.paths.run_dir = str(tmp_path / "run")
    cfg.sensitivity.calib = schema.CalibCfg(samples=3, seq_len=32)
    cfg.allocate = schema.AllocateCfg(check=False, **allocate)
    return cfg


def test_bad_input_is_refused_before_the_model_is_loaded(model, measured, tmp_path, monkeypatch):
    from mlxbun.errors import InputError

    def refuse(*a, **k):
        raise AssertionError("InModel built")

    monkeypatch.setattr(al, "InModel", refuse)
    with pytest.raises(InputError, match="allocate.budget_bpw=1.0 cannot be met"):
        al.run(command_cfg(tmp_path, model, sensitivity=str(measured.path), budget_bpw=1.0))


def test_a_budget_every_module_fits_at_its_largest_skips_interactions(model, measured, tmp_path, monkeypatch):
    monkeypatch.setattr(al, "InModel", lambda *a, **k: pytest.fail("InModel built"))
    al.run(command_cfg(tmp_path, model, sensitivity=str(measured.path), budget_bpw=16.0))
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert plan["interactions"] == {"skipped": "every module already takes its largest candidate"}


def test_memory_counts_both_weight_copies_and_a_batch_of_float64_logits(model, monkeypatch):
    from mlxbun.quant.allocate import budget

    cfg = command_cfg(model.parent, model)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    need = 8 * budget.read_source(model).parameters + 24 * cfg.sensitivity.batch_size * 32 * vocab
    monkeypatch.setattr(rounds, "available_memory", lambda: need / rounds.MEMORY_SHARE)
    assert al._memory_skip(cfg, allocation.SourceModel.of(model)) is None
    monkeypatch.setattr(rounds, "available_memory", lambda: need / rounds.MEMORY_SHARE - 64)
    assert al._memory_skip(cfg, allocation.SourceModel.of(model)).startswith("they need about")


def test_batches_shrink_for_large_vocabularies(model, tmp_path):
    from dataclasses import replace

    cfg = command_cfg(tmp_path, model)
    opened = allocation.SourceModel.of(model)
    assert al._batch(cfg, opened) == cfg.sensitivity.batch_size
    big = replace(opened, config={**opened.config, "vocab_size": 151936})
    cfg.sensitivity.calib.seq_len = 512
    assert al._batch(cfg, big) == 1  # 24 B x 512 x 151,936 = 1.87 GB per sample: one at a time


def test_the_command_says_what_it_is_doing(model, measured, tmp_path, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="mlxbun")
    al.run(command_cfg(tmp_path, model, sensitivity=str(measured.path), budget_bpw=4.5))
    assert "allocate.interactions: the reference over 3 x 32 calibration tokens" in caplog.text
    # the progress line counts the current round only: this plan keeps nothing, so round 2 never runs
    assert "interactions (round 1 of at most 2)" in caplog.text and " 16 steps/16 steps " in caplog.text
    assert "round 2" not in caplog.text


class _Stop(Exception):
    pass


def _tokens_measured_on(cfg, monkeypatch) -> tuple[int, int]:
    """The (samples, seq_len) allocate would measure interactions on (stopped there)."""
    seen = []

    def record(src, tokens, **kw):
        seen.append(tokens.shape)
        raise _Stop

    monkeypatch.setattr(al, "InModel", record)
    with pytest.raises(_Stop):
        al.run(cfg)
    return seen[0]


def test_interactions_take_the_calibration_the_sensitivity_recorded(model, measured, tmp_path, monkeypatch):
    from mlxbun.config import schema

    cfg = command_cfg(tmp_path, model, sensitivity=str(measured.path), budget_bpw=4.5)
    cfg.sensitivity.calib = schema.CalibCfg()  # not set: 24 x 512 is only the default
    assert _tokens_measured_on(cfg, monkeypatch) == (3, 32)


def test_an_explicit_calibration_is_used_and_the_difference_said_once(
    model, measured, tmp_path, monkeypatch, caplog
):
    from mlxbun.config import schema

    cfg = command_cfg(tmp_path, model, sensitivity=str(measured.path), budget_bpw=4.5)
    cfg.sensitivity.calib = schema.CalibCfg(samples=2, seq_len=32)
    assert _tokens_measured_on(cfg, monkeypatch) == (2, 32)
    assert caplog.text.count("differs from the calibration") == 1


# ---------------------------------------------------------------- clip / gptq candidates, in float32


@pytest.fixture(scope="module")
def hessians(model, tokens, tmp_path_factory):
    """The model's input Hessians on the calibration tokens (quant.hessians)."""
    from mlxbun.quant import hessian
    from mlxbun.quant.probe import load_model

    m, _, _ = load_model(model)
    path = tmp_path_factory.mktemp("h") / "hessians.safetensors"
    hessian.save(hessian.capture(m, tokens), path, tokens=tokens.size)
    return path


def with_methods(sens, paths, methods=("clip", "gptq")):
    """``sens`` with, for each of ``paths``, clip/gptq candidates at 2 and 4 bits (half rtn's KL)."""
    layers = dict(sens.layers)
    for path in paths:
        old = layers[path]
        extra = {
            QuantSpec(bits=b, group_size=64, method=m): old.kl[q(b)] / 2 for b in (2, 4) for m in methods
        }
        layers[path] = sf.LayerSensitivity(path, old.params, {**old.kl, **extra})
    return sf.Sensitivity(
        layers, sens.model_fingerprint, sens.calibration_fingerprint, sens.path, sens.calibration
    )


def test_in_model_puts_the_weights_quantize_would_write(model, tokens, hessians):
    """A clip or gptq setting is installed with the weight its rounding gives (with the module's H),
    dequantized to float32: the weight the quantized model has, not a round-to-nearest one."""
    import mlx.core as mx

    from mlxbun.quant import hessian, rounding
    from mlxbun.quant.probe import module_at

    path = "model.layers.0.mlp.down_proj"
    h = hessian.Hessians(hessians)[path]
    with ia.InModel(model, tokens, batch_size=2, hessians=hessians) as m:
        w = module_at(m.model, path).weight
        src = w.astype(mx.bfloat16)
        for method in ("clip", "gptq"):
            spec = QuantSpec(bits=3, group_size=64, method=method)
            wq, s, b = rounding.quantize(src, bits=3, group_size=64, method=method, hessian=h)
            want = mx.dequantize(wq, s, b, group_size=64, bits=3).astype(mx.float32)
            m.set({path: spec})
            got = module_at(m.model, path).weight
            assert got.dtype == mx.float32 and np.array_equal(np.asarray(got), np.asarray(want)), method
            rtn = m.set({path: q(3)})
            assert not np.array_equal(np.asarray(module_at(m.model, path).weight), np.asarray(want))
            assert rtn > 0
        # every forward runs in float32 (through the BLAS), never bf16 matmuls on the CPU
        from mlx.utils import tree_flatten

        assert {str(v.dtype) for _, v in tree_flatten(m.model.parameters())} == {"mlx.core.float32"}


def test_interactions_measure_clip_and_gptq_candidates(model, tokens, measured, hessians):
    paths = ["model.layers.0.mlp.down_proj", "model.layers.1.self_attn.v_proj"]
    sens = with_methods(measured, paths)
    with ia.InModel(model, tokens, batch_size=2, hessians=hessians) as m:
        plan = allocation.allocate(sens, model_dir=model, budget_bpw=4.5, in_model=m, decisions=8)
        assert "skipped" not in plan.interactions and plan.interactions["rounds"]
        assert m.set(plan.layers) == pytest.approx(plan.interactions["kl_after"], rel=1e-6)
    assert {plan.layers[p].method for p in paths} & {"clip", "gptq"}


def test_interactions_skip_gptq_without_hessians_and_awq(model, tokens, measured, caplog):
    """gptq rounds through H: without quant.hessians its weights cannot be made; awq folds scales
    into the layers before: neither is measured (said in plan.json), clip is."""
    path = "model.layers.0.mlp.down_proj"
    with ia.InModel(model, tokens, batch_size=2) as m:
        plan = allocation.allocate(
            with_methods(measured, [path]), model_dir=model, budget_bpw=4.5, in_model=m
        )
        assert m.forwards == 1.0  # nothing measured beyond the reference
        assert plan.interactions == {"skipped": "gptq candidates need quant.hessians to be measured"}
        plan = allocation.allocate(
            with_methods(measured, [path], ("awq",)), model_dir=model, budget_bpw=4.5, in_model=m
        )
        assert plan.interactions == {
            "skipped": "candidates round by awq; interactions measure rtn, clip and gptq"
        }
        plan = allocation.allocate(
            with_methods(measured, [path], ("clip",)), model_dir=model, budget_bpw=4.5, in_model=m
        )
        assert plan.interactions["rounds"]
    assert "allocate.interactions skipped" in caplog.text


def test_the_check_measures_the_written_model_against_the_interactions_reference(model, tokens, tmp_path):
    """The plan as written, measured on the reference InModel already holds (no second reference
    pass), agrees with the check's own measurement and with the plan's KL in the model."""
    from mlxbun.quant.allocate.check import measured_kl
    from mlxbun.quant.quantize.command import quantize_model_dir

    layers = uniform(model, 3)
    out = quantize_model_dir(model, tmp_path / "q", bits=3, group_size=64).out
    with ia.InModel(model, tokens, batch_size=2) as m:
        in_model = m.set(layers)
        before = m.forwards
        written = m.kl_of(out)
        assert m.forwards == before + 1.0
    assert written == pytest.approx(measured_kl(model, out, tokens, batch_size=2), rel=1e-4)
    assert written == pytest.approx(in_model, rel=1e-3)


def test_measured_kl_in_slices_and_with_a_loaded_reference_is_the_same(model, tokens, tmp_path, monkeypatch):
    """A large vocabulary's log-probs go a sample and a slice of tokens at a time (float64 log-probs
    of 8 x 256 tokens of a 150K vocabulary were 2.5 GB an array); the mean is the same."""
    from mlxbun.quant.allocate import check
    from mlxbun.quant.probe import load_model
    from mlxbun.quant.quantize.command import quantize_model_dir

    out = quantize_model_dir(model, tmp_path / "q", bits=3, group_size=64).out
    whole = check.measured_kl(model, out, tokens, batch_size=4)
    monkeypatch.setattr(check, "KL_BYTES", 8 * 1000 * 7)  # a few tokens of this vocabulary at a time
    # float32 forwards of one sample instead of four: the same to float32 rounding
    assert check.measured_kl(model, out, tokens, batch_size=4) == pytest.approx(whole, rel=1e-6)
    monkeypatch.undo()
    loaded = load_model(model)[0]
    assert check.measured_kl(model, out, tokens, batch_size=4, reference=loaded) == whole
