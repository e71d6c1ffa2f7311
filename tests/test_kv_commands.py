"""kv commands: kv_generate from a stored prefix gives the tokens of a from-scratch run; CLI wiring."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from cli_util import run_cli
from mlx_lm.models.cache import make_prompt_cache

from mlxbun.commands import COMMANDS
from mlxbun.errors import InputError
from mlxbun.kv import commands
from mlxbun.kv.store import MismatchError, Store
from mlxbun.synth import write as synth_write

PROMPT = "the quick brown fox jumps over the lazy dog; " * 6


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path = synth_write.ensure_synthetic(
        cache_dir=tmp_path_factory.mktemp("synth"), arch="llama", preset="tiny"
    )
    return commands.load_model(path)


def scratch(loaded, text: str, n: int, *, chat: bool = False) -> list[int]:
    toks = commands.prompt_tokens(loaded, text, chat=chat, reply=True)
    return commands.greedy(loaded, toks, make_prompt_cache(loaded.model), max_tokens=n)


@pytest.mark.parametrize("layout", ["blocks", "snapshot"])
def test_generate_from_stored_prefix_equals_scratch(loaded, tmp_path, layout):
    store = Store(tmp_path, block_kib=8)
    info, toks, _ = commands.save_prompt(store, loaded, name="sys", text=PROMPT, layout=layout)
    assert info.tokens == len(toks) > 50
    for question in (" and then the dog", ""):  # a longer prompt, and exactly the stored one
        text = PROMPT + question
        full = list(loaded.tokenizer.encode(text))
        got = commands.continue_from(store, loaded, full, name=None, max_tokens=12, verify=True)
        assert got.reused == (len(toks) if question else len(toks) - 1) and got.notes == []
        assert got.tokens == scratch(loaded, text, 12) and len(got.tokens) > 0


def test_named_snapshot_for_another_prompt_is_refused(loaded, tmp_path):
    store = Store(tmp_path)
    commands.save_prompt(store, loaded, name="sys", text=PROMPT, layout="blocks")
    other = list(loaded.tokenizer.encode("a different beginning " + PROMPT))
    with pytest.raises(MismatchError, match="not a prefix"):
        commands.continue_from(store, loaded, other, name="sys", max_tokens=4, verify=True)
    got = commands.continue_from(store, loaded, other, name=None, max_tokens=4, verify=True)
    assert got.reused == 0  # the lookup finds nothing usable and prefills from scratch
    have = list(loaded.tokenizer.encode(PROMPT))
    k = next(
        i for i, (x, y) in enumerate(zip(have, other, strict=False)) if x != y
    )  # after a shared BOS, if any
    assert got.notes == [
        f"no stored prefix of the prompt: 'sys' ({len(have)} tokens) diverges from the prompt at token {k}"
    ]


def _cli(tmp: Path, command: str, *args: str):
    model = ["model.synthetic=true"] if "model" in COMMANDS[command.partition("=")[2]].reads else []
    return run_cli(command, *args, *model, f"kv.store={tmp / 'kv'}", tmp=tmp)


def test_cli_save_generate_verify(tmp_path, loaded):
    r = _cli(tmp_path, "command=kv_save", "kv.name=sys", f"kv.prompt={json.dumps(PROMPT)}", "kv.block_kib=4")
    assert r.returncode == 0, r.stderr
    assert "saved 'sys'" in r.stdout
    text = PROMPT + " and then"
    r = _cli(tmp_path, "command=kv_generate", f"kv.prompt={json.dumps(text)}", "kv.max_tokens=10")
    assert r.returncode == 0, r.stderr
    gen = json.loads(next((tmp_path / "outputs/kv_generate").glob("*/generation.json")).read_text())
    assert gen["reused_tokens"] > 50 and gen["tokens"] == scratch(
        loaded, text, 10, chat=True
    )  # its chat template
    r = _cli(tmp_path, "command=kv_ls")
    assert (
        r.returncode == 0 and "snapshot" in r.stdout and str(tmp_path / "cache/synth") in r.stdout
    )  # the model, by path
    path = tmp_path / "kv/snapshots/sys.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 4
    path.write_bytes(bytes(raw))
    r = _cli(tmp_path, "command=kv_verify", "json=true")
    assert r.returncode == 1 and "hash mismatch" in r.stderr
    report = json.loads(r.stdout)
    assert report["ok"] is False and len(report["problems"]) == 1
    r = _cli(
        tmp_path, "command=kv_generate", f"kv.prompt={json.dumps(text)}", "kv.max_tokens=10", "kv.strict=true"
    )
    assert r.returncode == 1 and "hash mismatch" in r.stderr
    r = _cli(
        tmp_path, "command=kv_generate", f"kv.prompt={json.dumps(text)}", "kv.max_tokens=10", "json=true"
    )
    assert r.returncode == 0, r.stderr
    assert "recomputed its" in r.stdout and "replaced it" in r.stdout
    assert '"reused_tokens": 0' in r.stdout
    r = _cli(tmp_path, "command=kv_verify", "json=true")
    assert r.returncode == 0 and json.loads(r.stdout)["ok"] is True


@pytest.mark.slow
def test_cli_gc_and_bad_input(tmp_path):
    r = _cli(tmp_path, "command=kv_save", "kv.prompt=hello", "kv.layout=blocks")
    assert r.returncode == 2 and "kv.name is not set" in r.stderr
    r = _cli(tmp_path, "command=kv_save", "kv.name=x", "kv.prompt=a", "kv.prompt_file=b")
    assert r.returncode == 2 and "exactly one of kv.prompt" in r.stderr
    r = _cli(tmp_path, "command=kv_save", "kv.name=../x", "kv.prompt=a")
    assert r.returncode == 2 and "not a valid snapshot name" in r.stderr
    for name, text in (("a", "one two three"), ("a", "four five six seven")):
        assert (
            _cli(
                tmp_path,
                "command=kv_save",
                f"kv.name={name}",
                f"kv.prompt={json.dumps(text)}",
                "kv.layout=blocks",
            ).returncode
            == 0
        )
    r = _cli(tmp_path, "command=kv_ls", "json=true")
    assert [s["name"] for s in json.loads(r.stdout)["snapshots"]] == ["a"]
    r = _cli(tmp_path, "command=kv_gc")
    assert r.returncode == 0 and "1 blocks" in r.stdout and "kv.execute=true" in r.stdout
    r = _cli(tmp_path, "command=kv_gc", "json=true")
    plan = json.loads(r.stdout)["result"]
    assert r.returncode == 0 and len(plan["plan"]["blocks"]) == 1 and plan["done"] is None
    r = _cli(tmp_path, "command=kv_gc", "kv.execute=true")
    assert r.returncode == 0 and "freed" in r.stdout
    assert len(list((tmp_path / "kv/blocks").iterdir())) == 1
    assert _cli(tmp_path, "command=kv_verify").returncode == 0


def test_fingerprints_tell_models_and_tokenizers_apart(loaded, tmp_path):
    from mlxbun.source.fingerprint import model_fingerprint, tokenizer_fingerprint

    other = synth_write.ensure_synthetic(cache_dir=tmp_path, arch="llama", preset="tiny", seed=1)
    assert model_fingerprint(other) != loaded.model_fp  # same shapes, other weights
    assert model_fingerprint(loaded.path) == loaded.model_fp
    assert tokenizer_fingerprint(other) == loaded.tokenizer_fp
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok/tokenizer.json").write_text("{}")
    assert tokenizer_fingerprint(tmp_path / "tok") not in ("", loaded.tokenizer_fp)
    assert tokenizer_fingerprint(tmp_path) == ""


def _flip_one(model: Path, pick) -> str:
    """Negate one tensor (chosen by ``pick`` from the sorted names) of the model's last shard."""
    import mlx.core as mx

    shard = sorted(model.glob("*.safetensors"))[-1]
    tensors = mx.load(str(shard))
    name = pick(sorted(tensors))
    tensors[name] = -tensors[name]
    mx.save_safetensors(str(shard), tensors, metadata={"format": "mlx"})
    return name


def test_fingerprint_covers_every_tensor(tmp_path):
    """Negating any one of 40 tensors (5 MiB; the old 16 x 64 KiB sample saw a fifth of it)
    gives another fingerprint; a copy with the same bytes gives the same one."""
    import numpy as np
    from safetensors.numpy import save_file

    from mlxbun.source.fingerprint import model_fingerprint

    rng = np.random.default_rng(0)
    tensors = {f"layers.{i:02d}.w": rng.standard_normal((256, 128), dtype=np.float32) for i in range(40)}
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text('{"model_type": "llama"}')
    save_file(tensors, str(src / "model.safetensors"))
    cache = tmp_path / "digests"
    base = model_fingerprint(src, cache_dir=cache)
    seen = {base}
    for name in tensors:
        save_file(dict(tensors, **{name: -tensors[name]}), str(src / "model.safetensors"))
        seen.add(model_fingerprint(src, cache_dir=cache))
    assert len(seen) == 41
    save_file(tensors, str(src / "model.safetensors"))
    shutil.copytree(src, tmp_path / "same")
    assert model_fingerprint(tmp_path / "same", cache_dir=cache) == base == model_fingerprint(src)


def test_generate_explains_another_model_and_repairs(loaded, tmp_path):
    store = Store(tmp_path / "kv")
    commands.save_prompt(store, loaded, name="sys", text=PROMPT, layout="snapshot")
    other_dir = tmp_path / "other"
    shutil.copytree(loaded.path, other_dir)
    _flip_one(other_dir, lambda names: names[len(names) // 2])
    other = commands.load_model(other_dir)
    toks = list(other.tokenizer.encode(PROMPT + " more"))
    got = commands.continue_from(store, other, toks, name=None, max_tokens=4, verify=True)
    assert got.reused == 0 and "'sys' was saved for another model" in got.notes[0]
    with pytest.raises(MismatchError, match="saved for model"):
        commands.continue_from(store, other, toks, name="sys", max_tokens=4, verify=True)
    # an empty store says so; a missing named snapshot is recomputed and saved (not strict)
    empty = Store(tmp_path / "empty")
    got = commands.continue_from(empty, loaded, toks, name=None, max_tokens=4, verify=True)
    assert got.notes == [f"no snapshot in kv.store={empty.root} to reuse"]
    with pytest.raises(InputError, match="no such snapshot"):
        commands.continue_from(empty, loaded, toks, name="new", max_tokens=4, verify=True)
    got = commands.continue_from(empty, loaded, toks, name="new", max_tokens=4, verify=True, strict=False)
    assert "recomputed its" in got.notes[0] and empty.info("new").tokens == len(toks)
    assert got.tokens == scratch(loaded, PROMPT + " more", 4)


@pytest.mark.parametrize("layout", ["snapshot", "blocks"])
def test_corrupt_snapshot_is_recomputed_and_replaced(loaded, tmp_path, layout):
    from mlxbun.kv import format as fmt

    store = Store(tmp_path, block_kib=4)
    info, toks, _ = commands.save_prompt(store, loaded, name="sys", text=PROMPT, layout=layout)
    good = store.header("sys")[1]
    victim = sorted((tmp_path / "blocks").iterdir())[0] if layout == "blocks" else info.path
    raw = bytearray(victim.read_bytes())
    raw[-100] ^= 1
    victim.write_bytes(bytes(raw))
    full = list(loaded.tokenizer.encode(PROMPT + " and then"))
    with pytest.raises(fmt.CorruptError, match="hash mismatch"):
        commands.continue_from(store, loaded, full, name=None, max_tokens=6, verify=True, strict=True)
    got = commands.continue_from(store, loaded, full, name=None, max_tokens=6, verify=True, strict=False)
    # recomputed, not reused: the tokens came from a prefill, not the store
    assert got.reused == 0 and "hash mismatch" in got.notes[0] and "replaced it" in got.notes[0]
    assert got.tokens == scratch(loaded, PROMPT + " and then", 6)
    assert store.verify()[1] == [] if layout == "snapshot" else store.verify(["sys"])[1] == []
    assert store.header("sys")[1]["tokens"] == good["tokens"]


def test_read_only_store_fails_before_the_model_loads(tmp_path, monkeypatch):
    from types import SimpleNamespace

    (tmp_path / "file").write_text("x")
    kv = SimpleNamespace(
        name="s", prompt="hello", prompt_file=None, store=str(tmp_path / "file/kv"), block_kib=4
    )
    cfg = SimpleNamespace(
        kv=kv, model=SimpleNamespace(synthetic=True), paths=SimpleNamespace(cache=str(tmp_path))
    )

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the store was checked")

    monkeypatch.setattr(commands, "load_model", no_load)
    with pytest.raises(InputError, match=r"kv.store=.*/file/kv is not writable"):
        commands.save(cfg)
    args = ("command=kv_save", "kv.name=s", "kv.prompt=hello", "model.synthetic=true")
    r = run_cli(*args, f"kv.store={tmp_path / 'file/kv'}", tmp=tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "is not writable" in r.stderr


def test_a_fifo_or_directory_among_snapshots_is_skipped_with_a_warning(tmp_path, loaded):
    r = _cli(tmp_path, "command=kv_save", "kv.name=sys", f"kv.prompt={json.dumps(PROMPT)}")
    assert r.returncode == 0, r.stderr
    snaps = tmp_path / "kv" / "snapshots"
    os.mkfifo(snaps / "zzz.safetensors")
    (snaps / "yyy.safetensors").mkdir()
    for args in (["command=kv_ls"], ["command=kv_generate", f"kv.prompt={json.dumps(PROMPT + ' and')}"]):
        r = _cli(tmp_path, *args)
        assert r.returncode == 0, r.stderr
        assert "zzz.safetensors is not a regular file; skipped" in r.stderr
    assert "reused" in r.stdout and "reused 0 " not in r.stdout  # 'sys' still serves
    r = _cli(tmp_path, "command=kv_gc")
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("spoil", ["flip", "truncate", "empty"])
def test_strict_stops_on_a_snapshot_whose_header_cannot_be_read(tmp_path, loaded, spoil):
    r = _cli(tmp_path, "command=kv_save", "kv.name=sys", f"kv.prompt={json.dumps(PROMPT)}")
    assert r.returncode == 0, r.stderr
    snap = tmp_path / "kv" / "snapshots" / "sys.safetensors"
    raw = bytearray(snap.read_bytes())
    raw[40] ^= 0x55
    snap.write_bytes({"flip": bytes(raw), "truncate": bytes(raw[:100]), "empty": b""}[spoil])
    prompt = f"kv.prompt={json.dumps(PROMPT + ' and')}"
    r = _cli(tmp_path, "command=kv_generate", prompt, "kv.strict=true")
    assert r.returncode == 1 and "snapshot 'sys' cannot be read" in r.stderr
    r = _cli(tmp_path, "command=kv_generate", prompt)
    assert r.returncode == 0 and "snapshot 'sys' cannot be read" in r.stdout and "reused 0 " in r.stdout


def test_kv_save_of_a_model_without_tokenizer_files_is_one_line(tmp_path, loaded):
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in loaded.path.iterdir():
        if f.is_file() and "tokenizer" not in f.name and f.suffix in (".json", ".safetensors"):
            (bare / f.name).write_bytes(f.read_bytes())
    r = run_cli("command=kv_save", "kv.name=sys", "kv.prompt=hello", f"model.name={bare}", tmp=tmp_path)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"error: {bare}: no tokenizer files" in r.stderr
