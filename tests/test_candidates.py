"""Rich candidates (mlxbun/quant/candidates.py): every bits x group x rounding method and
microscaling mode scored from the input Hessians, written in sensitivity.json, allocated among,
quantized into a model mlx-lm loads."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from cli_util import run_cli

from mlxbun.errors import InputError
from mlxbun.quant import hessian
from mlxbun.quant.sensitivity import candidates
from mlxbun.quant.sensitivity.file import KIND, SCHEMA_VERSION, load_sensitivity, setting_key
from mlxbun.quant.spec import QuantSpec

FIXTURE = "tests/fixtures/llama-text-3m"


def _layer(seed: int, rows: int = 96, cols: int = 256) -> tuple[mx.array, np.ndarray]:
    """A weight and an input Hessian with correlated inputs of unequal size, as in trained models."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
    x = rng.standard_normal((1024, cols)) @ (np.eye(cols) + 0.3 * rng.standard_normal((cols, cols)) / 16)
    x *= np.exp(rng.standard_normal(cols))  # a few large channels
    return mx.array(w).astype(mx.bfloat16), (x.T @ x).astype(np.float32)


def test_gptq_estimate_is_exact_at_its_anchor_and_close_at_other_group_sizes() -> None:
    ratios = []
    for seed in range(3):
        w, h = _layer(seed)
        for spec, est, exact in candidates.gptq_agreement(w, h, bits=[3, 4], group_sizes=[32, 64, 128]):
            if spec.group_size == candidates.ANCHOR_GROUP:
                assert est == pytest.approx(exact, rel=1e-6), spec
            else:
                ratios.append(est / exact)
    assert 0.75 < float(np.median(ratios)) < 1.33, ratios
    assert min(ratios) > 0.4 and max(ratios) < 2.5, ratios


def test_gptq_estimate_costs_one_gptq_per_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    from mlxbun.quant import rounding

    calls = []
    real = rounding._gptq

    def counted(*a, **k):
        calls.append(k["group_size"])
        return real(*a, **k)

    monkeypatch.setattr(rounding, "_gptq", counted)
    w, h = _layer(0)
    specs = candidates.settings(
        [2, 3, 4], group_sizes=[32, 64, 128], methods=["rtn", "clip", "gptq"], modes=[]
    )
    errs, scales = candidates.module_errors(w, h, specs)
    assert len(calls) == 3 and set(calls) == {64}  # one per bits, at the anchor group
    assert {s for s in specs} == set(errs) and set(scales) == {"2", "3", "4"}


def test_candidate_kl_is_the_reference_kl_times_the_error_ratio() -> None:
    ref3, ref4 = QuantSpec(bits=3, group_size=64), QuantSpec(bits=4, group_size=64)
    gptq3 = QuantSpec(bits=3, group_size=32, method="gptq")
    mx4 = QuantSpec(mode="mxfp4")
    errors = {ref3: 2.0, ref4: 1.0, gptq3: 0.5, mx4: 3.0, QuantSpec(bits=5, group_size=32): 9.0}
    kl = candidates.to_kl({ref3: 0.02, ref4: 0.01}, errors, base_group=64)
    assert kl == {ref3: 0.02, ref4: 0.01, gptq3: 0.005, mx4: 0.03}  # no 5-bit reference: left out


def test_settings_refuse_what_they_cannot_score() -> None:
    with pytest.raises(InputError, match=r"sensitivity.candidates.methods has 'awq'"):
        candidates.settings([4], group_sizes=[64], methods=["awq"], modes=[])
    with pytest.raises(InputError, match=r"sensitivity.candidates.group_size=48"):
        candidates.settings([4], group_sizes=[48], methods=["rtn"], modes=[])
    assert candidates.settings([3], group_sizes=[64], methods=["rtn"], modes=["mxfp4", "mxfp8"]) == [
        QuantSpec(bits=3, group_size=64)
    ]  # the modes' bits were not measured


def test_sensitivity_json_keys_name_every_candidate(tmp_path: Path) -> None:
    specs = [
        QuantSpec(bits=4, group_size=64),
        QuantSpec(bits=3, group_size=32, method="gptq"),
        QuantSpec(mode="nvfp4"),
    ]
    keys = [setting_key(s, group=64, mode="affine") for s in specs]
    assert keys == ["4", "affine:3:32:gptq", "nvfp4:4:16"]
    doc = {"version": SCHEMA_VERSION, "kind": KIND, "bits": [4], "group_size": 64, "mode": "affine"}
    path = tmp_path / "sensitivity.json"
    path.write_text(
        json.dumps(doc | {"layers": [{"path": "m", "params": 1, "kl": dict.fromkeys(keys, 0.1)}]})
    )
    assert set(load_sensitivity(path).layers["m"].kl) == set(specs)
    path.write_text(
        json.dumps(doc | {"layers": [{"path": "m", "params": 1, "kl": {"affine:3:48:gptq": 0.1}}]})
    )
    with pytest.raises(InputError, match=r"kl key 'affine:3:48:gptq'.*group_size=48"):
        load_sensitivity(path)


def test_pipeline_allocates_among_rich_candidates_and_mlx_lm_loads_the_model(tmp_path: Path) -> None:
    args = [
        "command=pipeline", "pipeline.steps=[sensitivity,allocate,quantize]", f"model.name={FIXTURE}",
        "sensitivity.bits=[3,4]", "sensitivity.candidates.methods=[clip,gptq]",
        "sensitivity.candidates.group_sizes=[32]", "sensitivity.candidates.modes=[mxfp4]",
        "sensitivity.calib.samples=4", "sensitivity.calib.seq_len=64", "allocate.budget_bpw=3.9",
        "allocate.check=false",
    ]  # fmt: skip
    res = run_cli(*args, tmp=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    run = next((tmp_path / "outputs" / "pipeline").iterdir())
    doc = json.loads((run / "sensitivity" / "sensitivity.json").read_text())
    kl = doc["layers"][0]["kl"]
    assert {"3", "4", "affine:3:32", "affine:3:32:gptq", "affine:4:64:clip", "mxfp4:4:32"} <= set(kl)
    assert [p["key"] for p in doc["candidates"]["probes"]][0] == "rtn"
    plan = json.loads((run / "allocate" / "plan.json").read_text())
    used = {(e.get("method", "rtn"), e["group_size"]) for e in plan["layers"].values() if e}
    assert any(m != "rtn" for m, _ in used), used
    assert plan["predicted_bpw"] <= 3.9
    measured = plan["sensitivity"]  # what the plan was chosen from, and what the probes measured
    assert measured["methods"] == ["clip", "gptq", "rtn"] and measured["modes"] == ["mxfp4"]
    assert measured["probes"] == doc["candidates"]["probes"]
    from mlx_lm import load

    load(str(run / "quantize" / "model"))
    # a rerun finds every stage cached: same plan bytes
    again = run_cli(*args, tmp=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    second = sorted((tmp_path / "outputs" / "pipeline").iterdir())[-1]
    assert (second / "allocate" / "plan.json").read_bytes() == (run / "allocate" / "plan.json").read_bytes()
    assert "capturing input Hessians" not in again.stderr
    assert "29 layers x 13 settings" in again.stdout


def test_allocate_methods_filter_the_rounding_methods(tmp_path: Path) -> None:
    from mlxbun.config import schema
    from mlxbun.quant.allocate.allocation import candidate_filter
    from mlxbun.quant.sensitivity.file import LayerSensitivity, Sensitivity

    specs = [
        QuantSpec(bits=4, group_size=64),
        QuantSpec(bits=4, group_size=64, method="gptq"),
        QuantSpec(mode="mxfp4"),
    ]
    sens = Sensitivity({"m": LayerSensitivity("m", 1, dict.fromkeys(specs, 0.1))})
    assert candidate_filter(sens, bits=[], group_sizes=[], modes=[], methods=["rtn"]) == {specs[0], specs[2]}
    assert candidate_filter(sens, bits=[], group_sizes=[], modes=[], methods=[]) == set(specs)
    with pytest.raises(InputError, match=r"allocate.methods='awq' is not allowed"):
        schema.AllocateCfg(methods=["awq"])


def test_a_killed_candidate_scoring_resumes_from_the_modules_it_finished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlxbun.quant.sensitivity.command import Rich, sensitivity

    kw = dict(
        model_dir=FIXTURE, work_dir=tmp_path / "work", bits=[4], samples=2, seq_len=32,
        rich=Rich(group_sizes=[], methods=["gptq"], modes=[]),
    )  # fmt: skip
    real, calls = candidates.module_errors, []

    def dies_after_five(*a, **k):
        if len(calls) == 5:
            raise KeyboardInterrupt("killed")
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(candidates, "SAVE_EVERY", 0.0)
    monkeypatch.setattr(candidates, "module_errors", dies_after_five)
    with pytest.raises(KeyboardInterrupt):
        sensitivity(out_dir=tmp_path / "a", **kw)
    monkeypatch.setattr(candidates, "module_errors", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    doc = sensitivity(out_dir=tmp_path / "b", **kw)
    assert len(calls) == len(doc["layers"])  # 5 before the kill, the rest after it: none twice
    assert all("affine:4:64:gptq" in row["kl"] for row in doc["layers"])


def test_sensitivity_scores_with_the_given_quant_hessians(tmp_path: Path) -> None:
    """quant.hessians (a calibrate step's, or a file) is what the candidates are scored with."""
    from mlxbun.quant.calibrate import calibrate

    h = calibrate(model_dir=FIXTURE, out_dir=tmp_path / "h", samples=2, seq_len=32).path
    args = [
        "command=sensitivity", f"model.name={FIXTURE}", "sensitivity.bits=[4]", "sensitivity.calib.samples=2",
        "sensitivity.calib.seq_len=32", "sensitivity.candidates.methods=[gptq]", "sensitivity.candidates.correct=false",
        f"quant.hessians={h}",
    ]  # fmt: skip
    res = run_cli(*args, tmp=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "capturing input Hessians" not in res.stderr
    run = next((tmp_path / "outputs" / "sensitivity").iterdir())
    assert json.loads((run / "sensitivity.json").read_text())["candidates"]["hessians"] == str(h)


def _scored(monkeypatch: pytest.MonkeyPatch, *, threads: int, rows: int, file: Path | None = None) -> dict:
    """score() over four Linear layers of 512 x 256 (float32, as the stream reads them),
    each scored on ``rows`` of its rows."""
    import types

    import mlx.nn as nn

    monkeypatch.setattr(candidates, "SCORE_WEIGHTS", rows * 256)
    monkeypatch.setattr(candidates, "MIN_SCORE_ROWS", 1)
    model = nn.Module()
    model.layers = [nn.Linear(256, 512, bias=False) for _ in range(4)]
    hessians, measured, targets = {}, {}, []
    for i, layer in enumerate(model.layers):
        w, h = _layer(i, rows=512)
        layer.weight = w.astype(mx.float32)
        path = f"layers.{i}"
        hessians[path] = h
        measured[path] = {QuantSpec(bits=3, group_size=64): 0.1, QuantSpec(bits=4, group_size=64): 0.03}
        targets.append(types.SimpleNamespace(path=path, dtype="bfloat16", in_features=256, out_features=512))
    if file is not None:  # the Hessians as the recipe hands them: a file read a module at a time
        hessian.save(hessians, file, tokens=1)
        hessians = hessian.Hessians(file)
    specs = candidates.settings([3, 4], group_sizes=[32, 64, 128], methods=["rtn", "clip", "gptq"], modes=[])
    order = []
    modules = dict(model.named_modules())
    out, _ = candidates.score(
        weight=lambda p: modules[p].weight, targets=targets, hessians=hessians, measured=measured, specs=specs, base_group=64,
        on_module=lambda p, kl, a: order.append(p), threads=threads,
    )  # fmt: skip
    assert order == [t.path for t in targets]  # handed on in model order, whatever finished first
    return out


def test_scoring_on_threads_gives_the_same_values(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _scored(monkeypatch, threads=2, rows=512) == _scored(monkeypatch, threads=1, rows=512)


def test_scoring_on_worker_processes_gives_the_same_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """A big model's modules are scored on processes (mlxbun.quant.workers): the same bits."""
    from mlxbun.quant import workers

    here = _scored(monkeypatch, threads=1, rows=512)
    monkeypatch.setattr(workers, "MIN_WEIGHTS", 0)
    started = []
    real = workers.sent
    monkeypatch.setattr(workers, "sent", lambda w: started.append(1) or real(w))
    assert _scored(monkeypatch, threads=2, rows=512) == here
    assert len(started) == 4


def test_a_worker_reads_its_modules_h_from_the_file_not_sent_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker is sent the hessians file and key, not the array: at a 21,504-wide MLP the main
    process's copy of H and its pickled bytes were 1.85 GB each per module in flight."""
    from mlxbun.quant import workers

    here = _scored(monkeypatch, threads=1, rows=512)
    monkeypatch.setattr(workers, "MIN_WEIGHTS", 0)
    sent = []
    real = workers.hessian_for
    monkeypatch.setattr(workers, "hessian_for", lambda hs, k: sent.append(real(hs, k)) or sent[-1])
    assert _scored(monkeypatch, threads=2, rows=512, file=tmp_path / "h.safetensors") == here
    assert len(sent) == 4 and all(isinstance(h, workers.HessianRef) for h in sent)


def test_a_row_sample_scores_a_big_weight_close_to_all_its_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Errors are sums over rows and a candidate's KL is a ratio of two errors of the same rows."""
    full = _scored(monkeypatch, threads=1, rows=512)
    sample = _scored(monkeypatch, threads=1, rows=128)
    assert candidates.rows_scored(512, 256) is not None and len(candidates.rows_scored(512, 256)) == 128
    assert candidates.rows_scored(128, 256) is None
    monkeypatch.undo()
    assert candidates.rows_scored(4096, 64) is None  # the narrow fixtures' embeddings stay whole
    assert len(candidates.rows_scored(4864, 896)) == 292  # a 0.5B-shaped MLP weight
    assert len(candidates.rows_scored(896, 4864)) == candidates.MIN_SCORE_ROWS == 128  # a 0.5B down_proj
    assert full != sample
    for path, kl in full.items():
        for spec, v in kl.items():
            assert sample[path][spec] == pytest.approx(v, rel=0.1), (path, spec)


def _probed_stream() -> object:
    """The least of a Stream that corrected() reads when variants.measure is replaced."""
    from types import SimpleNamespace

    return SimpleNamespace(
        dir="m", source=lambda: {"current": {}, "dtypes": {}}, stored_dtype=lambda name: "bfloat16",
        embedding_path="e", head_paths=("e",), weight_shape=lambda path: (64, 64),
    )  # fmt: skip


def test_probes_measure_on_the_calibration_subset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The probes' whole-model KL runs on the samples the estimate's own KLs were measured on,
    every probe in one streamed pass."""

    from mlxbun.quant import hessian
    from mlxbun.quant.sensitivity import fisher, variants

    seen, passes = [], []
    monkeypatch.setattr(
        variants.Reference,
        "capture",
        classmethod(lambda cls, stream, tokens: seen.append(tokens.shape) or "ref"),
    )
    monkeypatch.setattr(
        variants, "measure", lambda stream, ref, vs, **k: passes.append(len(vs)) or [0.1] * len(vs)
    )
    default = QuantSpec(bits=4, group_size=64)
    gptq = QuantSpec(bits=4, group_size=64, method="gptq")
    stream = _probed_stream()
    hessian.save({"a": np.eye(64, dtype=np.float32)}, tmp_path / "h.safetensors", tokens=1)
    kls = {p: {default: 0.05, gptq: 0.03} for p in ("a", "b")}
    tokens = np.zeros((32, 16), dtype=np.int32)
    _, probes = candidates.corrected(
        kls,
        lambda _: {"a": gptq, "b": default},
        stream=stream,
        hessians=tmp_path / "h.safetensors",
        tokens=tokens,
    )
    assert [p["key"] for p in probes] == ["rtn", "gptq"]
    assert seen == [(32 // fisher.CALIB_FRACTION, 16)] and passes == [2]
    assert fisher.calibration_subset(tokens[:3]).shape == (1, 16)  # at least one sample


def test_a_quantizer_the_corrected_plan_brings_in_is_probed_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GPTQ's estimates are 4x too low: its probe corrects them, the plan moves to clip, and clip
    (never measured) is probed in a second round instead of standing on its raw estimate."""

    from mlxbun.quant import hessian
    from mlxbun.quant.sensitivity import variants

    rtn = QuantSpec(bits=4, group_size=64)
    gptq, clip = (QuantSpec(bits=4, group_size=64, method=m) for m in ("gptq", "clip"))
    true = {rtn: 0.05, gptq: 0.04, clip: 0.03}  # each module's KL in the whole model
    passes = []
    monkeypatch.setattr(variants.Reference, "capture", classmethod(lambda cls, stream, tokens: "ref"))

    def measure(stream, ref, vs, **k):
        passes.append(len(vs))
        return [sum(true[s] for s in v.values()) for v in vs]

    monkeypatch.setattr(variants, "measure", measure)
    stream = _probed_stream()
    hessian.save({"a": np.eye(64, dtype=np.float32)}, tmp_path / "h.safetensors", tokens=1)
    kls = {p: {rtn: 0.05, gptq: 0.01, clip: 0.02} for p in ("a", "b")}

    def plan(est):  # each module at its lowest estimate other than RTN's
        return {p: min((gptq, clip), key=lambda s: est[p][s]) for p in est}

    fixed, probes = candidates.corrected(
        kls,
        plan,
        stream=stream,
        hessians=tmp_path / "h.safetensors",
        tokens=np.zeros((8, 16), dtype=np.int32),
    )
    assert [(p["key"], p["factor"]) for p in probes] == [("rtn", 1.0), ("gptq", 4.0), ("clip", 1.5)]
    assert passes == [2, 2]  # the first plan's RTN and GPTQ probes, then RTN and clip around the second
    assert fixed["a"][clip] == pytest.approx(0.03) and fixed["a"][gptq] == pytest.approx(0.04)


def test_the_probes_progress_counts_their_roundings() -> None:
    """The probes' time is mostly their clip and GPTQ roundings, not their forwards (at 0.5B the
    progress counted forwards only: the blocks' roundings were a third of the bar and most of the
    time, and its ETA ran 1.65-1.85x over). measure() ticks each rounding's weights as work, each
    module and setting once, and rounding_work() is their total up front."""
    from mlxbun.quant.sensitivity import variants
    from mlxbun.quant.streamed import Stream

    stream = Stream(FIXTURE)
    ref = variants.Reference.capture(stream, np.arange(2 * 16, dtype=np.int32).reshape(2, 16) % 200)
    q, o, e = (
        f"{stream.prefix}{i}.{m}"
        for i, m in ((0, "self_attn.q_proj"), (1, "self_attn.o_proj"), (0, "mlp.up_proj"))
    )
    clip, gptq, rtn = (QuantSpec(bits=4, group_size=64, method=m) for m in ("clip", "gptq", "rtn"))
    wanted = [{q: clip, e: rtn}, {q: clip, o: gptq}, {stream.embedding_path: clip}]
    ticks = []
    kl = variants.measure(
        stream, ref, wanted, fake=lambda p, w, s, out_dtype=mx.float32, codes=False: w.astype(out_dtype),
        tick=lambda f, work=0.0: ticks.append((f, work)),
    )  # fmt: skip
    size = lambda p: float(np.prod(stream.weight_shape(p)))  # noqa: E731
    work = variants.rounding_work(stream, variants.roundings(stream, wanted))
    assert sum(w for _, w in ticks) == work
    tied = stream.embedding_path in stream.head_paths  # rounded for the lookups and the logits
    assert tied and work == size(q) + size(o) + 2 * size(stream.embedding_path)
    assert len(kl) == 3
    # the probes' Written ticks each rounding itself (a big weight a block of rows at a time)
    from mlxbun.quant.probe import Written

    written, ticks, own = Written(dtype="bfloat16", dtypes={}), [], []
    written.tick = own.append
    variants.measure(stream, ref, wanted, fake=written, tick=lambda f, work=0.0: ticks.append(work))
    assert sum(ticks) == 0 and sum(own) == work


def test_the_probes_progress_counts_no_rounding_read_back(tmp_path) -> None:
    """Written keeping its roundings ticks each module and setting once: the tied head's
    rounding after its lookups', and a second probe round's repeats, are read back in moments
    (counted as work they took 42% of a 0.5B second round's bar, and its ETA ran 1.68x over)."""
    from mlxbun.quant.probe import Written
    from mlxbun.quant.quantize.cache import Rounded
    from mlxbun.quant.sensitivity import variants
    from mlxbun.quant.streamed import Stream

    stream = Stream(FIXTURE)
    ref = variants.Reference.capture(stream, np.arange(2 * 16, dtype=np.int32).reshape(2, 16) % 200)
    q, o = (f"{stream.prefix}{i}.{m}" for i, m in ((0, "self_attn.q_proj"), (1, "self_attn.o_proj")))
    clip, gptq = (QuantSpec(bits=4, group_size=64, method=m) for m in ("clip", "gptq"))
    size = lambda p: float(np.prod(stream.weight_shape(p)))  # noqa: E731
    written = Written(dtype="bfloat16", dtypes={}, rounded=Rounded(tmp_path, "0" * 64))
    for wanted, want in (
        ([{q: clip}, {q: clip, stream.embedding_path: clip}], size(q) + size(stream.embedding_path)),
        ([{q: clip, o: gptq}], size(o)),  # the next round: q at clip is kept already
    ):
        own = []
        written.tick = own.append
        work = variants.rounding_work(stream, written.to_round(variants.roundings(stream, wanted)))
        variants.measure(stream, ref, wanted, fake=written)
        assert sum(own) == work == want


def test_two_big_roundings_never_run_on_the_workers_at_once(monkeypatch) -> None:
    """A worker's task for a module with a big H (GPTQ's factorization holds three H-sized
    arrays: 5.5 GB at a 21,504-wide MLP) waits while another such task runs; small ones do not
    wait (two down_proj at once set the candidate scores' peak at Gemma-3-27B's width, 12.7 GB)."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from mlxbun.quant import workers

    monkeypatch.setattr(workers, "BIG_H_BYTES", 4 * 100 * 100)
    running, most, lock = [0, 0], [0, 0], threading.Lock()

    def task(kind: int) -> int:
        with lock:
            running[kind] += 1
            most[kind] = max(most[kind], running[kind])
        time.sleep(0.05)
        with lock:
            running[kind] -= 1
        return kind

    with ThreadPoolExecutor(max_workers=4) as ex:
        ex.big = threading.Lock()  # as workers.pool gives it
        widths = [100, 100, 100, 10, 10, 10]
        with ThreadPoolExecutor(max_workers=6) as callers:
            got = list(callers.map(lambda w: workers.run(ex, task, int(w < 100), width=w), widths))
    assert got == [0, 0, 0, 1, 1, 1]
    assert most[0] == 1, most  # the big ones one at a time (the small ones are not held)
