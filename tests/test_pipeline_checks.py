"""A pipeline refuses, before its first step, what a later step would refuse after the work
before it: an allocate budget below the smallest plan, a quantize step without its Hessians."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_util import REPO, run_cli

from mlxbun import pipeline
from mlxbun.config import schema
from mlxbun.errors import InputError

FIXTURE = REPO / "tests" / "fixtures" / "llama-text-3m"


def _cfg(tmp_path: Path, steps: list[str], **allocate) -> schema.Config:
    cfg = schema.Config()
    cfg.command.name = "pipeline"
    cfg.model.name = str(FIXTURE)
    cfg.paths.run_dir = str(tmp_path / "run")
    cfg.pipeline.steps = steps
    cfg.allocate = schema.AllocateCfg(**allocate)
    return cfg


def test_a_budget_below_the_smallest_plan_is_refused_before_the_sensitivity_step(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, ["sensitivity", "allocate", "quantize"], budget_bpw=4.0)
    with pytest.raises(
        InputError, match=r"step 2 \(allocate\): allocate.budget_bpw=4.0 cannot be met.*nothing"
    ):
        pipeline.check_steps(cfg, cfg.pipeline.steps)
    cfg.sensitivity.bits = [2, 4, 8]  # 2-bit candidates reach below 4 bpw
    pipeline.check_steps(cfg, cfg.pipeline.steps)


def test_the_byte_budget_and_the_candidate_filters_count(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, ["sensitivity", "allocate"], budget_bytes=1_000_000)
    with pytest.raises(InputError, match="allocate.budget_bytes=1000000 cannot be met"):
        pipeline.check_steps(cfg, cfg.pipeline.steps)
    cfg = _cfg(tmp_path, ["sensitivity", "allocate"], budget_bpw=5.0, bits=[8])
    with pytest.raises(InputError, match="allocate.budget_bpw=5.0 cannot be met"):
        pipeline.check_steps(cfg, cfg.pipeline.steps)


def test_the_candidates_a_sensitivity_step_scores_count(tmp_path: Path) -> None:
    """2-bit g128 is smaller than 2-bit g64: a budget between them is met with the group sizes
    sensitivity.candidates adds."""
    cfg = _cfg(tmp_path, ["sensitivity", "allocate"], budget_bpw=2.4)
    cfg.sensitivity.bits = [2, 4]
    with pytest.raises(InputError, match="allocate.budget_bpw=2.4 cannot be met"):
        pipeline.check_steps(cfg, cfg.pipeline.steps)
    cfg.sensitivity.candidates = schema.CandidatesCfg(group_sizes=[128])
    cfg.allocate.default_group_size = 128
    pipeline.check_steps(cfg, cfg.pipeline.steps)
    cfg.allocate.group_sizes = [64]  # the filter leaves g64 only
    with pytest.raises(InputError, match="allocate.budget_bpw=2.4 cannot be met"):
        pipeline.check_steps(cfg, cfg.pipeline.steps)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_a_quantize_step_without_hessians_is_refused_before_the_first_step(
    tmp_path: Path, method: str
) -> None:
    cfg = _cfg(tmp_path, ["synth", "quantize"])
    cfg.model.name = None
    cfg.quant.method = method
    with pytest.raises(
        InputError, match=rf"step 2 \(quantize\): quant.method='{method}' needs quant.hessians"
    ):
        pipeline.check_steps(cfg, cfg.pipeline.steps)
    cfg.quant.hessians = str(tmp_path / "missing.safetensors")
    with pytest.raises(InputError, match="quant.hessians='.*missing.safetensors' does not exist"):
        pipeline.check_steps(cfg, cfg.pipeline.steps)


def test_cli_pipeline_with_an_unmeetable_budget_leaves_no_run(tmp_path: Path) -> None:
    res = run_cli(
        "command=pipeline",
        "pipeline.steps=[sensitivity,allocate,quantize]",
        f"model.name={FIXTURE}",
        "allocate.budget_bpw=4",
        tmp=tmp_path,
        timeout=300,
    )
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "step 2 (allocate): allocate.budget_bpw=4.0 cannot be met" in lines[0]
    outputs = tmp_path / "outputs"
    assert not outputs.exists() or not any(p.is_file() for p in outputs.rglob("*"))
    runs = run_cli("command=runs", tmp=tmp_path)
    assert "failed" not in runs.stdout


def test_an_allocate_step_with_a_missing_hessians_file_is_refused_before_the_first_step(
    tmp_path: Path,
) -> None:
    cfg = _cfg(tmp_path, ["sensitivity", "allocate"], budget_bpw=8.0)
    cfg.quant.hessians = str(tmp_path / "missing.safetensors")
    with pytest.raises(
        InputError, match=r"step 2 \(allocate\): quant.hessians='.*missing.safetensors' does not exist"
    ):
        pipeline.check_steps(cfg, cfg.pipeline.steps)
