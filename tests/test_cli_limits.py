"""Sizes checked before anything is written: synth against free disk and memory."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from cli_util import run_cli

from mlxbun import synth
from mlxbun.errors import InputError


def test_a_petabyte_synth_is_refused_before_writing(tmp_path: Path) -> None:
    res = run_cli("command=synth", "synth.hidden_size=10000000", tmp=tmp_path, timeout=60)
    assert res.returncode == 2, res.stderr
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("error: synth llama") and "PiB of disk" in line and "free" in line
    assert not list((tmp_path / "outputs").rglob("*.safetensors"))
    assert not list((tmp_path / "outputs").rglob("manifest.json"))
    with sqlite3.connect(tmp_path / "registry.db") as con:
        assert con.execute("SELECT COUNT(*) FROM runrecord").fetchone() == (0,)


def test_synth_larger_than_memory_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = synth.resolve_spec(arch="llama", preset="tiny", vocab_size=1_000_000)
    monkeypatch.setattr(synth, "available_memory", lambda: 100 << 20)
    with pytest.raises(InputError, match=r"needs about .* of memory .* 100.0 MiB is available"):
        synth.check_room(spec, out=tmp_path / "m", partial_root=None, shard_bytes=5 << 30, overlap=False)
    monkeypatch.setattr(synth, "available_memory", lambda: 8 << 30)
    synth.check_room(spec, out=tmp_path / "m", partial_root=None, shard_bytes=5 << 30, overlap=False)


def test_bytes_already_written_by_a_killed_build_count_as_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = synth.resolve_spec(arch="llama", preset="tiny")
    need = sum(t.nbytes for t in synth.plan(spec))
    partial = tmp_path / f".m.partial-{spec.hash}"
    partial.mkdir()
    (partial / "model-00001-of-00002.safetensors").write_bytes(b"\0" * (need // 2))
    usage = type("U", (), {"free": need - need // 2 + 1})
    monkeypatch.setattr(synth.shutil, "disk_usage", lambda _: usage)
    synth.check_room(spec, out=tmp_path / "m", partial_root=None, shard_bytes=5 << 30, overlap=False)
    (partial / "model-00001-of-00002.safetensors").unlink()
    with pytest.raises(InputError, match="of disk under"):
        synth.check_room(spec, out=tmp_path / "m", partial_root=None, shard_bytes=5 << 30, overlap=False)
