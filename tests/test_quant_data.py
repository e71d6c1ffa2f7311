"""Data and I/O defects of quantize: broken config.json, hostile Hessians, read-only outputs,
missing tokenizers, stale fisher spills, and two jobs sharing one ``quant.out``."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from cli_util import REPO, run_cli


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_broken_config_json_is_one_line_as_inspect_says_it(tmp_path, tiny_model):
    src = _copy(tiny_model(), tmp_path / "src")
    (src / "config.json").write_text('{"model_type": "llama",')
    seen = run_cli("command=inspect", f"model.name={src}", tmp=tmp_path)
    line = f"error: {src / 'config.json'}: not valid JSON (Expecting"
    assert seen.returncode == 1 and seen.stderr.strip().splitlines()[-1].startswith(line), seen.stderr
    commands = {"quantize": [], "sensitivity": [], "kv_save": ["kv.name=x", "kv.prompt=hello"]}
    for command, extra in commands.items():  # a corrupt file: exit 1, the run recorded failed
        r = run_cli(f"command={command}", f"model.name={src}", "blas=off", *extra, tmp=tmp_path)
        assert r.returncode == 1, r.stderr[-2000:]
        assert r.stderr.strip().splitlines()[-1].startswith(line), r.stderr[-2000:]
        assert "JSONDecodeError" not in r.stderr and "Traceback" not in r.stderr
        (run,) = (tmp_path / "outputs" / command).iterdir()
        assert json.loads((run / "manifest.json").read_text())["status"] == "failed"


# ---------------------------------------------------------------- hostile Hessians


def _hessians(src: Path, path: Path, corrupt=None) -> Path:
    """A valid H (A A^T) for every 2-D weight of ``src``; ``corrupt(hessians)`` may spoil one."""
    from mlxbun.io.safetensors import open_model
    from mlxbun.quant import hessian

    rng = np.random.default_rng(0)
    hs = {}
    with open_model(src) as m:
        for name, info in sorted(m.infos().items()):
            if name.endswith(".weight") and len(info.shape) == 2:
                a = rng.standard_normal((info.shape[1], info.shape[1] + 8)).astype(np.float32)
                hs[name[: -len(".weight")]] = a @ a.T
    if corrupt is not None:
        corrupt(hs)
    hessian.save(hs, path, tokens=64)
    return path


DOWN = "model.layers.1.mlp.down_proj"


def _not_psd(hs: dict) -> None:
    h = np.eye(hs[DOWN].shape[0], dtype=np.float32)
    h[:3, :3] = [[1, 0.9, 0.9], [0.9, 1, -0.9], [0.9, -0.9, 1]]  # |H_ij| <= 1, yet indefinite
    h *= 1e4  # beyond GPTQ's dampening
    hs[DOWN] = h


SPOILED = {
    "nan": (lambda hs: hs[DOWN].__setitem__((3, 5), np.nan), "holds 1 NaN or Inf value(s)"),
    "inf": (lambda hs: hs[DOWN].__setitem__((0, 0), np.inf), "holds 1 NaN or Inf value(s)"),
    "negative_diag": (lambda hs: hs[DOWN].__setitem__((7, 7), -1.0), "negative diagonal entry H[7,7]=-1"),
    "asymmetric": (lambda hs: hs[DOWN].__setitem__((2, 9), hs[DOWN][2, 9] + 50), "is not symmetric"),
    "outside_bound": (
        lambda hs: hs[DOWN].__setitem__(
            (slice(None), slice(None)), np.diag(np.diag(hs[DOWN])) + 1e6 * (1 - np.eye(hs[DOWN].shape[0]))
        ),
        "is not positive semi-definite",
    ),
    "indefinite": (_not_psd, "is not positive definite (its Cholesky failed after dampening)"),
    "shape": (
        lambda hs: hs.__setitem__(DOWN, np.eye(64, dtype=np.float32)),
        "has shape (64, 64); the model's in_features is 128",
    ),
}


@pytest.mark.parametrize("case", sorted(SPOILED))
def test_gptq_refuses_a_spoiled_hessian_naming_file_and_module(tmp_path, tiny_model, case):
    from mlxbun.errors import InputError
    from mlxbun.quant.quantize.command import quantize_model_dir

    corrupt, what = SPOILED[case]
    src = tiny_model()
    h = _hessians(src, tmp_path / "h.safetensors", corrupt)
    with pytest.raises(InputError) as err:
        quantize_model_dir(src, tmp_path / "out", bits=4, group_size=64, method="gptq", hessians=h)
    line = str(err.value)
    assert f"quant.hessians={str(h)!r}: {DOWN!r}" in line and what in line, line
    assert not (tmp_path / "out").exists()


def test_valid_hessians_pass_the_checks(tmp_path, tiny_model):
    from mlxbun.quant.quantize.command import quantize_model_dir

    src = tiny_model()
    h = _hessians(src, tmp_path / "h.safetensors")
    res = quantize_model_dir(src, tmp_path / "out", bits=4, group_size=64, method="gptq", hessians=h)
    assert (res.out / "config.json").is_file()


def test_cli_gptq_with_a_nan_hessian_exits_2_and_leaves_no_run(tmp_path, tiny_model):
    src = tiny_model()
    h = _hessians(src, tmp_path / "h.safetensors", SPOILED["nan"][0])
    r = run_cli(
        "command=quantize", f"model.name={src}", "quant.method=gptq", f"quant.hessians={h}", "blas=off",
        tmp=tmp_path,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"{DOWN!r} holds 1 NaN or Inf value(s)" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "outputs" / "quantize").exists()


def test_non_finite_scales_are_never_published(tmp_path, tiny_model):
    """Any rounding: an Inf weight makes mx.quantize's scales NaN; the run fails naming the module."""
    from mlxbun.errors import NumericFailure
    from mlxbun.quant.quantize.command import quantize_model_dir

    src = _copy(tiny_model(), tmp_path / "src")
    (f,) = src.glob("model*.safetensors")
    weights = dict(mx.load(str(f)))
    w = np.array(weights[DOWN + ".weight"].astype(mx.float32))
    w[4, 9] = np.inf
    weights[DOWN + ".weight"] = mx.array(w).astype(weights[DOWN + ".weight"].dtype)
    mx.save_safetensors(str(f), weights, metadata={"format": "pt"})
    for method in ("rtn", "clip"):
        with pytest.raises(
            NumericFailure, match=rf"{DOWN}.scales holds 1 NaN or Inf value\(s\) \(module '{DOWN}'\)"
        ):
            quantize_model_dir(src, tmp_path / f"out-{method}", bits=4, group_size=64, method=method)
        assert not (tmp_path / f"out-{method}").exists()
    r = run_cli("command=quantize", f"model.name={src}", "blas=off", tmp=tmp_path)
    assert r.returncode == 1, r.stderr[-2000:]
    assert f"module '{DOWN}'" in r.stderr and "Traceback" not in r.stderr
    (run,) = (tmp_path / "outputs" / "quantize").iterdir()
    assert json.loads((run / "manifest.json").read_text())["status"] == "failed"
    assert not (run / "model").exists()


# ---------------------------------------------------------------- a read-only quant.out


def _read_only_dir(tmp_path: Path) -> Path:
    """A directory this process cannot write in (root ignores modes: sysfs refuses everyone)."""
    if os.geteuid() == 0:
        return Path("/sys")
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o555)
    return d


def test_read_only_quant_out_names_the_directory_given_not_the_lock(tmp_path, tiny_model):
    out = _read_only_dir(tmp_path) / "mlxbun-quant-out"
    r = run_cli(
        "command=quantize", f"model.name={tiny_model()}", f"quant.out={out}", "blas=off", tmp=tmp_path
    )
    assert r.returncode == 1, r.stderr[-2000:]
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: quant.out={str(out)!r}: cannot write in {out.parent} ("), line
    assert ".lock" not in r.stderr and ".partial" not in r.stderr and "Traceback" not in r.stderr
    (run,) = (tmp_path / "outputs" / "quantize").iterdir()
    assert json.loads((run / "manifest.json").read_text())["status"] == "failed"


# ---------------------------------------------------------------- a source without a tokenizer


def test_quantize_without_tokenizer_files_warns_and_records_it(tmp_path, tiny_model):
    src = _copy(tiny_model(), tmp_path / "src")
    for f in src.glob("tokenizer*"):
        f.unlink()
    r = run_cli("command=quantize", f"model.name={src}", "blas=off", tmp=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    (line,) = [x for x in r.stderr.splitlines() if "no tokenizer files" in x]
    assert str(src) in line and "tokenizer.json" in line and "mlx_lm" in line
    (run,) = (tmp_path / "outputs" / "quantize").iterdir()
    (recorded,) = json.loads((run / "manifest.json").read_text())["metrics"]["warnings"]
    assert "no tokenizer files" in recorded
    ok = run_cli("command=quantize", f"model.name={tiny_model()}", "blas=off", tmp=tmp_path)
    assert ok.returncode == 0 and "no tokenizer files" not in ok.stderr


# ---------------------------------------------------------------- fisher spills of killed runs

KILLED_SPILL = """
import os, signal
import numpy as np
from mlxbun.quant.probe import Spill
s = Spill()
s.put("logits", np.zeros((256, 1024), np.float32))
print(s._dir.name, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_sigkilled_fishers_spill_is_removed_by_the_next_run(tmp_path, monkeypatch):
    from mlxbun.quant.probe import Spill

    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    killed = subprocess.run([sys.executable, "-c", KILLED_SPILL], capture_output=True, text=True, env=env)
    assert killed.returncode == -9, killed.stderr
    stale = Path(killed.stdout.strip())
    assert stale.parent == tmp_path and any(stale.glob("*.npy"))
    # a live process of another pid namespace: its pid looks gone, its lock is held
    other = tmp_path / "mlxbun-fisher-999999999-abc"
    other.mkdir()
    held = open(other / ".lock", "a")  # noqa: SIM115
    fcntl.flock(held.fileno(), fcntl.LOCK_EX)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    spill = Spill()
    try:
        assert not stale.exists() and other.is_dir()
        mine = Path(spill._dir.name)
        assert mine.parent == tmp_path and mine.name.startswith(f"mlxbun-fisher-{os.getpid()}-")
        again = Spill()  # a second spill of a live process keeps the first
        assert mine.is_dir()
        again.close()
    finally:
        spill.close()
        held.close()
    assert not mine.exists()


# ---------------------------------------------------------------- two jobs into one quant.out


def test_another_settings_job_keeps_the_killed_jobs_progress_until_it_publishes(
    tmp_path, monkeypatch, caplog
):
    from test_quantize import _killed_after_three_shards

    from mlxbun.quant.quantize import command as quantize

    src, out, partial = _killed_after_three_shards(tmp_path)

    def fails(*a, **k):
        raise RuntimeError("stopped before publishing")

    with monkeypatch.context() as m:
        m.setattr(quantize, "_convert", fails)
        with pytest.raises(RuntimeError, match="stopped before publishing"):
            quantize.quantize_model_dir(src, out, bits=8, group_size=64, shard_bytes=40000)
    assert len(list(partial.glob(".mlxbun-shard-*.safetensors"))) == 3  # still resumable
    (partial / ".config.json.tmp-123-abcd").write_text("{half")  # a kill inside an atomic write
    with caplog.at_level("INFO", logger="mlxbun"):
        quantize.quantize_model_dir(src, out, bits=4, group_size=64, shard_bytes=40000)
    assert "already written" in caplog.text  # the killed job resumed
    assert not [p.name for p in out.iterdir() if ".tmp-" in p.name]


def test_a_job_whose_out_was_published_meanwhile_names_it_and_leaves_no_staging(
    tmp_path, tiny_model, monkeypatch
):
    from mlxbun.errors import EnvironmentFailure
    from mlxbun.quant.quantize import command as quantize

    out = tmp_path / "q"
    real = quantize.write_record

    def publish_theirs_first(d, *a, **k):
        real(d, *a, **k)
        out.mkdir()
        (out / "model.safetensors").write_bytes(b"theirs")

    monkeypatch.setattr(quantize, "write_record", publish_theirs_first)
    with pytest.raises(EnvironmentFailure, match=rf"quant.out='{out}': another job published"):
        quantize.quantize_model_dir(tiny_model(), out, bits=4, group_size=64)
    assert (out / "model.safetensors").read_bytes() == b"theirs"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"]
