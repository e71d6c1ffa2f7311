"""kv commands: kv_generate from a stored prefix gives the tokens of a from-scratch run; CLI wiring."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_util import run_cli
from mlx_lm.models.cache import make_prompt_cache

from mlxbun import synth
from mlxbun.kv import commands
from mlxbun.kv.store import MismatchError, Store

PROMPT = "the quick brown fox jumps over the lazy dog; " * 6


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path = synth.ensure_synthetic(cache_dir=tmp_path_factory.mktemp("synth"), arch="llama", preset="tiny")
    return commands.load_model(path)


def scratch(loaded, text: str, n: int) -> list[int]:
    toks = list(loaded.tokenizer.encode(text))
    return commands.greedy(loaded, toks, make_prompt_cache(loaded.model), max_tokens=n)


@pytest.mark.parametrize("layout", ["blocks", "snapshot"])
def test_generate_from_stored_prefix_equals_scratch(loaded, tmp_path, layout):
    store = Store(tmp_path, block_kib=8)
    info, toks, _ = commands.save_prompt(store, loaded, name="sys", text=PROMPT, layout=layout)
    assert info.tokens == len(toks) > 50
    for question in (" and then the dog", ""):  # a longer prompt, and exactly the stored one
        text = PROMPT + question
        full = list(loaded.tokenizer.encode(text))
        out, reused = commands.continue_from(store, loaded, full, name=None, max_tokens=12, verify=True)
        assert reused == (len(toks) if question else len(toks) - 1)
        assert out == scratch(loaded, text, 12) and len(out) > 0


def test_named_snapshot_for_another_prompt_is_refused(loaded, tmp_path):
    store = Store(tmp_path)
    commands.save_prompt(store, loaded, name="sys", text=PROMPT, layout="blocks")
    other = list(loaded.tokenizer.encode("a different beginning " + PROMPT))
    with pytest.raises(MismatchError, match="not a prefix"):
        commands.continue_from(store, loaded, other, name="sys", max_tokens=4, verify=True)
    out, reused = commands.continue_from(store, loaded, other, name=None, max_tokens=4, verify=True)
    assert reused == 0  # the lookup finds nothing usable and prefills from scratch


def _cli(tmp: Path, *args: str):
    return run_cli(*args, "model.synthetic=true", f"kv.store={tmp / 'kv'}", tmp=tmp)


def test_cli_save_generate_verify(tmp_path, loaded):
    r = _cli(tmp_path, "command=kv_save", "kv.name=sys", f"kv.prompt={json.dumps(PROMPT)}", "kv.block_kib=4")
    assert r.returncode == 0, r.stderr
    assert "saved 'sys'" in r.stdout
    text = PROMPT + " and then"
    r = _cli(tmp_path, "command=kv_generate", f"kv.prompt={json.dumps(text)}", "kv.max_tokens=10")
    assert r.returncode == 0, r.stderr
    gen = json.loads(next((tmp_path / "outputs/kv_generate").glob("*/generation.json")).read_text())
    assert gen["reused_tokens"] > 50 and gen["tokens"] == scratch(loaded, text, 10)
    block = sorted((tmp_path / "kv/blocks").iterdir())[0]
    raw = bytearray(block.read_bytes())
    raw[3] ^= 4
    block.write_bytes(bytes(raw))
    r = _cli(tmp_path, "command=kv_verify")
    assert r.returncode == 1 and f"block {block.name} hash mismatch" in r.stderr


@pytest.mark.slow
def test_cli_gc_and_bad_input(tmp_path):
    r = _cli(tmp_path, "command=kv_save", "kv.prompt=hello")
    assert r.returncode == 2 and "kv.name is not set" in r.stderr
    r = _cli(tmp_path, "command=kv_save", "kv.name=x", "kv.prompt=a", "kv.prompt_file=b")
    assert r.returncode == 2 and "exactly one of kv.prompt" in r.stderr
    r = _cli(tmp_path, "command=kv_save", "kv.name=../x", "kv.prompt=a")
    assert r.returncode == 2 and "not a valid snapshot name" in r.stderr
    for name, text in (("a", "one two three"), ("a", "four five six seven")):
        assert (
            _cli(tmp_path, "command=kv_save", f"kv.name={name}", f"kv.prompt={json.dumps(text)}").returncode
            == 0
        )
    r = _cli(tmp_path, "command=kv_ls", "json=true")
    assert [s["name"] for s in json.loads(r.stdout)["snapshots"]] == ["a"]
    r = _cli(tmp_path, "command=kv_gc")
    assert r.returncode == 0 and "1 blocks" in r.stdout and "kv.execute=true" in r.stdout
    r = _cli(tmp_path, "command=kv_gc", "kv.execute=true")
    assert r.returncode == 0 and "freed" in r.stdout
    assert len(list((tmp_path / "kv/blocks").iterdir())) == 1
    assert _cli(tmp_path, "command=kv_verify").returncode == 0


def test_fingerprints_tell_models_and_tokenizers_apart(loaded, tmp_path):
    from mlxbun.kv.fingerprint import model_fingerprint, tokenizer_fingerprint

    other = synth.ensure_synthetic(cache_dir=tmp_path, arch="llama", preset="tiny", seed=1)
    assert model_fingerprint(other) != loaded.model_fp  # same shapes, other weights
    assert model_fingerprint(loaded.path) == loaded.model_fp
    assert tokenizer_fingerprint(other) == loaded.tokenizer_fp
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok/tokenizer.json").write_text("{}")
    assert tokenizer_fingerprint(tmp_path / "tok") not in ("", loaded.tokenizer_fp)
    assert tokenizer_fingerprint(tmp_path) == ""
