"""command=pipeline: every step's settings are checked before the first step runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxbun import commands, pipeline
from mlxbun.commands import COMMANDS, CONF_DIR
from mlxbun.config import schema
from mlxbun.errors import InputError
from mlxbun.help import available_recipes
from mlxbun.runs.provenance import RunResult


@pytest.fixture
def ran(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Steps replaced by recorders that hand on what the real steps provide."""
    calls: list[str] = []

    def fake(step: str):
        def run(cfg):
            calls.append(step)
            return RunResult(provides={k: f"/x/{step}" for k in COMMANDS[step].provides})

        return run

    monkeypatch.setattr(commands, "resolve", fake)
    return calls


def _cfg(tmp_path: Path, steps: list[str], **sections) -> schema.Config:
    cfg = schema.Config(pipeline=schema.PipelineCfg(steps=steps), **sections)
    cfg.paths.run_dir = str(tmp_path / "run")
    return cfg


def test_a_missing_setting_of_a_late_step_fails_before_the_first_step(tmp_path: Path, ran: list[str]) -> None:
    cfg = _cfg(tmp_path, ["synth", "sensitivity", "allocate"])
    with pytest.raises(
        InputError, match=r"step 3 \(allocate\) needs allocate.budget_bpw or allocate.budget_bytes"
    ):
        pipeline.run(cfg)
    assert ran == [] and not (tmp_path / "run").exists()


def test_keys_provided_by_earlier_steps_count_as_set(tmp_path: Path, ran: list[str]) -> None:
    cfg = _cfg(
        tmp_path,
        ["synth", "sensitivity", "allocate", "quantize"],
        allocate=schema.AllocateCfg(budget_bpw=4.5),
    )
    res = pipeline.run(cfg)
    assert ran == ["synth", "sensitivity", "allocate", "quantize"]
    # the run says what it ends with: the last model handed on, in the manifest and the message
    assert res.metrics["provides"]["model.name"] == "/x/quantize"
    assert res.message.splitlines()[-1] == "model: /x/quantize"


def test_a_step_without_its_model_is_refused(tmp_path: Path, ran: list[str]) -> None:
    with pytest.raises(InputError, match=r"step 1 \(quantize\) needs model.name or model.synthetic"):
        pipeline.run(_cfg(tmp_path, ["quantize"]))
    assert ran == []


def test_an_empty_pipeline_is_refused(tmp_path: Path, ran: list[str]) -> None:
    with pytest.raises(InputError, match=r"pipeline.steps=\[\] is empty"):
        pipeline.run(_cfg(tmp_path, []))


def test_provides_matches_what_the_steps_hand_on() -> None:
    """``provides`` is what each command's RunResult.provides sets (read from the source)."""
    import inspect
    import re

    for step, keys in ((n, c.provides) for n, c in COMMANDS.items() if c.provides):
        module = commands.resolve(step)
        source = inspect.getsource(inspect.getmodule(module))
        for key in keys:
            assert re.search(rf'provides=\{{[^}}]*"{re.escape(key)}"', source), (step, key)


# Recipes whose model and budget the user gives (their first comment lines say so).
USER_KEYS = {"best": ["model.name=${repo:tests/fixtures/llama-text-12l}", "allocate.budget_bpw=3.5"]}


def _compose_recipe(recipe: str, *extra: str):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    schema.register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return OmegaConf.to_object(
            compose("config", overrides=[f"+recipe={recipe}", "paths.run_dir=/tmp/x", *extra])
        )


@pytest.mark.parametrize("recipe", available_recipes())
def test_every_pipeline_recipe_passes_the_up_front_check(recipe: str) -> None:
    cfg = _compose_recipe(recipe, *USER_KEYS.get(recipe, []))
    if cfg.command.name == "pipeline":
        pipeline.check_steps(cfg, list(cfg.pipeline.steps))


def test_the_best_recipe_without_a_budget_names_the_keys_before_any_step() -> None:
    cfg = _compose_recipe("best", USER_KEYS["best"][0])
    with pytest.raises(
        InputError, match=r"step 3 \(allocate\) needs allocate.budget_bpw or allocate.budget_bytes"
    ):
        pipeline.check_steps(cfg, list(cfg.pipeline.steps))
    cfg = _compose_recipe("best", USER_KEYS["best"][0], "allocate.budget_bytes=3000000")
    pipeline.check_steps(cfg, list(cfg.pipeline.steps))
    assert cfg.sensitivity.candidates.methods == ["rtn", "clip", "gptq"]
    # tune's reference is the user's model, fixed before quantize hands on its output as model.name
    assert cfg.pipeline.steps[-2:] == ["quantize", "tune"]
    assert cfg.tune.reference == cfg.model.name and cfg.tune.reference.endswith("llama-text-12l")


def test_a_tune_step_without_a_reference_fails_before_the_first_step(tmp_path: Path, ran: list[str]) -> None:
    cfg = _cfg(tmp_path, ["quantize", "tune"], model=schema.ModelCfg(name=str(tmp_path)))
    with pytest.raises(InputError, match=r"step 2 \(tune\) needs tune.reference"):
        pipeline.run(cfg)
    assert ran == []


def test_a_synth_step_too_big_for_the_disk_fails_before_the_first_step(
    tmp_path: Path, ran: list[str]
) -> None:
    cfg = _cfg(tmp_path, ["synth", "quantize"], synth=schema.SynthCfg(hidden_size=10_000_000))
    with pytest.raises(InputError, match=r"needs .* of disk"):
        pipeline.run(cfg)
    assert ran == []


def test_a_finished_steps_memory_is_released_before_the_next(tmp_path: Path, monkeypatch) -> None:
    """A step's objects are collected and MLX's cache of freed buffers emptied between steps
    (a sensitivity's float32 reference stayed resident through quantize and tune)."""
    import gc

    import mlx.core as mx

    seen: dict[str, int] = {}

    class Model:  # a reference cycle: only the collector frees it
        def __init__(self) -> None:
            self.me, self.weight = self, mx.ones((1 << 20,))
            mx.eval(self.weight)

    def fake(step: str):
        def run(cfg):
            seen[step] = mx.get_cache_memory() + mx.get_active_memory()
            if step == "synth":
                Model()
            return RunResult(provides={k: f"/x/{step}" for k in COMMANDS[step].provides})

        return run

    monkeypatch.setattr(commands, "resolve", fake)
    gc.collect()
    mx.clear_cache()
    pipeline.run(_cfg(tmp_path, ["synth", "quantize"]))
    assert seen["quantize"] - seen["synth"] < 1 << 20  # the 4 MB weight neither held nor cached


def test_a_run_budget_gives_tune_what_the_steps_before_it_left(tmp_path: Path, monkeypatch) -> None:
    """pipeline.max_minutes lowers tune.max_minutes to the minutes left when tune starts less its
    closing's share, never below MIN_TUNE_MINUTES (tune still trains); a tune budget already
    below it is kept."""
    clock = iter(())
    monkeypatch.setattr(pipeline, "_now", lambda: next(clock))
    given: dict[str, float | None] = {}

    def fake(step: str):
        def run(cfg):
            given[step] = cfg.tune.max_minutes
            return RunResult(provides={k: f"/x/{step}" for k in COMMANDS[step].provides})

        return run

    monkeypatch.setattr(commands, "resolve", fake)
    share = 1 - pipeline.TUNE_CLOSING_SHARE  # the rest is tune's closing
    for budget, own, want in (
        (45.0, 60.0, 15.0 * share),
        (20.0, 60.0, pipeline.MIN_TUNE_MINUTES),
        (45.0, 5.0, 5.0),
    ):
        clock = iter([0.0, 30 * 60.0])  # the run starts; tune starts 30 minutes later
        cfg = _cfg(
            tmp_path, ["synth", "quantize", "tune"], tune=schema.TuneCfg(reference="/x/ref", max_minutes=own)
        )
        cfg.pipeline.max_minutes = budget
        pipeline.run(cfg)
        assert given["tune"] == pytest.approx(want), (budget, own)
        assert given["synth"] == own  # the steps before tune keep their settings
    with pytest.raises(InputError, match=r"pipeline.max_minutes=0"):
        schema.PipelineCfg(steps=["tune"], max_minutes=0)
