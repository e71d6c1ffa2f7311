"""What a new user meets: --version, per-command help, hints for near-misses, json=true on every
command, human units, recipes from any directory, quiet exits into a closed pipe."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_util import REPO, isolated_args, run_cli

from mlxbun import cli
from mlxbun.commands import COMMANDS, CONF_DIR
from mlxbun.config import schema
from mlxbun.progress import human_bytes, human_count, human_seconds

FIXTURE = REPO / "tests" / "fixtures" / "llama-text-3m"


def test_version_is_mlxbun_s(tmp_path: Path) -> None:
    import mlxbun

    res = run_cli("--version", tmp=tmp_path, isolate=False)
    assert res.returncode == 0 and res.stdout.strip() == f"mlxbun {mlxbun.__version__}"


def test_per_command_help_lists_keys_with_type_value_and_comment(tmp_path: Path) -> None:
    res = run_cli("command=quantize", "help=true", "quant.bits=3", tmp=tmp_path)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith("command=quantize: ")
    (bits,) = [x for x in lines if x.split()[:1] == ["quant.bits"]]
    assert bits.split()[1:5] == ["int", "|", "None", "3"]
    (out,) = [x for x in lines if x.split()[:1] == ["quant.out"]]
    assert "Output model directory" in out
    assert not any(x.split()[:1] == ["kv.store"] for x in lines)  # other commands' keys stay out
    assert not (tmp_path / "outputs").exists()


def test_a_bare_command_name_hints_command_equals(tmp_path: Path) -> None:
    res = run_cli("quantize", "quant.bits=4", tmp=tmp_path)
    assert res.returncode == 2
    assert res.stderr.strip() == (
        "error: 'quantize' is not a key=value override; to run that command write command=quantize"
    )


def test_a_misspelt_key_gives_its_full_path_and_a_suggestion(tmp_path: Path) -> None:
    res = run_cli("command=quantize", "quant.bitz=4", tmp=tmp_path)
    assert res.returncode == 2
    (line,) = res.stderr.strip().splitlines()
    assert "unknown config key 'quant.bitz'; did you mean 'quant.bits'?" in line


def test_a_missing_launcher_plugin_says_what_to_install(tmp_path: Path) -> None:
    pytest.importorskip("hydra")
    try:
        import hydra_plugins.hydra_ray_launcher  # noqa: F401

        pytest.skip("the ray launcher is installed here")
    except ImportError:
        pass
    res = run_cli("-m", "command=synth", "hydra/launcher=ray_local", tmp=tmp_path)
    assert res.returncode == 2
    assert "pip install -e '.[ray]'" in res.stderr.strip().splitlines()[-1]


def _json(res: subprocess.CompletedProcess) -> dict:
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_json_true_is_honoured_by_recorded_and_read_only_commands(tmp_path: Path) -> None:
    doc = _json(run_cli("command=synth", "json=true", tmp=tmp_path))
    assert doc["command"] == "synth" and doc["status"] == "ok" and doc["metrics"]["params"] > 0
    run_dir = Path(doc["run_dir"])
    assert (run_dir / "manifest.json").is_file() and doc["manifest"] == str(run_dir / "manifest.json")
    doc = _json(run_cli("command=verify", f"runs.dir={run_dir}", "json=true", tmp=tmp_path))
    assert doc["run_dir"] == str(run_dir) and doc["drift"] == []
    doc = _json(
        run_cli("command=quantize", f"model.name={FIXTURE}", "quant.bits=4", "json=true", tmp=tmp_path)
    )
    assert doc["metrics"]["output_bytes"] > 0
    assert "0.00 GB" not in doc["message"] and "MiB" in doc["message"]


def test_human_units() -> None:
    assert human_bytes(512) == "512 B"
    assert human_bytes(1_800_000) == "1.7 MiB"
    assert human_bytes(5 << 30) == "5.0 GiB"
    assert human_bytes(1.2e15) == "1.1 PiB"
    assert [human_count(n) for n in (950, 12_600, 494_032_768, 1_543_714_304)] == [
        "950",
        "12.6K",
        "494M",
        "1.54B",
    ]
    assert human_seconds(42.4) == "42s"
    assert human_seconds(3147) == "52m27s"
    assert human_seconds(7 * 3600 + 125) == "7h02m"
    assert human_seconds(float("inf")) == "?"


def test_recipes_with_repo_paths_work_from_any_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    monkeypatch.chdir(tmp_path)
    schema.register()
    for recipe in ("sensitivity_quickstart", "mixed_pipeline", "sweep_sensitivity"):
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = OmegaConf.to_object(
                compose("config", overrides=[f"+recipe={recipe}", "paths.run_dir=/tmp/x"])
            )
        assert Path(cfg.model.name) == FIXTURE and Path(cfg.model.name).is_dir()


def test_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "mlxbun", "command=runs", *isolated_args(tmp_path)]
    run_cli("command=synth", tmp=tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for args in (argv, [sys.executable, "-m", "mlxbun"]):
        proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        proc.stdout.close()  # the reader is gone before the first line, as `| head -0`
        stderr = proc.stderr.read().decode()
        assert proc.wait(timeout=120) == 141, stderr
        assert stderr == "", stderr


def test_a_paths_outputs_through_a_file_names_the_key_and_exits_2(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    out, cache = f"paths.outputs={tmp_path / 'a-file' / 'out'}", f"paths.cache={tmp_path / 'cache'}"
    res = run_cli("command=synth", out, cache, tmp=tmp_path, isolate=False)
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert res.stderr.startswith(
        f"error: paths.outputs='{tmp_path / 'a-file' / 'out'}' is not a directory"
    ), res.stderr


def test_a_registry_that_is_no_database_names_registry_path(tmp_path: Path) -> None:
    res = run_cli("command=runs", "registry.path=/dev/null", tmp=tmp_path, isolate=False)
    assert res.returncode == 1 and res.stderr.count("\n") == 1, res.stderr
    assert res.stderr.startswith("error: registry.path='/dev/null': not a usable registry database (")
    assert "rollback" not in res.stderr


@pytest.mark.parametrize(
    ("args", "start"),
    [
        (["runs.max_gb=4"], "error: runs.max_gb=4.0 filters evaluated candidates"),
        (["runs.model=llama"], "error: runs.model='llama' filters evaluated candidates"),
        (["runs.command=eval", "runs.status=ok"], "error: runs.status='ok' filters recorded runs"),
        (["runs.command=eval", "runs.recipe=best"], "error: runs.recipe='best' filters recorded runs"),
    ],
)
def test_a_runs_filter_the_listing_does_not_apply_is_refused(
    tmp_path: Path, args: list[str], start: str
) -> None:
    """runs.max_gb and runs.model apply to runs.command=eval's listing only, runs.status and
    runs.recipe to the other: one that would be ignored is one line, exit 2."""
    res = run_cli("command=runs", *args, tmp=tmp_path)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and res.stderr.startswith(start), res.stderr


@pytest.mark.parametrize(
    ("args", "key", "code"),
    [
        (["command=runs", "runs.limit=-1"], "runs.limit", 2),
        (["command=nope"], "command", 2),
        (["command=runs", "registry.path=/dev/null"], "registry.path", 1),
    ],
)
def test_with_json_true_an_error_is_a_json_document(
    tmp_path: Path, args: list[str], key: str, code: int
) -> None:
    res = run_cli(*args, "json=true", tmp=tmp_path, isolate=False)
    doc = json.loads(res.stdout)
    assert res.returncode == code and doc["exit"] == code and doc["key"] == key and doc["error"], res.stdout


def test_a_misspelt_section_suggests_by_section_and_name(tmp_path: Path) -> None:
    res = run_cli("command=quantize", "qunt.bits=4", tmp=tmp_path)
    assert res.returncode == 2
    (line,) = res.stderr.strip().splitlines()
    assert "unknown config key 'qunt.bits'; did you mean 'quant.bits'?" in line


@pytest.mark.parametrize(
    ("arg", "want"),
    [
        ("command=quantise", "error: command='quantise' does not exist; did you mean quantize? ("),
        ("+recipe=quickstrat", "error: recipe='quickstrat' does not exist; did you mean quickstart? ("),
    ],
)
def test_a_misspelt_command_or_recipe_suggests_the_nearest_names(tmp_path: Path, arg: str, want: str) -> None:
    res = run_cli(arg, tmp=tmp_path)
    assert res.returncode == 2 and res.stderr.startswith(want), res.stderr
    assert "kv_export" not in res.stderr and "sweep_bits" not in res.stderr  # not the whole list


def test_multirun_flag_works_after_the_overrides(tmp_path: Path) -> None:
    assert cli.multirun_first(["command=synth", "synth.seed=1,2", "-m"]) == [
        "-m",
        "command=synth",
        "synth.seed=1,2",
    ]
    res = run_cli("command=synth", "synth.preset=tiny", "synth.seed=1,2", "-m", tmp=tmp_path)
    assert res.returncode == 0, res.stderr
    assert len(list((tmp_path / "outputs" / "multirun").rglob("manifest.json"))) == 2


def test_the_command_list_does_not_call_sensitivity_exact() -> None:
    summary = COMMANDS["sensitivity"].summary
    assert "fisher" in summary and not summary.startswith("exact")
