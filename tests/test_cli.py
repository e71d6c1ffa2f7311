"""The command suite end to end: config composition, bad input, manifests, verify, sweeps."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from cli_util import REPO, isolated_args, run_cli
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from mlxbun import commands
from mlxbun.commands import COMMANDS, CONF_DIR
from mlxbun.config import keys, schema
from mlxbun.errors import InputError
from mlxbun.help import available_recipes, recipe_summary


def _compose(overrides: list[str]) -> schema.Config:
    schema.register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[*overrides, "paths.run_dir=/tmp/x"])
    return OmegaConf.to_object(cfg)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_config_composes(command: str) -> None:
    cfg = _compose([f"command={command}"])
    assert cfg.command.name == command
    assert (CONF_DIR / "command" / f"{command}.yaml").is_file()


def test_every_command_conf_file_is_a_command_of_the_table() -> None:
    files = {p.stem for p in (CONF_DIR / "command").glob("*.yaml")}
    assert files == set(COMMANDS), f"conf files without a command: {sorted(files - set(COMMANDS))}"


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_is_the_run_of_its_module(command: str) -> None:
    """command=X is ``run`` of a module named X, of X/command.py (a package named after the
    command), or of <package>/<name>.py for X = package_name (kv_gc: kv/gc.py,
    sensitivity_merge: sensitivity/merge.py); or a function of the module that holds a family of
    commands (kv_ls: kv/commands.py's ``ls``)."""
    target = COMMANDS[command]
    assert callable(commands.resolve(command))
    *packages, name = target.module.removeprefix("mlxbun.").split(".")
    package, name = (packages or [""])[-1], name.rstrip("_")
    if target.function == "run":
        named = {name, f"{package}_{name}"} | ({package} if name == "command" else set())
        assert command in named, target.module
    else:
        assert command == f"{package}_{target.function}", target


def test_pipeline_needs_and_provides_name_real_keys() -> None:
    known = set(keys.all_keys())
    for name, c in COMMANDS.items():
        for key in [k for group in c.needs for k in group] + list(c.provides):
            assert key in known, (name, key)


@pytest.mark.parametrize("recipe", available_recipes())
def test_every_recipe_composes_and_names_a_command(recipe: str) -> None:
    cfg = _compose([f"+recipe={recipe}"])
    assert cfg.command.name in COMMANDS
    assert recipe_summary(recipe), f"recipes/{recipe}.yaml needs a one-line description comment"


def test_help_lists_every_command_and_recipe(tmp_path: Path) -> None:
    res = run_cli(tmp=tmp_path, isolate=False)
    assert res.returncode == 0, res.stderr
    for name in COMMANDS:
        assert f"  {name} " in res.stdout
    for recipe in available_recipes():
        assert f"  {recipe} " in res.stdout or res.stdout.rstrip().endswith(recipe)


def test_unknown_recipe_is_an_error_listing_recipes(tmp_path: Path) -> None:
    res = run_cli("+recipe=does_not_exist", tmp=tmp_path)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "does_not_exist" in lines[0] and "quickstart" in lines[0]
    assert not (tmp_path / "outputs").exists()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["command=quantize", "quant.bits=7"], "quant.bits=7"),
        (["command=quantize", "quant.mode=int3"], "quant.mode='int3'"),
        (["command=quantize", "quant.group_size=48"], "quant.group_size=48"),
        (["command=synth", "synth.arch=gpt5"], "synth.arch='gpt5'"),
        (["command=synth", "io.shard_gb=-1"], "io.shard_gb=-1"),
        (["command=synth", "synth.hidden_size=abc"], "synth.hidden_size"),
        (["command=synth", "+nope=1"], "nope"),
        (["command=synth", "nope=1"], "nope"),
        (["command=nosuch"], "command='nosuch'"),
        (["command=sensitivity", "sensitivity.shard=3", "sensitivity.num_shards=2"], "sensitivity.shard=3"),
        (["command=sensitivity", "sensitivity.bits=4"], "give one, e.g. 'sensitivity.bits=[4]'"),
        (
            ["command=sensitivity_merge", "sensitivity.inputs=[[x]]"],
            "sensitivity.inputs has ['x'], not a string",
        ),
        (
            ["command=pipeline", "pipeline.steps=[[quantize]]"],
            "pipeline.steps has ['quantize'], not a string",
        ),
        (["command=sensitivity", "sensitivity.bits=4,8"], "give a list as key=[a,b]"),
    ],
)
def test_bad_value_is_one_line_exit_2(tmp_path: Path, args: list[str], needle: str) -> None:
    res = run_cli(*args, tmp=tmp_path)
    assert res.returncode == 2, (res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("error: ") and needle in lines[0]
    assert "Traceback" not in res.stderr
    outputs = tmp_path / "outputs"
    assert not outputs.exists() or not any(outputs.rglob("manifest.json"))


def test_verbose_shows_the_traceback(tmp_path: Path) -> None:
    res = run_cli("command=verify", "runs.dir=/nonexistent", "verbose=true", tmp=tmp_path)
    assert res.returncode == 2
    assert "Traceback" in res.stderr and res.stderr.strip().splitlines()[-1].startswith("error: ")


def test_schema_errors_name_key_value_and_choices() -> None:
    with pytest.raises(InputError, match=r"quant.mode='fp3' is not allowed; choose one of affine, mxfp4"):
        schema.QuantCfg(mode="fp3")
    with pytest.raises(InputError, match=r"kv.block_kib=0 is out of range; it must be > 0"):
        schema.KvCfg(block_kib=0)


def _manifest(run_dir: Path) -> dict:
    return json.loads((run_dir / "manifest.json").read_text())


def _run_dir(stdout: str) -> Path:
    line = next(x for x in stdout.splitlines() if x.startswith("outputs:"))
    return Path(line.split(":", 1)[1].strip())


@pytest.fixture(scope="module")
def quickstart_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    tmp = tmp_path_factory.mktemp("quickstart")
    dirs = []
    for _ in range(2):
        res = run_cli("+recipe=quickstart", tmp=tmp)
        assert res.returncode == 0, res.stderr
        dirs.append(_run_dir(res.stdout))
    return tmp, dirs


def test_quickstart_twice_gives_identical_artifacts(quickstart_runs) -> None:
    _, (a, b) = quickstart_runs
    ma, mb = _manifest(a), _manifest(b)
    assert ma["status"] == mb["status"] == "ok"
    assert ma["outputs"], "quickstart must produce artifacts"
    assert ma["outputs"] == mb["outputs"]
    assert ma["started_at"] != mb["started_at"] or a != b


def test_manifest_records_provenance(quickstart_runs) -> None:
    _, (a, _) = quickstart_runs
    m = _manifest(a)
    for key in (
        "config",
        "overrides",
        "recipe",
        "git",
        "versions",
        "platform",
        "seed",
        "blas",
        "started_at",
        "finished_at",
        "status",
        "inputs",
        "outputs",
    ):
        assert key in m, key
    blob = subprocess.run(
        ["git", "hash-object", "recipes/quickstart.yaml"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert m["recipe"] == {"name": "quickstart", "file": "recipes/quickstart.yaml", "git_blob": blob}
    assert "+recipe=quickstart" in m["overrides"]
    assert set(m["versions"]) >= {"python", "mlx", "mlx-lm", "mlxbun"}
    assert all(set(v) == {"sha256", "size"} for v in m["outputs"].values())


def test_verify_passes_then_fails_after_a_flipped_byte(quickstart_runs) -> None:
    tmp, (a, b) = quickstart_runs
    for run_dir in (a, b):
        res = run_cli("command=verify", f"runs.dir={run_dir}", tmp=tmp)
        assert res.returncode == 0, res.stderr
    rel = sorted(_manifest(b)["outputs"])[0]
    target = b / rel
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))
    res = run_cli("command=verify", f"runs.dir={b}", tmp=tmp)
    assert res.returncode == 1
    assert rel in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_runs_lists_recorded_runs(quickstart_runs) -> None:
    tmp, dirs = quickstart_runs
    res = run_cli("command=runs", "json=true", "runs.recipe=quickstart", tmp=tmp)
    assert res.returncode == 0, res.stderr
    rows = json.loads(res.stdout)
    assert {r["output_dir"] for r in rows} >= {str(d) for d in dirs}
    assert all(r["status"] == "ok" and r["command"] == "pipeline" for r in rows)


def test_joblib_sweep_gives_one_dir_manifest_and_record_per_job(tmp_path: Path) -> None:
    res = run_cli(
        "-m", "+recipe=sweep_synth", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", tmp=tmp_path
    )
    assert res.returncode == 0, res.stderr
    manifests = sorted((tmp_path / "outputs" / "multirun").rglob("manifest.json"))
    assert len(manifests) == 8
    assert {json.loads(m.read_text())["status"] for m in manifests} == {"ok"}
    res = run_cli("command=runs", "json=true", "runs.command=synth", tmp=tmp_path)
    rows = json.loads(res.stdout)
    assert len(rows) == 8 and {r["output_dir"] for r in rows} == {str(m.parent) for m in manifests}


@pytest.mark.parametrize("launcher", ["joblib_local", "slurm", "submitit_local", "ray_local"])
def test_launcher_presets_compose(launcher: str) -> None:
    from hydra.core.plugins import Plugins  # noqa: F401  (loads launcher plugins)

    if launcher == "ray_local":
        pytest.importorskip("hydra_plugins.hydra_ray_launcher")
    schema.register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"hydra/launcher={launcher}"], return_hydra_config=True)
    assert "Launcher" in cfg.hydra.launcher._target_


def test_submitit_local_sweep_records_each_job(tmp_path: Path) -> None:
    res = run_cli(
        "-m",
        "command=synth",
        "synth.seed=0,1",
        "hydra/launcher=submitit_local",
        "hydra.launcher.timeout_min=10",
        tmp=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    manifests = sorted((tmp_path / "outputs" / "multirun").rglob("manifest.json"))
    assert len(manifests) == 2


@pytest.mark.parametrize("command", sorted(n for n, c in COMMANDS.items() if c.readonly and n != "verify"))
def test_read_only_commands_leave_no_run_directory(tmp_path: Path, command: str) -> None:
    run_cli(f"command={command}", tmp=tmp_path)
    assert not (tmp_path / "outputs").exists()


def test_bad_input_leaves_no_outputs_directory_it_made(tmp_path: Path) -> None:
    """A first run with a bad value left an empty paths.outputs (and the parents Hydra made for
    it) behind; one that was there already, with what is in it, stays."""
    fresh = tmp_path / "new" / "outputs"
    isolated = [a for a in isolated_args(tmp_path) if not a.startswith("paths.outputs=")]
    res = run_cli("command=tune", "tune.max_minutes=-1", f"paths.outputs={fresh}", *isolated,
                  tmp=tmp_path, isolate=False)  # fmt: skip
    assert res.returncode == 2 and "tune.max_minutes=-1.0" in res.stderr, res.stderr
    assert not (tmp_path / "new").exists()
    (tmp_path / "outputs" / "keep").mkdir(parents=True)
    res = run_cli("command=tune", "tune.max_minutes=-1", tmp=tmp_path)
    assert res.returncode == 2 and (tmp_path / "outputs" / "keep").is_dir()
