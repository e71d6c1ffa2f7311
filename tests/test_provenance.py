"""Manifest hashing: parallel sha256 of files, the input digest cache, and verify."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from mlxbun import provenance
from mlxbun.errors import DriftError, InputError
from mlxbun.provenance import Manifest, RunResult, cached_sha256, hash_paths, verify_run


def _tree(root: Path) -> dict[str, bytes]:
    files = {"a.bin": os.urandom(3000), "sub/b.txt": b"hello\n", "sub/deeper/c": b""}
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    (root / ".hidden.tmp-1").write_bytes(b"partial")  # temp names are never part of a run
    return files


def test_hash_paths_hashes_every_file_relative_to_base(tmp_path: Path) -> None:
    files = _tree(tmp_path / "run")
    got = hash_paths([tmp_path / "run"], base=tmp_path / "run")
    want = {k: {"sha256": hashlib.sha256(v).hexdigest(), "size": len(v)} for k, v in sorted(files.items())}
    assert got == want and list(got) == sorted(got)


def test_digest_cache_reuses_unchanged_files_and_notices_changes(tmp_path: Path, monkeypatch) -> None:
    f = tmp_path / "shard.safetensors"
    f.write_bytes(b"x" * 1000)
    cache = tmp_path / "digests"
    calls = []
    real = provenance.sha256_file
    monkeypatch.setattr(provenance, "sha256_file", lambda p: calls.append(p) or real(p))
    first = cached_sha256(f, cache)
    assert cached_sha256(f, cache) == first and len(calls) == 1
    f.write_bytes(b"y" * 1000)  # same size, new content: new mtime, new key
    os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 1_000_000))
    assert cached_sha256(f, cache) == hashlib.sha256(b"y" * 1000).hexdigest() and len(calls) == 2


def test_verify_reports_changed_and_missing_outputs(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _tree(run_dir)
    m = Manifest(run_dir=run_dir, command="synth", config={}, overrides=[], recipe=None, seed=0, blas={})
    m.finish(status="ok", result=RunResult(outputs=[run_dir]))
    assert verify_run(run_dir) == []
    (run_dir / "sub/b.txt").write_bytes(b"hellO\n")
    (run_dir / "a.bin").unlink()
    drift = {d.path: d.found for d in verify_run(run_dir)}
    assert set(drift) == {"a.bin", "sub/b.txt"} and drift["a.bin"] == "missing"


def test_verify_refuses_a_directory_without_manifest_and_a_torn_one(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="has no manifest.json"):
        verify_run(tmp_path)
    (tmp_path / "manifest.json").write_text('{"outputs": ')
    with pytest.raises(DriftError, match="manifest is unreadable"):
        verify_run(tmp_path)
