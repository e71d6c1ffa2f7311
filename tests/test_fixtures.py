"""The representative fixtures: stock mlx-lm loads them and FIXTURE.json says how they were made."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"
CONFIRMATION = "qwen3-man-7l"  # confirms defaults chosen on the others; never chooses one
REPRESENTATIVE = ("llama-narrow-6l", "llama-narrow-8l", CONFIRMATION)


def _script():
    spec = importlib.util.spec_from_file_location("train_fixture", REPO / "scripts" / "train_fixture.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name", REPRESENTATIVE)
def test_representative_fixture_loads_in_mlx_lm(name):
    import mlx.core as mx
    from mlx_lm import load

    model, tok = load(str(FIXTURES / name))
    config = json.loads((FIXTURES / name / "config.json").read_text())
    script = _script()
    assert config["model_type"] == (script.CONFIG | script.PRESETS[name][0])["model_type"]
    ids = tok.encode("Alice was beginning to get very tired")
    logits = model(mx.array([ids]))
    assert logits.shape == (1, len(ids), config["vocab_size"])
    assert bool(mx.all(mx.isfinite(logits)).item())


@pytest.mark.parametrize("name", REPRESENTATIVE)
def test_representative_fixture_records_corpus_and_settings(name):
    meta = json.loads((FIXTURES / name / "FIXTURE.json").read_text())
    config = json.loads((FIXTURES / name / "config.json").read_text())
    overrides, extra, steps, defaults = _script().PRESETS[name]
    for key, value in overrides.items():
        assert config[key] == value, key
    settings = meta["settings"]
    assert settings["preset"] == name and settings["steps"] == steps
    assert settings["lr"] == defaults["lr"] and settings["weight_decay"] == defaults["weight_decay"]
    assert meta["script"] == "scripts/train_fixture.py" and meta["train_tokens"] > 0
    corpus = meta["corpus"]
    assert corpus and all(set(e) == {"file", "sha256"} and len(e["sha256"]) == 64 for e in corpus)
    # The evaluation text is never in the training corpus.
    heldout = REPO / "mlxbun" / "data" / "heldout.txt"
    digest = hashlib.sha256(heldout.read_bytes()).hexdigest()
    assert digest not in {e["sha256"] for e in corpus}
    assert not any(Path(e["file"]).name == heldout.name for e in corpus)


@pytest.mark.parametrize("name", REPRESENTATIVE)
def test_representative_fixture_costs_what_real_models_cost_under_mlx_lm_q3_and_q4(name):
    """The bar: mlx-lm's q3 g64 held-out KL >= 0.2 and q4 g64 >= 0.05 (real 8B models: ~0.1-0.25)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm import load

    model, tok = load(str(FIXTURES / name))
    ids = tok.encode((REPO / "mlxbun" / "data" / "heldout.txt").read_text())[: 16 * 128]
    x = mx.array(ids).reshape(16, 128)
    ref = nn.log_softmax(model(x).astype(mx.float32), axis=-1)
    kl = {}
    for bits in (3, 4):
        q, _ = load(str(FIXTURES / name))
        nn.quantize(q, group_size=64, bits=bits)
        lq = nn.log_softmax(q(x).astype(mx.float32), axis=-1)
        kl[bits] = mx.mean(mx.sum(mx.exp(ref) * (ref - lq), axis=-1)).item()
    assert kl[3] >= 0.2 and kl[4] >= 0.05, kl


def test_confirmation_fixture_is_another_architecture_and_domain_and_records_its_role():
    meta = json.loads((FIXTURES / CONFIRMATION / "FIXTURE.json").read_text())
    config = json.loads((FIXTURES / CONFIRMATION / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["num_key_value_heads"] < config["num_attention_heads"]
    assert (FIXTURES / CONFIRMATION / "model.safetensors").stat().st_size <= 3_000_000
    assert meta["role"] == "confirmation" and "never" in meta["note"]
    # Its corpus is rendered man pages: no file shared with the other fixtures' licences and modules.
    others = {
        e["file"]
        for n in REPRESENTATIVE[:-1]
        for e in json.loads((FIXTURES / n / "FIXTURE.json").read_text())["corpus"]
    }
    files = [e["file"] for e in meta["corpus"]]
    assert all(f.startswith("/usr/share/man/man8/") for f in files) and not others & set(files)
    assert meta["renderer"]["env"]["MANWIDTH"] == "80" and len(meta["rendered_sha256"]) == 64
    # mlx-lm's own convert of it costs what it costs real models, more at fewer bits.
    kl = meta["mlx_lm_kl"]["convert"]
    assert kl["q3"] >= 0.2 and kl["q4"] >= 0.05, kl
    assert kl["q2"] > kl["q3"] > kl["q4"] > kl["q6"] > 0, kl
