"""command=inspect: totals and quantization against mlx-lm's own numbers, text and JSON output."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from cli_util import run_cli
from test_shards import LLAMA, tiny_llama

from mlxbun.config.schema import Config
from mlxbun.errors import InputError
from mlxbun.inspect import format_report, inspect_model, run


@pytest.fixture(scope="module")
def quantized_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, nn.Module]:
    """A mixed 4/8-bit tiny llama saved by mlx-lm itself (the reference writer)."""
    from mlx_lm.utils import save_config, save_model

    model = tiny_llama()

    def predicate(path: str, module: nn.Module) -> bool | dict:
        if not hasattr(module, "to_quantized"):
            return False
        return {"group_size": 32, "bits": 8} if path == "lm_head" else True

    nn.quantize(model, group_size=64, bits=4, class_predicate=predicate)
    out = tmp_path_factory.mktemp("q") / "model"
    save_model(out, model)
    quant = {
        "group_size": 64,
        "bits": 4,
        "mode": "affine",
        "lm_head": {"group_size": 32, "bits": 8, "mode": "affine"},
    }
    save_config({**LLAMA, "quantization": quant}, config_path=out / "config.json")
    return out, model


def test_totals_match_mlx_lm(quantized_dir: tuple[Path, nn.Module]) -> None:
    from mlx_lm.utils import compute_bits_per_weight, get_total_parameters

    path, model = quantized_dir
    report = inspect_model(path)
    assert report["parameters"] == get_total_parameters(model)
    assert report["bits_per_weight"] == pytest.approx(compute_bits_per_weight(model), abs=1e-3)
    ref = mx.load(str(path / "model.safetensors"))
    assert [t["name"] for t in report["tensors"]] == sorted(ref)
    for row in report["tensors"]:
        assert tuple(row["shape"]) == ref[row["name"]].shape and row["bytes"] == ref[row["name"]].nbytes
    assert report["total_bytes"] == sum(a.nbytes for a in ref.values())
    assert report["metadata"] == {"format": "mlx"} and report["model_type"] == "llama"


def test_quantization_summary(quantized_dir: tuple[Path, nn.Module]) -> None:
    path, model = quantized_dir
    q = inspect_model(path)["quantization"]
    assert q["modules"]["lm_head"]["bits"] == 8 and q["modules"]["lm_head"]["group_size"] == 32
    assert q["modules"]["model.layers.0.mlp.up_proj"]["bits"] == 4
    assert [(g["bits"], g["group_size"], g["modules"]) for g in q["by_bits"]] == [(4, 64, 15), (8, 32, 1)]
    # 4-bit g64 with bf16 scale and bias per group: 4 + 32/64 = 4.5 bits per weight
    assert q["modules"]["model.layers.0.mlp.up_proj"]["bits_per_weight"] == pytest.approx(4.5)
    assert q["modules"]["lm_head"]["bits_per_weight"] == pytest.approx(8 + 32 / 32)
    norms = 2 * 2 * LLAMA["hidden_size"] + LLAMA["hidden_size"]
    assert q["unquantized_parameters"] == norms


def test_unquantized_model_has_no_quant_section(tmp_path: Path) -> None:
    from mlx_lm.utils import save_model

    save_model(tmp_path, tiny_llama())
    report = inspect_model(tmp_path)
    assert report["quantization"] is None and report["bits_per_weight"] == pytest.approx(16.0)


def test_text_report(quantized_dir: tuple[Path, nn.Module]) -> None:
    path, _ = quantized_dir
    report = inspect_model(path)
    full = format_report(report, tensors=True)
    assert "model.layers.1.mlp.down_proj.scales" in full and "model.safetensors" in full
    assert "differ from the default: lm_head=8b" in full
    brief = format_report(report, tensors=False)
    assert "down_proj.scales" not in brief and f"parameters: {report['parameters']:,}" in brief


def config_for(tmp_path: Path, **inspect: object) -> Config:
    cfg = Config()
    cfg.registry.path = str(tmp_path / "registry.db")
    cfg.registry.hub_cache = str(tmp_path / "hub")
    for k, v in inspect.items():
        setattr(cfg.inspect, k, v)
    return cfg


def test_run_json_and_inputs(quantized_dir: tuple[Path, nn.Module], tmp_path: Path) -> None:
    path, _ = quantized_dir
    cfg = config_for(tmp_path, path=str(path), tensors=False)
    cfg.json = True
    result = run(cfg)
    data = json.loads(result.message)
    assert "tensors" not in data and "modules" not in data["quantization"]
    assert data["parameters"] == result.metrics["parameters"] and result.inputs == [path]
    assert result.outputs == [] and result.provides == {}


def test_run_single_file_via_model_name(quantized_dir: tuple[Path, nn.Module], tmp_path: Path) -> None:
    path, _ = quantized_dir
    cfg = config_for(tmp_path)
    cfg.model.name = str(path / "model.safetensors")
    assert "tensors: 53" in run(cfg).message


def test_run_errors(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(InputError, match="not a .safetensors file or a model directory"):
        run(config_for(tmp_path, path=str(tmp_path / "notes.txt")))
    with pytest.raises(InputError, match="inspect.path='no-such-model'"):
        run(config_for(tmp_path, path="no-such-model"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="no weights found"):
        run(config_for(tmp_path, path=str(tmp_path / "empty")))


def test_cli(quantized_dir: tuple[Path, nn.Module], tmp_path: Path) -> None:
    path, _ = quantized_dir
    proc = run_cli(
        "command=inspect", f"inspect.path={path}", "inspect.tensors=false", "json=true", tmp=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["total_tensors"] == 53
    assert not list(tmp_path.rglob("manifest.json"))  # read-only: no recorded run
    (tmp_path / "hub").mkdir()
    bad = run_cli("command=inspect", f"inspect.path={tmp_path / 'missing'}", tmp=tmp_path)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("error: inspect.path=")


def test_odd_packed_shape_is_reported_not_fatal(tmp_path: Path) -> None:
    from mlxbun.io.shards import write_sharded

    write_sharded(tmp_path, {"x.weight": mx.zeros((4, 7), dtype=mx.uint32), "x.scales": mx.ones((4, 3))})
    report = inspect_model(tmp_path)
    assert report["parameters"] == 28  # counted as its 32-bit words
    assert report["quantization"]["modules"]["x"]["source"] == "unknown"
    assert "packed modules" in format_report(report)
