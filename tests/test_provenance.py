"""Manifest hashing: parallel sha256 of files, the input digest cache, and verify."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pytest

from mlxbun.errors import DriftError, InputError
from mlxbun.runs import provenance, verify
from mlxbun.runs.provenance import Manifest, RunResult, cached_sha256, hash_paths, verify_run


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
    real = provenance.file_digest
    monkeypatch.setattr(provenance, "file_digest", lambda p, kind: calls.append(p) or real(p, kind))
    first = cached_sha256(f, cache)
    assert cached_sha256(f, cache) == first and len(calls) == 1
    f.write_bytes(b"y" * 1000)  # same size, new content: new mtime, new key
    os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 1_000_000))
    assert cached_sha256(f, cache) == hashlib.sha256(b"y" * 1000).hexdigest() and len(calls) == 2
    before = f.stat()
    time.sleep(0.05)  # file times tick with the kernel's coarse clock (at most 10 ms a tick)
    with open(f, "r+b") as fh:  # rewritten in place (same inode, same size), its mtime set back
        fh.write(b"z" * 1000)
    os.utime(f, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert cached_sha256(f, cache) == hashlib.sha256(b"z" * 1000).hexdigest() and len(calls) == 3


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


def _model_run(run_dir: Path) -> Manifest:
    """A finished run whose outputs are a model directory (with a hidden side file) and a plan."""
    model = run_dir / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "model.safetensors").write_bytes(os.urandom(256))
    (model / ".mlxbun-quantize.json").write_text('{"bits": 4}')
    (run_dir / "plan.json").write_text("{}")
    (run_dir / "notes.txt").write_text("beside the outputs, not one of them")
    m = Manifest(run_dir=run_dir, command="quantize", config={}, overrides=[], recipe=None, seed=0, blas={})
    m.finish(status="ok", result=RunResult(outputs=[model, run_dir / "plan.json"]))
    return m


@pytest.mark.parametrize("status", ["running", "failed", "interrupted"])
def test_verify_refuses_a_run_that_did_not_complete(tmp_path: Path, status: str) -> None:
    run_dir = tmp_path / "run"
    m = Manifest(run_dir=run_dir, command="quantize", config={}, overrides=[], recipe=None, seed=0, blas={})
    if status == "running":  # killed: the first manifest is all there is, outputs empty
        m.write()
    else:
        (run_dir / "model").mkdir(parents=True)
        (run_dir / "model" / "config.json").write_text("{}")
        m.finish(status=status, result=RunResult(outputs=[run_dir / "model"]), error="boom")
    with pytest.raises(DriftError, match=f"status is '{status}'"):
        verify_run(run_dir)


def test_verify_reports_added_files_and_edited_hidden_files(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _model_run(run_dir)
    assert verify_run(run_dir) == []
    (run_dir / "model" / "evil.py").write_text("import os\n")
    (run_dir / "model" / "sub").mkdir()
    (run_dir / "model" / "sub" / ".hidden").write_text("x")
    (run_dir / "model" / ".mlxbun-quantize.json").write_text('{"bits": 8}')
    drift = {d.path: d for d in verify_run(run_dir)}
    assert set(drift) == {"model/evil.py", "model/sub/.hidden", "model/.mlxbun-quantize.json"}
    assert drift["model/evil.py"].expected == "absent" and drift["model/evil.py"].found != "missing"


def test_verify_never_reads_a_manifest_path_outside_the_run_dir(tmp_path: Path, monkeypatch) -> None:
    run_dir = tmp_path / "run"
    _model_run(run_dir)
    secret = tmp_path / "secret"
    secret.write_text("not yours")
    (run_dir / "model" / "link").symlink_to(secret)
    mpath = run_dir / "manifest.json"
    manifest = json.loads(mpath.read_text())
    for entry in (str(secret), "../secret", "model/../../secret", "model/link"):
        manifest["outputs"][entry] = {"sha256": "0" * 64, "size": 9}
    mpath.write_text(json.dumps(manifest))
    read = []
    real = provenance.file_digest
    monkeypatch.setattr(provenance, "file_digest", lambda p, kind: read.append(Path(p)) or real(p, kind))
    drift = {d.path: d.found for d in verify_run(run_dir)}
    assert {k for k, v in drift.items() if "outside the run directory" in v} == {
        str(secret),
        "../secret",
        "model/../../secret",
        "model/link",
    }
    assert all(p.resolve().is_relative_to(run_dir.resolve()) for p in read) and read


def test_verify_command_prints_json_and_exits_1_on_drift(tmp_path: Path) -> None:
    from mlxbun.config import schema

    run_dir = tmp_path / "run"
    _model_run(run_dir)
    cfg = schema.Config()
    cfg.runs.dir, cfg.json = str(run_dir), True
    res = verify.run(cfg)
    assert res.exit_code == 0 and json.loads(res.message) == {"run_dir": str(run_dir), "drift": []}
    (run_dir / "plan.json").write_text("[]")
    res = verify.run(cfg)
    got = json.loads(res.message)
    assert res.exit_code == 1 and [d["path"] for d in got["drift"]] == ["plan.json"]


def _elsewhere_run(tmp_path: Path, config: dict) -> Path:
    """A finished run whose model and one file were written outside the run directory."""
    run_dir, model, snap = (
        tmp_path / "run",
        tmp_path / "out" / "model",
        tmp_path / "kv" / "snapshots" / "s.bin",
    )
    model.mkdir(parents=True)
    (model / "model.safetensors").write_bytes(os.urandom(64))
    snap.parent.mkdir(parents=True)
    snap.write_bytes(b"kv")
    m = Manifest(
        run_dir=run_dir, command="pipeline", config=config, overrides=[], recipe=None, seed=0, blas={}
    )
    m.finish(status="ok", result=RunResult(outputs=[model, snap, snap]))
    return run_dir


def test_verify_checks_outputs_the_runs_own_config_placed_elsewhere(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # relative config paths are taken from where the run started
    run_dir = _elsewhere_run(tmp_path, {"quant": {"out": "out/model"}, "kv": {"store": str(tmp_path / "kv")}})
    assert verify_run(run_dir) == []
    monkeypatch.chdir(run_dir)
    assert verify_run(run_dir) == []
    (tmp_path / "out" / "model" / "model.safetensors").write_bytes(b"changed")
    assert [d.path for d in verify_run(run_dir)] == [str(tmp_path / "out" / "model" / "model.safetensors")]


def test_verify_refuses_paths_outside_the_config_and_lists_each_once(tmp_path: Path) -> None:
    run_dir = _elsewhere_run(tmp_path, {"quant": {"out": None}, "kv": {"store": str(tmp_path / "elsewhere")}})
    drift = verify_run(run_dir)
    paths = [d.path for d in drift]
    assert len(paths) == len(set(paths)) == 3 and all(d.found == provenance.OUTSIDE for d in drift)
    assert str(tmp_path / "kv" / "snapshots" / "s.bin") in paths
    mpath = run_dir / "manifest.json"
    manifest = json.loads(mpath.read_text())
    manifest["config"]["quant"]["out"] = "/"  # an edited config cannot open the whole disk
    mpath.write_text(json.dumps(manifest))
    assert {d.path for d in verify_run(run_dir)} == set(paths)


def test_verify_reports_links_fifos_and_empty_dirs_added_to_an_output_dir(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _model_run(run_dir)
    model = run_dir / "model"
    (model / "link").symlink_to(model / "config.json")
    (model / "dangling").symlink_to(tmp_path / "nowhere")
    os.mkfifo(model / "pipe")
    (model / "empty").mkdir()
    drift = {d.path: d.describe() for d in verify_run(run_dir)}
    assert drift == {
        "model/dangling": "model/dangling: a symbolic link added (not in the manifest)",
        "model/empty": "model/empty: an empty directory added (not in the manifest)",
        "model/link": "model/link: a symbolic link added (not in the manifest)",
        "model/pipe": "model/pipe: a FIFO added (not in the manifest)",
    }


def test_a_run_records_only_what_it_wrote_in_an_output_dir(tmp_path: Path) -> None:
    run_dir, model = tmp_path / "run", tmp_path / "out"
    model.mkdir()
    (model / "weights.bin").write_bytes(b"w")
    (model / ".record.json").write_text("{}")
    (model / "evil.py").write_text("import os\n")
    (model / "sub").mkdir()
    (model / "sub" / "f").write_text("x")
    m = Manifest(run_dir=run_dir, command="quantize", config={"quant": {"out": str(model)}}, overrides=[],
                 recipe=None, seed=0, blas={})  # fmt: skip
    m.finish(
        status="ok",
        result=RunResult(outputs=[model], written=[model / "weights.bin", model / ".record.json"]),
    )
    assert list(m.outputs) == [str(model / "weights.bin")] and list(m.side_files) == [
        str(model / ".record.json")
    ]
    assert {d.path for d in verify_run(run_dir)} == {str(model / "evil.py"), str(model / "sub" / "f")}
