"""Path inputs (quant.hessians, quant.plan, allocate.sensitivity): missing or not a regular file
is bad input named by its key (exit 2, no run left), never a hang or "does not exist"."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from cli_util import run_cli

from mlxbun.errors import InputError
from mlxbun.quant.plan import Plan, input_file, load_plan
from mlxbun.quant.quantize.command import quantize_model_dir
from mlxbun.quant.sensitivity.file import load_sensitivity
from mlxbun.quant.spec import QuantSpec


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    path = tmp_path / "fifo"
    os.mkfifo(path)
    return path


@pytest.mark.parametrize(
    ("read", "key"),
    [(load_plan, "quant.plan"), (load_sensitivity, "allocate.sensitivity")],
)
def test_a_fifo_or_device_is_named_as_such(read, key: str, fifo: Path) -> None:
    with pytest.raises(InputError, match=f"{key}='{fifo}' is a FIFO, not a regular file"):
        read(fifo)
    with pytest.raises(InputError, match=f"{key}='/dev/zero' is a device, not a regular file"):
        read("/dev/zero")


def test_a_directory_is_allowed_only_when_asked(tmp_path: Path) -> None:
    assert input_file("k", tmp_path, what="x", directory=True) == tmp_path
    with pytest.raises(InputError, match="is a directory, not a regular file"):
        input_file("k", tmp_path, what="x")


@pytest.mark.parametrize("kind", ["missing", "fifo", "device"])
def test_bad_hessians_are_refused_before_work(tiny_model, tmp_path: Path, fifo: Path, kind: str) -> None:
    path = {"missing": tmp_path / "nope.safetensors", "fifo": fifo, "device": Path("/dev/zero")}[kind]
    with pytest.raises(InputError, match=f"quant.hessians='{path}'"):
        quantize_model_dir(tiny_model(), tmp_path / "out", method="gptq", hessians=path)
    assert not (tmp_path / "out").exists()


def test_cli_missing_hessians_is_exit_2_and_leaves_no_run(tmp_path: Path) -> None:
    missing = tmp_path / "nope.safetensors"
    res = run_cli(
        "command=quantize",
        "model.synthetic=true",
        "quant.method=gptq",
        f"quant.hessians={missing}",
        tmp=tmp_path,
    )
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and f"quant.hessians='{missing}' does not exist" in lines[0]
    outputs = tmp_path / "outputs"
    assert not outputs.exists() or not any(p.is_file() for p in outputs.rglob("*"))


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_a_plan_entry_needing_hessians_is_refused_without_them(
    tiny_model, tmp_path: Path, method: str
) -> None:
    plan = Plan(default=QuantSpec(), layers={"model.layers.0.mlp.up_proj": QuantSpec(bits=4, method=method)})
    with pytest.raises(
        InputError, match=f"'model.layers.0.mlp.up_proj' method '{method}', which needs quant.hessians"
    ):
        quantize_model_dir(tiny_model(), tmp_path / "out", plan=plan)
    assert not (tmp_path / "out").exists()
