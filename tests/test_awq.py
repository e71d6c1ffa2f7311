"""awq: activation-aware scales folded exactly into norms/linears; search checked against a plain reference."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from test_quantize import make_hf_model

from mlxbun.errors import InputError
from mlxbun.quant import awq, hessian
from mlxbun.quant.quantize.command import quantize_model_dir

TOKENS = np.random.default_rng(0).integers(3, 64, (8, 32))


def _outlier_model(path: Path, arch: str = "llama", **over) -> Path:
    """A tiny checkpoint whose norm gains have a few large channels, as trained models do."""
    src = make_hf_model(path, arch, **over)
    f = src / "model.safetensors"
    w = dict(mx.load(str(f)))
    rng = np.random.default_rng(1)
    for name in sorted(w):
        if name.endswith("layernorm.weight"):
            g = np.ones(w[name].shape[0], np.float32)
            g[rng.choice(g.size, 6, replace=False)] = 8.0
            w[name] = mx.array(g).astype(w[name].dtype)
    mx.save_safetensors(str(f), w, metadata={"format": "pt"})
    return src


def _float_model(src: Path):
    from mlx_lm.utils import load

    model, _ = load(str(src))
    model.set_dtype(mx.float32)
    return model


def _digest(d: Path) -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(d.glob("model*.safetensors")))).hexdigest()


def _fold(model, config: dict, bits: int = 3) -> awq.Fold:
    weights = dict(tree_flatten(model.parameters()))
    h = {k: np.asarray(v) for k, v in hessian.capture(model, TOKENS).items()}
    return awq.search(
        names=set(weights), config=config, read=weights.__getitem__, hessians=h,
        quant=lambda p: {"bits": bits, "group_size": 64, "mode": "affine"},
    )  # fmt: skip


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
def test_folded_float_model_has_the_same_logits(tmp_path, arch):
    src = _outlier_model(tmp_path / "src", arch)
    config = json.loads((src / "config.json").read_text())
    model = _float_model(src)
    ref = model(mx.array(TOKENS))
    names = {n for n, _ in tree_flatten(model.parameters())}
    groups, _ = awq.groups(names, config)
    fold, rng = awq.Fold(), np.random.default_rng(0)
    for g in groups:  # any positive scales fold exactly; the searched ones too (below)
        width = dict(tree_flatten(model.parameters()))[f"{g.layers[0]}.weight"].shape[1]
        fold.add(g, np.exp(rng.standard_normal(width)).astype(np.float32), names)
    searched = _fold(model, config)
    # every group is searched, or named as skipped (llama's down_proj, width 96, is not quantized)
    named = set(searched.ratios) | {line.split(":")[0].split(" ")[0] for line in searched.skipped}
    assert len(groups) >= 3 * 4 and named >= {g.prev for g in groups}
    model.load_weights([(n, fold.apply(n, a)) for n, a in tree_flatten(model.parameters())])
    out = model(mx.array(TOKENS))
    assert float(mx.max(mx.abs(out - ref))) < 1e-4 * float(mx.std(ref)) * 100


def test_groups_and_what_is_skipped():
    names = {f"model.layers.0.{m}.weight" for m in (
        "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
        "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
    )} | {"model.norm.weight", "lm_head.weight", "model.embed_tokens.weight"}  # fmt: skip
    mha = {"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 4}
    got, skipped = awq.groups(names, mha)
    assert [g.prev for g in got] == [
        "model.layers.0.input_layernorm", "model.layers.0.self_attn.v_proj", "model.layers.0.mlp.up_proj",
        "model.layers.0.post_attention_layernorm", "model.norm",
    ] and not skipped  # fmt: skip
    got, skipped = awq.groups(names, {**mha, "num_key_value_heads": 2, "tie_word_embeddings": True})
    assert "model.layers.0.self_attn.v_proj" not in [g.prev for g in got] and "model.norm" not in [
        g.prev for g in got
    ]
    assert any("grouped-query" in s for s in skipped) and any("tied" in s for s in skipped)
    got, skipped = awq.groups(names, {"model_type": "gemma3_text"})
    assert got == [] and "gemma3_text" in skipped[0]


def _reference_search(ws, q, x):
    """AWQ as written in the paper, on the activations themselves: plain loops, float64."""
    act = np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=0))
    act = act / np.sqrt(np.mean(act**2))
    best = None
    for k in range(awq.GRID):
        s = np.maximum(act ** (k / awq.GRID), awq.MIN_SCALE)
        s = (s / np.sqrt(s.max() * s.min())).astype(np.float32)
        err = 0.0
        for w in ws:
            scaled = (np.asarray(w) * s).astype(np.float32)
            deq = mx.dequantize(
                *mx.quantize(mx.array(scaled).astype(mx.bfloat16), 64, q), group_size=64, bits=q
            )
            wq = np.asarray(deq.astype(mx.float32), np.float64) / s
            err += float(np.sum((x @ (wq - np.asarray(w, np.float64)).T) ** 2))
        if best is None or err < best[0]:
            best = (err, s, k / awq.GRID)
    return best


@pytest.mark.parametrize("bits", [3, 4])
def test_search_matches_a_plain_reference(bits):
    rng = np.random.default_rng(bits)
    x = rng.standard_normal((512, 128)) * np.where(np.arange(128) % 17 == 0, 12.0, 1.0)
    ws = [mx.array(rng.standard_normal((n, 128)).astype(np.float32) * 0.05) for n in (64, 96)]
    h = (x.T @ x).astype(np.float32)
    s, r, errs = awq.search_group(ws, [{"bits": bits, "group_size": 64}] * 2, h)
    ref_err, ref_s, ref_r = _reference_search(ws, bits, x)
    assert r == ref_r and r > 0
    assert np.allclose(s, ref_s, rtol=1e-5)
    assert np.isclose(sum(errs), ref_err, rtol=1e-3)


def test_awq_model_is_stock_deterministic_and_closer_than_rtn(tmp_path):
    from mlx_lm import generate, load

    src = _outlier_model(tmp_path / "src", "llama", intermediate_size=256, num_key_value_heads=4)
    model = _float_model(src)
    hessian.save(hessian.capture(model, TOKENS), tmp_path / "h.safetensors", tokens=TOKENS.size)
    with pytest.raises(InputError, match="needs quant.hessians"):
        quantize_model_dir(src, tmp_path / "x", bits=3, group_size=64, method="awq")
    kw = dict(bits=3, group_size=64, hessians=tmp_path / "h.safetensors")
    out = quantize_model_dir(src, tmp_path / "awq", method="awq", **kw).out
    assert _digest(out) == _digest(quantize_model_dir(src, tmp_path / "again", method="awq", **kw).out)
    m, tok = load(str(out))
    assert isinstance(generate(m, tok, prompt="w3 w4 w5 w6", max_tokens=8), str)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"] == {"group_size": 64, "bits": 3, "mode": "affine"}
    ref = model(mx.array(TOKENS))
    errs = {}
    for name, d in (("awq", out), ("clip", quantize_model_dir(src, tmp_path / "clip", method="clip", **kw).out),
                    ("rtn", quantize_model_dir(src, tmp_path / "rtn", bits=3, group_size=64).out)):  # fmt: skip
        errs[name] = float(mx.mean(mx.square(load(str(d))[0](mx.array(TOKENS)).astype(mx.float32) - ref)))
    assert errs["awq"] < errs["clip"] < errs["rtn"], errs
