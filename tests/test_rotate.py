"""The R1 fold: exact Hadamard constructions, logits unchanged per family, the record, refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from cli_util import run_cli
from safetensors.numpy import load_file, save_file

from mlxbun.errors import DriftError, InputError
from mlxbun.kl import kl
from mlxbun.rotate import command as rotate
from mlxbun.rotate import fold as rotate_fold
from mlxbun.rotate import hadamard
from mlxbun.rotate.command import FoldRecord, read_fold_record, rotate_model_dir
from mlxbun.rotate.fold import Rotation

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma3_text"]


def logits(path: Path, tokens: np.ndarray) -> np.ndarray:
    """Logits through mlx-lm's public loader (model + tokenizer), as float64 numpy."""
    from mlx_lm import load

    model, _ = load(str(path))
    out = model(mx.array(tokens)[None])[0].astype(mx.float32)
    mx.eval(out)
    return np.asarray(out, dtype=np.float64)


def tokens(n: int = 48, vocab: int = 512) -> np.ndarray:
    return np.random.default_rng(7).integers(0, vocab, size=n)


def edit_weights(path: Path, fn) -> None:
    """Rewrite model.safetensors of a (copied) model dir through ``fn(dict of numpy arrays)``."""
    w = load_file(path / "model.safetensors")
    fn(w)
    save_file(w, str(path / "model.safetensors"), metadata={"format": "pt"})


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ---------------------------------------------------------------------------- Hadamard


@pytest.mark.parametrize("n", [1, 2, 8, 12, 20, 28, 36, 60, 84, 96, 1152])
def test_constructions_are_hadamard_and_fast_transform_matches_dense(n):
    spec = hadamard.plan(n)
    h = hadamard.dense(spec)
    assert set(np.unique(h)) <= {-1.0, 1.0}
    np.testing.assert_array_equal(h @ h.T, n * np.eye(n))
    x = np.random.default_rng(0).standard_normal((5, n))
    np.testing.assert_allclose(hadamard.apply_rows(x, spec), x @ h, atol=1e-9)
    np.testing.assert_allclose(hadamard.apply_rows(x, spec, transpose=True), x @ h.T, atol=1e-9)


@pytest.mark.parametrize("n", [16, 256, 1024])
def test_sylvester_matches_mlx_hadamard_transform(n):
    x = np.random.default_rng(1).standard_normal((3, n)).astype(np.float32)
    ref = np.asarray(mx.hadamard_transform(mx.array(x), scale=1.0))
    got = hadamard.apply_rows(x.astype(np.float64), hadamard.plan(n))
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-3)


def test_real_model_sizes_mlx_cannot_do_are_built():
    # Gemma 2/3 hidden sizes for which mx.hadamard_transform returns garbage (FINDINGS.md).
    got = {n: hadamard.plan(n).describe() for n in (1152, 2304, 3840, 4608, 5376)}
    assert got[5376] == "paley1(q=83, order 84) ⊗ sylvester(2^6)"
    assert got[1152] == "paley2(q=17, order 36) ⊗ sylvester(2^5)"
    assert got[3840] == "paley1(q=59, order 60) ⊗ sylvester(2^6)"


@pytest.mark.parametrize("n", [0, 6, 10, 100, 184])
def test_unsupported_sizes_are_refused_naming_the_size(n):
    with pytest.raises(InputError, match=rf"hidden_size={n} has no Hadamard construction.*12, 20, 28"):
        hadamard.plan(n)


def test_spec_from_dict_rejects_unbuildable_constructions():
    spec = hadamard.plan(96)
    assert hadamard.HadamardSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(InputError, match="not a construction"):
        hadamard.HadamardSpec.from_dict({**spec.to_dict(), "q": 13})


def test_rotation_is_orthogonal_and_signs_are_pinned():
    r = Rotation.build(seed=0, n=96)
    eye = np.eye(96)
    np.testing.assert_allclose(r.rows_t(r.rows(eye)), eye, atol=1e-12)
    np.testing.assert_allclose(r.rows(eye) @ r.rows(eye).T, eye, atol=1e-12)

    def pattern(seed):
        return "".join("+" if v > 0 else "-" for v in rotate_fold.signs(seed, 32))

    # SHAKE-256 signs do not depend on numpy's RNG: same seed, same signs, on any machine.
    assert pattern(0) == "--++-+-++++--+++++++++-----+-+-+"
    assert pattern(1) == "+----+-+-+---+--+++---+++-++++--"


# ---------------------------------------------------------------------------- the fold, per family


def gemma_with_uniform_post_norms(tiny_model, dst: Path) -> Path:
    """A gemma3_text model with jittered pre-norms and uniform (but not unit) post-norms."""
    model = copy_model(tiny_model("gemma3_text", dtype="float32", norm_jitter=0.3), dst)

    def uniform(w):
        for name in w:
            if "post_attention_layernorm" in name or "post_feedforward_layernorm" in name:
                w[name] = np.full_like(w[name], 0.25)

    edit_weights(model, uniform)
    return model


def family_source(tiny_model, tmp_path: Path, arch: str) -> Path:
    if arch == "gemma3_text":
        return gemma_with_uniform_post_norms(tiny_model, tmp_path / "src")
    return tiny_model(arch, dtype="float32", norm_jitter=0.3)


@pytest.mark.parametrize("arch", FAMILIES)
def test_rotated_logits_match_the_source_in_float32(tiny_model, tmp_path, arch):
    src = family_source(tiny_model, tmp_path, arch)
    res = rotate_model_dir(src, tmp_path / "rot", seed=3)
    ref, got = logits(src, tokens()), logits(res.out, tokens())
    assert np.max(np.abs(ref - got)) <= 1e-4 * np.std(ref)
    assert res.verify is not None and res.verify.ok and res.verify.forward == "float64"
    # The weights really moved, and every folded norm is now unit gain.
    before, after = load_file(src / "model.safetensors"), load_file(res.out / "model.safetensors")
    assert np.abs(before["model.embed_tokens.weight"] - after["model.embed_tokens.weight"]).max() > 0.05
    unit = 0.0 if arch == "gemma3_text" else 1.0
    assert np.all(after["model.norm.weight"] == unit)
    assert np.all(after["model.layers.1.input_layernorm.weight"] == unit)
    if arch == "gemma3_text":  # post-norms pass through untouched
        assert np.all(after["model.layers.0.post_feedforward_layernorm.weight"] == 0.25)
    if arch in ("qwen3", "gemma3_text"):  # per-head q/k norms act on head_dim, not the residual stream
        name = "model.layers.0.self_attn.q_norm.weight"
        np.testing.assert_array_equal(before[name], after[name])


def test_o_proj_and_down_proj_biases_are_rotated(tiny_model, tmp_path):
    # Every projection gets a bias: q/k/v/gate/up ones stay, o_proj/down_proj ones rotate.
    src = copy_model(tiny_model("llama", dtype="float32", norm_jitter=0.3), tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "attention_bias": True, "mlp_bias": True}))
    rng = np.random.default_rng(0)

    def add_biases(w):
        for name in list(w):
            if name.endswith("_proj.weight"):
                w[name.replace(".weight", ".bias")] = rng.normal(0, 0.1, w[name].shape[0]).astype(np.float32)

    edit_weights(src, add_biases)
    res = rotate_model_dir(src, tmp_path / "rot", seed=0)
    ref, got = logits(src, tokens()), logits(res.out, tokens())
    assert np.max(np.abs(ref - got)) <= 1e-4 * np.std(ref)


def test_each_folded_tensor_is_written_as_it_comes(tiny_model, tmp_path, nothing_pending):
    """No shard is held: after every add the writer has nothing pending."""
    from mlxbun.rotate import command as rotate

    nothing_pending(rotate)
    src = tiny_model("llama")
    res = rotate_model_dir(src, tmp_path / "rot", seed=0, verify=False, shard_bytes=1 << 40)
    assert [p.name for p in res.out.glob("model*.safetensors")] == ["model.safetensors"]


def test_rotation_spreads_planted_outlier_channels(tiny_model, tmp_path):
    src = tiny_model("llama", dtype="float32", outlier_channels=2, outlier_scale=20.0)
    res = rotate_model_dir(src, tmp_path / "rot", seed=0, verify=False)

    def peak_to_median(path):
        col = np.linalg.norm(load_file(path / "model.safetensors")["model.embed_tokens.weight"], axis=0)
        return col.max() / np.median(col)

    assert peak_to_median(src) > 10
    assert peak_to_median(res.out) < 2


def test_bfloat16_fold_stays_close_and_out_dtype_is_honoured(tiny_model, tmp_path):
    src = tiny_model("qwen3", dtype="bfloat16", norm_jitter=0.3)
    res = rotate_model_dir(src, tmp_path / "bf16", seed=0)
    assert res.verify.ok and res.verify.kl < 1e-2
    assert {v.dtype for v in load_file_mx(res.out).values()} == {mx.bfloat16}
    res32 = rotate_model_dir(src, tmp_path / "f32", seed=0, dtype="float32")
    assert {v.dtype for v in load_file_mx(res32.out).values()} == {mx.float32}
    assert res32.verify.kl < res.verify.kl  # not re-rounded to bf16


def load_file_mx(path: Path) -> dict:
    return mx.load(str(path / "model.safetensors"))


# ---------------------------------------------------------------------------- tied and untied heads


def test_tied_head_with_a_final_gain_is_untied(tiny_model, tmp_path):
    src = tiny_model("llama", dtype="float32", norm_jitter=0.3, tie_embeddings=True)
    assert "lm_head.weight" not in load_file(src / "model.safetensors")
    res = rotate_model_dir(src, tmp_path / "rot", seed=0)
    weights = load_file(res.out / "model.safetensors")
    assert "lm_head.weight" in weights
    assert json.loads((res.out / "config.json").read_text())["tie_word_embeddings"] is False
    assert res.record.untied
    gain = load_file(src / "model.safetensors")["model.norm.weight"]
    np.testing.assert_allclose(res.record.final_gain, gain.astype(np.float64))
    # lm_head = embedding · diag(g) · R1, computed independently with the dense matrix.
    emb = load_file(src / "model.safetensors")["model.embed_tokens.weight"].astype(np.float64)
    r1 = np.diag(rotate_fold.signs(0, 64)) @ hadamard.dense(hadamard.plan(64)) / 8.0
    np.testing.assert_allclose(weights["lm_head.weight"], emb @ np.diag(gain) @ r1, atol=1e-5)


def test_tied_head_with_unit_final_gain_stays_tied(tiny_model, tmp_path):
    src = tiny_model("qwen2", dtype="float32", tie_embeddings=True)
    res = rotate_model_dir(src, tmp_path / "rot", seed=0)
    assert "lm_head.weight" not in load_file(res.out / "model.safetensors")
    assert not res.record.untied and set(res.record.final_gain) == {1.0}
    ref, got = logits(src, tokens()), logits(res.out, tokens())
    assert np.max(np.abs(ref - got)) <= 1e-4 * np.std(ref)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_untied_source_head_is_rotated(tiny_model, tmp_path, arch):
    src = tiny_model(arch, dtype="float32", tie_embeddings=False)
    res = rotate_model_dir(src, tmp_path / "rot", seed=5)
    assert not res.record.untied
    before, after = load_file(src / "model.safetensors"), load_file(res.out / "model.safetensors")
    assert before["lm_head.weight"].shape == after["lm_head.weight"].shape
    assert np.abs(before["lm_head.weight"] - after["lm_head.weight"]).max() > 0.05
    ref, got = logits(src, tokens()), logits(res.out, tokens())
    assert np.max(np.abs(ref - got)) <= 1e-4 * np.std(ref)


# ---------------------------------------------------------------------------- the record


def test_record_round_trips_and_describes_the_fold(tiny_model, tmp_path):
    src = tiny_model("llama", dtype="float32", norm_jitter=0.3)
    res = rotate_model_dir(src, tmp_path / "rot", seed=11, verify=False)
    on_disk = json.loads((res.out / rotate.RECORD).read_text())
    assert on_disk["version"] == rotate.FORMAT_VERSION and on_disk["seed"] == 11
    assert on_disk["hidden_size"] == 64 and on_disk["hadamard"]["base"] == "sylvester"
    assert len(on_disk["final_gain"]) == 64 and on_disk["model_type"] == "llama"
    assert len(on_disk["source"]["sha256"]) == 64 and on_disk["source"]["tensors"] > 0
    record = read_fold_record(res.out)
    assert record == res.record == FoldRecord.from_dict(record.to_dict())
    record.write(tmp_path / "again.json")
    assert (tmp_path / "again.json").read_bytes() == (res.out / rotate.RECORD).read_bytes()
    # The record rebuilds the same R1 that was applied.
    emb = load_file(src / "model.safetensors")["model.embed_tokens.weight"].astype(np.float64)
    rotated = load_file(res.out / "model.safetensors")["model.embed_tokens.weight"]
    np.testing.assert_allclose(record.rotation().rows(emb), rotated, atol=1e-5)


def test_unknown_keys_are_ignored_and_unknown_versions_refused(tmp_path):
    d = {"version": 2, "seed": 1, "hidden_size": 8, "final_gain": [1.0] * 8, "future": {"x": 1}}
    assert FoldRecord.from_dict(d).hadamard == hadamard.plan(8).to_dict()
    with pytest.raises(InputError, match="version=9 is unknown"):
        FoldRecord.from_dict({**d, "version": 9})
    with pytest.raises(InputError, match="final_gain has 3 entries"):
        FoldRecord.from_dict({**d, "final_gain": [1.0] * 3})
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(InputError, match="not a readable"):
        read_fold_record(tmp_path / "bad.json")


def as_version_1(model: Path) -> None:
    """Rewrite the record as the old format: no final_gain (and no later fields)."""
    d = json.loads((model / rotate.RECORD).read_text())
    old = {k: d[k] for k in ("seed", "hidden_size")} | {"version": 1}
    (model / rotate.RECORD).write_text(json.dumps(old))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_old_record_recovers_final_gain_from_an_untied_tied_head(tiny_model, tmp_path, dtype):
    src = tiny_model("llama", dtype=dtype, norm_jitter=0.3, tie_embeddings=True)
    res = rotate_model_dir(src, tmp_path / "rot", seed=4, verify=False)
    as_version_1(res.out)
    assert FoldRecord.read(res.out / rotate.RECORD).final_gain is None
    record = read_fold_record(res.out)
    assert record.version == rotate.FORMAT_VERSION
    tol = 1e-6 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(record.final_gain, res.record.final_gain, rtol=tol)


def test_old_record_without_recoverable_gain_is_refused(tiny_model, tmp_path):
    untied = rotate_model_dir(
        tiny_model("llama", dtype="float32", tie_embeddings=False), tmp_path / "u", verify=False
    )
    as_version_1(untied.out)
    with pytest.raises(InputError, match="not recoverable"):
        read_fold_record(untied.out)
    tied = rotate_model_dir(
        tiny_model("llama", dtype="float32", tie_embeddings=True), tmp_path / "t", verify=False
    )
    as_version_1(tied.out)
    with pytest.raises(InputError, match="no separate lm_head.weight"):
        read_fold_record(tied.out / rotate.RECORD)


def test_same_seed_same_bytes_other_seed_other_weights(tiny_model, tmp_path):
    src = tiny_model("qwen3", dtype="bfloat16", norm_jitter=0.3)
    a = rotate_model_dir(src, tmp_path / "a", seed=1, shard_bytes=40_000, verify=False)
    b = rotate_model_dir(src, tmp_path / "b", seed=1, shard_bytes=40_000, verify=False)
    c = rotate_model_dir(src, tmp_path / "c", seed=2, shard_bytes=40_000, verify=False)
    files = sorted(p.name for p in a.out.iterdir())
    assert len([f for f in files if f.startswith("model-")]) > 1
    assert files == sorted(p.name for p in b.out.iterdir())
    for f in files:
        assert (a.out / f).read_bytes() == (b.out / f).read_bytes(), f
    first = next(f for f in files if f.startswith("model-00001-of-"))
    assert (a.out / first).read_bytes() != (c.out / first).read_bytes()


# ---------------------------------------------------------------------------- refusals


def test_gemma_non_uniform_post_norm_is_refused_with_the_reason(tiny_model, tmp_path):
    src = tiny_model("gemma3_text", dtype="float32", norm_jitter=0.3)
    with pytest.raises(
        InputError, match=r"post_attention_layernorm.weight has a non-uniform gain.*residual add"
    ):
        rotate_model_dir(src, tmp_path / "rot")
    assert not (tmp_path / "rot").exists() and not list(tmp_path.glob(".rot*"))


def test_bad_sources_are_refused_before_anything_is_written(tiny_model, tmp_path):
    base = tiny_model("llama", dtype="float32")
    cases = {}
    phi = copy_model(base, tmp_path / "phi")
    (phi / "config.json").write_text(
        json.dumps({**json.loads((phi / "config.json").read_text()), "model_type": "phi3"})
    )
    cases[phi] = r"model_type='phi3' is not supported by rotate; choose one of llama, mistral, qwen2, qwen3"
    extra = copy_model(base, tmp_path / "extra")
    edit_weights(
        extra, lambda w: w.__setitem__("model.layers.0.mlp.experts.weight", np.zeros((2, 64), np.float32))
    )
    cases[extra] = r"tensor 'model.layers.0.mlp.experts.weight' is not part of a llama checkpoint"
    ints = copy_model(base, tmp_path / "ints")
    edit_weights(ints, lambda w: w.__setitem__("model.norm.weight", np.ones(64, np.int32)))
    cases[ints] = r"tensor 'model.norm.weight' is I32; rotate reads BF16, F16, F32"
    for src, message in cases.items():
        with pytest.raises(InputError, match=message):
            rotate_model_dir(src, tmp_path / f"{src.name}-rot")
        assert not (tmp_path / f"{src.name}-rot").exists()


def test_unsupported_hidden_size_is_refused(tiny_model, tmp_path):
    src = tiny_model("llama", dtype="float32", hidden_size=100, num_heads=4, head_dim=16)
    with pytest.raises(
        InputError, match=r"hidden_size=100 has no Hadamard construction here; supported: n = m·2\^k"
    ):
        rotate_model_dir(src, tmp_path / "rot")


def test_existing_output_quantized_and_rotated_sources_are_refused(tiny_model, tmp_path):
    src = tiny_model("llama", dtype="float32")
    (tmp_path / "taken").mkdir()
    with pytest.raises(InputError, match="already exists"):
        rotate_model_dir(src, tmp_path / "taken")
    with pytest.raises(InputError, match="fold.dtype='int8' is not allowed"):
        rotate_model_dir(src, tmp_path / "x", dtype="int8")
    res = rotate_model_dir(src, tmp_path / "rot", verify=False)
    with pytest.raises(InputError, match="is a rotated model; rotate its source"):
        rotate_model_dir(res.out, tmp_path / "twice")
    from mlxbun.quant.quantize.command import quantize_model_dir

    q = quantize_model_dir(src, tmp_path / "q4", bits=4, group_size=32)
    with pytest.raises(InputError, match="is quantized; rotate needs an unquantized"):
        rotate_model_dir(q.out, tmp_path / "qrot")


def test_a_wrong_fold_is_caught_by_verify_and_nothing_is_published(tiny_model, tmp_path, monkeypatch):
    src = tiny_model("llama", dtype="float32", norm_jitter=0.3)
    real = rotate.fold_tensor

    def forget_one_norm(a, role, gain, rot, **kw):
        return real(a, role, None if role == "in" and a.shape[0] == 128 else gain, rot, **kw)

    monkeypatch.setattr(rotate, "fold_tensor", forget_one_norm)
    with pytest.raises(DriftError, match="rotated model differs"):
        rotate_model_dir(src, tmp_path / "rot")
    assert not (tmp_path / "rot").exists() and not list(tmp_path.glob(".rot*"))


def test_interrupted_run_resumes_to_the_same_bytes(tiny_model, tmp_path, monkeypatch):
    src = tiny_model("mistral", dtype="bfloat16", norm_jitter=0.3)
    clean = rotate_model_dir(src, tmp_path / "clean", seed=9, shard_bytes=40_000, verify=False)
    real, calls = rotate.fold_tensor, []

    def crash_late(*args, **kw):
        calls.append(1)
        if len(calls) == 15:
            raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(rotate, "fold_tensor", crash_late)
    with pytest.raises(KeyboardInterrupt):
        rotate_model_dir(src, tmp_path / "out", seed=9, shard_bytes=40_000, verify=False)
    (partial,) = tmp_path.glob(".out.partial-*[!k]")
    assert not (tmp_path / "out").exists() and list(partial.glob(".mlxbun-shard-*"))
    calls.clear()
    monkeypatch.setattr(rotate, "fold_tensor", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    resumed = rotate_model_dir(src, tmp_path / "out", seed=9, shard_bytes=40_000, verify=False)
    assert len(calls) < 15 + 5  # completed shards were not recomputed
    for f in sorted(p.name for p in clean.out.iterdir()):
        assert (clean.out / f).read_bytes() == (resumed.out / f).read_bytes(), f


# ---------------------------------------------------------------------------- downstream and CLI


def test_rotated_then_quantized_loads_in_mlx_lm_and_quantizes_better(tiny_model, tmp_path):
    from mlx_lm import load

    from mlxbun.quant.quantize.command import quantize_model_dir

    src = tiny_model("llama", dtype="bfloat16", outlier_channels=2, outlier_scale=8.0)
    rot = rotate_model_dir(src, tmp_path / "rot", seed=0)
    plain = quantize_model_dir(src, tmp_path / "plain-q3", bits=3, group_size=32)
    rotated = quantize_model_dir(rot.out, tmp_path / "rot-q3", bits=3, group_size=32)
    model, tokenizer = load(str(rotated.out))
    assert "quantization" in json.loads((rotated.out / "config.json").read_text())
    assert tokenizer.encode("hello world")
    ref = logits(src, tokens())
    kl_plain, kl_rot = (
        kl(ref, logits(plain.out, tokens())),
        kl(ref, logits(rotated.out, tokens())),
    )
    assert kl_rot < kl_plain


def test_cli_rotate_writes_model_record_and_manifest(tmp_path):
    proc = run_cli(
        "command=rotate", "model.synthetic=true", "synth.dtype=float32", "synth.norm_jitter=0.2",
        "fold.seed=3", f"hydra.run.dir={tmp_path / 'run'}", tmp=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    model = tmp_path / "run" / "model"
    assert read_fold_record(model).seed == 3
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["status"] == "ok" and manifest["metrics"]["verify"]["ok"] is True
    assert "model/turboquant_fold.json" in manifest["outputs"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["synth.hidden_size=100", "synth.head_dim=16"], "hidden_size=100 has no Hadamard construction"),
        (["fold.dtype=int4"], "fold.dtype='int4' is not allowed; choose one of bfloat16, float16, float32"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(tmp_path, args, message):
    proc = run_cli(
        "command=rotate", "model.synthetic=true", *args, f"hydra.run.dir={tmp_path / 'run'}", tmp=tmp_path
    )
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "model").exists()


def test_recipe_synth_rotate_quantize_loads_in_mlx_lm(tmp_path):
    from mlx_lm import load

    run = tmp_path / "run"
    proc = run_cli(
        "+recipe=rotate_quantize_synth", "pipeline.steps=[synth,rotate,quantize]", "synth.preset=tiny",
        "quant.bits=4", f"hydra.run.dir={run}", tmp=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert read_fold_record(run / "rotate" / "model").seed == 0
    config = json.loads((run / "quantize" / "model" / "config.json").read_text())
    assert config["quantization"]["bits"] == 4
    model, _ = load(str(run / "quantize" / "model"))
    out = model(mx.array(tokens(8))[None])
    assert np.isfinite(np.asarray(out.astype(mx.float32))).all()


def test_a_torn_partial_from_another_job_is_started_afresh(tiny_model, tmp_path, monkeypatch):
    src = tiny_model("llama", dtype="float32")
    real = rotate.fold_tensor

    def crash(*args, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(rotate, "fold_tensor", crash)
    with pytest.raises(KeyboardInterrupt):
        rotate_model_dir(src, tmp_path / "out", seed=0, verify=False)
    (partial,) = tmp_path.glob(".out.partial-*[!k]")
    (partial / ".mlxbun-stage.json").write_text('{"seed": ')
    (partial / "stray.bin").write_bytes(b"x")
    monkeypatch.setattr(rotate, "fold_tensor", real)
    res = rotate_model_dir(src, tmp_path / "out", seed=0, verify=False)
    assert not (res.out / "stray.bin").exists() and not partial.exists()
    assert read_fold_record(res.out).seed == 0
