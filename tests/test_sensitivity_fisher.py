"""Sensitivity method=fisher against exact: agreement, its calibration, its cost, cache keys, progress."""

from __future__ import annotations

import io
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mlxbun import blas

blas.load()

import mlx.core as mx  # noqa: E402
from test_sensitivity import FIXTURE, by_path, quantized_fixture, run_sens, tiny_qwen3  # noqa: E402

from mlxbun import kl  # noqa: E402
from mlxbun.progress import Progress  # noqa: E402
from mlxbun.quant import probe  # noqa: E402
from mlxbun.quant.sensitivity import (  # noqa: E402
    backward,
    fisher,
    setup,  # noqa: E402
)
from mlxbun.quant.sensitivity import command as sens  # noqa: E402
from mlxbun.quant.spec import QuantSpec  # noqa: E402

CAL = {"samples": 4, "seq_len": 64, "seed": 0}


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fisher")
    exact = run_sens(FIXTURE, tmp / "e", tmp / "we", bits=[3, 4, 8], method="exact", batch_size=4, **CAL)
    est = run_sens(FIXTURE, tmp / "f", tmp / "wf", bits=[3, 4, 8], method="fisher", batch_size=2, **CAL)
    return by_path(exact), est


def test_fisher_ranks_modules_like_exact(both):
    exact, doc = both
    est = by_path(doc)
    assert est.keys() == exact.keys() and doc["method"] == "fisher"
    for bits in ("4", "8"):
        paths = sorted(exact)
        rho = spearman([exact[p][bits] for p in paths], [est[p][bits] for p in paths])
        assert rho > 0.8, (bits, rho)
    # Same scale as exact; calibration groups: one per role, and per depth quarter at low bits.
    for bits in ("3", "4", "8"):
        total_est = sum(v[bits] for v in est.values())
        total_exact = sum(v[bits] for v in exact.values())
        assert 0.33 < total_est / total_exact < 3.0, (bits, total_est, total_exact)
    s = sens.prepare(model_dir=FIXTURE, bits=[3, 4, 8], group_size=64, mode="affine", calib_path=None,
                     method="fisher", batch_size=2, **CAL)  # fmt: skip
    for c in s.cands:
        groups = fisher.calibration_groups(s.targets, c)
        assert len(groups) == (29 if c.bits <= fisher.LOW_BITS else 8)  # 7 roles x 4 depths + embedding
        assert groups.keys() == doc["estimate"]["measured"][str(c.bits)].keys()


def test_group_kl_is_exact(tmp_path):
    """A calibration group.s forward equals an independent float32 forward with its modules fake-quantized."""
    s = sens.prepare(model_dir=FIXTURE, bits=[4], group_size=64, mode="affine", calib_path=None,
                     method="fisher", batch_size=1, **CAL)  # fmt: skip
    est = fisher.estimate(s.stream, s.tokens, s.targets, s.cands, seed=0)
    ref, _, _ = probe.load_model(FIXTURE)  # float32, as the exact method runs
    sub = s.tokens[: max(1, len(s.tokens) // fisher.CALIB_FRACTION)]
    want_ref = [kl.log_probs(ref(mx.array(sub[i : i + 1]))) for i in range(len(sub))]
    for t in s.targets:
        if fisher.role(t.path) == "down_proj":
            mod = probe.module_at(ref, t.path)
            mod.weight = probe.fake_quant(mod.weight, s.cands[0], dtype=t.dtype)
    kls = [kl.kl_rows(r, ref(mx.array(sub[i : i + 1])))[0] for i, r in enumerate(want_ref)]
    assert est.measured["4"]["down_proj"] == pytest.approx(float(np.mean(kls)), rel=1e-3)


def test_fisher_cost_does_not_grow_with_candidates(monkeypatch):
    """Each block is read once for the forward, once for the backward and once for all the
    calibration groups together: no term grows with modules x candidates x depth."""
    s = sens.prepare(model_dir=FIXTURE, bits=[2, 3, 4, 5, 6, 8], group_size=64, mode="affine",
                     calib_path=None, method="fisher", batch_size=2, **CAL)  # fmt: skip
    loads = []
    original = type(s.stream).load
    monkeypatch.setattr(
        type(s.stream), "load", lambda self, i, *a, **k: loads.append(i) or original(self, i, *a, **k)
    )
    est = fisher.estimate(s.stream, s.tokens, s.targets, s.cands, seed=0)
    n = s.stream.n_blocks
    assert sorted(loads) == sorted(list(range(n)) * 3)
    n_samples = 4
    n_sub = max(1, n_samples // fisher.CALIB_FRACTION)
    # Each group runs from its first block (the embedding's from the lookup) to the head: a
    # depth quarter starting at block k is (n - k) blocks' part of a forward and the head's
    # (weighed by their multiply-adds) over the subset.
    groups = groups_by_bits(s)
    todo = fisher.to_measure(groups, s.cands, sampled=frozenset({s.stream.embedding_path}))
    head = s.stream.head_share()
    starts = [
        min(max(t.group for t in ts if t.group < n) if all(t.group < n for t in ts) else n, min(t.group for t in ts))
        for b, by_key in todo.items() for ts in by_key.values()
    ]  # fmt: skip
    share = sum((n - max(k, 0)) * (1 - head) / n + head for k in starts)
    assert est.forward_equivalents == pytest.approx(4 + len(s.cands) + share * n_sub / n_samples)
    # 8 bits is measured only for the embedding (scored on a sample of the tokens): the other
    # groups take 6 bits' factors.
    assert set(est.measured["8"]) == {"embed_tokens"}
    assert {k: v for k, v in est.factors["8"].items() if k != "embed_tokens"} == {
        k: v for k, v in est.factors["6"].items() if k != "embed_tokens"
    }
    for t in s.targets:
        key = {b: next(k for k, ts in g.items() if t in ts) for b, g in groups_by_bits(s).items()}
        row = {b: est.raw[t.path][b] * est.factors[b][key[b]] for b in est.raw[t.path]}
        assert est.kl[t.path] == pytest.approx(fisher._monotone(row))


def groups_by_bits(s: sens.Setup) -> dict[str, dict]:
    return {str(c.bits): fisher.calibration_groups(s.targets, c) for c in s.cands}


def test_a_source_at_six_bits_measures_eight_and_keeps_its_own_setting_at_zero(tmp_path):
    """Quantized to 6 bits already, nothing is quantized at 6: there is no factor to carry, so
    8 bits is measured; the source's own setting keeps KL 0 (out of the monotone fit)."""
    qdir = quantized_fixture(tmp_path / "q6", 6)
    doc = run_sens(qdir, tmp_path / "out", tmp_path / "w", bits=[4, 6, 8], method="fisher", **CAL)
    assert doc["estimator"] == fisher.VERSION and doc["refine"] == 0 and doc["batch_size"] == 3
    measured = doc["estimate"]["measured"]
    assert "6" not in measured and set(measured["8"]) == {fisher.role(r["path"]) for r in doc["layers"]}
    assert all(row["kl"]["6"] == 0.0 and row["kl"]["8"] > 0 and row["kl"]["4"] > 0 for row in doc["layers"])
    exact = run_sens(qdir, tmp_path / "exact", tmp_path / "w", bits=[4, 6, 8], method="exact", **CAL)
    fisher_8 = sum(row["kl"]["8"] for row in doc["layers"])
    exact_8 = sum(row["kl"]["8"] for row in exact["layers"])
    assert 0.5 < fisher_8 / exact_8 < 1.6, (fisher_8, exact_8)  # carried placeholders: 2x


def test_a_group_partly_at_six_bits_is_measured_at_eight(tmp_path):
    """k_proj at 6 bits in blocks 0-1 and 4 bits in 2-3: 6 bits' k_proj factor is measured on
    blocks 2-3 only, so 8 bits (which changes all four) is measured, not carried; the rest is."""

    def mixed(path: str, module: Any) -> Any:
        return (
            {"bits": 6, "group_size": 64}
            if path.endswith(("0.self_attn.k_proj", "1.self_attn.k_proj"))
            else True
        )

    qdir = quantized_fixture(tmp_path / "mixed", 4, mixed)
    doc = run_sens(qdir, tmp_path / "out", tmp_path / "w", bits=[4, 6, 8], method="fisher", **CAL)
    assert set(doc["estimate"]["measured"]["8"]) == {"k_proj", "embed_tokens"}  # the embedding: always
    assert doc["estimate"]["factors"]["8"]["down_proj"] == doc["estimate"]["factors"]["6"]["down_proj"]


@pytest.mark.slow
def test_a_two_bit_source_is_not_fitted_to_fall_with_bits(tmp_path, caplog):
    """2 bits' grid fits in 4 bits' (15 = 3 x 5): re-quantizing a 2-bit source to 4 bits loses
    far less than to 5, as exact measures; a fit that forces KL to fall with bits hid that."""
    qdir = quantized_fixture(tmp_path / "q2", 2)
    with caplog.at_level(logging.WARNING, logger="mlxbun"):
        doc = run_sens(qdir, tmp_path / "out", tmp_path / "w", bits=[2, 4, 5], method="fisher",
                       refine=1.0, refine_bits=[2], **CAL)  # fmt: skip
    kl4 = sum(row["kl"]["4"] for row in doc["layers"])
    kl5 = sum(row["kl"]["5"] for row in doc["layers"])
    assert all(row["kl"]["2"] == 0.0 for row in doc["layers"])
    assert kl4 < 0.5 * kl5, (kl4, kl5)
    assert any("probes nothing" in r.getMessage() for r in caplog.records)


def test_monotone_keeps_the_current_setting():
    row = {"4": 3.0, "6": 0.0, "8": 1.0}  # a source at 6 bits: re-quantizing to 8 adds error
    assert fisher._monotone(row, keep={"6"}) == pytest.approx(row)
    assert fisher._monotone({"4": 1.0, "6": 2.0, "8": 0.5}, keep=set()) == pytest.approx(
        {"4": 2.0**0.5, "6": 2.0**0.5, "8": 0.5}
    )


def test_carried_needs_six_bits():
    specs = {b: QuantSpec(bits=b, group_size=64, mode="affine") for b in (4, 6, 8)}
    assert fisher.carried([specs[4], specs[6], specs[8]]) == {"8": "6"}
    assert fisher.carried([specs[4], specs[8]]) == {}  # 8 bits is measured without a 6-bit source


def test_fisher_untied_head_and_blocks_released(tmp_path):
    model_dir = tiny_qwen3(tmp_path / "qwen3")
    s = sens.prepare(model_dir=model_dir, bits=[4, 8], group_size=64, mode="affine", calib_path=None,
                     method="fisher", batch_size=2, **CAL)  # fmt: skip
    head = np.array(s.stream.weight("lm_head").astype(mx.float32))
    est = fisher.estimate(s.stream, s.tokens, s.targets, s.cands, seed=0)
    for t in s.targets:
        assert est.kl[t.path]["4"] > est.kl[t.path]["8"] > 0, t.path
    assert "lm_head" in est.kl and s.stream.head_paths == ("lm_head",)
    assert np.array_equal(np.array(s.stream.weight("lm_head").astype(mx.float32)), head)  # head swaps undone
    for i, block in enumerate(s.stream.blocks):  # every block back to its never-read parameters
        for name, value in s.stream._lazy[i].items():
            assert probe.module_at(block, name.rpartition(".")[0]).get(name.rpartition(".")[2]) is value


# ------------------------------------------------------------------ cache keys


def test_cache_key_changes_with_blas_and_method(tmp_path, monkeypatch):
    """A blas=off run's checkpoints must not be reused by an OpenBLAS run (the numbers differ)."""
    cheap = {"samples": 2, "seq_len": 32, "bits": [8], "method": "exact"}
    first = run_sens(FIXTURE, tmp_path / "a", tmp_path / "w", **cheap)
    assert first["_stats"]["groups_computed"] > 0
    again = run_sens(FIXTURE, tmp_path / "b", tmp_path / "w", **cheap)
    assert again["_stats"]["groups_computed"] == 0  # same everything: resumed
    # Another BLAS than this process runs (which one depends on what loaded mlx first).
    blas = f"not {first['runtime']['blas']}"
    monkeypatch.setattr(setup, "runtime", lambda: {"mlx": mx.__version__, "blas": blas})
    other = run_sens(FIXTURE, tmp_path / "c", tmp_path / "w", **cheap)
    assert other["_stats"]["groups_resumed"] == 0 and other["runtime"]["blas"] == blas
    monkeypatch.undo()
    fish = run_sens(FIXTURE, tmp_path / "d", tmp_path / "w", **(cheap | {"method": "fisher"}))
    assert fish["_stats"]["groups_resumed"] == 0
    keys = {Path(d["_stats"]["checkpoints"]).name for d in (first, other, fish)}
    assert len(keys) == 3
    # A changed estimator does not reuse what the older one cached.
    monkeypatch.setattr(fisher, "VERSION", fisher.VERSION + 1)
    newer = run_sens(FIXTURE, tmp_path / "e", tmp_path / "w", **(cheap | {"method": "fisher"}))
    assert newer["_stats"]["groups_resumed"] == 0 and newer["_stats"]["groups_computed"] > 0


# ------------------------------------------------------------------ progress


def test_progress_heartbeat_rate_and_work_eta(caplog):
    stream = io.StringIO()  # not a terminal: log lines
    with caplog.at_level(logging.INFO, logger="mlxbun"):
        p = Progress(total=40, unit="modules", desc="sensitivity", stream=stream, log_every=0.2,
                     work_total=100.0, heartbeat=True)  # fmt: skip
        p.hint(30.0)  # an estimate, shown until work is done
        p.update(1, work=50.0)  # the first module carried half the work
        time.sleep(1.0)  # no updates: the heartbeat still reports
        p.close()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) >= 3, lines  # the estimate, at least one heartbeat, the close
    assert "0.0%" in lines[0] and "ETA ~30s (estimated" in lines[0]
    assert "50.0%" in lines[1] and "modules/s" in lines[1] and "ETA ?" not in lines[1]
    assert " 0 modules/s" not in lines[-1]  # small rates keep their digits


def test_fisher_resumed_run_writes_the_same_document(tmp_path):
    """A rerun that resumes every group still carries the estimate's calibration: same bytes."""
    cheap = {"samples": 2, "seq_len": 32, "bits": [4, 8], "method": "fisher"}
    first = run_sens(FIXTURE, tmp_path / "a", tmp_path / "w", **cheap)
    again = run_sens(FIXTURE, tmp_path / "b", tmp_path / "w", **cheap)
    assert again["_stats"]["groups_computed"] == 0 and "estimate" in first
    assert (tmp_path / "a" / "sensitivity.json").read_bytes() == (
        tmp_path / "b" / "sensitivity.json"
    ).read_bytes()


# ------------------------------------------------------------------ calibration and refinement


def test_group_factor_matches_the_all_sample_estimate_to_the_measured_kl():
    """Each group's estimates over all samples sum to its measured KL: the factor's denominator is
    the all-sample estimate, not the noisy subset's (which biased every factor upwards)."""
    s = sens.prepare(model_dir=FIXTURE, bits=[3, 6], group_size=64, mode="affine", calib_path=None,
                     method="fisher", batch_size=2, **CAL)  # fmt: skip
    est = fisher.estimate(s.stream, s.tokens, s.targets, s.cands, seed=0)
    for c in s.cands:
        for key, ts in fisher.calibration_groups(s.targets, c).items():
            total = sum(est.raw[t.path][str(c.bits)] for t in ts) * est.factors[str(c.bits)][key]
            assert total == pytest.approx(est.measured[str(c.bits)][key], rel=1e-9), (c.bits, key)


def test_refine_probes_modules_exactly_and_scales_their_estimates():
    s = sens.prepare(model_dir=FIXTURE, bits=[3, 4, 8], group_size=64, mode="affine", calib_path=None,
                     method="fisher", batch_size=2, **CAL)  # fmt: skip
    plain = fisher.estimate(s.stream, s.tokens, s.targets, s.cands, seed=0)
    est = fisher.estimate(s.stream, s.tokens, s.targets, s.cands, seed=0, refine=0.5, refine_bits=[4])
    probed = fisher.probe_plan(s.targets, s.cands, refine=0.5, refine_bits=[4])
    assert len(probed) == -(-len(s.targets) // 2) and est.probes.keys() == probed.keys()
    # A probe is KL(ref || that one module at 4 bits) on the calibration subset, by plain forwards.
    ref, _, _ = probe.load_model(FIXTURE)
    sub = s.tokens[: max(1, len(s.tokens) // fisher.CALIB_FRACTION)]
    path = sorted(probed)[0]
    want_ref = [kl.log_probs(ref(mx.array(sub[i : i + 1]))) for i in range(len(sub))]
    mod = probe.module_at(ref, path)
    mod.weight = probe.fake_quant(mod.weight, s.cands[1], dtype="bfloat16")
    got = np.mean([kl.kl_rows(r, ref(mx.array(sub[i : i + 1])))[0] for i, r in enumerate(want_ref)])
    assert est.probes[path]["4"] == pytest.approx(float(got), rel=1e-3)
    # Probed modules take their probe's value at 4 bits (unless pooled to stay monotone); others keep theirs.
    same = [p for p in probed if est.kl[p]["4"] == pytest.approx(est.probes[p]["4"], rel=1e-9)]
    assert len(same) >= 0.8 * len(probed)
    assert all(est.kl[t.path] == plain.kl[t.path] for t in s.targets if t.path not in probed)
    n = s.stream.n_blocks
    head = s.stream.head_share()
    extra = sum(((n - t.group) * (1 - head) / n + head) * len(probed.get(t.path, ())) for t in s.targets)
    assert est.forward_equivalents == pytest.approx(
        plain.forward_equivalents + extra * len(sub) / len(s.tokens)
    )


def test_refine_is_part_of_the_cache_key_and_checked(tmp_path):
    from mlxbun.config.schema import SensitivityCfg
    from mlxbun.errors import InputError

    cheap = {"samples": 2, "seq_len": 32, "bits": [4, 8], "method": "fisher"}
    a = run_sens(FIXTURE, tmp_path / "a", tmp_path / "w", **cheap)
    b = run_sens(FIXTURE, tmp_path / "b", tmp_path / "w", **cheap, refine=1.0, refine_bits=[4])
    assert b["_stats"]["groups_resumed"] == 0 and a["_stats"]["checkpoints"] != b["_stats"]["checkpoints"]
    assert set(b["estimate"]["probes"]) == {r["path"] for r in b["layers"]}
    with pytest.raises(InputError, match="sensitivity.refine=1.5"):
        SensitivityCfg(refine=1.5)
    with pytest.raises(InputError, match="sensitivity.refine_bits has 3"):
        SensitivityCfg(bits=[4, 8], refine_bits=[3])


# ------------------------------------------------------------------ the streamed pass


def raw_scores(s, tokens) -> dict:
    """The Fisher pass's second-order scores of ``tokens`` (before calibration)."""
    fp = backward.FisherStream(s.stream, s.targets, s.cands, seed=0)
    try:
        return fp.run(tokens)
    finally:
        fp.close()


def whole_model_scores(s, tokens, labels) -> dict:
    """The same scores from one forward and backward of the whole float32 model (the labels given):
    a zero tap at every module's output (and at a tied embedding's head use), the sum over tokens
    of (g . dW x)^2 / 2 / tokens, the head's dot added to the lookups' before squaring."""
    import mlx.nn as nn

    model, _, _ = probe.load_model(FIXTURE)
    taps, inputs, originals = {}, {}, {}

    class Tapped:
        def __init__(self, mod, path):
            self.mod, self.path = mod, path

        def __call__(self, x):
            inputs[self.path] = x
            if isinstance(self.mod, nn.Embedding):
                return self.mod.weight[x] + taps[self.path]
            return self.mod(x) + taps[self.path]

        def as_linear(self, x):
            inputs[self.path + "@head"] = x
            return x @ self.mod.weight.T + taps[self.path + "@head"]

    for t in s.targets:
        originals[t.path] = probe.module_at(model, t.path)
        parent, _, name = t.path.rpartition(".")
        setattr(probe.module_at(model, parent) if parent else model, name, Tapped(originals[t.path], t.path))
    x = mx.array(tokens)
    vocab = s.stream.vocab

    def loglik(d):
        taps.clear()
        taps.update(d)
        logits = model(x).astype(mx.float32)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return mx.take_along_axis(logp, mx.array(labels)[..., None], axis=-1).sum()

    zeros = {}
    for t in s.targets:
        mod = originals[t.path]
        width = mod.weight.shape[1] if isinstance(mod, nn.Embedding) else mod.weight.shape[0]
        zeros[t.path] = mx.zeros((*tokens.shape, width), mx.float32)
        if isinstance(mod, nn.Embedding):
            zeros[t.path + "@head"] = mx.zeros((*tokens.shape, vocab), mx.float32)
    grads = mx.grad(loglik)(zeros)
    out = {}
    for t in s.targets:
        w, row = originals[t.path].weight, {}
        for c in s.cands:
            d = probe.fake_quant(w, c, dtype=t.dtype) - w
            if isinstance(originals[t.path], nn.Embedding):
                dot = (grads[t.path] * d[inputs[t.path]]).sum(-1)
                dot = dot + (grads[t.path + "@head"] * (inputs[t.path + "@head"] @ d.T)).sum(-1)
            else:
                dot = (grads[t.path] * (inputs[t.path] @ d.T)).sum(-1)
            row[str(c.bits)] = 0.5 * float(mx.sum(mx.square(dot)).item()) / tokens.size
        out[t.path] = row
    return out


def test_streamed_scores_equal_one_whole_model_backward(monkeypatch):
    """With the labels fixed (the model's argmax), the block-by-block pass gives the scores of one
    backward through the whole model. (The fixture's head is tied: its term joins the lookups'.)"""
    s = sens.prepare(model_dir=FIXTURE, bits=[3, 8], group_size=64, mode="affine", calib_path=None,
                     method="fisher", batch_size=2, **CAL)  # fmt: skip
    monkeypatch.setattr(backward.mx.random, "categorical", lambda logits, key=None: mx.argmax(logits, -1))
    tokens = s.tokens[:2]
    streamed = raw_scores(s, tokens)
    model, _, _ = probe.load_model(FIXTURE)
    labels = np.array(mx.argmax(model(mx.array(tokens)).astype(mx.float32), -1))
    whole = whole_model_scores(s, tokens, labels)
    assert streamed.keys() == whole.keys()
    for path, row in whole.items():
        for bits, value in row.items():
            assert streamed[path][bits] == pytest.approx(value, rel=1e-3), (path, bits)
            assert value > 0, (path, bits)


def test_disk_and_batches_and_slices_give_the_same_scores(monkeypatch):
    """Block inputs and the logits' gradients on disk, one window a batch, weights scored in small
    row slices: the same sums as all in memory at once."""
    s = sens.prepare(model_dir=FIXTURE, bits=[3, 8], group_size=64, mode="affine", calib_path=None,
                     method="fisher", batch_size=2, **CAL)  # fmt: skip
    kept = raw_scores(s, s.tokens)
    saved = []
    monkeypatch.setattr(backward.np, "save", lambda p, a, _s=np.save: saved.append(p) or _s(p, a))
    monkeypatch.setattr(backward, "BOUNDARY_MEMORY", 1)
    monkeypatch.setattr(backward, "COLUMNS_MEMORY", 1)
    monkeypatch.setattr(backward, "ACTIVATION_BYTES", 1)
    monkeypatch.setattr(backward, "CHUNK", 32 * 256)  # 32 rows of 256 per slice
    spilled = raw_scores(s, s.tokens)
    assert len(saved) == s.stream.n_blocks
    for path, row in kept.items():
        for bits, value in row.items():
            assert value > 0 and spilled[path][bits] == pytest.approx(value, rel=1e-4), (path, bits)


@pytest.mark.parametrize("in_memory", [False, True])
def test_spill_put_again_replaces_only_that_name(in_memory):
    spill = probe.Spill()
    spill.in_memory = in_memory
    try:
        spill.put("a", np.zeros(2))
        spill.put("b", np.ones(2))
        spill.put("a", np.full(3, 7.0))  # a second put of a name must not write over another's file
        spill.put("c", np.full(1, 5.0))
        assert spill.get("a").tolist() == [7.0, 7.0, 7.0]
        assert spill.get("b").tolist() == [1.0, 1.0]
        assert spill.get("c").tolist() == [5.0]
    finally:
        spill.close()


def test_the_head_is_scored_on_a_sample_of_the_tokens(monkeypatch):
    """Past HEAD_TOKENS tokens the head and the lookups are scored on that many evenly spaced ones
    (labels fixed here); every other module's scores are unchanged. The embedding is alone in its
    calibration groups, and measured at every bit width (never carried), so its KL is measured."""
    s = sens.prepare(model_dir=FIXTURE, bits=[6, 8], group_size=64, mode="affine", calib_path=None,
                     method="fisher", batch_size=2, **CAL)  # fmt: skip
    monkeypatch.setattr(backward.mx.random, "categorical", lambda logits, key=None: mx.argmax(logits, -1))
    every = raw_scores(s, s.tokens)
    monkeypatch.setattr(backward, "HEAD_TOKENS", s.tokens.size // 4)
    fp = backward.FisherStream(s.stream, s.targets, s.cands, seed=0)
    assert len(fp.scored_rows(s.tokens.size)) == s.tokens.size // 4
    sampled = raw_scores(s, s.tokens)
    emb = s.stream.embedding_path
    assert sampled[emb] != every[emb]
    for path, row in every.items():
        if path != emb:
            for bits, value in row.items():
                assert sampled[path][bits] == pytest.approx(value, rel=1e-4), (path, bits)
    est = fisher.estimate(s.stream, s.tokens, s.targets, s.cands, seed=0)
    assert set(est.measured["8"]) == {"embed_tokens"}
    assert est.kl[emb]["8"] == pytest.approx(est.measured["8"]["embed_tokens"], rel=1e-9)
