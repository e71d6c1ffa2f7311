"""command=calibrate: Hessians from the CLI, cached by model and calibration, used by quantize."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from cli_util import other_model, run_cli

from mlxbun.quant import hessian
from mlxbun.quant.calibrate import calibrate
from mlxbun.quant.plan import HESSIANS_NAME

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "llama-text-3m"
CALIB = ["sensitivity.calib.samples=2", "sensitivity.calib.seq_len=16"]


def test_calibrate_equals_capture_and_reuses_its_cache(tmp_path):
    out1, out2, work = tmp_path / "run1", tmp_path / "run2", tmp_path / "work"
    first = calibrate(model_dir=FIXTURE, out_dir=out1, work_dir=work, samples=2, seq_len=16)
    assert not first.reused
    ref = calibrate(model_dir=FIXTURE, out_dir=tmp_path / "ref", samples=2, seq_len=16).path  # no cache
    got, want = hessian.Hessians(first.path), hessian.Hessians(ref)
    assert sorted(got) == sorted(want) and len(got) > 0
    for k in want:
        assert np.allclose(got[k], want[k], rtol=1e-5, atol=1e-4), k
    meta = got.file.metadata
    assert json.loads(meta["calibration"])["samples"] == 2 and meta["model"]
    second = calibrate(model_dir=FIXTURE, out_dir=out2, work_dir=work, samples=2, seq_len=16)
    assert second.reused and second.key == first.key
    assert second.path.read_bytes() == first.path.read_bytes()
    other = calibrate(model_dir=FIXTURE, out_dir=tmp_path / "run3", work_dir=work, samples=3, seq_len=16)
    assert other.key != first.key and not other.reused


def test_a_damaged_cache_entry_is_captured_again(tmp_path):
    work = tmp_path / "work"
    first = calibrate(model_dir=FIXTURE, out_dir=tmp_path / "a", work_dir=work, samples=2, seq_len=16)
    cached = work / first.key / HESSIANS_NAME
    data = cached.read_bytes()
    cached.unlink()  # a hard link: the run's copy stays as it was
    cached.write_bytes(data[: len(data) // 2])
    again = calibrate(model_dir=FIXTURE, out_dir=tmp_path / "b", work_dir=work, samples=2, seq_len=16)
    assert not again.reused and again.path.read_bytes() == data


def test_cli_calibrate_then_gptq_quantize_names_the_run(tmp_path):
    r = run_cli("command=calibrate", f"model.name={FIXTURE}", *CALIB, tmp=tmp_path)
    assert r.returncode == 0, r.stderr
    runs = list((tmp_path / "outputs" / "calibrate").iterdir())
    assert len(runs) == 1 and (runs[0] / "hessians.safetensors").is_file()
    manifest = json.loads((runs[0] / "manifest.json").read_text())
    assert any(str(o).endswith("hessians.safetensors") for o in manifest["outputs"])
    assert "captured" in r.stderr + r.stdout
    again = run_cli("command=calibrate", f"model.name={FIXTURE}", *CALIB, tmp=tmp_path)
    assert again.returncode == 0 and "reused" in again.stderr + again.stdout
    q = run_cli(
        "command=quantize", f"model.name={FIXTURE}", "quant.method=gptq", "quant.bits=4",
        f"quant.hessians={runs[0]}", f"quant.out={tmp_path / 'q'}", tmp=tmp_path,
    )  # fmt: skip
    assert q.returncode == 0, q.stderr
    assert (tmp_path / "q" / "config.json").is_file()


def test_cli_calibrate_bad_input_is_one_line(tmp_path):
    r = run_cli("command=calibrate", f"model.name={tmp_path / 'none'}", *CALIB, tmp=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "model.name" in r.stderr


def test_pipeline_calibrate_provides_the_hessians_to_quantize(tmp_path):
    r = run_cli(
        "command=pipeline", "pipeline.steps=[calibrate,quantize]", f"model.name={FIXTURE}", *CALIB,
        "quant.method=gptq", "quant.bits=4", tmp=tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    run = next((tmp_path / "outputs" / "pipeline").iterdir())
    assert (run / "calibrate" / "hessians.safetensors").is_file()
    record = json.loads(next((run / "quantize").rglob(".mlxbun-quantize.json")).read_text())
    assert record["settings"]["method"] == "gptq" and record["settings"]["hessians"]


def test_quant_hessians_names_a_run_dir_or_the_file(tmp_path):
    from mlxbun.errors import InputError
    from mlxbun.quant.plan import hessians_file

    with pytest.raises(
        InputError, match=f"quant.hessians='{tmp_path}' is a directory without {HESSIANS_NAME}"
    ):
        hessians_file(tmp_path)
    (tmp_path / HESSIANS_NAME).write_bytes(b"x")
    assert hessians_file(tmp_path) == tmp_path / HESSIANS_NAME == hessians_file(tmp_path / HESSIANS_NAME)


def test_a_flipped_byte_in_the_cache_is_captured_again_and_the_earlier_run_still_verifies(tmp_path):
    """The cache is checked against the digest recorded when it was written, and a run's file is
    its own copy: a byte flipped in the cache is neither reused nor a change to the earlier run."""
    r = run_cli("command=calibrate", f"model.name={FIXTURE}", *CALIB, tmp=tmp_path)
    assert r.returncode == 0, r.stderr
    (first,) = (tmp_path / "outputs" / "calibrate").iterdir()
    good = (first / HESSIANS_NAME).read_bytes()
    (cached,) = (tmp_path / "cache" / "hessians").rglob(HESSIANS_NAME)
    with open(cached, "r+b") as f:  # in place, as a disk error or a stray write would
        f.seek(len(good) - 100)
        f.write(bytes([good[-100] ^ 0x01]))
    verified = run_cli("command=verify", f"runs.dir={first}", tmp=tmp_path)
    assert verified.returncode == 0, verified.stderr
    again = run_cli("command=calibrate", f"model.name={FIXTURE}", *CALIB, tmp=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "reused" not in again.stdout and "captured" in again.stdout
    assert f"{cached} is damaged" in again.stderr
    (second,) = set((tmp_path / "outputs" / "calibrate").iterdir()) - {first}
    assert (second / HESSIANS_NAME).read_bytes() == good == cached.read_bytes()
    assert (second / HESSIANS_NAME).stat().st_ino != cached.stat().st_ino


def test_hessians_of_another_model_of_the_same_shapes_are_refused_naming_both(tmp_path):
    """The file records the model it was captured on (its fingerprint); quantize refuses it for
    another model of the same shapes before any work."""
    other = other_model(FIXTURE, tmp_path / "other")
    theirs = calibrate(model_dir=other, out_dir=tmp_path / "h", samples=2, seq_len=16).path
    out = tmp_path / "q"
    args = ("command=quantize", "quant.method=gptq", "quant.bits=4", f"quant.out={out}")
    r = run_cli(*args, f"model.name={FIXTURE}", f"quant.hessians={theirs}", tmp=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert f"quant.hessians={str(theirs)!r}" in line and str(FIXTURE) in line and "another model" in line, (
        line
    )
    assert not out.exists() and not list((tmp_path / "outputs").rglob("manifest.json"))
    mine = run_cli(*args, f"model.name={other}", f"quant.hessians={theirs}", tmp=tmp_path)
    assert mine.returncode == 0, mine.stderr


def test_asking_whether_a_module_has_a_hessian_reads_none(tmp_path, monkeypatch):
    """`path in hessians` answers from the file's header: it neither reads nor checks the module's
    H (each GPTQ rounding asked, then read and checked it again)."""
    path = tmp_path / "h.safetensors"
    hessian.save({"a": np.eye(8, dtype=np.float32)}, path, tokens=1)
    h = hessian.Hessians(path)
    checked = []
    monkeypatch.setattr(hessian, "check", lambda *a, **k: checked.append(k["module"]))
    assert "a" in h and "b" not in h and checked == []
    assert h["a"].shape == (8, 8) and checked == ["a"]
