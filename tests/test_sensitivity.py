"""Sensitivity (method=exact): fast path == seed-faithful reference, shards + merge == one job, resume, quantized
source, calibration determinism. Models: the trained fixture and a random tiny qwen3 (untied head)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mlxbun import blas

blas.load()

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from mlxbun.errors import InputError  # noqa: E402
from mlxbun.kl import kl_rows, log_probs  # noqa: E402
from mlxbun.quant import calibration as calib_mod  # noqa: E402
from mlxbun.quant import probe, rounding  # noqa: E402
from mlxbun.quant.sensitivity import command as sens  # noqa: E402
from mlxbun.quant.sensitivity.file import combine_shards  # noqa: E402
from mlxbun.quant.sensitivity.merge import merge  # noqa: E402
from mlxbun.quant.sensitivity.reference import reference_kl  # noqa: E402
from mlxbun.quant.spec import QuantSpec  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "fixtures" / "llama-text-3m"
SMALL = {"samples": 4, "seq_len": 48, "seed": 0}
CHEAP = {"samples": 3, "seq_len": 32, "bits": [4]}  # for shard/resume plumbing


def tiny_qwen3(path: Path) -> Path:
    """A random 3-block qwen3 (untied lm_head, q/k norms) with the fixture's tokenizer, bf16."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3

    config = {
        "model_type": "qwen3", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 2048,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 512,
        "tie_word_embeddings": False,
    }  # fmt: skip
    mx.random.seed(3)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    weights = {k: v.astype(mx.bfloat16) for k, v in tree_flatten(model.parameters())}
    path.mkdir(parents=True)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIXTURE / f, path / f)
    return path


def run_sens(model_dir: Path, out: Path, work: Path, **kw) -> dict:
    args = {"bits": [4, 8], "batch_size": 3, "calib_path": None, "method": "exact"} | SMALL | kw
    return sens.sensitivity(model_dir=model_dir, out_dir=out, work_dir=work, **args)


def by_path(doc: dict) -> dict[str, dict[str, float]]:
    return {row["path"]: row["kl"] for row in doc["layers"]}


def assert_close(fast: dict, ref: dict, *, rtol: float = 1e-3) -> None:
    assert fast.keys() == ref.keys()
    for path in ref:
        for bits, want in ref[path].items():
            got = fast[path][bits]
            assert abs(got - want) <= rtol * abs(want), (path, bits, got, want)


# ------------------------------------------------------------------ calibration


class FakeTok:
    eos_token_id = 1
    chat_template = None

    def encode(self, text, add_special_tokens=False):
        return [2 + (ord(c) % 50) for c in text]

    def apply_chat_template(self, msgs, tokenize=False):
        return "".join(f"<{m['role']}>{m['content']}</>" for m in msgs)


def test_builtin_calibration_is_varied():
    docs, source = calib_mod.read_documents(None)
    kinds = {d.kind for d in docs}
    assert {"prose", "code", "dialogue", "math"} <= kinds and source.startswith("builtin")
    text = calib_mod.BUILTIN.read_text(encoding="utf-8")
    langs = {line.split()[2] for line in text.splitlines() if line.startswith("### ")}
    assert len(langs) >= 15 and 20_000 < len(text.encode()) < 200_000
    assert all(d.messages for d in docs if d.kind == "dialogue")


def test_calibration_is_deterministic_by_seed():
    tok = FakeTok()
    a = calib_mod.load_calibration(tokenizer=tok, samples=6, seq_len=100, seed=0)
    b = calib_mod.load_calibration(tokenizer=tok, samples=6, seq_len=100, seed=0)
    c = calib_mod.load_calibration(tokenizer=tok, samples=6, seq_len=100, seed=1)
    assert a.tokens.shape == (6, 100) and a.tokens.dtype == np.int32
    assert np.array_equal(a.tokens, b.tokens) and a.fingerprint == b.fingerprint
    assert a.fingerprint != c.fingerprint
    assert a.fingerprint == calib_mod.fingerprint(a.tokens.copy())


def test_jsonl_chat_template_and_errors(tmp_path):
    f = tmp_path / "c.jsonl"
    f.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "yo"}]})
        + "\n" + json.dumps({"text": "plain words " * 20}) + "\n"
    )  # fmt: skip
    tok = FakeTok()
    tok.chat_template = "{{ messages }}"
    docs, _ = calib_mod.read_documents(f)
    ids, used = calib_mod.render(docs[0], tok)
    assert used and ids == tok.encode("<user>hi there</><assistant>yo</>")
    tok.chat_template = None
    ids, used = calib_mod.render(docs[0], tok)
    assert not used and ids == tok.encode("user: hi there\nassistant: yo\n")
    cal = calib_mod.load_calibration(tokenizer=tok, path=f, samples=2, seq_len=50, seed=0)
    assert cal.tokens.shape == (2, 50)
    with pytest.raises(InputError, match="seq_len=100000"):
        calib_mod.load_calibration(tokenizer=tok, path=f, samples=2, seq_len=100_000)
    (tmp_path / "bad.jsonl").write_text('{"nope": 1}\n')
    with pytest.raises(InputError, match="line 1"):
        calib_mod.read_documents(tmp_path / "bad.jsonl")


# ------------------------------------------------------------------ numerics


def test_kl_rows_matches_float64_numpy():
    rng = np.random.default_rng(0)
    ref = rng.normal(size=(2, 5, 40)).astype(np.float32) * 3
    cur = ref + rng.normal(size=ref.shape).astype(np.float32) * 0.01

    def logp(z):
        z = z.astype(np.float64)
        return (
            z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z.max(-1, keepdims=True)
        )

    want = (np.exp(logp(ref)) * (logp(ref) - logp(cur))).sum(-1).mean(-1)
    got = kl_rows(log_probs(mx.array(ref)), mx.array(cur))
    np.testing.assert_allclose(got, want, rtol=1e-9)
    assert np.all(kl_rows(log_probs(mx.array(ref)), mx.array(ref)) == 0)


def test_fake_quant_equals_mx_quantize_roundtrip():
    w = mx.random.normal((64, 128), key=mx.random.key(0))
    cand = QuantSpec(bits=4, group_size=64, mode="affine")
    q = mx.quantize(w.astype(mx.bfloat16), group_size=64, bits=4)
    want = mx.dequantize(*q, group_size=64, bits=4).astype(mx.float32)
    assert mx.array_equal(probe.fake_quant(w, cand, dtype="bfloat16"), want)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["fixture", "qwen3"])
def test_fast_equals_reference(which, tmp_path):
    model_dir = FIXTURE if which == "fixture" else tiny_qwen3(tmp_path / "qwen3")
    doc = run_sens(model_dir, tmp_path / "out", tmp_path / "work")
    s = sens.prepare(model_dir=model_dir, bits=[4, 8], group_size=64, mode="affine", calib_path=None,
                     method="reference", batch_size=1, **SMALL)  # fmt: skip
    # Every module of the first and last groups and one per middle group (the reference is slow).
    last = max(t.group for t in s.targets)
    some = [t for t in s.targets if t.group in (0, last) or t.path.endswith(("mlp.down_proj", "v_proj"))]
    ref = reference_kl(s.model, s.tokens, some, s.cands)
    assert_close({p: kl for p, kl in by_path(doc).items() if p in ref}, ref)
    kl4 = [row["kl"]["4"] for row in doc["layers"]]
    kl8 = [row["kl"]["8"] for row in doc["layers"]]
    assert all(a > b > 0 for a, b in zip(kl4, kl8, strict=True))  # a real signal, not noise
    if which == "qwen3":
        assert doc["layers"][-1]["path"] == "lm_head" and doc["layers"][-1]["group"] == 3
    assert max(kl4) / min(kl4) > 10  # layers differ: the fixture has structure


@pytest.mark.slow
def test_sharded_merged_equals_single_job(tmp_path):
    single = run_sens(FIXTURE, tmp_path / "single", tmp_path / "w1", **CHEAP)
    for i in range(2):
        part = run_sens(FIXTURE, tmp_path / f"s{i}", tmp_path / "w2", shard=i, num_shards=2, **CHEAP)
        assert part["shard"]["index"] == i and 0 < len(part["layers"]) < len(single["layers"])
    with pytest.raises(InputError, match="cover"):
        merge(inputs=[str(tmp_path / "s0")], out_dir=tmp_path / "bad")
    merged, files, _ = merge(inputs=[str(tmp_path / "s1"), str(tmp_path / "s0")], out_dir=tmp_path / "m")
    assert len(files) == 2
    for name in ("sensitivity.json", "sensitivity.csv", "sensitivity.png"):
        assert (tmp_path / "m" / name).read_bytes() == (tmp_path / "single" / name).read_bytes(), name


@pytest.mark.slow
def test_resume_after_interrupt(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        run_sens(FIXTURE, tmp_path / "a", tmp_path / "w", stop_after_groups=2, **CHEAP)
    assert not (tmp_path / "a" / "sensitivity.json").exists()
    resumed = run_sens(FIXTURE, tmp_path / "a", tmp_path / "w", **CHEAP)
    n_groups = resumed["model"]["num_layers"]  # tied head: groups 0..L-1
    assert resumed["_stats"]["groups_resumed"] == 2 and resumed["_stats"]["groups_computed"] == n_groups - 2
    run_sens(FIXTURE, tmp_path / "b", tmp_path / "w-fresh", **CHEAP)
    assert (tmp_path / "a" / "sensitivity.json").read_bytes() == (
        tmp_path / "b" / "sensitivity.json"
    ).read_bytes()
    again = run_sens(FIXTURE, tmp_path / "c", tmp_path / "w", **CHEAP)
    assert again["_stats"]["groups_computed"] == 0


def quantized_fixture(qdir: Path, bits: int, predicate: Any = None) -> Path:
    """FIXTURE quantized by mlx-lm to ``bits`` (g64) in ``qdir``: a quantized source
    (``predicate``: mlx-lm's quant_predicate, for a mixed one)."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load, quantize_model, save_config

    model, _ = load(str(FIXTURE))
    config = json.loads((FIXTURE / "config.json").read_text())
    model, qconfig = quantize_model(model, config, group_size=64, bits=bits, quant_predicate=predicate)
    qdir.mkdir()
    mx.save_safetensors(
        str(qdir / "model.safetensors"), dict(tree_flatten(model.parameters())), metadata={"format": "mlx"}
    )
    save_config(qconfig, qdir / "config.json")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIXTURE / f, qdir / f)
    return qdir


@pytest.mark.slow
def test_quantized_source(tmp_path):
    qdir = quantized_fixture(tmp_path / "q4", 4)
    doc = run_sens(qdir, tmp_path / "out", tmp_path / "w", bits=[3, 4, 8], samples=3, seq_len=32)
    assert doc["model"]["quantized"]
    assert all(row["kl"]["4"] == 0.0 and row["current"]["bits"] == 4 for row in doc["layers"])
    assert all(row["kl"]["3"] > 0 and row["kl"]["8"] > 0 for row in doc["layers"])
    s = sens.prepare(model_dir=qdir, bits=[3, 4, 8], group_size=64, mode="affine", calib_path=None,
                     method="reference", batch_size=1, samples=3, seq_len=32, seed=0)  # fmt: skip
    some = [t for t in s.targets if t.path.endswith(("embed_tokens", "layers.1.mlp.down_proj"))]
    assert_close(
        {p: by_path(doc)[p] for p in (t.path for t in some)}, reference_kl(s.model, s.tokens, some, s.cands)
    )


def test_reports_and_bad_input(tmp_path):
    doc = run_sens(FIXTURE, tmp_path / "out", tmp_path / "w", samples=2, seq_len=32, bits=[8])
    csv_lines = (tmp_path / "out" / "sensitivity.csv").read_text().splitlines()
    assert csv_lines[0].startswith("path,group") and len(csv_lines) == 1 + len(doc["layers"])
    assert (tmp_path / "out" / "sensitivity.png").read_bytes()[:4] == b"\x89PNG"
    on_disk = json.loads((tmp_path / "out" / "sensitivity.json").read_text())
    assert (
        on_disk["version"] == 1 and on_disk["calibration"]["fingerprint"] and on_disk["model"]["fingerprint"]
    )
    assert (
        on_disk["layers"][0]["params"]
        == on_disk["layers"][0]["in_features"] * on_disk["layers"][0]["out_features"]
    )
    with pytest.raises(InputError, match="sensitivity.bits"):
        run_sens(FIXTURE, tmp_path / "x", tmp_path / "w", bits=[7])
    assert not (tmp_path / "x").exists()


# ------------------------------------------------------------------ CLI


def test_cli_run_and_merge(tmp_path):
    from cli_util import run_cli

    args = [
        f"model.name={FIXTURE}",
        "sensitivity.bits=[8]",
        "sensitivity.calib.samples=2",
        "sensitivity.calib.seq_len=32",
    ]
    proc = run_cli("command=sensitivity", *args, tmp=tmp_path)
    assert proc.returncode == 0, proc.stderr
    run = sorted((tmp_path / "outputs" / "sensitivity").glob("*/sensitivity.json"))[-1].parent
    manifest = json.loads((run / "manifest.json").read_text())
    assert (
        manifest["status"] == "ok" and {"sensitivity.json", "sensitivity.png"} <= manifest["outputs"].keys()
    )
    assert manifest["blas"]["loaded"] == (manifest["blas"]["library"] is not None)
    proc = run_cli("command=sensitivity_merge", f"sensitivity.inputs=[{run}]", tmp=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = sorted((tmp_path / "outputs" / "sensitivity_merge").glob("*/sensitivity.json"))[-1]
    assert out.read_bytes() == (run / "sensitivity.json").read_bytes()
    bad = run_cli(
        "command=sensitivity",
        f"model.name={FIXTURE}",
        "sensitivity.shard=2",
        "sensitivity.num_shards=2",
        tmp=tmp_path,
    )
    assert bad.returncode == 2 and "sensitivity.shard=2" in bad.stderr


@pytest.mark.slow
def test_sigkill_then_resume(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    from cli_util import REPO as ROOT
    from cli_util import isolated_args

    args = ["command=sensitivity", f"model.name={FIXTURE}", "sensitivity.bits=[3,4,8]", "sensitivity.batch_size=2",
            "sensitivity.method=exact",
            "sensitivity.calib.samples=4", "sensitivity.calib.seq_len=64", *isolated_args(tmp_path)]  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "mlxbun", *args], cwd=ROOT, stderr=subprocess.PIPE)
    groups = tmp_path / "cache" / "sensitivity"
    deadline = time.monotonic() + 300
    while not list(groups.glob("*/groups/*.json")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done = len(list(groups.glob("*/groups/*.json")))
    assert 1 <= done < 4, "kill landed after the run finished; make the run longer"
    again = subprocess.run([sys.executable, "-m", "mlxbun", *args], cwd=ROOT, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    assert f"({done} groups resumed)" in again.stdout


def test_fake_quant_in_row_slices_gives_the_same_values(monkeypatch):
    """A large weight is fake-quantized in slices of rows (bounded temporaries): same values."""
    w = mx.random.normal((48, 256), key=mx.random.key(3)).astype(mx.bfloat16)
    for cand in (QuantSpec(bits=3, group_size=64), QuantSpec(bits=4, group_size=32, mode="mxfp4")):
        whole = np.array(probe.fake_quant(w, cand, dtype="bfloat16"))
        monkeypatch.setattr(rounding, "CHUNK", 5 * 256)  # 5 rows per slice: 10 slices, one short
        sliced = np.array(probe.fake_quant(w, cand, dtype="bfloat16"))
        monkeypatch.undo()
        assert sliced.dtype == np.float32 and np.array_equal(whole, sliced), cand


def test_a_head_swapped_in_whole_is_fake_quantized_in_its_own_dtype(monkeypatch):
    """fake_quant(out=bfloat16) gives the float32 result's values in bfloat16 slice by slice, so a
    swapped-in embedding never exists in float32 (its float32 slices and their concatenation were
    most of the sensitivity's peak at a 150K vocabulary)."""
    w = mx.random.normal((8192, 256), key=mx.random.key(5)).astype(mx.bfloat16)
    mx.eval(w)
    monkeypatch.setattr(rounding, "CHUNK", 128 * 256)  # 64 slices
    peaks, got = [], []
    for out in (mx.float32, mx.bfloat16):
        mx.clear_cache()
        mx.reset_peak_memory()
        held = mx.get_active_memory()
        got.append(probe.fake_quant(w, QuantSpec(bits=5, group_size=64), dtype="bfloat16", out_dtype=out))
        mx.eval(got[-1])
        peaks.append(mx.get_peak_memory() - held)
    assert got[1].dtype == mx.bfloat16 and mx.array_equal(got[1], got[0].astype(mx.bfloat16)).item()
    assert peaks[1] < 0.75 * got[0].nbytes, peaks  # the bfloat16 result and a slice: no float32 whole


def test_written_gives_a_rounding_in_the_dtype_asked_fresh_and_read_back(tmp_path):
    """Written (the probes' weights as quantize writes them) in bfloat16 on request: GPTQ rounded
    here, then read back from the rounded cache, both the float32 result's values (a read-back
    once took the cached arrays for the dtype and failed the 0.5B recipe's probes)."""
    from mlxbun.quant.quantize.cache import Rounded

    rng = np.random.default_rng(0)
    w = mx.array(rng.standard_normal((64, 128)).astype(np.float32))
    x = rng.standard_normal((256, 128)).astype(np.float32)
    hessians = {"m": x.T @ x}
    spec = QuantSpec(bits=4, group_size=64, method="gptq")
    written = probe.Written(
        dtype="bfloat16", dtypes={}, hessians=hessians, rounded=Rounded(tmp_path, "0" * 64)
    )
    f32 = written("m", w, spec)
    fresh = written("m", w, spec, out_dtype=mx.bfloat16)
    again = written("m", w, spec, out_dtype=mx.bfloat16)  # from the cache
    assert written.rounded.hits >= 1
    for got in (fresh, again):
        assert got.dtype == mx.bfloat16 and mx.array_equal(got, f32.astype(mx.bfloat16)).item()


@pytest.mark.parametrize("method", ["rtn", "clip"])
def test_a_probed_head_is_swapped_in_as_codes(tmp_path, monkeypatch, method):
    """A probe that rounds a tied head swaps its codes in, the values made a slice of vocabulary
    at a time beside the stored weight: the same KL as the rounded weight swapped in whole, and
    no second copy of the head (Gemma-3-27B's tied head: 2.8 GB in bfloat16 beside the stored
    one, the probes' peak at its width)."""
    from mlxbun.quant import streamed
    from mlxbun.quant.sensitivity import variants

    stream = streamed.Stream(FIXTURE)
    head = stream.embedding_path
    ref = variants.Reference.capture(stream, np.arange(16).reshape(2, 8))
    ref.logits = None  # the reference's logits made a slice at a time too, as at a large vocabulary
    spec = QuantSpec(bits=4, group_size=64, method=method)
    from mlxbun.quant.quantize.cache import Rounded

    fake = probe.Written(dtype="bfloat16", dtypes={}, rounded=Rounded(tmp_path, "0" * 64))

    def whole(
        path: str, w: mx.array, s: QuantSpec, out_dtype: Any = mx.float32, codes: bool = False
    ) -> mx.array:
        return fake(path, w, s, out_dtype=out_dtype)  # the rounded weight made whole

    want = variants.measure(stream, ref, [{head: spec}], fake=whole)[0]
    stored = stream.weight(head).nbytes
    monkeypatch.setattr(streamed, "HEAD_CHUNK_BYTES", stored // 16)  # 8 slices of float32
    monkeypatch.setattr(rounding, "CHUNK", stored // 16)  # rtn's codes made in 8 slices too
    # (clip's rounding is read back from the cache, as quantize's blocks of rows are at scale)
    mx.clear_cache()
    mx.reset_peak_memory()
    held = mx.get_active_memory()
    variants._head_kl(stream, ref, ref.final, {head: spec}, fake)
    peak = mx.get_peak_memory() - held
    got = variants.measure(stream, ref, [{head: spec}], fake=fake)[0]
    assert got == pytest.approx(want, rel=1e-5) and got > 0  # slices sum in another order
    assert peak < stored, peak / stored  # codes, slices and logits; whole: above 2x (the copy, its slices)


def test_a_probed_embeddings_codes_are_not_held_through_the_blocks(monkeypatch):
    """The lookups' rounded embedding is let go once its lookups are made: the blocks run with
    the same memory as for a probe of a block's module (the codes were held to the end: 1.4 GB
    of 8-bit codes at Gemma-3-27B's vocabulary, through the Fisher pass's blocks and heads)."""
    from mlxbun.quant import streamed
    from mlxbun.quant.sensitivity import variants

    stream = streamed.Stream(FIXTURE)
    ref = variants.Reference.capture(stream, np.arange(16).reshape(2, 8))
    spec = QuantSpec(bits=8, group_size=64)
    fake = probe.Written(dtype="bfloat16", dtypes={})
    run, seen = stream.run, []

    def recording(i: int, h: mx.array) -> mx.array:
        if i == stream.n_blocks - 1:  # a block neither probe changes
            seen.append(mx.get_active_memory())
        return run(i, h)

    monkeypatch.setattr(stream, "run", recording)
    held = []
    for v in ({f"{stream.prefix}0.mlp.up_proj": spec}, {stream.embedding_path: spec}):
        mx.clear_cache()
        seen.clear()
        variants.measure(stream, ref, [v], fake=fake)
        held.append(seen[0])
    codes = stream.weight(stream.embedding_path).nbytes // 2  # 8 bits of a bfloat16 matrix
    assert held[1] - held[0] < codes / 2, (held, codes)


def test_merge_names_a_shard_written_before_a_setting_was_recorded():
    new = {"kind": "x", "batch_size": 8, "estimator": 5}
    old = {"kind": "x", "estimator": 5}
    with pytest.raises(InputError, match=r"'old' does not record it .*'batch_size'.*; rerun that shard"):
        combine_shards([new, old], ["new", "old"])
    with pytest.raises(InputError, match=r"in 'batch_size'; merge only shards of one sweep"):
        combine_shards([new, {**new, "batch_size": 4}], ["new", "other"])


def test_a_quantized_model_loads_dequantized_one_slice_at_a_time(tmp_path, monkeypatch):
    """The float32 model a quantized source gives is mlx-lm's dequantize_model's, value for value,
    for affine and microscaling modules; its peak stays near one float32 copy (all weights
    dequantized in one evaluation held two: bf16 and float32 copies and their temporaries)."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import dequantize_model, load

    def predicate(path: str, module: Any) -> Any:
        if path.endswith("mlp.up_proj"):
            return {"group_size": 32, "bits": 4, "mode": "mxfp4"}
        return {"group_size": 64, "bits": 3 if "self_attn" in path else 4, "mode": "affine"}

    qdir = quantized_fixture(tmp_path / "mixed", 4, predicate)
    monkeypatch.setattr(rounding, "CHUNK", 4096)
    mx.clear_cache()
    mx.reset_peak_memory()
    model = probe.load_model(qdir)[0]
    peak = mx.get_peak_memory()
    ours = dict(tree_flatten(model.parameters()))
    f32 = sum(v.nbytes for v in ours.values())
    theirs, _ = load(str(qdir))
    theirs = dequantize_model(theirs)
    theirs.set_dtype(mx.float32)
    theirs = dict(tree_flatten(theirs.parameters()))
    assert ours.keys() == theirs.keys()
    assert all(ours[k].dtype == mx.float32 and mx.array_equal(ours[k], theirs[k]).item() for k in ours)
    assert peak < 1.4 * f32, (peak, f32)


def test_a_streamed_quantized_source_reads_a_large_embedding_in_slices(tmp_path, monkeypatch):
    """Stream dequantizes a quantized embedding (5 bits, the size a plan gives a 150K vocabulary's)
    in slices of rows: the same float32 values, and the peak near one float32 copy (whole, mlx's
    5-bit dequantize held ~6x the embedding's float32 size in temporaries: 3.2 GB at Qwen2.5-0.5B)."""
    from mlxbun.quant.streamed import Stream

    def predicate(path: str, module: Any) -> Any:
        return {"group_size": 64, "bits": 5 if path.endswith("embed_tokens") else 4, "mode": "affine"}

    qdir = quantized_fixture(tmp_path / "q", 4, predicate)
    want = {}
    for exact in (False, True):
        monkeypatch.setattr(rounding, "CHUNK", 1 << 30)  # whole: one slice
        mx.clear_cache()
        want[exact] = np.array(Stream(qdir, exact=exact).read("model.embed_tokens.weight"))
    f32 = want[True].nbytes
    monkeypatch.setattr(rounding, "CHUNK", f32 // 4 // 16)  # 16 slices
    for exact in (False, True):
        s = Stream(qdir, exact=exact)
        mx.clear_cache()
        mx.reset_peak_memory()
        held = mx.get_active_memory()
        got = s.read("model.embed_tokens.weight")
        peak = mx.get_peak_memory() - held  # whole: 7x f32
        assert got.dtype == mx.float32 and np.array_equal(np.array(got), want[exact])
        assert peak < 3 * f32, (exact, peak, f32)


def test_an_exact_stream_keeps_a_quantized_embedding_packed(tmp_path):
    """Tune's quantized model (an exact stream) keeps its quantized embedding and head packed and
    takes float32 rows only where used: the same lookups and logits as the whole float32 matrix,
    and the model holds no float32 copy of it (at Gemma-3-27B's vocabulary, 5.6 GB)."""
    from mlxbun.quant.streamed import Dequantized, Stream

    def predicate(path: str, module: Any) -> Any:
        return {
            "group_size": 64,
            "bits": 5 if path.endswith(("embed_tokens", "lm_head")) else 4,
            "mode": "affine",
        }

    qdir = quantized_fixture(tmp_path / "q", 4, predicate)
    s = Stream(qdir, exact=True)
    paths = {s.embedding_path, *s.head_paths}
    assert all(isinstance(s.weight(p), Dequantized) for p in paths)
    held = sum(v.nbytes for p in paths for _, v in tree_flatten(s._base(p).parameters()))
    whole = {p: s.read(f"{p}.weight") for p in paths}
    assert held < 0.5 * sum(w.nbytes for w in whole.values())
    tokens = np.array([[1, 5, 9, 300, 2]])
    emb = whole[s.embedding_path]
    assert np.array_equal(np.array(s.embed(tokens)), np.array(emb[mx.array(tokens)]))
    h = s.embed(tokens)
    got = s.head(h)
    head = whole[s.head_paths[0]]
    norm = s.model.model.norm
    want = norm(h) @ head.T
    assert np.allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)


def test_the_head_casts_one_slice_of_its_vocabulary_at_a_time(monkeypatch):
    """chunked_matmul's logits equal x @ w.T in float32, and only one slice of the bfloat16
    head is in float32 at a time (made as one graph, every slice's cast was alive at once)."""
    from mlxbun.quant import streamed

    w = mx.random.normal((16384, 256), key=mx.random.key(1)).astype(mx.bfloat16)
    x = mx.random.normal((1, 4, 256), key=mx.random.key(2))
    mx.eval(w, x)
    want = np.array(x @ w.astype(mx.float32).T)
    monkeypatch.setattr(streamed, "HEAD_CHUNK_BYTES", 1024 * 256 * 4)  # 16 slices of 1,024 rows
    mx.clear_cache()
    mx.reset_peak_memory()
    held = mx.get_active_memory()
    got = streamed.chunked_matmul(x, w)
    mx.eval(got)
    peak = mx.get_peak_memory() - held
    f32 = w.size * 4
    assert np.allclose(np.array(got), want, rtol=1e-5, atol=1e-5)
    assert peak < 0.35 * f32, peak / f32  # one slice (1/16) and the logits; whole: f32 and more


@pytest.mark.parametrize("scale", [1e-1, 1e-2, 1e-3])
def test_the_streamed_kl_keeps_its_digits_on_the_host_and_on_the_device(scale):
    """The streamed KL (float32) runs in numpy on MLX's CPU backend and in MLX on a GPU: both
    agree with float64 to float32 precision, down to KLs of ~1e-7."""
    from mlxbun import kl

    rng = np.random.default_rng(1)
    ref = rng.normal(size=(1, 6, 4096)).astype(np.float32) * 3
    cur = ref + rng.normal(size=ref.shape).astype(np.float32) * scale
    z, y = ref.astype(np.float64), cur.astype(np.float64)
    logp = z - z.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    logq = y - y.max(-1, keepdims=True)
    logq -= np.log(np.exp(logq).sum(-1, keepdims=True))
    want = (np.exp(logp) * (logp - logq)).sum(-1)
    host = kl._kl_rows_host(ref.copy(), cur.copy())
    device = np.array(kl._kl_rows_device(mx.array(ref), mx.array(cur)))
    chosen = np.array(kl.kl_logits(mx.array(ref), mx.array(cur)))
    for got in (host, device, chosen):
        assert got.shape == want.shape and np.allclose(got, want, rtol=5e-3, atol=0), (got, want)


def test_a_large_weights_fake_quant_is_made_in_place_a_slice_at_a_time(monkeypatch) -> None:
    """A tied embedding's group swapped in at a candidate (the Fisher pass's whole-model KLs) is
    made a slice of rows at a time into one array of its dtype: memory is that array and a slice,
    not the slices and their concatenation (at a 262,144-word vocabulary, 2.8 GB more)."""
    from mlxbun.quant.probe import fake_quant
    from mlxbun.quant.spec import QuantSpec

    w = mx.random.normal((4096, 512), key=mx.random.key(0)).astype(mx.bfloat16)
    spec = QuantSpec(bits=4, group_size=64)
    monkeypatch.setattr(rounding, "CHUNK", 1 << 30)
    whole = fake_quant(w, spec, dtype="bfloat16", out_dtype=mx.bfloat16)
    mx.eval(whole)
    monkeypatch.setattr(rounding, "CHUNK", w.size // 32)  # 32 slices
    mx.clear_cache()
    held = mx.get_active_memory()
    mx.reset_peak_memory()
    got = fake_quant(w, spec, dtype="bfloat16", out_dtype=mx.bfloat16)
    mx.eval(got)
    peak = mx.get_peak_memory() - held
    assert mx.array_equal(got, whole).item()
    assert peak < 1.5 * got.nbytes, (peak, got.nbytes)
