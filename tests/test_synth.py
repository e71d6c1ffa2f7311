"""synth: real-architecture random checkpoints load in mlx-lm, are deterministic and shaped right."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from cli_util import KILL_AFTER_SECOND_SHARD, REPO, run_cli
from mlx.utils import tree_flatten

from mlxbun.errors import InputError
from mlxbun.synth import arch as synth_arch
from mlxbun.synth import values as synth_values
from mlxbun.synth import write as synth_write
from mlxbun.synth.arch import ARCHS


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


def _weights(d: Path) -> dict[str, mx.array]:
    out: dict[str, mx.array] = {}
    for f in sorted(d.glob("model*.safetensors")):
        out.update(mx.load(str(f)))
    return out


def _skeleton(config: dict):
    """mlx-lm's own model for ``config``, parameters left lazy (never allocated)."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config=config)
    return model_class(args_class.from_dict(config))


@pytest.mark.parametrize("arch", ARCHS)
def test_each_arch_loads_in_mlx_lm_and_generates(tiny_model, arch):
    import mlx_lm
    from mlx_lm.generate import generate_step

    d = tiny_model(arch, outlier_channels=4, norm_jitter=0.1)
    model, tok = mlx_lm.load(str(d))  # strict: a missing or extra parameter raises
    loaded = dict(tree_flatten(model.parameters()))
    on_disk = _weights(d)
    config = json.loads((d / "config.json").read_text())
    assert set(loaded) == set(_skeleton(config).sanitize(dict(on_disk)))
    name = "model.layers.1.mlp.down_proj.weight"
    assert mx.array_equal(loaded[name], on_disk[name])
    prompt = tok.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True)
    steps = generate_step(mx.array(prompt), model, max_tokens=4)
    tokens = [int(t) for t, _ in steps]
    assert len(tokens) == 4 and all(0 <= t < 512 for t in tokens)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_untied_head_is_written_and_used(tiny_model, arch):
    import mlx_lm

    d = tiny_model(arch, tie_embeddings=False)
    assert "lm_head.weight" in _weights(d)
    model, _ = mlx_lm.load(str(d))
    assert "lm_head.weight" in dict(tree_flatten(model.parameters()))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("preset", ["1b", "27b"])
def test_plan_matches_mlx_lm_parameters(arch, preset):
    spec = synth_write.resolve_spec(arch=arch, preset=preset)
    model = _skeleton(synth_write.hf_config(spec))
    planned = {t.name: t.shape for t in synth_write.plan(spec)}
    kept = model.sanitize(dict.fromkeys(planned))  # drops a tied lm_head, as mlx_lm.load does
    want = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
    assert {k: planned[k] for k in kept} == want


def test_gemma3_27b_preset_is_gemma_3_27b():
    spec = synth_write.resolve_spec(arch="gemma3_text", preset="27b")
    cfg = synth_write.hf_config(spec)
    real = {
        "hidden_size": 5376,
        "intermediate_size": 21504,
        "num_hidden_layers": 62,
        "num_attention_heads": 32,
        "num_key_value_heads": 16,
        "head_dim": 128,
        "vocab_size": 262208,
        "query_pre_attn_scalar": 168,
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
        "tie_word_embeddings": True,
    }
    assert {k: cfg[k] for k in real} == real
    tensors = {t.name: t for t in synth_write.plan(spec)}
    assert tensors["model.embed_tokens.weight"].shape == (262208, 5376)
    assert tensors["model.layers.61.self_attn.k_proj.weight"].shape == (2048, 5376)
    assert tensors["model.layers.61.mlp.down_proj.weight"].shape == (5376, 21504)
    assert tensors["model.layers.0.self_attn.q_norm.weight"].shape == (128,)
    assert "lm_head.weight" not in tensors and "model.layers.62.input_layernorm.weight" not in tensors
    layer = 2 * 4096 * 5376 + 2 * 2048 * 5376 + 3 * 5376 * 21504 + 2 * 128 + 4 * 5376
    params = 262208 * 5376 + 62 * layer + 5376
    assert sum(t.numel for t in tensors.values()) == params == 27_009_346_304
    assert sum(t.nbytes for t in tensors.values()) == 2 * params


def test_explicit_dims_override_the_preset():
    spec = synth_write.resolve_spec(arch="qwen3", preset="27b", num_layers=3, vocab_size=1000)
    assert (spec.shape.num_layers, spec.shape.vocab_size, spec.shape.hidden_size) == (3, 1000, 5376)
    spec = synth_write.resolve_spec(arch="llama", preset="tiny", hidden_size=128)
    assert spec.shape.head_dim == 32  # derived from the new hidden size
    assert synth_write.resolve_spec(arch="qwen2", preset="1.5b").shape.hidden_size == 1536


def test_same_spec_same_bytes(tmp_path):
    kw = dict(arch="qwen2", outlier_channels=3, norm_jitter=0.05, seed=7)
    a = synth_write.synthesize(tmp_path / "a", **kw)
    b = synth_write.synthesize(tmp_path / "b", **kw)
    c = synth_write.synthesize(tmp_path / "c", **{**kw, "seed": 8})
    fa, fb = _files(a), _files(b)
    assert fa == fb
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"} <= set(fa)
    assert _files(c)["model.safetensors"] != fa["model.safetensors"]
    assert not list(tmp_path.glob(".*"))  # no partial directories left behind


def test_each_tensor_is_written_as_it_is_generated(tmp_path, nothing_pending):
    """No shard is held: after every add the writer has nothing pending, with a shard ceiling
    larger than the model."""
    nothing_pending(synth_write)
    out = synth_write.synthesize(tmp_path / "m", arch="llama", preset="tiny", shard_bytes=1 << 40)
    assert [p.name for p in out.glob("model*.safetensors")] == ["model.safetensors"]


def test_values_do_not_depend_on_threads_or_order(monkeypatch):
    spec = synth_write.resolve_spec(arch="llama", outlier_channels=4)
    t = next(t for t in synth_write.plan(spec) if t.name.endswith("o_proj.weight"))
    ch = synth_write.planted_channels(spec)
    monkeypatch.setattr(synth_values, "CHUNK", 100)  # many chunks: rows are spread over streams
    monkeypatch.setattr(synth_values, "THREADS", 1)
    one = np.array(synth_write.tensor_array(t, spec=spec, channels=ch).astype(mx.float32))
    monkeypatch.setattr(synth_values, "THREADS", 3)
    three = np.array(synth_write.tensor_array(t, spec=spec, channels=ch).astype(mx.float32))
    np.testing.assert_array_equal(one, three)


def test_value_scales_are_realistic(tiny_model):
    w = _weights(tiny_model("llama", preset="small"))
    q = np.array(w["model.layers.0.self_attn.q_proj.weight"].astype(mx.float32))
    assert q.std() == pytest.approx(1 / np.sqrt(512), rel=0.02)
    assert abs(q.mean()) < 1e-3
    emb = np.array(w["model.embed_tokens.weight"].astype(mx.float32))
    assert emb.std() == pytest.approx(3 / np.sqrt(512), rel=0.02)
    assert np.all(np.array(w["model.norm.weight"].astype(mx.float32)) == 1.0)
    g = _weights(tiny_model("gemma3_text"))
    assert np.all(np.array(g["model.layers.0.pre_feedforward_layernorm.weight"].astype(mx.float32)) == 0.0)


def _col_ratio(w: mx.array, channels: list[int], axis: int) -> float:
    a = np.abs(np.array(w.astype(mx.float32)))
    per = a.mean(axis=1 - axis)
    others = np.delete(per, channels)
    return float(per[channels].mean() / others.mean())


def test_outlier_channels_planted(tiny_model):
    d = tiny_model("llama", outlier_channels=4, outlier_scale=20.0)
    ch = json.loads((d / "synth.json").read_text())["planted_channels"]
    assert len(ch) == 4 and ch == sorted(set(ch))
    w = _weights(d)
    for name in ("self_attn.q_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
        assert _col_ratio(w[f"model.layers.1.{name}.weight"], ch, axis=1) == pytest.approx(20, rel=0.2)
    assert _col_ratio(w["model.embed_tokens.weight"], ch, axis=1) == pytest.approx(20, rel=0.2)
    assert _col_ratio(w["model.layers.0.mlp.down_proj.weight"], ch, axis=0) == pytest.approx(20, rel=0.2)
    none = _weights(tiny_model("llama"))
    assert _col_ratio(none["model.layers.1.self_attn.q_proj.weight"], ch, axis=1) == pytest.approx(1, rel=0.2)


def test_planted_channels_dominate_the_residual_stream(tiny_model):
    import mlx_lm

    d = tiny_model("llama", outlier_channels=4, outlier_target="activations")
    ch = json.loads((d / "synth.json").read_text())["planted_channels"]
    model, tok = mlx_lm.load(str(d))
    h = model.model.embed_tokens(mx.array([tok.encode("the residual stream of a tiny model")]))
    for layer in model.model.layers:
        h = layer(h, "causal", None)
        per_channel = np.abs(np.array(h.astype(mx.float32)))[0].mean(axis=0)
        assert sorted(np.argsort(per_channel)[-4:].tolist()) == ch
    # The final norm damps them (1 / outlier_scale), so the logits are not one-hot.
    out = np.abs(np.array(model.model.norm(h).astype(mx.float32)))[0].mean(axis=0)
    assert out[ch].mean() < 3 * np.delete(out, ch).mean()
    probs = np.array(mx.softmax(model(mx.array([tok.encode("a b c")])).astype(mx.float32), axis=-1))
    assert probs.max(axis=-1).mean() < 0.9
    w = _weights(d)  # activations only: the q/k/v/gate/up weights are untouched
    assert _col_ratio(w["model.layers.0.self_attn.q_proj.weight"], ch, axis=1) == pytest.approx(1, rel=0.2)


def test_outputs_are_neither_one_hot_nor_uniform(tiny_model):
    import mlx_lm

    for arch in ARCHS:
        model, tok = mlx_lm.load(str(tiny_model(arch)))
        ids = tok.encode("Synthetic weights should still give a spread of next-token guesses.")
        logp = np.array(mx.log(mx.softmax(model(mx.array([ids])).astype(mx.float32), axis=-1)))[0]
        entropy = -(np.exp(logp) * logp).sum(axis=-1).mean()
        assert 0.5 < entropy < np.log(512) - 0.5, (arch, entropy)
        copies = (logp.argmax(axis=-1) == np.array(ids)).mean()
        assert copies < 0.8, (arch, copies)  # not a copy of the input token (gemma's sqrt(h) scale)


def test_norm_jitter_moves_gains(tiny_model):
    w = _weights(tiny_model("qwen3", norm_jitter=0.1))
    gains = np.array(w["model.layers.0.self_attn.q_norm.weight"].astype(mx.float32))
    assert gains.std() == pytest.approx(0.1, rel=0.35) and abs(gains.mean() - 1) < 0.1


def test_tokenizer_has_vocab_size_tokens_and_round_trips(tmp_path):
    from transformers import AutoTokenizer

    for n in (synth_write.MIN_VOCAB, 512, 9000):
        assert len(synth_write.build_tokenizer(n)) == n
    synth_write.build_tokenizer(600).save_pretrained(str(tmp_path / "a"))
    synth_write.build_tokenizer(600).save_pretrained(str(tmp_path / "b"))
    assert _files(tmp_path / "a") == _files(tmp_path / "b")
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "a"))
    text = "Größe: 42 tokens, naïve café — ok?\n"
    ids = tok.encode(text)
    assert ids[0] == synth_arch.BOS_ID and max(ids) < 600
    assert tok.decode(ids, skip_special_tokens=True) == text
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<s><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_ensure_synthetic_builds_once(tmp_path):
    a = synth_write.ensure_synthetic(cache_dir=tmp_path, arch="mistral", preset="tiny", out=None)
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    # The same resolved spec spelled differently reuses the cached directory.
    b = synth_write.ensure_synthetic(cache_dir=tmp_path, arch="mistral", hidden_size=64, head_dim=16)
    assert a == b and (b / "model.safetensors").stat().st_mtime_ns == mtime
    assert a.name == synth_write.resolve_spec(arch="mistral").hash


def test_interrupted_build_resumes_and_leaves_nothing_final(tmp_path, monkeypatch):
    out = tmp_path / "m"
    calls = {"n": 0}
    real = synth_write.tensor_array

    def counting(t, **kw):
        calls["n"] += 1
        if calls["n"] == 12 and kill["on"]:
            raise KeyboardInterrupt
        return real(t, **kw)

    kill = {"on": True}
    monkeypatch.setattr(synth_write, "tensor_array", counting)
    with pytest.raises(KeyboardInterrupt):
        synth_write.synthesize(out, arch="llama", shard_bytes=20_000)
    (partial,) = tmp_path.glob(".m.partial-*[!k]")
    assert not out.exists() and partial.is_dir()
    kill["on"], calls["n"] = False, 0
    synth_write.synthesize(out, arch="llama", shard_bytes=20_000)
    assert (
        0 < calls["n"] < len(synth_write.plan(synth_write.resolve_spec(arch="llama")))
    )  # resumed, not redone
    fresh = synth_write.synthesize(tmp_path / "fresh", arch="llama", shard_bytes=20_000)
    assert _files(out) == _files(fresh)
    assert (out / "model.safetensors.index.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh", "m"]  # no partial, no lock left


def test_cli_rerun_after_sigkill_resumes(tmp_path):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(KILL_AFTER_SECOND_SHARD)
    args = ("command=synth", "synth.arch=qwen3", "io.shard_gb=0.00002", "verbose=true")
    env = {"PYTHONPATH": f"{hook}{os.pathsep}{REPO}"}
    killed = run_cli(*args, tmp=tmp_path, env=env)
    assert killed.returncode == -9, killed.stderr[-2000:]
    again = run_cli(*args, tmp=tmp_path, env={"PYTHONPATH": str(REPO)})
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resuming" in again.stderr
    runs = sorted((tmp_path / "outputs" / "synth").iterdir())
    assert len(runs) == 2 and not (runs[0] / "model").exists()
    clean = synth_write.synthesize(tmp_path / "clean", arch="qwen3", shard_bytes=int(0.00002 * (1 << 30)))
    assert _files(runs[1] / "model") == _files(clean)
    assert not list((tmp_path / "outputs" / ".partial").iterdir())


@pytest.mark.parametrize(
    ("fields", "key"),
    [
        ({"arch": "gpt2"}, "synth.arch"),
        ({"preset": "huge"}, "synth.preset"),
        ({"hidden_size": -8}, "synth.hidden_size"),
        ({"num_kv_heads": 3}, "synth.num_kv_heads"),
        ({"vocab_size": 100}, "synth.vocab_size"),
        ({"outlier_channels": 65}, "synth.outlier_channels"),
        ({"arch": "qwen2", "head_dim": 32}, "synth.head_dim"),
        ({"outlier_target": "bias"}, "synth.outlier_target"),
    ],
)
def test_bad_specs_name_the_key(tmp_path, fields, key):
    with pytest.raises(InputError, match=key.replace(".", r"\.")):
        synth_write.synthesize(tmp_path / "m", **fields)
    assert not list(tmp_path.iterdir())


def test_existing_output_is_refused(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(InputError, match="already exists"):
        synth_write.synthesize(tmp_path / "m")


def test_cli_synth_writes_model_and_manifest(tmp_path):
    r = run_cli("command=synth", "synth.arch=gemma3_text", "synth.outlier_channels=2", tmp=tmp_path)
    assert r.returncode == 0, r.stderr
    (manifest,) = (tmp_path / "outputs" / "synth").glob("*/manifest.json")
    m = json.loads(manifest.read_text())
    assert m["status"] == "ok" and m["metrics"]["params"] > 0
    model = manifest.parent / "model"
    assert "model/model.safetensors" in m["outputs"]
    assert json.loads((model / "config.json").read_text())["model_type"] == "gemma3_text"
    assert m["metrics"]["bytes"] == sum(
        t.nbytes for t in synth_write.plan(synth_write.resolve_spec(arch="gemma3_text", outlier_channels=2))
    )


@pytest.mark.parametrize("arg", ["synth.arch=gpt2", "synth.hidden_size=-1", "synth.preset=huge"])
def test_cli_bad_input_exits_2_with_one_line(tmp_path, arg):
    r = run_cli("command=synth", arg, tmp=tmp_path)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and arg.split("=")[0] in lines[0]
    assert not list((tmp_path / "outputs").rglob("*.safetensors"))


def test_tiny_model_fixture_is_shared(tiny_model):
    a, b = tiny_model("qwen3"), tiny_model("qwen3")
    assert a == b and (a / "config.json").is_file()
    shutil.copytree(a, a.parent / "copy")  # the documented way to get a private copy


def test_concurrent_ensure_synthetic_builds_once(tmp_path):
    code = (
        "import sys; from mlxbun.synth import write as synth_write; "
        "print(synth_write.ensure_synthetic(cache_dir=sys.argv[1], arch='qwen3', preset='small'))"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs[0] == outs[1] and Path(outs[0]).is_dir()
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == [Path(outs[0]).name]


def test_model_synthetic_source_uses_the_cache(tmp_path):
    from mlxbun.config.schema import Config
    from mlxbun.source.model import model_dir

    cfg = Config()
    cfg.paths.cache = str(tmp_path)
    cfg.model.synthetic = True
    cfg.synth.arch = "gemma3_text"
    d = model_dir(cfg)
    assert d.parent == tmp_path / "synth" and d.name == synth_write.resolve_spec(arch="gemma3_text").hash
    assert model_dir(cfg) == d


@pytest.mark.parametrize(("dtype", "mx_dtype"), [("float16", mx.float16), ("float32", mx.float32)])
def test_other_dtypes(tiny_model, dtype, mx_dtype):
    d = tiny_model("qwen2", dtype=dtype)
    assert json.loads((d / "config.json").read_text())["torch_dtype"] == dtype
    w = _weights(d)
    assert {a.dtype for a in w.values()} == {mx_dtype}
    bf16 = _weights(tiny_model("qwen2"))["model.layers.0.mlp.up_proj.weight"].astype(mx.float32)
    # Same draws, other storage precision: values agree to bf16 rounding.
    np.testing.assert_allclose(
        np.array(w["model.layers.0.mlp.up_proj.weight"].astype(mx.float32)),
        np.array(bf16),
        rtol=1e-2,
        atol=1e-3,
    )
