"""kv_import / kv_export: mlx-lm prompt-cache files in and out of the store, checked both ways."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import mlx.core as mx
import pytest
from cli_util import REPO, run_cli
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache

from mlxbun.errors import DriftError, InputError
from mlxbun.kv import commands
from mlxbun.kv import import_ as imp
from mlxbun.kv.export import export
from mlxbun.kv.store import Store
from mlxbun.synth import write as synth_write

PROMPT = "the quick brown fox jumps over the lazy dog; " * 6


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path = synth_write.ensure_synthetic(
        cache_dir=tmp_path_factory.mktemp("synth"), arch="llama", preset="tiny"
    )
    return commands.load_model(path)


def cached(loaded, text: str, path) -> list[int]:
    """What ``mlx_lm cache_prompt`` writes for ``text``: the whole prompt's cache, full buffers."""
    toks = commands.prompt_tokens(loaded, text, chat=True)
    cache = make_prompt_cache(loaded.model)
    commands.prefill(loaded.model, toks, cache)
    save_prompt_cache(str(path), cache, {"model": str(loaded.path), "tokenizer_config": "{}"})
    return toks


def cli_import(loaded, tmp_path, src, prompt: str):
    """``kv_import`` of ``src`` as ``sys`` into ``tmp_path/kv``; returns the result and the kv overrides."""
    kv = [f"kv.store={tmp_path / 'kv'}", f"model.name={loaded.path}"]
    args = ("command=kv_import", "kv.name=sys", f"kv.file={src}", f"kv.prompt={json.dumps(prompt)}")
    r = run_cli(*args, *kv, tmp=tmp_path)
    assert r.returncode == 0, r.stderr
    return r, kv


def test_import_checks_then_stores_a_prompt_cache(loaded, tmp_path):
    src = tmp_path / "sys.safetensors"
    toks = cached(loaded, PROMPT, src)
    cache, _ = imp.read_prompt_cache(src)
    imp.check_against(loaded, cache, toks, path=src)
    assert imp.recompute_check(loaded, imp.read_prompt_cache(src)[0], toks, path=src) < 1e-2
    store = Store(tmp_path / "kv")
    store.save("sys", cache, tokens=toks, model=loaded.model_fp, tokenizer=loaded.tokenizer_fp)
    assert store.verify()[1] == []
    full = toks + [5, 6, 7]  # the chat-templated prompt, then a question
    got = commands.continue_from(store, loaded, full, name=None, max_tokens=8, verify=True)
    scratch = commands.greedy(loaded, full, make_prompt_cache(loaded.model), max_tokens=8)
    assert got.reused == len(toks) and got.tokens == scratch


def test_import_refuses_another_prompt_or_model(loaded, tmp_path):
    src = tmp_path / "sys.safetensors"
    toks = cached(loaded, PROMPT, src)
    cache, _ = imp.read_prompt_cache(src)
    with pytest.raises(InputError, match="caches .* tokens but the prompt encodes to"):
        imp.check_against(loaded, cache, toks[:-1], path=src)
    wrong = toks[:-1] + [(toks[-1] + 7) % 500]  # same length, another last token
    with pytest.raises(DriftError, match="not made by this model from this prompt"):
        imp.recompute_check(loaded, imp.read_prompt_cache(src)[0], wrong, path=src)
    other = commands.load_model(
        synth_write.ensure_synthetic(cache_dir=tmp_path, arch="llama", preset="tiny", seed=1)
    )
    with pytest.raises(DriftError, match="not made by this model"):
        imp.recompute_check(other, imp.read_prompt_cache(src)[0], toks, path=src)


def test_import_refuses_hostile_files(tmp_path):
    bad = tmp_path / "bad.safetensors"
    mx.save_safetensors(str(bad), {"0.0": mx.zeros((1,))}, {"1.0": "ArraysCache", "2.0": ""})
    with pytest.raises(InputError, match="'ArraysCache' is not supported"):
        imp.read_prompt_cache(bad)
    mx.save_safetensors(str(bad), {"w": mx.zeros((1,))}, {"format": "mlx"})
    with pytest.raises(InputError, match="not an mlx-lm prompt-cache file"):
        imp.read_prompt_cache(bad)
    bad.write_bytes(b"\xff" * 20)
    with pytest.raises(InputError, match="not a safetensors file"):
        imp.read_prompt_cache(bad)
    with pytest.raises(InputError, match="must end in .safetensors"):
        imp.check_file(str(tmp_path / "x.kvs"))


@pytest.mark.parametrize("layout", ["snapshot", "blocks"])
def test_export_writes_a_plain_prompt_cache(loaded, tmp_path, layout):
    store = Store(tmp_path / "kv", block_kib=4)
    info, toks, _ = commands.save_prompt(store, loaded, name="sys", text=PROMPT, layout=layout)
    out = tmp_path / "out.safetensors"
    done = export(store, "sys", out)
    assert done["tokens"] == len(toks) and done["model"] == str(loaded.path)
    cache, meta = load_prompt_cache(str(out), return_metadata=True)
    assert meta == {"model": str(loaded.path), "tokenizer_config": "{}"}
    rest = list(loaded.tokenizer.encode(PROMPT + " and then"))
    scratch = commands.greedy(loaded, rest, make_prompt_cache(loaded.model), max_tokens=8)
    assert commands.greedy(loaded, rest[len(toks) :], cache, max_tokens=8) == scratch


def test_cli_import_of_mlx_lm_cache_prompt_and_export(loaded, tmp_path):
    """The real ``mlx_lm cache_prompt`` output imports; the export opens in ``mlx_lm generate``."""
    src = tmp_path / "sys.safetensors"
    argv = [sys.executable, "-m", "mlx_lm", "cache_prompt", "--model", str(loaded.path)]
    argv += ["--prompt", PROMPT, "--prompt-cache-file", str(src)]
    r = subprocess.run(
        argv, capture_output=True, text=True, timeout=300, env={"HF_HUB_OFFLINE": "1", "PATH": ""}
    )
    assert r.returncode == 0, r.stderr
    r, kv = cli_import(loaded, tmp_path, src, PROMPT)
    assert "imported" in r.stdout and "positions recomputed in every layer within" in r.stdout
    r = run_cli("command=kv_import", "kv.name=x", f"kv.file={src}", "kv.prompt=short", *kv, tmp=tmp_path)
    assert r.returncode == 2 and "but the prompt encodes to" in r.stderr
    out = tmp_path / "out.safetensors"
    r = run_cli("command=kv_export", "kv.name=sys", f"kv.file={out}", *kv, tmp=tmp_path)
    assert r.returncode == 0, r.stderr
    argv = [sys.executable, "-m", "mlx_lm", "generate", "--prompt-cache-file", str(out)]
    argv += ["--prompt", " and then", "--max-tokens", "4", "--ignore-chat-template"]
    r = subprocess.run(
        argv, capture_output=True, text=True, timeout=300, env={"HF_HUB_OFFLINE": "1", "PATH": ""}
    )
    assert r.returncode == 0, r.stderr
    # the store's own file is path-free (model "" for a local directory): stock loaders open it
    # as it is, and kv_export adds the model directory the store recorded for mlx_lm generate
    snap = tmp_path / "kv/snapshots/sys.safetensors"
    cache, meta = load_prompt_cache(str(snap), return_metadata=True)
    assert meta["model"] == "" and len(cache) == len(make_prompt_cache(loaded.model))


def test_export_never_overwrites_a_model_the_store_or_an_existing_file(loaded, tmp_path):
    from mlxbun.kv.export import check_target

    store = Store(tmp_path / "kv", block_kib=4)
    commands.save_prompt(store, loaded, name="sys", text=PROMPT, layout="snapshot")
    snap = store.root / "snapshots" / "sys.safetensors"
    weights = loaded.path / "model.safetensors"
    before = {p: p.read_bytes() for p in (snap, weights)}
    for target, why in ((snap, "inside the KV store"), (weights, "inside the model directory")):
        for overwrite in (False, True):
            with pytest.raises(InputError, match=why):
                check_target(target, store_root=store.root, overwrite=overwrite)
    other = tmp_path / "mine.safetensors"
    other.write_bytes(b"keep")
    with pytest.raises(InputError, match="kv.overwrite=true"):
        check_target(other, store_root=store.root, overwrite=False)
    check_target(other, store_root=store.root, overwrite=True)
    check_target(tmp_path / "new.safetensors", store_root=store.root, overwrite=False)
    assert {p: p.read_bytes() for p in before} == before and other.read_bytes() == b"keep"


def test_cli_export_refuses_an_existing_file_and_writes_nothing(loaded, tmp_path):
    kv = [f"kv.store={tmp_path / 'kv'}", f"model.name={loaded.path}"]
    r = run_cli("command=kv_save", "kv.name=sys", f"kv.prompt={json.dumps(PROMPT)}", *kv, tmp=tmp_path)
    assert r.returncode == 0, r.stderr
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"keep")
    r = run_cli("command=kv_export", "kv.name=sys", f"kv.file={out}", *kv, tmp=tmp_path)
    assert r.returncode == 2 and "kv.overwrite=true" in r.stderr and out.read_bytes() == b"keep"
    assert len(r.stderr.strip().splitlines()) == 1
    r = run_cli("command=kv_export", "kv.name=sys", f"kv.file={out}", "kv.overwrite=true", *kv, tmp=tmp_path)
    assert r.returncode == 0, r.stderr
    assert load_prompt_cache(str(out)) is not None


def _spoiled(src, out, spoil) -> None:
    """``src`` rewritten as ``out`` with ``spoil(layer, name, array) -> array`` applied to each tensor."""
    arrays, meta = mx.load(str(src), return_metadata=True)
    mx.save_safetensors(str(out), {k: spoil(k, v) for k, v in arrays.items()}, meta)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_import_refuses_non_finite_caches(loaded, tmp_path, value):
    src, bad = tmp_path / "sys.safetensors", tmp_path / "bad.safetensors"
    toks = cached(loaded, PROMPT, src)
    _spoiled(
        src, bad, lambda k, v: v.at[:, :, 3].add(value) if k.endswith("1") else v
    )  # one layer, one token
    cache, _ = imp.read_prompt_cache(bad)
    with pytest.raises(InputError, match="non-finite values"):
        imp.check_finite(cache, len(toks), path=bad)


def test_import_refuses_a_zeroed_last_layer(loaded, tmp_path):
    src, bad = tmp_path / "sys.safetensors", tmp_path / "bad.safetensors"
    toks = cached(loaded, PROMPT, src)
    last = max(int(k.split(".")[0]) for k in mx.load(str(src)))  # "<layer>.<0 keys, 1 values, 2 offset>"
    _spoiled(src, bad, lambda k, v: mx.zeros_like(v) if k.startswith(f"{last}.") and v.ndim == 4 else v)
    with pytest.raises(DriftError, match=f"in layer {last}\\."):
        imp.recompute_check(loaded, imp.read_prompt_cache(bad)[0], toks, path=bad)


def test_import_refuses_a_cache_of_another_prompt_of_the_same_length_and_last_token(loaded, tmp_path):
    src = tmp_path / "sys.safetensors"
    toks = cached(loaded, PROMPT, src)
    p = imp.sample_positions(len(toks))[len(imp.sample_positions(len(toks))) // 2]  # a middle one
    claimed = list(toks)
    claimed[p] = (toks[p] + 11) % 500  # "little dog" for "little cat": one word apart
    assert claimed[-1] == toks[-1] and len(claimed) == len(toks)
    with pytest.raises(DriftError, match=f"recomputing token {p} "):
        imp.recompute_check(loaded, imp.read_prompt_cache(src)[0], claimed, path=src)


def test_import_names_a_trailing_newline_in_the_prompt(loaded, tmp_path):
    src = tmp_path / "sys.safetensors"
    cached(loaded, PROMPT.rstrip(), src)
    cache, _ = imp.read_prompt_cache(src)
    text = PROMPT.rstrip() + "\n"
    toks = commands.prompt_tokens(loaded, text, chat=True)
    assert len(toks) != imp.cache_tokens(cache)  # the newline is a token of its own
    with pytest.raises(InputError, match="because it ends in '\\\\n'.*final newline"):
        imp.check_trailing_space(loaded, cache, text, toks, path=src, chat=True)
    imp.check_trailing_space(
        loaded,
        cache,
        PROMPT.rstrip(),
        commands.prompt_tokens(loaded, PROMPT.rstrip(), chat=True),
        path=src,
        chat=True,
    )


def test_cli_import_of_a_chat_template_model_is_reused_by_generate(loaded, tmp_path):
    """kv_import caches the prompt through the chat template, as ``mlx_lm cache_prompt`` does;
    kv_generate encodes its prompt the same way (then the assistant's turn), so it reuses the
    import, and says so when told to encode plain text instead."""
    assert loaded.tokenizer.has_chat_template  # the synthetic tokenizer has one
    src, system = tmp_path / "sys.safetensors", PROMPT.rstrip()
    toks = cached(loaded, system, src)
    _, kv = cli_import(loaded, tmp_path, src, system)
    question = system + " And then?"
    r = run_cli("command=kv_generate", f"kv.prompt={json.dumps(question)}", "json=true", *kv, tmp=tmp_path)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)["result"]
    full = commands.prompt_tokens(loaded, question, chat=True, reply=True)
    assert full[: len(toks)] == toks and got["prompt_tokens"] == len(full)
    assert got["reused_tokens"] == len(toks)
    assert got["tokens"] == commands.greedy(loaded, full, make_prompt_cache(loaded.model), max_tokens=32)
    plain = ["kv.chat_template=false", f"kv.prompt={json.dumps(question)}", "json=true"]
    r = run_cli("command=kv_generate", *plain, *kv, tmp=tmp_path)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)["result"]
    assert got["reused_tokens"] == 0 and "through the chat template" in got["notes"][-1]


def test_cli_export_is_continued_by_mlx_lm_generate_with_a_relative_model_path(loaded, tmp_path):
    """The exported file names the model as ``model.name`` was spelt (here relative to the cwd),
    which is what ``mlx_lm generate --model`` must equal; the message says how to continue it."""
    model = tmp_path / "my-model"
    shutil.copytree(loaded.path, model)
    rel = os.path.relpath(model, REPO)
    kv = [f"kv.store={tmp_path / 'kv'}", f"model.name={rel}"]
    r = run_cli("command=kv_save", "kv.name=sys", f"kv.prompt={json.dumps(PROMPT)}", *kv, tmp=tmp_path)
    assert r.returncode == 0, r.stderr
    r = run_cli("command=kv_ls", f"kv.store={tmp_path / 'kv'}", tmp=tmp_path)
    assert (
        "command=kv_export kv.name=sys kv.file=sys.safetensors model.name=" in r.stdout
    )  # how to hand it over
    out = tmp_path / "sys-export.safetensors"
    r = run_cli("command=kv_export", "kv.name=sys", f"kv.file={out}", *kv, tmp=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"--prompt-cache-file {out}" in r.stdout and repr(rel) in r.stdout
    assert "--ignore-chat-template" not in r.stdout  # saved through the template, as mlx_lm generate goes
    assert load_prompt_cache(str(out), return_metadata=True)[1]["model"] == rel
    argv = [sys.executable, "-m", "mlx_lm", "generate", "--model", rel, "--prompt-cache-file", str(out)]
    argv += ["--prompt", " and then", "--max-tokens", "4"]
    r = subprocess.run(
        argv, cwd=REPO, capture_output=True, text=True, timeout=300, env={"HF_HUB_OFFLINE": "1"}
    )
    assert r.returncode == 0, r.stderr
    other = synth_write.ensure_synthetic(cache_dir=tmp_path / "o", arch="llama", preset="tiny", seed=1)
    r = run_cli(
        "command=kv_export", "kv.name=sys", f"kv.file={tmp_path / 'x.safetensors'}", f"kv.store={tmp_path / 'kv'}",
        f"model.name={other}", tmp=tmp_path,
    )  # fmt: skip
    assert r.returncode == 2 and "model.name=" in r.stderr and "another model" in r.stderr
    assert not (tmp_path / "x.safetensors").exists()


def test_export_says_ignore_chat_template_only_for_a_plain_snapshot_of_a_chat_model(tmp_path):
    from mlxbun.kv.export import how_to_continue

    out = tmp_path / "x.safetensors"
    plain, chat, none = ({"model": "m", "chat_template": c} for c in (False, True, None))
    assert "--ignore-chat-template" in how_to_continue(out, plain)
    assert "--ignore-chat-template" not in how_to_continue(out, chat) + how_to_continue(out, none)
