"""The representative fixtures: stock mlx-lm loads them and FIXTURE.json says how they were made."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"
REPRESENTATIVE = ("llama-narrow-6l", "llama-narrow-8l")


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
    assert config["model_type"] == "llama"
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
