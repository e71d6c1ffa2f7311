"""No setting silently ignored: keys a command does not read, and keys another key overrides."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_util import run_cli
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from mlxbun import pipeline
from mlxbun.commands import CONF_DIR
from mlxbun.config import keys, schema
from mlxbun.errors import InputError
from mlxbun.help import available_recipes


def _check(overrides: list[str], *, given: list[str] | None = None, steps: bool = True) -> None:
    """Compose like the CLI and run its checks of unread keys (of ``given``, default the
    overrides) and of the schema."""
    schema.register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        dcfg = compose("config", overrides=[*overrides, "paths.run_dir=/tmp/x"])
    defaults = OmegaConf.to_container(OmegaConf.structured(schema.Config))
    given = overrides if given is None else given
    keys.check_unread(OmegaConf.to_container(dcfg, resolve=False), defaults, given=given)
    cfg = OmegaConf.to_object(dcfg)
    if steps and cfg.command.name == "pipeline":
        pipeline.check_steps(cfg, list(cfg.pipeline.steps))


@pytest.mark.parametrize("recipe", available_recipes())
def test_every_recipe_sets_only_keys_its_command_reads(recipe: str) -> None:
    every_key = [f"{k}=" for k in keys.all_keys()]  # a recipe's keys, held to the command line's rule
    _check([f"+recipe={recipe}"], given=every_key, steps=False)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["command=allocate", "quant.method=gptq"], "quant.method='gptq' is not read by command=allocate"),
        (
            ["command=sensitivity", "quant.method=gptq"],
            "quant.method='gptq' is not read by command=sensitivity",
        ),
        (["command=synth", "quant.bits=8"], "quant.bits=8 is not read by command=synth"),
        (["command=serve", "kv.prompt=hi"], "kv.prompt='hi' is not read by command=serve"),
        (["command=serve", "kv.max_tokens=8"], "kv.max_tokens=8 is not read by command=serve"),
        (["command=kv_ls", "kv.name=x"], "kv.name='x' is not read by command=kv_ls"),
        (["command=kv_verify", "kv.strict=true"], "kv.strict=True is not read by command=kv_verify"),
        (["command=kv_gc", "kv.layout=blocks"], "kv.layout='blocks' is not read by command=kv_gc"),
        (["command=sensitivity_merge", "sensitivity.bits=[2]"], "sensitivity.bits=[2] is not read"),
        (["command=quantize", "quant.plan=p.json", "quant.bits=8"], "quant.bits=8 is ignored by quant.plan"),
        (["command=quantize", "quant.plan=p.json", "quant.mode=mxfp4"], "quant.mode='mxfp4' is ignored"),
        (
            [
                "command=pipeline",
                "pipeline.steps=[sensitivity,allocate,quantize]",
                "model.name=m",
                "allocate.budget_bpw=4.5",
                "quant.bits=8",
            ],
            "quant.bits=8 is ignored by quant.plan",
        ),  # fmt: skip
    ],
)
def test_a_key_the_command_would_ignore_is_refused(args: list[str], needle: str) -> None:
    with pytest.raises(InputError, match=needle.replace("[", r"\[").replace("(", r"\(")):
        _check(args)


@pytest.mark.parametrize(
    "args",
    [
        ["command=allocate", "quant.dtype=float16", "sensitivity.calib.samples=4", "io.shard_gb=1"],
        ["command=quantize", "model.synthetic=true", "synth.preset=tiny", "quant.bits=8"],
        ["command=pipeline", "pipeline.steps=[synth,quantize]", "synth.num_layers=2", "quant.bits=8"],
        ["command=quantize", "quant.plan=p.json", "quant.method=clip", "quant.dtype=float16"],
        [
            "command=serve",
            "kv.store=/s",
            "kv.layout=blocks",
            "kv.block_kib=64",
            "kv.verify=false",
            "kv.cap_gb=1",
        ],
        ["command=kv_verify", "kv.store=/s", "kv.name=x"],
        ["command=kv_gc", "kv.store=/s", "kv.block_kib=64", "kv.cap_gb=1", "kv.execute=true"],
    ],
)
def test_keys_the_command_reads_pass(args: list[str]) -> None:
    _check(args)


def test_serve_refuses_a_kv_key_it_does_not_read_before_it_starts(tmp_path: Path) -> None:
    fixture = Path(__file__).resolve().parent / "fixtures" / "llama-text-3m"
    res = run_cli(
        "command=serve", f"model.name={fixture}", "serve.port=0", "kv.prompt=hi", tmp=tmp_path, timeout=60
    )
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert res.stderr.startswith("error: kv.prompt='hi' is not read by command=serve"), res.stderr


def test_a_recipe_for_more_steps_than_run_is_not_refused() -> None:
    """Steps dropped from a recipe's pipeline leave its settings for them unread: the user chose that."""
    _check(["+recipe=rotate_quantize_synth", "pipeline.steps=[synth,rotate,quantize]", "quant.bits=4"])


def test_cli_refuses_an_unread_key_before_any_work(tmp_path: Path) -> None:
    res = run_cli("command=sensitivity", "model.name=/nonexistent", "quant.method=gptq", tmp=tmp_path)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "quant.method='gptq' is not read by command=sensitivity" in lines[0]
    outputs = tmp_path / "outputs"
    assert not outputs.exists() or not any(p.is_file() for p in outputs.rglob("*"))


def test_help_lists_the_single_keys_a_command_reads(tmp_path: Path) -> None:
    res = run_cli("command=allocate", "help=true", tmp=tmp_path, isolate=False)
    assert res.returncode == 0, res.stderr
    assert "quant.hessians" in res.stdout and "sensitivity.calib.samples" in res.stdout
    assert "quant.method" not in res.stdout and "sensitivity.bits" not in res.stdout


@pytest.mark.parametrize(
    "key", ["quant.out", "quant.plan", "quant.hessians", "synth.out", "allocate.sensitivity"]
)
def test_an_empty_path_is_refused_naming_the_key(key: str) -> None:
    command = {"quant": "quantize", "synth": "synth", "allocate": "allocate"}[key.partition(".")[0]]
    with pytest.raises(InputError, match=f"{key}='' is empty"):
        _check([f"command={command}", f"{key}="])


def test_cli_refuses_an_empty_quant_out(tmp_path: Path) -> None:
    res = run_cli("command=quantize", "model.synthetic=true", "quant.out=", tmp=tmp_path)
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines() == [
        "error: quant.out='' is empty; give a path, or leave quant.out unset for its default"
    ]


@pytest.mark.parametrize("rule", ["mixed_2_6", "mixed_3_4", "mixed_3_6", "mixed_4_6"])
def test_quant_plan_takes_an_mlx_lm_mixed_rule_as_its_help_says(rule: str) -> None:
    q = schema.QuantCfg(plan=rule)
    assert (q.plan, q.mixed) == (None, rule)
    with pytest.raises(InputError, match="both set"):
        schema.QuantCfg(plan=rule, mixed="mixed_3_6")
    with pytest.raises(InputError, match="quant.bits=8 is ignored by quant.mixed"):
        _check(["command=quantize", f"quant.plan={rule}", "quant.bits=8"])


def test_cli_quantizes_with_quant_plan_mixed_3_6(tmp_path: Path) -> None:
    out = tmp_path / "q"
    res = run_cli(
        "command=quantize", "model.synthetic=true", "quant.plan=mixed_3_6", f"quant.out={out}", tmp=tmp_path
    )
    assert res.returncode == 0, res.stderr
    quantization = json.loads((out / "config.json").read_text())["quantization"]
    assert {3, 6} <= {e["bits"] for e in quantization.values() if isinstance(e, dict)}
