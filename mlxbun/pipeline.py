"""command=pipeline: run several commands in order in one run directory.

Each step writes into ``<run_dir>/<step>`` and hands keys to later steps through
``RunResult.provides`` (e.g. synth provides ``model.name``; allocate provides ``quant.plan``).

    <run_dir>/
        manifest.json
        synth/  quantize/  ...     one directory per step (``name-2`` when a step repeats)
"""

from __future__ import annotations

import copy
from dataclasses import fields, is_dataclass, replace
from pathlib import Path
from typing import Any

from mlxbun.errors import InputError
from mlxbun.provenance import RunResult


def set_key(cfg: Any, dotted: str, value: Any) -> Any:
    """A copy of dataclass ``cfg`` with ``dotted`` (e.g. "model.name") set to ``value``."""
    head, _, rest = dotted.partition(".")
    if not is_dataclass(cfg) or head not in {f.name for f in fields(cfg)}:
        raise InputError(f"pipeline key {dotted!r} does not exist in the config")
    if not rest:
        return replace(cfg, **{head: value})
    return replace(cfg, **{head: set_key(getattr(cfg, head), rest, value)})


def run_steps(cfg: Any, steps: list[str]) -> RunResult:
    from mlxbun.cli import COMMANDS, resolve_command

    for step in steps:
        if step not in COMMANDS or step in ("pipeline", "help"):
            allowed = ", ".join(n for n in COMMANDS if n not in ("pipeline", "help"))
            raise InputError(f"pipeline.steps has {step!r}; choose from {allowed}")
    total = RunResult()
    run_dir, seen = Path(cfg.paths.run_dir), {}
    for step in steps:
        seen[step] = seen.get(step, 0) + 1
        sub = step if seen[step] == 1 else f"{step}-{seen[step]}"
        step_cfg = set_key(
            set_key(copy.deepcopy(cfg), "paths.run_dir", str(run_dir / sub)), "command.name", step
        )
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
        result = resolve_command(step)(step_cfg)
        for key, value in result.provides.items():
            cfg = set_key(cfg, key, value)
        total.outputs += result.outputs
        total.inputs += [p for p in result.inputs if not _under(p, run_dir)]
        total.metrics[sub] = result.metrics
        if result.message:
            total.message += f"[{sub}] {result.message}\n"
    total.message = total.message.rstrip()
    return total


def _under(path: Path, root: Path) -> bool:
    try:
        Path(path).resolve().relative_to(root.resolve())
        return True
    except ValueError:
        return False


def run(cfg: Any) -> RunResult:
    return run_steps(cfg, list(cfg.pipeline.steps))
