"""The mlxbun entry point: one Hydra app; ``command=<name>`` picks a command, imported lazily.

Run ``python -m mlxbun`` for the list of commands and recipes. This module is the one error
boundary: bad input becomes ``error: <one line>`` and exit code 2 (a traceback only with
``verbose=true``), verification drift and environment failures exit 1 naming the path, a
signal exits 128 + its number, and every run gets a manifest and a RunRecord
(:mod:`mlxbun.runs.record`) that end ``ok``, ``failed`` or ``interrupted``.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import re
import signal
import sys
import traceback
from pathlib import Path
from typing import Any, NoReturn

import hydra
from hydra._internal import utils as hydra_utils
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import OmegaConf

import mlxbun
from mlxbun import blas, commands, device
from mlxbun.commands import COMMANDS, CONF_DIR
from mlxbun.config import checks, keys, schema
from mlxbun.errors import EnvironmentFailure, InputError
from mlxbun.help import available_recipes, command_help
from mlxbun.runs.record import (
    RunRecorder,
    describe,
    record_unmade,
    registry_label,
    remove_empty_dirs,
    signals_raise,
)

log = logging.getLogger("mlxbun")


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
        raise InputError(f"recipe={name!r} does not exist; {nearest(name, recipes, 'recipes')}")


def check_command(name: str) -> None:
    if name not in COMMANDS:
        raise InputError(f"command={name!r} does not exist; {nearest(name, list(COMMANDS), 'commands')}")


def nearest(name: str, choices: list[str], what: str) -> str:
    """A hint naming the 1-3 closest of ``choices`` ("did you mean a or b?"), or all when none is close."""
    near = difflib.get_close_matches(name, choices, n=3, cutoff=0.6)
    if near:
        return f"did you mean {' or '.join(near)}? (`python -m mlxbun` lists the {what})"
    return f"available {what}: {', '.join(choices)}"


def _version() -> str:
    return mlxbun.__version__


# Launcher plugin (as named in a Hydra "Could not load 'hydra/launcher/<x>'" error) -> extra.
LAUNCHER_EXTRAS = {"ray": "ray", "joblib": "joblib", "submitit_slurm": "slurm", "submitit_local": "slurm"}


def _config_error(e: Exception) -> str:
    """One line from a Hydra/OmegaConf compose error: key, value, and what is allowed."""
    cause = e.__cause__ if e.__cause__ is not None else e
    msg = getattr(cause, "msg", None) or str(cause)
    key = getattr(cause, "full_key", None)
    first = msg.strip().splitlines()[0] if msg.strip() else type(cause).__name__
    if (plugin := _missing_launcher(str(e))) is not None:
        return plugin
    if "is not in struct" in str(e) or "Could not override" in str(e) or "not in '" in first:
        if key:
            return keys.unknown_key_message(_full_key(str(key)))
        return f"unknown config key ({first}); `python -m mlxbun command=<name> help=true` lists the keys"
    if first.startswith("Ambiguous value for argument"):  # Hydra's hint is on the next lines
        return f"{first}; give a list as key=[a,b], quote a string with a comma, or sweep it with -m"
    if key and "is not a ListConfig" in first:  # a scalar where a list goes
        value = getattr(cause, "value", None)
        return f"{key}={value} is not a list; give one, e.g. '{key}=[{value}]'"
    return f"{key}: {first}" if key and str(key) not in first else first


def _full_key(key: str) -> str:
    """The whole dotted key of the override Hydra names only by its first unknown part
    (``qunt`` of ``qunt.bits=4``), so the suggestion can match section and name."""
    for arg in sys.argv[1:]:
        given = arg.partition("=")[0].lstrip("+~")
        if given.startswith(key + "."):
            return given
    return key


def _missing_launcher(text: str) -> str | None:
    found = re.search(r"Could not load 'hydra/launcher/([\w-]+)'", text)
    if found is None:
        return None
    name = found.group(1)
    extra = LAUNCHER_EXTRAS.get(name)
    how = f"pip install -e '.[{extra}]'" if extra else f"pip install the Hydra plugin that provides {name}"
    return f"hydra/launcher needs the {name!r} launcher plugin, which is not installed; {how}"


def _report(func: Any) -> Any:
    """Replacement for Hydra's run_and_report: config errors become one line and exit 2; a run
    directory that cannot be made names paths.outputs and exits 1."""
    try:
        return func()
    except Exception as e:
        if "--verbose" in sys.argv or "verbose=true" in sys.argv:
            traceback.print_exc()
        if (line := _outputs_error(e)) is not None:
            _record_unmade(line)
            fail(line, 1)
        fail(_config_error(e), 2)


class OutputsCheck(Callback):
    """Hydra callback (``hydra.callbacks`` in conf/config.yaml): refuse a bad ``paths.outputs``
    before Hydra makes the run directory under it, and keep the composed config, so that a run
    directory Hydra cannot make is still recorded failed (:func:`_record_unmade`)."""

    config: Any = None
    # paths.outputs and the parents of it that this run makes (removed if bad input stops it)
    made: tuple[Path, ...] = ()

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        OutputsCheck.config = config
        outputs = Path(str(config.paths.outputs)).expanduser().absolute()
        OutputsCheck.made = tuple(p for p in (outputs, *outputs.parents) if not p.exists())
        under = "${paths.outputs}" in str(OmegaConf.to_container(config.hydra.run, resolve=False).get("dir"))
        try:
            checks.check_outputs(config.paths.outputs, on_disk=under)
        except InputError as e:  # Hydra turns a callback's exceptions into warnings: exit here
            fail(str(e), 2)


def _record_unmade(line: str) -> None:
    """The run whose directory Hydra could not make, recorded failed in its registry."""
    if (c := OutputsCheck.config) is None:
        return
    overrides = list(c.hydra.overrides.task)
    plain = {k: v for k, v in OmegaConf.to_container(c, resolve=False).items() if k != "hydra"}
    outputs = Path(c.paths.outputs).expanduser().absolute()
    run_dir = str(outputs / c.command.name)  # the timestamped directory below was never made
    args = dict(command=c.command.name, url=c.registry.url, path=c.registry.path, output_dir=run_dir)
    record_unmade(**args, overrides=overrides, recipe=recipe_from_argv(overrides), config=plain, error=line)


def _outputs_error(e: Exception) -> str | None:
    """One line for an OSError while Hydra made the run directory under paths.outputs, else None."""
    if not isinstance(e, OSError) or e.filename is None:
        return None
    given = _argv_value(sys.argv[1:], "paths.outputs") or schema.PathsCfg.outputs
    outputs, failed = Path(given).expanduser().absolute(), Path(str(e.filename)).absolute()
    if not (failed.is_relative_to(outputs) or outputs.is_relative_to(failed)):
        return None
    return (
        f"paths.outputs={given!r}: cannot create the run directory ({failed}: {e.strerror}); choose a"
        " writable directory for paths.outputs"
    )


def fail(line: str, code: int, *, as_json: bool | None = None) -> NoReturn:
    """Print an error and exit ``code``: ``error: <line>`` on stderr, or with json=true (from the
    command line unless ``as_json`` says) one JSON document on stdout naming the key it is about."""
    if as_json is None:
        as_json = (_argv_value(sys.argv[1:], "json") or "").lower() in ("true", "1", "yes")
    if not as_json:
        sys.stderr.write(f"error: {line}\n")
        sys.exit(code)
    key = found.group(1) if (found := re.match(r"([\w.]+)=", line)) else None
    print(json.dumps({"error": line, "exit": code, "key": key}, sort_keys=True), flush=True)
    sys.exit(code)


def _task(dcfg: Any) -> None:
    verbose = bool(dcfg.get("verbose", False))
    try:
        with signals_raise():
            try:
                data = OmegaConf.to_container(dcfg, resolve=False)
                keys.check_keys(data)
                cfg = OmegaConf.to_object(dcfg)
                checks.check_strings(cfg)
                defaults = OmegaConf.to_container(OmegaConf.structured(schema.Config))
                keys.check_unread(data, defaults, given=_overrides())
            except InputError:
                raise
            except Exception as e:
                raise InputError(_config_error(e)) from None
            code = execute(cfg, OmegaConf.to_container(dcfg, resolve=True))
    except BrokenPipeError:
        _quiet_stdout()
        sys.exit(128 + signal.SIGPIPE)
    except BaseException as e:
        if isinstance(e, SystemExit):
            raise
        if verbose:
            traceback.print_exc()
        if isinstance(e, InputError):
            _remove_if_empty(dcfg)
        line, code, _ = describe(e, registry=registry_label(dcfg))
        fail(line, code, as_json=bool(dcfg.get("json", False)))
    if code:
        sys.exit(code)


def _quiet_stdout() -> None:
    """The reader of stdout went away (``| head``): send the rest to /dev/null and stop quietly."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def _remove_if_empty(dcfg: Any) -> None:
    """Remove the run directory Hydra made when bad input stopped the run before any output (and
    ``paths.outputs`` with the parents this run made, while nothing else is there)."""
    try:
        remove_empty_dirs(Path(dcfg.paths.run_dir))
        for made in OutputsCheck.made:  # deepest first
            made.rmdir()
    except Exception:  # not resolvable, or not empty: leave it
        pass


def execute(cfg: Any, resolved: dict[str, Any]) -> int:
    """Run ``cfg.command.name`` with a manifest and a RunRecord around it."""
    blas_info = blas.load(cfg.blas)
    name = cfg.command.name
    device.select(cfg.device, bounded_cache=name != "serve")
    check_command(name)
    fn = commands.resolve(name)
    if COMMANDS[name].readonly:
        result = fn(cfg)
        emit(cfg, result)
        return getattr(result, "exit_code", 0)
    return _recorded_run(cfg, resolved, fn, blas_info)


def emit(cfg: Any, result: Any, *, run_dir: Path | None = None, manifest: Path | None = None) -> None:
    """Print a command's result: its message (and where the run went), or one JSON document."""
    if not cfg.json:
        text = result.message
        if run_dir is not None:
            text = f"{text}\n" if text else ""
            text += f"outputs:  {run_dir}\nmanifest: {manifest}"
        if text:
            print(text, flush=True)
        return
    if run_dir is None and _is_json(result.message):
        print(result.message, flush=True)
        return
    doc: dict[str, Any] = {"command": cfg.command.name, "status": "ok", "metrics": result.metrics}
    doc["result" if _is_json(result.message) else "message"] = (
        json.loads(result.message) if _is_json(result.message) else result.message
    )
    doc["outputs"] = [str(p) for p in result.outputs]
    if run_dir is not None:
        doc.update(run_dir=str(run_dir), manifest=str(manifest))
    print(json.dumps(doc, indent=2, sort_keys=True, default=str), flush=True)


def _is_json(text: str) -> bool:
    if not text or text.lstrip()[:1] not in ("{", "["):
        return False
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _overrides() -> list[str]:
    try:
        return list(HydraConfig.get().overrides.task)
    except ValueError:
        return []


def _recorded_run(cfg: Any, resolved: dict[str, Any], fn: Any, blas_info: dict[str, Any]) -> int:
    overrides = _overrides()
    record = RunRecorder(
        cfg, resolved=resolved, overrides=overrides, recipe=recipe_from_argv(overrides), blas_info=blas_info
    )
    record.start()
    try:
        result = fn(cfg)
        problem = record.finish("ok", result=result)  # a signal while hashing ends it interrupted
    except BaseException as e:
        line, _, status = describe(e, registry=record.registry)
        if isinstance(e, InputError) and record.forget():
            raise
        record.finish(status, error=line)
        raise
    if problem is not None:
        raise EnvironmentFailure(problem)
    emit(cfg, result, run_dir=record.run_dir, manifest=record.run_dir / "manifest.json")
    return 0


def check_argv(argv: list[str]) -> None:
    """Fail before Hydra runs on a bare command name, an unknown recipe or command."""
    for arg in argv:
        if arg in COMMANDS:
            raise InputError(f"{arg!r} is not a key=value override; to run that command write command={arg}")
    if (recipe := recipe_from_argv(argv)) is not None:
        check_recipe(recipe)
    if (command := _argv_value(argv, "command")) is not None:
        check_command(command)


def main() -> None:
    """Console entry: check the recipe, make Hydra errors one line, then run the Hydra app."""
    # transformers (imported by mlx-lm for tokenizers) advises installing PyTorch on every run.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    argv = sys.argv[1:] = multirun_first(sys.argv[1:])
    if "--version" in argv or "-V" in argv:
        print(f"mlxbun {_version()}")
        return
    schema.register()
    try:
        check_argv(argv)
        if (_argv_value(argv, "help") or "").lower() in ("true", "1", "yes"):
            _print_or_quit(command_help(argv))
            return
    except InputError as e:
        fail(str(e), 2)
    except Exception as e:
        fail(_config_error(e), 2)
    hydra_utils.run_and_report = _report
    app = hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")(_task)
    app()


def multirun_first(argv: list[str]) -> list[str]:
    """``-m``/``--multirun`` moved before the overrides, where Hydra's parser wants it."""
    flags = [a for a in argv if a in ("-m", "--multirun")]
    return flags + [a for a in argv if a not in flags]


def _print_or_quit(text: str) -> None:
    try:
        print(text, flush=True)
    except BrokenPipeError:
        _quiet_stdout()
        sys.exit(128 + signal.SIGPIPE)
