"""The mlxbun entry point: one Hydra app; ``command=<name>`` picks a command, imported lazily.

Run ``python -m mlxbun`` for the list of commands and recipes. This module is the one error
boundary: bad input becomes ``error: <one line>`` and exit code 2 (a traceback only with
``verbose=true``), verification drift exits 1, and every run gets a manifest and a RunRecord.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Any

from mlxbun.errors import DriftError, InputError

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"

# name -> ("module[:function]", one line). Read-only commands write no run directory.
COMMANDS: dict[str, tuple[str, str]] = {
    "help": ("mlxbun.cli:run_help", "list the commands and the recipes"),
    "pipeline": ("mlxbun.pipeline", "run several commands in order in one run directory"),
    "synth": ("mlxbun.synth", "write a deterministic random checkpoint of a real architecture"),
    "inspect": ("mlxbun.io.inspect", "tensors, totals, metadata and quantization of a model"),
    "quantize": ("mlxbun.quant.uniform", "stream an HF checkpoint to a quantized MLX model"),
    "sensitivity": ("mlxbun.quant.sensitivity", "exact per-layer KL at candidate bit widths"),
    "sensitivity_merge": ("mlxbun.quant.sensitivity_merge", "combine sharded sensitivity runs"),
    "allocate": ("mlxbun.quant.allocate", "per-layer bits under a true size budget -> plan.json"),
    "rotate": ("mlxbun.rotate", "fold a seeded randomized Hadamard R1 into a checkpoint"),
    "kv_save": ("mlxbun.kv.commands:save", "prefill a prompt and persist its KV cache"),
    "kv_generate": ("mlxbun.kv.commands:generate", "restore the best cached prefix and generate"),
    "kv_ls": ("mlxbun.kv.commands:ls", "list stored KV snapshots"),
    "kv_verify": ("mlxbun.kv.commands:verify", "re-hash stored KV snapshots and blocks"),
    "kv_gc": ("mlxbun.kv.gc", "plan (and with kv.execute=true free) unreferenced KV blocks"),
    "kv_import": ("mlxbun.kv.import_", "verify an mlx_lm cache_prompt file and store it as a snapshot"),
    "kv_export": ("mlxbun.kv.export", "write a stored snapshot as a plain mlx-lm prompt-cache file"),
    "registry_scan": ("mlxbun.registry:run_scan", "index the HF cache and local model dirs"),
    "registry_ls": ("mlxbun.registry:run_ls", "list indexed models with filters"),
    "registry_resolve": ("mlxbun.registry:run_resolve", "resolve a fuzzy name to one model"),
    "registry_fit": ("mlxbun.registry:run_fit", "does a model fit a memory budget"),
    "runs": ("mlxbun.cli:run_runs", "list recorded runs"),
    "verify": ("mlxbun.provenance", "re-hash a run's outputs against its manifest"),
}
READONLY = {
    "help",
    "inspect",
    "kv_ls",
    "kv_verify",
    "registry_ls",
    "registry_resolve",
    "registry_fit",
    "runs",
    "verify",
}

log = logging.getLogger("mlxbun")


def available_recipes() -> list[str]:
    return sorted(str(p.relative_to(RECIPES_DIR).with_suffix("")) for p in RECIPES_DIR.rglob("*.yaml"))


def recipe_summary(name: str) -> str:
    """The recipe's first comment line (its one-line description)."""
    for line in (RECIPES_DIR / f"{name}.yaml").read_text().splitlines():
        text = line.lstrip("# ").strip()
        if line.startswith("#") and text and not text.startswith("@package"):
            return text
    return ""


def _argv_value(argv: list[str], key: str) -> str | None:
    for arg in argv:
        for prefix in (f"+{key}=", f"{key}=", f"++{key}="):
            if arg.startswith(prefix):
                return arg[len(prefix) :]
    return None


def recipe_from_argv(argv: list[str]) -> str | None:
    return _argv_value(argv, "recipe")


def check_recipe(name: str) -> None:
    """Fail before Hydra runs when a recipe does not exist (Hydra would turn it into a string)."""
    recipes = available_recipes()
    if name not in recipes:
        raise InputError(f"recipe={name!r} does not exist; available recipes: {', '.join(recipes)}")


def check_command(name: str) -> None:
    if name not in COMMANDS:
        raise InputError(f"command={name!r} does not exist; choose one of {', '.join(COMMANDS)}")


def resolve_command(name: str):
    """Import the chosen command's module (lazily: only this one) and return its function."""
    check_command(name)
    module, _, func = COMMANDS[name][0].partition(":")
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and (e.name == module or module.startswith(e.name + ".")):
            raise InputError(
                f"command={name!r} is not available in mlxbun {_version()} (module {module} is missing)"
            ) from None
        raise
    return getattr(mod, func or "run")


def _version() -> str:
    import mlxbun

    return mlxbun.__version__


def run_help(cfg: Any) -> Any:
    from mlxbun.provenance import RunResult

    width = max(len(n) for n in COMMANDS)
    lines = ["usage: python -m mlxbun command=<name> [key=value ...] | +recipe=<name>", "", "commands:"]
    lines += [f"  {n:<{width}}  {d}" for n, (_, d) in COMMANDS.items()]
    recipes = available_recipes()
    rwidth = max((len(r) for r in recipes), default=0)
    lines += ["", "recipes (+recipe=<name>):"]
    lines += [f"  {r:<{rwidth}}  {recipe_summary(r)}" for r in recipes]
    return RunResult(message="\n".join(lines))


def run_runs(cfg: Any) -> Any:
    from mlxbun import registry
    from mlxbun.provenance import RunResult

    registry.open_db(url=cfg.registry.url, path=cfg.registry.path)
    rows = registry.list_runs(
        command=cfg.runs.command, recipe=cfg.runs.recipe, status=cfg.runs.status, limit=cfg.runs.limit
    )
    if cfg.json:
        return RunResult(message=json.dumps(rows, indent=2, sort_keys=True))
    head = f"{'id':>5}  {'command':<18} {'recipe':<22} {'status':<8} {'secs':>8}  output_dir"
    lines = [head] + [
        f"{r['id']:>5}  {r['command']:<18} {str(r['recipe'] or '-'):<22} {r['status']:<8} "
        f"{(r['duration_s'] or 0):>8.1f}  {r['output_dir']}"
        for r in rows
    ]
    return RunResult(message="\n".join(lines))


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text or type(e).__name__


def _config_error(e: Exception) -> str:
    """One line from a Hydra/OmegaConf compose error: key, value, and what is allowed."""
    cause = e.__cause__ if e.__cause__ is not None else e
    msg = getattr(cause, "msg", None) or str(cause)
    key = getattr(cause, "full_key", None)
    first = msg.strip().splitlines()[0] if msg.strip() else type(cause).__name__
    if "is not in struct" in str(e) or "Could not override" in str(e) or "not found" in first:
        first = first.replace("\n", " ")
        return f"unknown config key ({first}); run `python -m mlxbun` for the commands"
    return f"{key}: {first}" if key and str(key) not in first else first


def _report(func: Any) -> Any:
    """Replacement for Hydra's run_and_report: config errors become one line and exit 2."""
    try:
        return func()
    except Exception as e:
        if "--verbose" in sys.argv or "verbose=true" in sys.argv:
            traceback.print_exc()
        sys.stderr.write(f"error: {_config_error(e)}\n")
        sys.exit(2)


def config_hash(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()


def _task(dcfg: Any) -> None:
    from omegaconf import OmegaConf

    from mlxbun import schema

    verbose = bool(dcfg.get("verbose", False))
    try:
        try:
            schema.check_keys(OmegaConf.to_container(dcfg, resolve=False))
            cfg = OmegaConf.to_object(dcfg)
        except InputError:
            raise
        except Exception as e:
            raise InputError(_config_error(e)) from None
        code = execute(cfg, OmegaConf.to_container(dcfg, resolve=True))
    except (InputError, DriftError) as e:
        if verbose:
            traceback.print_exc()
        if isinstance(e, InputError):
            _remove_if_empty(dcfg)
        sys.stderr.write(f"error: {_one_line(e)}\n")
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted\n")
        sys.exit(130)
    except Exception as e:
        if verbose:
            traceback.print_exc()
        sys.stderr.write(f"error: {type(e).__name__}: {_one_line(e)} (verbose=true shows the traceback)\n")
        sys.exit(1)
    if code:
        sys.exit(code)


def _remove_if_empty(dcfg: Any) -> None:
    """Remove the run directory Hydra made when bad input stopped the run before any output."""
    try:
        run_dir = Path(dcfg.paths.run_dir)
        run_dir.rmdir()
        run_dir.parent.rmdir()
    except Exception:  # not empty, not there, or not resolvable: leave it
        pass


def execute(cfg: Any, resolved: dict[str, Any]) -> int:
    """Run ``cfg.command.name`` with a manifest and a RunRecord around it."""
    from mlxbun import blas

    blas_info = blas.load(cfg.blas)
    name = cfg.command.name
    fn = resolve_command(name)
    if name in READONLY:
        result = fn(cfg)
        if result.message:
            print(result.message)
        return 0
    return _recorded_run(cfg, resolved, fn, blas_info)


def _overrides() -> list[str]:
    from hydra.core.hydra_config import HydraConfig

    try:
        return list(HydraConfig.get().overrides.task)
    except ValueError:
        return []


def _recorded_run(cfg: Any, resolved: dict[str, Any], fn: Any, blas_info: dict[str, Any]) -> int:
    from mlxbun import registry
    from mlxbun.provenance import Manifest

    run_dir = Path(cfg.paths.run_dir).resolve()
    overrides = _overrides()
    recipe = recipe_from_argv(overrides)
    manifest = Manifest(
        run_dir=run_dir,
        command=cfg.command.name,
        config=resolved,
        overrides=overrides,
        recipe=recipe,
        seed=cfg.seed,
        blas=blas_info,
        digest_cache=Path(cfg.paths.cache).expanduser() / "digests",
    )
    manifest.write()
    registry.open_db(url=cfg.registry.url, path=cfg.registry.path)
    run_id = registry.record_run_start(
        command=cfg.command.name,
        recipe=recipe,
        overrides=overrides,
        config_hash=config_hash(resolved),
        output_dir=str(run_dir),
    )
    try:
        result = fn(cfg)
    except BaseException as e:
        registry.record_run_end(run_id, status="failed", error=_one_line(e))
        if isinstance(e, InputError):
            (run_dir / "manifest.json").unlink(missing_ok=True)  # bad input: leave no run behind
        else:
            manifest.finish(status="failed", error=_one_line(e))
        raise
    mpath = manifest.finish(status="ok", result=result)
    registry.record_run_end(run_id, status="ok", metrics=result.metrics)
    if result.message:
        print(result.message)
    print(f"outputs:  {run_dir}\nmanifest: {mpath}")
    return 0


def main() -> None:
    """Console entry: check the recipe, make Hydra errors one line, then run the Hydra app."""
    import hydra
    from hydra._internal import utils as hydra_utils

    from mlxbun import schema

    # transformers (imported by mlx-lm for tokenizers) advises installing PyTorch on every run.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    argv = sys.argv[1:]
    try:
        if (recipe := recipe_from_argv(argv)) is not None:
            check_recipe(recipe)
        if (command := _argv_value(argv, "command")) is not None:
            check_command(command)
    except InputError as e:
        sys.stderr.write(f"error: {e}\n")
        sys.exit(2)
    schema.register()
    hydra_utils.run_and_report = _report
    app = hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")(_task)
    app()
