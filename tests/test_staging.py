"""Staging of quantize outputs: no stuck states after SIGKILL, other runs' progress kept, reuse
verified against digests recorded at publish, no absolute paths in artifacts."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from cli_util import run_python
from test_quantize import make_hf_model

from mlxbun.io.staging import Stage, damaged_files, digest_files, read_marker
from mlxbun.quant.quantize.command import quantize_model_dir

REPO = Path(__file__).resolve().parent.parent
SHARD = 40_000  # bytes: a tiny llama gives several shards


def quantize_code(src: Path, out: Path, **kw) -> str:
    args = ", ".join(f"{k}={v!r}" for k, v in {"bits": 4, "shard_bytes": SHARD, **kw}.items())
    return (
        "from mlxbun.quant.quantize.command import quantize_model_dir\n"
        f"quantize_model_dir({str(src)!r}, {str(out)!r}, {args})\n"
    )


def all_files(d: Path) -> dict[str, bytes]:
    """Every file under ``d``, hidden ones included, by relative name."""
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def visible_files(d: Path) -> dict[str, bytes]:
    return {k: v for k, v in all_files(d).items() if not k.startswith(".")}


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("src") / "llama", "llama", files=2)


@pytest.fixture(scope="module")
def clean(src, tmp_path_factory) -> Path:
    return quantize_model_dir(src, tmp_path_factory.mktemp("clean") / "model", bits=4, shard_bytes=SHARD).out


def test_kill_after_the_writer_finished_then_rerun_completes(src, clean, tmp_path):
    out = tmp_path / "model"
    killed = run_python(quantize_code(src, out), tmp=tmp_path, kill_at="finish")
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert not out.exists()
    res = quantize_model_dir(src, out, bits=4, shard_bytes=SHARD)
    assert not res.reused and all_files(out) == all_files(clean)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kill-hook", "model"]


@pytest.mark.parametrize("resume", [True, False])
def test_kill_while_the_first_marker_is_written_then_rerun_completes(src, clean, tmp_path, resume):
    out = tmp_path / "model"
    killed = run_python(quantize_code(src, out), tmp=tmp_path, kill_at="rename-in:.model.partial-")
    assert killed.returncode == -9, killed.stderr[-2000:]
    (partial,) = [p for p in tmp_path.glob(".model.partial-*") if p.is_dir()]
    assert [p.name for p in partial.iterdir() if ".tmp-" not in p.name] == []  # only a temp file
    quantize_model_dir(src, out, bits=4, shard_bytes=SHARD, resume=resume)
    assert all_files(out) == all_files(clean)


def test_an_unrelated_quantize_keeps_another_runs_progress(src, clean, tmp_path):
    root = tmp_path / "outputs" / ".partial"  # the CLI's stable root: every run's out is <run>/model
    first, second = tmp_path / "run1" / "model", tmp_path / "run2" / "model"
    killed = run_python(quantize_code(src, first, partial_root=str(root)), tmp=tmp_path, kill_at="shard:2")
    assert killed.returncode == -9, killed.stderr[-2000:]
    (progress,) = [p for p in root.iterdir() if p.is_dir()]
    quantize_model_dir(src, second, bits=8, shard_bytes=SHARD, partial_root=root)  # another conversion
    assert progress.is_dir() and len(list(progress.glob(".mlxbun-shard-*"))) == 2
    again = tmp_path / "run3" / "model"
    quantize_model_dir(src, again, bits=4, shard_bytes=SHARD, partial_root=root)
    assert all_files(again) == all_files(clean) and not progress.exists()


@pytest.mark.parametrize("damage", ["flip", "delete", "truncate"])
def test_a_damaged_output_is_not_reused(src, clean, tmp_path, damage):
    out = tmp_path / "model"
    shutil.copytree(clean, out)
    shard = sorted(out.glob("model-*.safetensors"))[1]
    if damage == "flip":
        data = bytearray(shard.read_bytes())
        data[-100] ^= 0x80
        shard.write_bytes(bytes(data))
    elif damage == "delete":
        shard.unlink()
    else:
        shard.write_bytes(shard.read_bytes()[:-8])
    res = quantize_model_dir(src, out, bits=4, shard_bytes=SHARD)
    assert not res.reused
    assert all_files(out) == all_files(clean)
    assert quantize_model_dir(src, out, bits=4, shard_bytes=SHARD).reused  # intact now: reused


def test_outputs_do_not_depend_on_where_the_source_is(src, clean, tmp_path):
    elsewhere = tmp_path / "another" / "checkout" / "llama"
    shutil.copytree(src, elsewhere)
    for p in elsewhere.iterdir():
        os.utime(p, ns=(1_000_000_000, 1_000_000_000))  # a fresh checkout: other mtimes
    out = quantize_model_dir(elsewhere, tmp_path / "model", bits=4, shard_bytes=SHARD).out
    assert all_files(out) == all_files(clean)
    record = json.loads(next(out.glob(".mlxbun-*.json")).read_text())
    assert str(tmp_path) not in json.dumps(record) and str(src) not in json.dumps(record)


def test_rotate_cli_rerun_after_sigkill_resumes(tiny_model, tmp_path):
    from cli_util import kill_hook, run_cli

    from mlxbun.rotate.command import rotate_model_dir

    src = tiny_model("llama", norm_jitter=0.2)
    args = ("command=rotate", f"model.name={src}", "io.shard_gb=0.00002", "fold.verify=false", "verbose=true")
    hook = {"PYTHONPATH": f"{kill_hook(tmp_path)}{os.pathsep}{REPO}", "MLXBUN_TEST_KILL_AT": "shard:2"}
    killed = run_cli(*args, tmp=tmp_path, env=hook)
    assert killed.returncode == -9, killed.stderr[-2000:]
    again = run_cli(*args, tmp=tmp_path, env={"PYTHONPATH": str(REPO)})
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resuming" in again.stderr
    runs = sorted((tmp_path / "outputs" / "rotate").iterdir())
    assert len(runs) == 2 and not (runs[0] / "model").exists()
    clean = rotate_model_dir(src, tmp_path / "clean", shard_bytes=int(0.00002 * (1 << 30)), verify=False)
    assert all_files(runs[1] / "model") == all_files(clean.out)
    assert not list((tmp_path / "outputs" / ".partial").iterdir())


# ---------------------------------------------------------------------------- the protocol itself


def _claimed(out: Path, key: str, root: Path, *, kind: str = "synth", setting: str | None = None) -> Path:
    with Stage.locked(out, kind=kind, key=key, root=root, setting=setting) as stage:
        stage.claim()
        (stage.dir / "part").write_text(key)
        return stage.dir


def test_stale_sweep_removes_only_earlier_jobs_into_the_same_out(tmp_path):
    """Another job's progress into the same out is kept until this job publishes; a live one
    (lock held) refuses this job before any work."""
    import fcntl

    from mlxbun.errors import InputError

    root, out = tmp_path / "root", tmp_path / "run1" / "model"
    earlier = _claimed(out, "a" * 64, root)
    held = _claimed(out, "b" * 64, root)
    other_run = _claimed(tmp_path / "run2" / "model", "c" * 64, root)
    other_kind = _claimed(out, "d" * 64, root, kind="rotate")
    foreign = root / ".model.partial-eeeeeeeeeeeeeeee"  # no marker: not known to be stale
    foreign.mkdir()
    with open(held.with_name(held.name + ".lock"), "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # a live run
        with pytest.raises(InputError, match=rf"is being built by another synth job .*{held.name}"):
            _claimed(out, "f" * 64, root, setting="synth.out")
    assert not list(root.glob(".model.partial-ffff*"))
    with Stage.locked(out, kind="synth", key="f" * 64, root=root) as stage:
        stage.claim()
        assert earlier.is_dir() and held.is_dir()  # resumable until this job publishes
        assert read_marker(stage.dir) == {"version": 1, "kind": "synth", "key": "f" * 64, "target": str(out)}
        stage.publish()
    assert not earlier.exists() and not earlier.with_name(earlier.name + ".lock").exists()
    assert not held.exists()
    assert all(d.is_dir() for d in (other_run, other_kind, foreign)) and out.is_dir()


def test_a_second_job_publishing_into_a_taken_out_is_named_and_cleaned(tmp_path):
    from mlxbun.errors import EnvironmentFailure

    root, out = tmp_path / "root", tmp_path / "run1" / "model"
    with Stage.locked(out, kind="synth", key="a" * 64, root=root, setting="synth.out") as stage:
        stage.claim()
        (stage.dir / "part").write_text("a")
        out.mkdir(parents=True)  # another job published meanwhile
        (out / "theirs").write_text("b")
        with pytest.raises(EnvironmentFailure, match=rf"synth.out='{out}': another job published"):
            stage.publish()
    assert (out / "theirs").read_text() == "b" and list(root.iterdir()) == []


def test_a_resumed_stage_never_adopts_an_unfinished_atomic_write(tmp_path):
    root, out = tmp_path / "root", tmp_path / "run1" / "model"
    d = _claimed(out, "a" * 64, root)
    (d / ".config.json.tmp-123-abcd").write_text("{half")  # a kill inside atomic_write_bytes
    with Stage.locked(out, kind="synth", key="a" * 64, root=root) as stage:
        assert stage.claim()
        stage.publish()
    assert sorted(p.name for p in out.iterdir()) == ["part"]


def test_a_rerun_with_another_target_resumes_and_retargets(tmp_path):
    root = tmp_path / "root"
    first = _claimed(tmp_path / "run1" / "model", "a" * 64, root)
    with Stage.locked(tmp_path / "run2" / "model", kind="synth", key="a" * 64, root=root) as stage:
        assert stage.claim() and stage.dir == first and (first / "part").read_text() == "a" * 64
        assert read_marker(first)["target"] == str(tmp_path / "run2" / "model")
        stage.publish()
    assert (tmp_path / "run2" / "model" / "part").is_file() and list(root.iterdir()) == []
    with Stage.locked(tmp_path / "run3" / "model", kind="synth", key="a" * 64, root=root) as stage:
        with pytest.raises(RuntimeError, match=r"publish\(\) on a stage that is locked"):
            stage.publish()
        assert stage.claim() is False  # nothing left to resume
        with pytest.raises(RuntimeError, match=r"claim\(\) on a stage that is claimed"):
            stage.claim()
        stage.discard()
    assert list(root.iterdir()) == []


def test_damaged_files_names_each_problem(tmp_path):
    (tmp_path / "a").write_bytes(b"aaaa")
    (tmp_path / "b").write_bytes(b"bbbb")
    (tmp_path / ".hidden").write_bytes(b"not recorded")
    files = digest_files(tmp_path)
    assert sorted(files) == ["a", "b"] and files["a"]["size"] == 4
    (tmp_path / "a").write_bytes(b"aaab")
    (tmp_path / "b").unlink()
    files["../x"] = {"xxh3_128": "0" * 32, "size": 1}
    assert damaged_files(tmp_path, files) == [
        "../x: missing",
        "a: xxh3_128 differs from the one recorded at publish",
        "b: missing",
    ]


def test_a_waiter_on_a_lock_file_unlinked_by_a_publish_locks_the_current_one(tmp_path):
    import fcntl
    import threading

    from mlxbun.io.staging import _open_locked

    path = tmp_path / ".model.partial-0123456789abcdef.lock"
    holder = open(path, "a")
    fcntl.flock(holder.fileno(), fcntl.LOCK_EX)
    got = {}
    waiter = threading.Thread(target=lambda: got.update(f=_open_locked(path, wait=True)))
    waiter.start()
    while not got and not _waiting_on(path):
        pass
    path.unlink()  # the holder published and dropped the lock file ...
    newcomer = open(path, "a")  # ... and a newcomer created and locked a fresh one
    fcntl.flock(newcomer.fileno(), fcntl.LOCK_EX)
    holder.close()  # the waiter now gets the old, unlinked file: it must not stop there
    waiter.join(0.5)
    assert waiter.is_alive()  # still waiting, now on the newcomer's file
    newcomer.close()
    waiter.join(5)
    assert os.fstat(got["f"].fileno()).st_ino == os.stat(path).st_ino
    got["f"].close()


def _waiting_on(path: Path) -> bool:
    """Is some thread of this process blocked in flock on ``path``? (from /proc/locks)"""
    ino = os.stat(path).st_ino
    return any(f":{ino} " in line and "->" in line for line in Path("/proc/locks").read_text().splitlines())


def test_atomic_save_publishes_whole_files_and_leaves_no_temporary(tmp_path):
    from mlxbun.io.atomic import atomic_save

    out = tmp_path / "x.safetensors"
    atomic_save(out, lambda name: Path(name).write_bytes(b"one"))
    assert out.read_bytes() == b"one" and [p.name for p in tmp_path.iterdir()] == ["x.safetensors"]

    def fails(name: str) -> None:
        Path(name).write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_save(out, fails)
    assert out.read_bytes() == b"one" and [p.name for p in tmp_path.iterdir()] == ["x.safetensors"]
