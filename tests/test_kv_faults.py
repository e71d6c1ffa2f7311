"""kv fault tests: corruption, lying headers, hostile block names, SIGKILL mid-save, two writers, disk full."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from kv_child import version_cache
from kv_util import filled, state_arrays, tiny_model

from mlxbun.kv import blocks as blk
from mlxbun.kv import format as fmt
from mlxbun.kv import promptcache as pc
from mlxbun.kv import snapshot as snap
from mlxbun.kv import state
from mlxbun.kv.store import STEPS, Store

LAYOUTS = ["snapshot", "blocks"]
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def _saved(model, tmp_path, layout):
    cache, toks = filled(model, "kv", 40)
    store = Store(tmp_path, block_kib=4)
    store.save("s", cache, tokens=toks, model="m", layout=layout)
    return store, cache, toks


def _flip(path: Path, pos: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[pos] ^= 0x01
    path.write_bytes(bytes(raw))


def _block(tmp_path: Path) -> Path:
    return sorted((tmp_path / "blocks").iterdir())[1]


# ---------------------------------------------------------------- corruption is detected and named


def test_snapshot_data_flip_names_the_tensor(model, tmp_path):
    store, _, _ = _saved(model, tmp_path, "snapshot")
    path = tmp_path / "snapshots/s.safetensors"
    h = snap.read_header(path, what="x")
    t = h["layers"][1]["tensors"]["values"]
    _flip(path, h["data_start"] + t["offset"] + 5)
    with pytest.raises(fmt.CorruptError, match=r"tensor '1\.values' hash mismatch"):
        store.load("s", model="m")
    assert store.load("s", model="m", verify=False).cache  # verification is switchable
    _, problems = store.verify()
    assert len(problems) == 1 and "1.values" in problems[0]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_header_flip_truncation_and_extension(model, tmp_path, layout):
    store, _, _ = _saved(model, tmp_path, layout)
    path = tmp_path / "snapshots" / ("s.safetensors" if layout == "snapshot" else "s.kvm")
    good = path.read_bytes()
    _flip(path, 70)
    with pytest.raises(fmt.CorruptError, match="header hash mismatch"):
        store.load("s", model="m")
    path.write_bytes(good[:40])
    with pytest.raises(fmt.CorruptError, match="truncated header"):
        store.load("s", model="m")
    path.write_bytes(good[:-1] if layout == "snapshot" else good[: len(good) // 2])
    with pytest.raises(fmt.CorruptError, match="truncated|exceeds the file"):
        store.load("s", model="m")
    path.write_bytes(good + b"\0")
    if layout == "snapshot":
        with pytest.raises(fmt.CorruptError, match="truncated or extended"):
            store.load("s", model="m")
    magic_at = 8 if layout == "snapshot" else 0  # a .kvs opens with its safetensors header length
    path.write_bytes(good[:magic_at] + b"GARBAGE!" + good[magic_at + 8 :])
    with pytest.raises(fmt.CorruptError, match="bad magic"):
        store.load("s", model="m")
    if layout == "snapshot":
        for length, msg in (
            (b"GARBAGE!", "header length .* exceeds"),
            (b"\xf8\x7f" + bytes(6), "hash mismatch"),
        ):
            path.write_bytes(length + good[8:])
            with pytest.raises(fmt.CorruptError, match=msg):
                store.load("s", model="m")


def _reseal(path: Path, edit) -> None:
    """Apply ``edit`` to a snapshot's safetensors table and rewrite it with a valid header hash."""
    raw = path.read_bytes()
    start = int.from_bytes(raw[:8], "little") + 8
    table = json.loads(raw[8:start])
    edit(table)
    body = json.dumps(table, separators=(",", ":")).encode()
    head = raw[:8] + body + b" " * (start - 8 - len(body))
    assert len(body) <= start - 8
    zeroed = head[: pc.HASH_AT] + b"0" * 64 + head[pc.HASH_AT + 64 :]
    digest = hashlib.sha256(zeroed).hexdigest().encode()
    path.write_bytes(head[: pc.HASH_AT] + digest + head[pc.HASH_AT + 64 :] + raw[start:])


def test_snapshot_table_padding_and_version_are_covered(model, tmp_path):
    """The safetensors table mx.load follows must be the one the header describes; every byte
    before the data is hashed, padding included; another container version is refused."""
    store, _, _ = _saved(model, tmp_path, "snapshot")
    path = tmp_path / "snapshots/s.safetensors"
    good = path.read_bytes()
    _flip(path, 16000)  # a padding space
    with pytest.raises(fmt.CorruptError, match="header hash mismatch"):
        store.load("s", model="m")
    path.write_bytes(good)

    def swap(table):  # point layer 0's keys at its values' bytes
        table["0.0"]["data_offsets"], table["0.1"]["data_offsets"] = (
            table["0.1"]["data_offsets"],
            table["0.0"]["data_offsets"],
        )

    _reseal(path, swap)
    with pytest.raises(fmt.CorruptError, match="tensor table does not match its header"):
        store.load("s", model="m")
    path.write_bytes(good)
    _reseal(path, lambda t: t["__metadata__"].update({"0.mlxbun_kvs": "4"}))
    with pytest.raises(fmt.UnsupportedError, match="format version 4 is not supported"):
        store.load("s", model="m")
    path.write_bytes(good)
    assert store.load("s", model="m").cache


def test_block_flip_truncate_extend_missing_name_the_block(model, tmp_path):
    store, _, _ = _saved(model, tmp_path, "blocks")
    block = _block(tmp_path)
    good = block.read_bytes()
    cases = [
        (good[:-3], "is truncated"),
        (good + b"xx", "is extended"),
        (bytes([good[0] ^ 0x80]) + good[1:], "hash mismatch"),
    ]
    for data, pattern in cases:
        block.write_bytes(data)
        with pytest.raises(fmt.CorruptError, match=f"block {block.name} {pattern}"):
            store.load("s", model="m")
        _, problems = store.verify()
        assert len(problems) == 1 and block.name in problems[0]
    block.unlink()
    with pytest.raises(fmt.CorruptError, match=f"block {block.name} is missing"):
        store.load("s", model="m")


def test_a_damaged_block_of_the_right_size_is_rewritten_by_the_next_save(model, tmp_path):
    """A block's name is its content's hash: one that exists with other bytes is replaced, not
    taken as already written."""
    store, cache, toks = _saved(model, tmp_path, "blocks")
    block = _block(tmp_path)
    good = block.read_bytes()
    block.write_bytes(bytes([good[0] ^ 0x80]) + good[1:])
    assert block.name in store.verify()[1][0]
    store.save("s", cache, tokens=toks, model="m", layout="blocks")
    assert block.read_bytes() == good and store.verify()[1] == []
    assert store.load("s", model="m").cache


# ---------------------------------------------------------------- lying headers


def _rewrite(path: Path, h: dict) -> None:
    """Re-encode a (modified) header with a valid hash, keeping the data (and, for a snapshot,
    its safetensors table: the lie is in the mlxbun header the table should derive from)."""
    if path.suffix == ".kvm":
        path.write_bytes(fmt.encode(h))
        return
    text = json.dumps(h, sort_keys=True, separators=(",", ":"))
    _reseal(path, lambda t: t["__metadata__"].update({"0.mlxbun_header": text}))


LIES = [
    (lambda h: h["layers"][0]["tensors"]["keys"].update(dtype="float64"), "dtype 'float64'"),
    (lambda h: h["layers"][0]["tensors"]["keys"].update(shape=[1, 2, 40]), "not 4 integers"),
    (lambda h: h["layers"][0]["tensors"]["keys"].update(shape=[1, 2, 41, 32]), "holds 41 tokens"),
    (lambda h: h["layers"][0]["tensors"]["keys"].update(shape=[1, 2, -40, 32]), "must be an integer >= 0"),
    (lambda h: h["layers"][0]["meta"].update(offset=1 << 41), "holds 40 tokens"),
    (
        lambda h: (
            h["layers"][0]["meta"].update(offset=1 << 41),
            [t.update(shape=[1, 2, 1 << 41, 32]) for t in h["layers"][0]["tensors"].values()],
        ),
        "larger than",
    ),
    (lambda h: h["layers"][0]["tensors"].pop("values"), "do not match class"),
    (lambda h: h["layers"][1].update({"class": "MambaCache"}), "'MambaCache' is not supported"),
    (lambda h: h.update(tokens=h["tokens"][:-1]), "tokens_sha256"),
    (lambda h: h.update(hash="md5"), "hash 'md5' is not supported"),
]
SNAPSHOT_LIES = [
    (lambda h: h["layers"][0]["tensors"]["keys"].update(offset=100), "overlap|contiguous"),
    (lambda h: h["layers"][0]["tensors"]["keys"].update(offset=1 << 40), "runs past"),
    (lambda h: h["layers"][0]["tensors"]["keys"].update(nbytes=7), "nbytes=7"),
    (lambda h: h["layers"][0]["tensors"]["values"].update(offset=0), "overlap"),
    (lambda h: h.update(data_bytes=h["data_bytes"] + 16384), "truncated or extended"),
]
BLOCK_LIES = [
    (lambda h: h["blocks"].pop(), "blocks; the shapes need"),
    (lambda h: h["blocks"][0].update(nbytes=h["blocks"][0]["nbytes"] + 1), "but the shapes give"),
    (lambda h: h.update(block_tokens=0), "block_tokens"),
]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_lying_headers_refused_before_allocating(model, tmp_path, layout, monkeypatch):
    store, _, _ = _saved(model, tmp_path, layout)
    path = tmp_path / "snapshots" / ("s.safetensors" if layout == "snapshot" else "s.kvm")
    good = path.read_bytes()
    original = store.header("s")[1]

    def no_alloc(*a, **k):
        raise AssertionError("allocated before the header was validated")

    lies = LIES + (SNAPSHOT_LIES if layout == "snapshot" else BLOCK_LIES)
    for lie, pattern in lies:
        h = json.loads(json.dumps(original))
        lie(h)
        _rewrite(path, h)
        monkeypatch.setattr(np, "empty", no_alloc)
        monkeypatch.setattr(state, "alloc", no_alloc)
        with pytest.raises((fmt.CorruptError, fmt.UnsupportedError), match=pattern):
            store.load("s", model="m")
        monkeypatch.undo()
        path.write_bytes(good)
    assert store.load("s", model="m").cache


# ---------------------------------------------------------------- hostile block names and symlinks


@pytest.mark.parametrize("bad", ["../../x", "A" * 64, "ab" * 31, "0" * 65, "../" + "0" * 61, "g" * 64])
def test_bad_block_names_rejected(model, tmp_path, bad):
    store, _, _ = _saved(model, tmp_path, "blocks")
    path = tmp_path / "snapshots/s.kvm"
    h, _ = fmt.read_header(path, what="x")
    h["blocks"][0]["hash"] = bad
    path.write_bytes(fmt.encode(h))
    (tmp_path / "x").write_bytes(b"outside")
    with pytest.raises(fmt.CorruptError, match="is not 64 lower-case hex digits"):
        store.load("s", model="m")
    with pytest.raises(fmt.CorruptError):
        blk.read_block(tmp_path / "blocks", bad, 7, verify=False, what="t")


def test_symlinks_in_blocks_rejected(model, tmp_path):
    store, cache, toks = _saved(model, tmp_path, "blocks")
    block = _block(tmp_path)
    elsewhere = tmp_path / "copy"
    elsewhere.write_bytes(block.read_bytes())
    block.unlink()
    block.symlink_to(elsewhere)  # same bytes, right name: still refused
    with pytest.raises(fmt.CorruptError, match="symlink"):
        store.load("s", model="m")
    _, problems = store.verify()
    assert any("symlink" in p for p in problems)
    (tmp_path / "blocks" / "README").write_text("stray")
    assert any("blocks/README: not a block name" in p for p in store.scan_blocks_dir())
    with pytest.raises(fmt.CorruptError, match="not a regular file"):
        store.save(
            "again", cache, tokens=toks, model="m", layout="blocks"
        )  # a writer will not trust it either


# ---------------------------------------------------------------- SIGKILL mid-save, two writers


def _digest(cache) -> str:
    h = hashlib.sha256()
    for a in state_arrays(cache):
        h.update(a.tobytes())
    return h.hexdigest()


def _child(
    root: Path, layout: str, versions: list[int], rounds: int | str, name: str = "s"
) -> subprocess.Popen:
    """Started now (imports overlap), saving only after go()."""
    args = [
        sys.executable,
        str(REPO / "tests/kv_child.py"),
        str(root),
        layout,
        str(rounds),
        name,
        *map(str, versions),
    ]
    p = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return p


def go(p: subprocess.Popen) -> None:
    assert p.stdout.readline().strip() == "ready"
    p.stdin.write("go\n")
    p.stdin.flush()


SLOW_SNAPSHOT = ["blocks", pytest.param("snapshot", marks=pytest.mark.slow)]


@pytest.mark.parametrize("layout", SLOW_SNAPSHOT)
def test_sigkill_mid_save_leaves_old_snapshot_loadable(tmp_path, layout):
    store = Store(tmp_path, block_kib=64)
    cache, toks = version_cache(0)
    store.save("s", cache, tokens=toks, model="m", layout=layout)
    known = {v: _digest(version_cache(v)[0]) for v in (0, 1, 2)}
    rng = random.Random(1234)
    kids = [_child(tmp_path, layout, [1, 2], rounds=50) for _ in range(3)]
    interrupted = 0
    for child in kids:
        go(child)
        time.sleep(rng.uniform(0.0, 0.8))
        child.send_signal(signal.SIGKILL)
        child.wait()
        lines = child.stdout.read().split()
        interrupted += len(lines) > 1 and lines[-2] == "start"  # killed inside store.save
        assert store.names() == ["s"]  # no torn file is visible under any name
        restored = store.load("s", model="m", tokens=[store.header("s")[1]["tokens"][0]] * 1500)
        digest = _digest(restored.cache)
        assert digest in known.values()  # bit-exactly one complete version
        assert store.verify()[1] == []
    assert interrupted >= 1  # at least one kill landed mid-write
    from mlxbun.kv import gc

    gc.execute(store, gc.plan(store))  # leftovers of dead writers are only hidden temp files
    assert not [p for p in tmp_path.rglob(".*tmp-*")]
    assert store.load("s", model="m").cache


@pytest.mark.parametrize("layout", SLOW_SNAPSHOT)
def test_two_writers_of_the_same_snapshot(tmp_path, layout):
    store = Store(tmp_path, block_kib=64)
    kids = [_child(tmp_path, layout, [v], rounds=3) for v in (3, 4)]
    for k in kids:
        go(k)
    for k in kids:
        assert k.stdout.read().split()[-1] == "done"
        assert k.wait() == 0
    digest = _digest(store.load("s", model="m").cache)
    assert digest in {_digest(version_cache(v)[0]) for v in (3, 4)}
    assert store.verify()[1] == []
    assert not [p for p in tmp_path.rglob(".*tmp-*")]


# ---------------------------------------------------------------- disk full


@pytest.mark.parametrize("layout", LAYOUTS)
def test_disk_full_simulated(model, tmp_path, layout, monkeypatch):
    store, cache, toks = _saved(model, tmp_path, layout)
    before = state_arrays(store.load("s", model="m").cache)
    calls = {"n": 0}
    real = snap._write

    def full(fd, data, offset):
        calls["n"] += 1
        if calls["n"] > 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, data, offset)

    monkeypatch.setattr(snap, "_write", full)
    monkeypatch.setattr(blk, "_write", full)
    bigger, more = filled(model, "kv", 60, seed=7)
    with pytest.raises(OSError, match="No space left.*previous version is untouched"):
        store.save("s", bigger, tokens=more, model="m", layout=layout)
    monkeypatch.undo()
    for a, b in zip(before, state_arrays(store.load("s", model="m").cache), strict=True):
        np.testing.assert_array_equal(a, b)
    assert not [p for p in tmp_path.rglob(".*tmp-*")]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_disk_full_on_a_real_small_tmpfs(layout):
    mnt = Path(tempfile.mkdtemp())
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        store = Store(mnt, block_kib=256)
        small, toks = version_cache(5, tokens=300)  # ~2.4 MB
        store.save("s", small, tokens=toks, model="m", layout=layout)
        big, btoks = version_cache(6, tokens=1500)  # ~12 MB: does not fit
        with pytest.raises(OSError, match="No space left"):
            store.save("s", big, tokens=btoks, model="m", layout=layout)
        assert _digest(store.load("s", model="m").cache) == _digest(small)
        assert not [p for p in mnt.rglob(".*tmp-*")]
        from mlxbun.kv import gc

        gc.execute(store, gc.plan(store))  # orphan blocks of the failed save are freed
        assert store.verify()[1] == []
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


# ---------------------------------------------------------------- a kill at every named step


def _published(root: Path) -> dict[str, bytes]:
    """Every published file of a store (hidden temporary files, locks and use times aside)."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for d in ("snapshots", "blocks")
        if (root / d).is_dir()
        for p in sorted((root / d).iterdir())
        if not p.name.startswith(".")
    }


def _save_killed_at(root: Path, layout: str, step: str) -> subprocess.CompletedProcess:
    code = f"""
import os, signal, sys
sys.path[:0] = [{str(REPO)!r}, {str(REPO / "tests")!r}]
from kv_child import version_cache
from mlxbun.kv.store import Store
cache, toks = version_cache(1, tokens=300)
def stage(name):
    if name == {step!r}:
        os.kill(os.getpid(), signal.SIGKILL)
Store({str(root)!r}, block_kib=64).save("s", cache, tokens=toks, model="m", layout={layout!r}, on_stage=stage)
"""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("layout", "step"),
    [(lay, s) for lay in LAYOUTS for s in STEPS[lay]],
)
def test_kill_at_every_named_step_then_rerun_gives_the_same_bytes(tmp_path, layout, step):
    old, old_toks = version_cache(0, tokens=300)
    new, new_toks = version_cache(1, tokens=300)
    clean = Store(tmp_path / "clean", block_kib=64)
    clean.save("s", old, tokens=old_toks, model="m", layout=layout)
    clean.save("s", new, tokens=new_toks, model="m", layout=layout)
    store = Store(tmp_path / "killed", block_kib=64)
    store.save("s", old, tokens=old_toks, model="m", layout=layout)
    r = _save_killed_at(store.root, layout, step)
    assert r.returncode == -signal.SIGKILL, r.stderr
    got = store.load("s", model="m")  # the previous version or the new one, never a mix
    assert got.tokens in (old_toks, new_toks)
    want = old if got.tokens == old_toks else new
    for a, b in zip(state_arrays(want), state_arrays(got.cache), strict=True):
        np.testing.assert_array_equal(a, b)
    store.save("s", new, tokens=new_toks, model="m", layout=layout)  # the rerun
    assert _published(store.root) == _published(clean.root)
    assert store.verify() == clean.verify()
