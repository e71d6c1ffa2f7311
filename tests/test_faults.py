"""Fault injection: SIGKILL quantize, synth and rotate at every named step of the staging protocol
(and inside the shard writer), then re-run: the re-run finishes with the same bytes as a clean run
and leaves no staging dir or lock behind.

The kill comes from the KILL_AT sitecustomize hook of cli_util (MLXBUN_TEST_KILL_AT). Runs go
through a shared staging root with a new output directory per run, as the CLI does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_util import run_python
from test_quantize import make_hf_model

from mlxbun.io.staging import STEPS
from mlxbun.quant.quantize.command import quantize_model_dir
from mlxbun.rotate.command import rotate_model_dir
from mlxbun.synth.write import resolve_spec, write_spec

SHARD = 40_000
# Where a run is killed: each staging step, after the writer's first and second shard, when the
# writer finished, and before the first rename into the staging dir (the marker's temp file).
KILL_POINTS = [f"step:{s}" for s in STEPS] + ["shard:1", "shard:2", "finish", "rename-in:.model.partial-"]


def all_files(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def sources(tmp_path_factory, tiny_model) -> dict[str, str]:
    return {
        "quantize": str(make_hf_model(tmp_path_factory.mktemp("faults") / "llama", "llama", files=2)),
        "rotate": str(tiny_model("llama", norm_jitter=0.2)),
    }


def child_code(command: str, sources: dict[str, str], out: Path, root: Path) -> str:
    """The job as a script, for a child process that is killed."""
    out, root = str(out), str(root)
    if command == "quantize":
        return (
            "from mlxbun.quant.quantize.command import quantize_model_dir\n"
            f"quantize_model_dir({sources['quantize']!r}, {out!r}, bits=4, shard_bytes={SHARD}, partial_root={root!r})"
        )
    if command == "synth":
        return (
            "from mlxbun.synth.write import resolve_spec, write_spec\n"
            f"write_spec(resolve_spec(arch='qwen3'), {out!r}, shard_bytes={SHARD}, partial_root={root!r})"
        )
    return (
        "from mlxbun.rotate.command import rotate_model_dir\n"
        f"rotate_model_dir({sources['rotate']!r}, {out!r}, seed=3, shard_bytes={SHARD}, verify=False,"
        f" partial_root={root!r})"
    )


def run_here(command: str, sources: dict[str, str], out: Path, root: Path | None) -> Path:
    """The same job in this process."""
    if command == "quantize":
        return quantize_model_dir(sources["quantize"], out, bits=4, shard_bytes=SHARD, partial_root=root).out
    if command == "synth":
        return write_spec(resolve_spec(arch="qwen3"), out, shard_bytes=SHARD, partial_root=root)
    return rotate_model_dir(
        sources["rotate"], out, seed=3, shard_bytes=SHARD, verify=False, partial_root=root
    ).out


@pytest.fixture(scope="module")
def reference(sources, tmp_path_factory) -> dict[str, dict[str, bytes]]:
    base = tmp_path_factory.mktemp("reference")
    return {
        c: all_files(run_here(c, sources, base / c / "model", None)) for c in ("quantize", "synth", "rotate")
    }


@pytest.mark.parametrize("where", KILL_POINTS)
@pytest.mark.parametrize("command", ["quantize", "synth", "rotate"])
def test_a_kill_at_any_step_then_a_rerun_gives_the_same_bytes(sources, reference, tmp_path, command, where):
    root = tmp_path / "outputs" / ".partial"
    first, second = tmp_path / "run1" / "model", tmp_path / "run2" / "model"
    killed = run_python(child_code(command, sources, first, root), tmp=tmp_path, kill_at=where)
    assert killed.returncode == -9, killed.stderr[-2000:]
    if where == "step:published":
        assert all_files(first) == reference[command]
    else:
        assert not first.exists()  # nothing that looks finished
    out = run_here(command, sources, second, root)
    assert all_files(out) == reference[command]
    assert list(root.iterdir()) == []


@pytest.mark.slow
@pytest.mark.parametrize("where", KILL_POINTS)
def test_quantize_killed_then_rerun_into_the_same_out(sources, reference, tmp_path, where):
    out = tmp_path / "model"
    killed = run_python(child_code("quantize", sources, out, tmp_path), tmp=tmp_path, kill_at=where)
    assert killed.returncode == -9, killed.stderr[-2000:]
    res = quantize_model_dir(sources["quantize"], out, bits=4, shard_bytes=SHARD, partial_root=tmp_path)
    assert res.reused == (where == "step:published")
    assert all_files(out) == reference["quantize"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kill-hook", "model"]
