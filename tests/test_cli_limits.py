"""Sizes checked before anything is written: synth against free disk and memory."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from cli_util import run_cli

from mlxbun.errors import InputError
from mlxbun.synth import write as synth_write


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
    spec = synth_write.resolve_spec(arch="llama", preset="tiny", vocab_size=1_000_000)
    monkeypatch.setattr(synth_write, "available_memory", lambda: 100 << 20)
    with pytest.raises(InputError, match=r"needs about .* of memory .* 100.0 MiB is available"):
        synth_write.check_room(spec, out=tmp_path / "m", partial_root=None)
    monkeypatch.setattr(synth_write, "available_memory", lambda: 8 << 30)
    synth_write.check_room(spec, out=tmp_path / "m", partial_root=None)


def test_bytes_already_written_by_a_killed_build_count_as_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = synth_write.resolve_spec(arch="llama", preset="tiny")
    need = sum(t.nbytes for t in synth_write.plan(spec))
    partial = tmp_path / f".m.partial-{spec.hash}"
    partial.mkdir()
    (partial / "model-00001-of-00002.safetensors").write_bytes(b"\0" * (need // 2))
    usage = type("U", (), {"free": need - need // 2 + 1})
    monkeypatch.setattr(synth_write.shutil, "disk_usage", lambda _: usage)
    synth_write.check_room(spec, out=tmp_path / "m", partial_root=None)
    (partial / "model-00001-of-00002.safetensors").unlink()
    with pytest.raises(InputError, match="of disk under"):
        synth_write.check_room(spec, out=tmp_path / "m", partial_root=None)


FIXTURE = Path(__file__).resolve().parent / "fixtures" / "llama-text-3m"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (
            ["command=quantize", f"model.name={FIXTURE}", "quant.bits=3", "quant.mixed=mixed_3_6"],
            "quant.bits=3",
        ),
        (["command=allocate", f"model.name={FIXTURE}", "allocate.budget_bpw=40"], "allocate.budget_bpw=40"),
        (["command=pipeline"], "pipeline.steps=[] is empty"),
        (["command=synth", "io.shard_gb=nan"], "io.shard_gb=nan"),
        (["command=synth", "io.shard_gb=inf"], "io.shard_gb=inf"),
        (["command=kv_gc", "kv.cap_gb=nan"], "kv.cap_gb=nan"),
        (["command=registry_fit", "registry.fit.budget_gb=inf"], "registry.fit.budget_gb=inf"),
        (["command=registry_ls", "registry.filter.max_gb=nan"], "registry.filter.max_gb=nan"),
        (["command=allocate", "allocate.budget_bpw=nan"], "allocate.budget_bpw=nan"),
        (["command=synth", "synth.outlier_scale=inf", "synth.outlier_channels=2"], "synth.outlier_scale=inf"),
        (["command=runs", "runs.limit=100000000000000000000"], "runs.limit=100000000000000000000"),
        (["command=runs", "runs.limit=1e20"], "runs.limit"),
        (["command=rotate", f"model.name={FIXTURE}", "fold.seed=-5"], "fold.seed=-5"),
    ],
)
def test_silently_accepted_values_are_refused(tmp_path: Path, args: list[str], needle: str) -> None:
    res = run_cli(*args, tmp=tmp_path, timeout=120)
    assert res.returncode == 2, (res.stdout, res.stderr)
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("error: ") and needle in line, line
    assert not (tmp_path / "outputs").exists() or not list((tmp_path / "outputs").rglob("manifest.json"))


def test_the_filesystem_root_is_refused_as_outputs_root(tmp_path: Path) -> None:
    res = run_cli(
        "command=synth",
        "paths.outputs=/",
        f"hydra.run.dir={tmp_path}/run",
        f"paths.cache={tmp_path}",
        f"registry.path={tmp_path}/r.db",
        tmp=tmp_path,
        isolate=False,
        timeout=60,
    )
    assert res.returncode == 2 and "paths.outputs='/' is the filesystem root" in res.stderr


def test_a_shard_ceiling_under_a_byte_gives_one_tensor_per_shard(tmp_path: Path) -> None:
    """io.shard_gb > 0 is allowed; under one byte it means one tensor per shard, for every command
    (quantize once read it as a 0-byte ceiling and failed naming an internal parameter)."""
    res = run_cli("command=quantize", "model.synthetic=true", "synth.preset=tiny", "io.shard_gb=1e-10",
                  tmp=tmp_path, timeout=120)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    (model,) = (tmp_path / "outputs").rglob("model.safetensors.index.json")
    index = json.loads(model.read_text())
    assert len(set(index["weight_map"].values())) == len(index["weight_map"])
