"""What a run says about itself: every run ends ok, failed or interrupted in its manifest and its
registry row; bad input leaves neither a row nor a directory; environment failures name the path.

Faults are injected into a child process through a ``sitecustomize.py`` on its PYTHONPATH.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sqlite3
import subprocess
from pathlib import Path

import pytest
from cli_util import REPO, run_cli

FIXTURE = REPO / "tests" / "fixtures" / "llama-text-3m"


def _inject(tmp: Path, body: str) -> dict[str, str]:
    site = tmp / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(body)
    return {"PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}


def _rows(tmp: Path) -> list[dict]:
    db = tmp / "registry.db"
    if not db.exists():
        return []
    with sqlite3.connect(db) as con:
        con.row_factory = sqlite3.Row
        return [dict(r) for r in con.execute("SELECT * FROM runrecord ORDER BY id")]


def _manifests(tmp: Path) -> list[dict]:
    found = sorted((tmp / "outputs").rglob("manifest.json"))
    return [json.loads(p.read_text()) for p in found]


def _one_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert lines and lines[-1].startswith("error: "), stderr
    return lines[-1]


# A synth run that receives a signal while it writes weights (as Slurm preemption would).
SIGNAL_DURING_SYNTH = """
import os, signal, time
from mlxbun.synth import write as synth_write
real = synth_write._write_weights
def write_then_signal(*a, **k):
    os.kill(os.getpid(), signal.{sig})
    time.sleep(30)
    real(*a, **k)
synth_write._write_weights = write_then_signal
"""


def test_sigterm_ends_the_run_interrupted_in_manifest_and_registry(tmp_path: Path) -> None:
    env = _inject(tmp_path, SIGNAL_DURING_SYNTH.format(sig="SIGTERM"))
    res = run_cli("command=synth", tmp=tmp_path, env=env, timeout=120)
    assert res.returncode == 143, res.stderr
    assert "SIGTERM" in _one_error_line(res.stderr) and "Traceback" not in res.stderr
    (m,) = _manifests(tmp_path)
    assert m["status"] == "interrupted" and "SIGTERM" in m["error"]
    (row,) = _rows(tmp_path)
    assert row["status"] == "interrupted" and "SIGTERM" in row["error"]
    # The staging directory was cleaned up: no model published, no stray temp files in the run.
    run_dir = next((tmp_path / "outputs" / "synth").iterdir())
    assert sorted(p.name for p in run_dir.iterdir()) == ["manifest.json"]


def test_sigint_ends_the_run_interrupted(tmp_path: Path) -> None:
    env = _inject(tmp_path, SIGNAL_DURING_SYNTH.format(sig="SIGINT"))
    res = run_cli("command=synth", tmp=tmp_path, env=env, timeout=120)
    assert res.returncode == 130, res.stderr
    (m,) = _manifests(tmp_path)
    (row,) = _rows(tmp_path)
    assert m["status"] == row["status"] == "interrupted"


def test_runs_lists_interrupted_runs(tmp_path: Path) -> None:
    res = run_cli("command=runs", "runs.status=interrupted", tmp=tmp_path)
    assert res.returncode == 0, res.stderr


def test_corrupt_registry_fails_the_run_naming_the_database(tmp_path: Path) -> None:
    (tmp_path / "registry.db").write_bytes(b"this is not a database" * 100)
    res = run_cli("command=synth", tmp=tmp_path)
    assert res.returncode == 1, res.stderr
    line = _one_error_line(res.stderr)
    assert str(tmp_path / "registry.db") in line, line
    (m,) = _manifests(tmp_path)
    assert m["status"] == "failed" and str(tmp_path / "registry.db") in m["error"]


# The disk fills while synth writes, and stays full: the manifest cannot be rewritten either.
DISK_FULL = """
import errno, os
from mlxbun.runs import provenance
from mlxbun.synth import command as synth
writes = []
real_write = provenance.atomic_write_json
def write_manifest(path, data, *a, **k):
    writes.append(path)
    if len(writes) > 1:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    return real_write(path, data, *a, **k)
provenance.atomic_write_json = write_manifest
def full(spec, out_dir, **k):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(out_dir) + "/model-00001-of-00001.safetensors")
synth.write_spec = full
"""


def test_disk_full_never_leaves_a_manifest_saying_running(tmp_path: Path) -> None:
    env = _inject(tmp_path, DISK_FULL)
    res = run_cli("command=synth", tmp=tmp_path, env=env)
    assert res.returncode == 1, res.stderr
    line = _one_error_line(res.stderr)
    assert "No space left on device" in line and "model-00001-of-00001.safetensors" in line
    assert all(m["status"] != "running" for m in _manifests(tmp_path))
    (row,) = _rows(tmp_path)
    assert row["status"] == "failed" and "No space left" in row["error"]


# The command publishes its outputs, then the registry cannot record the end of the run.
REGISTRY_FAILS_AT_END = """
import sqlite3
from mlxbun import registry
real_end = registry.record_run_end
def end(run_id, *, status, **k):
    if status == "ok":
        raise sqlite3.OperationalError("disk I/O error")
    return real_end(run_id, status=status, **k)
registry.record_run_end = end
"""


def test_a_run_that_fails_to_register_is_not_ok_in_its_manifest(tmp_path: Path) -> None:
    env = _inject(tmp_path, REGISTRY_FAILS_AT_END)
    res = run_cli("command=synth", tmp=tmp_path, env=env)
    assert res.returncode == 1, res.stderr
    assert str(tmp_path / "registry.db") in _one_error_line(res.stderr)
    (m,) = _manifests(tmp_path)
    assert m["status"] == "failed" and "disk I/O error" in m["error"]
    (row,) = _rows(tmp_path)
    assert row["status"] == "failed"


def test_bad_input_found_by_a_command_leaves_no_row_and_no_directory(tmp_path: Path) -> None:
    res = run_cli("command=allocate", f"model.name={FIXTURE}", tmp=tmp_path)
    assert res.returncode == 2, res.stderr
    assert "allocate." in _one_error_line(res.stderr)
    assert _rows(tmp_path) == []
    assert not (tmp_path / "outputs").exists() or not any((tmp_path / "outputs").rglob("*"))


# quant.out is not writable (a read-only mount); the error names the path.
READ_ONLY_OUT = """
import errno, os
from mlxbun.quant.quantize import command as quantize
def ro(src, out, **k):
    raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(out))
quantize.quantize_model_dir = ro
"""


def test_environment_error_names_the_path_and_records_the_run_failed(tmp_path: Path) -> None:
    env = _inject(tmp_path, READ_ONLY_OUT)
    out = tmp_path / "ro" / "q"
    res = run_cli("command=quantize", f"model.name={FIXTURE}", f"quant.out={out}", tmp=tmp_path, env=env)
    assert res.returncode == 1, res.stderr
    line = _one_error_line(res.stderr)
    assert str(out) in line and "Read-only file system" in line, line
    (m,) = _manifests(tmp_path)
    (row,) = _rows(tmp_path)
    assert m["status"] == row["status"] == "failed" and str(out) in row["error"]


def _broken_config(d: Path) -> None:
    (d / "config.json").write_text('{"model_type": "llama",')


def _no_tokenizer(d: Path) -> None:
    for f in d.glob("tokenizer*"):
        f.unlink()


@pytest.mark.parametrize(
    ("damage", "args"),
    [
        (_broken_config, ["command=quantize", "quant.bits=4"]),
        (_no_tokenizer, ["command=kv_save", "kv.name=x", "kv.prompt=hello"]),
    ],
)
def test_a_broken_model_dir_is_named_and_the_run_recorded_failed(tmp_path: Path, damage, args) -> None:
    model = tmp_path / "model"
    shutil.copytree(FIXTURE, model)
    damage(model)
    res = run_cli(*args, f"model.name={model}", tmp=tmp_path)
    assert res.returncode == 1, res.stderr
    line = _one_error_line(res.stderr)
    named = model / "config.json" if damage is _broken_config else model
    assert line.startswith(f"error: {named}: "), line
    (m,) = _manifests(tmp_path)
    (row,) = _rows(tmp_path)
    assert m["status"] == row["status"] == "failed" and str(model) in row["error"]


# SIGTERM arrives after the command finished, while its outputs are hashed into the manifest.
SIGTERM_WHILE_HASHING = """
import os, signal, time
from mlxbun.runs import provenance
real = provenance.hash_paths
def hash_then_signal(paths, **k):
    if k.get("cache_dir") is None:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
    return real(paths, **k)
provenance.hash_paths = hash_then_signal
"""


def test_sigterm_while_outputs_are_hashed_ends_the_run_interrupted(tmp_path: Path) -> None:
    env = _inject(tmp_path, SIGTERM_WHILE_HASHING)
    res = run_cli("command=synth", tmp=tmp_path, env=env, timeout=120)
    assert res.returncode == 143, res.stderr
    (m,) = _manifests(tmp_path)
    (row,) = _rows(tmp_path)
    assert m["status"] == row["status"] == "interrupted"


# The registry breaks while quantize registers the model it just published.
REGISTRY_FAILS_IN_COMMAND = """
import sqlite3
from mlxbun import registry
def broken(*a, **k):
    raise sqlite3.DatabaseError("database disk image is malformed")
registry.register_model = broken
"""


def test_a_registry_failure_inside_a_command_names_the_database(tmp_path: Path) -> None:
    env = _inject(tmp_path, REGISTRY_FAILS_IN_COMMAND)
    res = run_cli("command=quantize", f"model.name={FIXTURE}", "quant.bits=4", tmp=tmp_path, env=env)
    assert res.returncode == 1, res.stderr
    line = _one_error_line(res.stderr)
    assert f"registry {tmp_path / 'registry.db'}: DatabaseError: database disk image is malformed" in line
    (m,) = _manifests(tmp_path)
    (row,) = _rows(tmp_path)
    assert m["status"] == row["status"] == "failed"


def test_quantize_into_an_existing_out_records_only_its_own_files(tmp_path: Path) -> None:
    out = tmp_path / "q"
    first = run_cli("command=quantize", f"model.name={FIXTURE}", f"quant.out={out}", tmp=tmp_path)
    assert first.returncode == 0, first.stderr
    (out / "evil.py").write_text("import os\n")
    (out / "sub").mkdir()
    (out / "sub" / "f").write_text("x")
    again = run_cli("command=quantize", f"model.name={FIXTURE}", f"quant.out={out}", tmp=tmp_path)
    assert again.returncode == 0 and "reused" in again.stdout, again.stderr
    run_dir = Path(again.stdout.split("outputs:")[1].split()[0])
    listed = json.loads((run_dir / "manifest.json").read_text())["outputs"]
    assert listed and not [k for k in listed if k.endswith(("evil.py", "sub/f"))]
    check = run_cli("command=verify", f"runs.dir={run_dir}", tmp=tmp_path)
    assert check.returncode == 1 and "evil.py: added" in check.stderr and "sub/f: added" in check.stderr


def test_runs_lists_a_malformed_row_as_such_and_goes_on(tmp_path: Path) -> None:
    from mlxbun import registry

    registry.open_db(path=tmp_path / "registry.db")
    good = registry.record_run_start(
        command="synth", recipe=None, overrides=[], config_hash="h", output_dir="/ok"
    )
    db = sqlite3.connect(tmp_path / "registry.db")
    cols = "command, overrides, config_hash, status, output_dir, metrics, started_at"
    when = "2026-12-05 03:00:00"
    for row in [("quantize", "[]", "h", "ok", "/a", "not json", when), ("quantize", "[]", "h", "ok", "/b", "{}", 12345),
                (b"q\xff", "[]", "h", "ok", "/c", "{}", when)]:  # fmt: skip
        db.execute(f"INSERT INTO runrecord ({cols}) VALUES (?, ?, ?, ?, ?, ?, ?)", row)
    db.execute(
        f"INSERT INTO runrecord ({cols}) VALUES ('x', '[]', 'h', 'ok', CAST(? AS TEXT), '{{}}', ?)",
        (b"/\xff", when),
    )
    db.commit()
    res = run_cli("command=runs", "json=true", tmp=tmp_path)
    assert res.returncode == 0, res.stderr
    rows = json.loads(res.stdout)
    assert [r["id"] for r in rows if "malformed" in r] == [5, 4, 3, 2] and rows[-1]["id"] == good
    assert res.stderr.count("is malformed") == 4
    text = run_cli("command=runs", tmp=tmp_path)
    assert text.returncode == 0 and text.stdout.count("malformed row:") == 4 and "/ok" in text.stdout


@pytest.mark.parametrize(("value", "why"), [("", "is empty"), ("{file}/out", "is not a directory")])
def test_a_bad_paths_outputs_is_one_line_exit_2_before_hydra_makes_anything(
    tmp_path: Path, value, why
) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    value = value.format(file=tmp_path / "a-file")
    keep = [f"paths.cache={tmp_path / 'cache'}", f"registry.path={tmp_path / 'registry.db'}"]
    res = run_cli("command=synth", f"paths.outputs={value}", *keep, tmp=tmp_path, isolate=False)
    assert res.returncode == 2, res.stderr
    line = _one_error_line(res.stderr)
    assert line.startswith(f"error: paths.outputs={value!r} {why}") and res.stderr.count("\n") == 1, line
    assert _rows(tmp_path) == [] and not (REPO / value / "synth").exists()


# Hydra cannot make the run directory under paths.outputs (permission denied).
DENIED_OUTPUTS = """
import errno, os, pathlib
real = pathlib.Path.mkdir
def mkdir(self, *a, **k):
    if "denied-outputs" in str(self):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
    return real(self, *a, **k)
pathlib.Path.mkdir = mkdir
"""


def test_a_run_directory_that_cannot_be_made_is_named_exit_1_and_recorded_failed(tmp_path: Path) -> None:
    env = _inject(tmp_path, DENIED_OUTPUTS)
    out = tmp_path / "denied-outputs"
    keep = [f"paths.cache={tmp_path / 'cache'}", f"registry.path={tmp_path / 'registry.db'}"]
    res = run_cli("command=synth", f"paths.outputs={out}", *keep, tmp=tmp_path, isolate=False, env=env)
    assert res.returncode == 1, res.stderr
    line = _one_error_line(res.stderr)
    assert line.startswith(f"error: paths.outputs='{out}': cannot create") and "Permission denied" in line, (
        line
    )
    (row,) = _rows(tmp_path)
    assert row["status"] == "failed" and row["command"] == "synth" and str(out) in row["error"], row
    assert not out.exists()


@contextlib.contextmanager
def _read_only(path: Path):
    """The file or directory ``path`` made read-only for this process: by its mode, or for root,
    who ignores modes, by a read-only mount (skipped where mounting is not allowed)."""
    is_file = path.is_file()
    if os.geteuid() != 0:
        mode = path.stat().st_mode
        path.chmod(0o444 if is_file else 0o555)
        try:
            yield
        finally:
            path.chmod(mode)
        return
    mount = (
        ["mount", "--bind", str(path), str(path)] if is_file else ["mount", "-t", "tmpfs", "tmpfs", str(path)]
    )
    if subprocess.run(mount, capture_output=True).returncode:
        pytest.skip("cannot mount here")
    try:
        ro = ["mount", "-o", "remount,ro,bind" if is_file else "remount,ro", str(path)]
        assert subprocess.run(ro, capture_output=True).returncode == 0
        yield
    finally:
        subprocess.run(["umount", str(path)], check=False)


@pytest.mark.parametrize("read_only", ["file", "directory"])
def test_a_registry_that_cannot_be_written_is_one_line_naming_registry_path(
    tmp_path: Path, read_only: str
) -> None:
    """A run is recorded in the registry: one it cannot write is bad input, refused before any
    work (exit 2, nothing written), not the database's own error once the run has started;
    a read-only command still reads a registry it cannot write."""
    where = tmp_path / ("registry.db" if read_only == "file" else "ro")
    db = where if read_only == "file" else where / "registry.db"
    keep = [
        f"paths.outputs={tmp_path / 'outputs'}",
        f"paths.cache={tmp_path / 'cache'}",
        f"registry.path={db}",
    ]
    if read_only == "file":
        assert (
            run_cli("command=runs", *keep, tmp=tmp_path, isolate=False).returncode == 0
        )  # an empty registry
    else:
        where.mkdir()
    with _read_only(where):
        r = run_cli(
            "command=quantize", f"model.name={FIXTURE}", "quant.bits=4", *keep, tmp=tmp_path, isolate=False
        )
        listed = run_cli("command=runs", *keep, tmp=tmp_path, isolate=False)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith(f"error: registry.path={str(db)!r} cannot be written"), r.stderr
    assert not (tmp_path / "outputs").exists() or not any((tmp_path / "outputs").rglob("*"))
    if read_only == "file":
        assert listed.returncode == 0, listed.stderr
