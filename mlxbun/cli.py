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
import re
import signal
import sys
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mlxbun.errors import DriftError, EnvironmentFailure, InputError, Interrupted

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


# Launcher plugin (as named in a Hydra "Could not load 'hydra/launcher/<x>'" error) -> extra.
LAUNCHER_EXTRAS = {"ray": "ray", "joblib": "joblib", "submitit_slurm": "slurm", "submitit_local": "slurm"}


def _config_error(e: Exception) -> str:
    """One line from a Hydra/OmegaConf compose error: key, value, and what is allowed."""
    from mlxbun import schema

    cause = e.__cause__ if e.__cause__ is not None else e
    msg = getattr(cause, "msg", None) or str(cause)
    key = getattr(cause, "full_key", None)
    first = msg.strip().splitlines()[0] if msg.strip() else type(cause).__name__
    if (plugin := _missing_launcher(str(e))) is not None:
        return plugin
    if "is not in struct" in str(e) or "Could not override" in str(e) or "not in '" in first:
        if key:
            return schema.unknown_key_message(str(key))
        return f"unknown config key ({first}); `python -m mlxbun command=<name> help=true` lists the keys"
    return f"{key}: {first}" if key and str(key) not in first else first


def _missing_launcher(text: str) -> str | None:
    found = re.search(r"Could not load 'hydra/launcher/([\w-]+)'", text)
    if found is None:
        return None
    name = found.group(1)
    extra = LAUNCHER_EXTRAS.get(name)
    how = f"pip install -e '.[{extra}]'" if extra else f"pip install the Hydra plugin that provides {name}"
    return f"hydra/launcher needs the {name!r} launcher plugin, which is not installed; {how}"


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


def describe(e: BaseException) -> tuple[str, int, str]:
    """(one line, exit code, run status) for whatever stopped a run."""
    if isinstance(e, Interrupted):
        return f"interrupted by {e}", e.exit_code, "interrupted"
    if isinstance(e, KeyboardInterrupt):
        return "interrupted by SIGINT", 128 + signal.SIGINT, "interrupted"
    if isinstance(e, (InputError, DriftError, EnvironmentFailure)):
        return _one_line(e), e.exit_code, "failed"
    if isinstance(e, OSError) and e.filename is not None:
        where = f"{e.filename} -> {e.filename2}" if e.filename2 is not None else str(e.filename)
        return f"{where}: {e.strerror or _one_line(e)}", 1, "failed"
    if type(e).__module__.split(".")[0] in ("peewee", "sqlite3", "psycopg2"):
        return f"registry database: {type(e).__name__}: {_one_line(e)}", 1, "failed"
    where = _path_in_traceback(e)
    at = f"{where}: " if where else ""
    return f"{at}{type(e).__name__}: {_one_line(e)} (verbose=true shows the traceback)", 1, "failed"


def _path_in_traceback(e: BaseException) -> str | None:
    """The path the innermost mlxbun frame was working on (a Path local), to name in the error."""
    package = str(Path(__file__).resolve().parent)
    found, tb = None, e.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_filename.startswith(package):
            paths = [v for v in frame.f_locals.values() if isinstance(v, Path)]
            found = next((p for p in paths if p.exists()), found)
        tb = tb.tb_next
    if isinstance(e, json.JSONDecodeError) and found is not None and found.is_dir():
        found = next((f for f in sorted(found.glob("*.json")) if _holds(f, e.doc)), found)
    return None if found is None else str(found)


def _holds(path: Path, text: str) -> bool:
    """Whether ``path`` holds exactly ``text`` (which JSON file of a directory failed to parse)."""
    try:
        return path.stat().st_size == len(text.encode()) and path.read_text() == text
    except (OSError, UnicodeDecodeError):
        return False


@contextmanager
def signals_raise() -> Iterator[None]:
    """Turn the first SIGTERM or SIGINT into :class:`Interrupted` raised in the main thread.

    Slurm sends SIGTERM on preemption (submitit relays it); raising lets ``finally`` blocks clean
    staging directories and the run end ``interrupted``. A second SIGTERM is ignored while that
    cleanup runs; a second SIGINT interrupts it.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

    def handler(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        raise Interrupted(signum)

    for s in previous:
        signal.signal(s, handler)
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _task(dcfg: Any) -> None:
    from omegaconf import OmegaConf

    from mlxbun import schema

    verbose = bool(dcfg.get("verbose", False))
    try:
        with signals_raise():
            try:
                schema.check_keys(OmegaConf.to_container(dcfg, resolve=False))
                cfg = OmegaConf.to_object(dcfg)
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
        line, code, _ = describe(e)
        sys.stderr.write(f"error: {line}\n")
        sys.exit(code)
    if code:
        sys.exit(code)


def _quiet_stdout() -> None:
    """The reader of stdout went away (``| head``): send the rest to /dev/null and stop quietly."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def _remove_if_empty(dcfg: Any) -> None:
    """Remove the run directory Hydra made when bad input stopped the run before any output."""
    try:
        _remove_empty_dirs(Path(dcfg.paths.run_dir))
    except Exception:  # not resolvable: leave it
        pass


def _remove_empty_dirs(run_dir: Path) -> None:
    """Remove ``run_dir`` and then its parent, each only when empty."""
    for d in (run_dir, run_dir.parent):
        try:
            d.rmdir()
        except OSError:  # not empty or not there
            return


def execute(cfg: Any, resolved: dict[str, Any]) -> int:
    """Run ``cfg.command.name`` with a manifest and a RunRecord around it."""
    from mlxbun import blas

    blas_info = blas.load(cfg.blas)
    name = cfg.command.name
    fn = resolve_command(name)
    if name in READONLY:
        emit(cfg, fn(cfg))
        return 0
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
    from hydra.core.hydra_config import HydraConfig

    try:
        return list(HydraConfig.get().overrides.task)
    except ValueError:
        return []


class RunRecorder:
    """The manifest and the RunRecord of one run, kept truthful whatever ends the run.

    Both say ``running`` while the command runs and end ``ok``, ``failed`` or ``interrupted``
    (with the reason) wherever they can be written. A manifest that cannot be rewritten is
    removed, so a run directory never claims a state it did not reach. Bad input leaves neither.
    """

    def __init__(self, cfg: Any, resolved: dict[str, Any], blas_info: dict[str, Any]) -> None:
        from mlxbun.provenance import Manifest

        self.cfg, self.run_id = cfg, None
        self.run_dir = Path(cfg.paths.run_dir).resolve()
        self.overrides = _overrides()
        self.recipe = recipe_from_argv(self.overrides)
        self.registry = cfg.registry.url or str(Path(cfg.registry.path).expanduser())
        self.config_hash = config_hash(resolved)
        self.manifest = Manifest(
            run_dir=self.run_dir,
            command=cfg.command.name,
            config=resolved,
            overrides=self.overrides,
            recipe=self.recipe,
            seed=cfg.seed,
            blas=blas_info,
            digest_cache=Path(cfg.paths.cache).expanduser() / "digests",
        )

    def start(self) -> None:
        """Write the ``running`` manifest and row; an environment failure ends the run failed."""
        from mlxbun import registry

        problem = self._registry(
            lambda: registry.open_db(url=self.cfg.registry.url, path=self.cfg.registry.path)
        )
        if problem is None:
            problem = self._registry(self._insert_row)
        try:
            self.manifest.write()
        except OSError as e:
            problem = problem or describe(e)[0]
        if problem is not None:
            self.finish("failed", error=problem)
            raise EnvironmentFailure(problem)

    def _insert_row(self) -> None:
        from mlxbun import registry

        self.run_id = registry.record_run_start(
            command=self.cfg.command.name,
            recipe=self.recipe,
            overrides=self.overrides,
            config_hash=self.config_hash,
            output_dir=str(self.run_dir),
        )

    def _delete_row(self) -> None:
        from mlxbun import registry

        with registry.write_txn():
            registry.RunRecord.delete_by_id(self.run_id)

    def _registry(self, call: Any) -> str | None:
        """Run a registry call; an environment failure becomes a line naming the database."""
        try:
            call()
        except InputError:
            raise
        except Exception as e:
            return f"registry {self.registry}: {type(e).__name__}: {_one_line(e)}"
        return None

    def finish(self, status: str, *, result: Any = None, error: str | None = None) -> str | None:
        """Record the end in the manifest, then the row; return what could not be recorded."""
        problem = self._write_manifest(status, result=result, error=error)
        if problem is not None and status == "ok":
            status, error = "failed", problem
        metrics = result.metrics if result is not None else None
        row_problem = self._end_row(status, metrics=metrics, error=error)
        if row_problem is not None and status == "ok":
            self._write_manifest("failed", error=row_problem)  # the run is not recorded: not ok
            self._end_row("failed", metrics=metrics, error=row_problem)
        return problem or row_problem

    def _end_row(self, status: str, *, metrics: Any, error: str | None) -> str | None:
        from mlxbun import registry

        if self.run_id is None:
            return None
        return self._registry(
            lambda: registry.record_run_end(self.run_id, status=status, metrics=metrics, error=error)
        )

    def _write_manifest(self, status: str, *, result: Any = None, error: str | None = None) -> str | None:
        try:
            self.manifest.finish(status=status, result=result, error=error)
        except Exception as e:
            (self.run_dir / "manifest.json").unlink(missing_ok=True)  # never leave "running"
            return describe(e)[0]
        return None

    def forget(self) -> bool:
        """Bad input stopped the run: remove its row, manifest and directory; False if it wrote."""

        (self.run_dir / "manifest.json").unlink(missing_ok=True)
        if self.run_dir.exists() and any(self.run_dir.iterdir()):
            return False  # the command wrote something before it refused: keep it, recorded failed
        if self.run_id is not None:
            self._registry(self._delete_row)
        _remove_empty_dirs(self.run_dir)
        return True


def _recorded_run(cfg: Any, resolved: dict[str, Any], fn: Any, blas_info: dict[str, Any]) -> int:
    record = RunRecorder(cfg, resolved, blas_info)
    record.start()
    try:
        result = fn(cfg)
        problem = record.finish("ok", result=result)  # a signal while hashing ends it interrupted
    except BaseException as e:
        line, _, status = describe(e)
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


# The config sections each command reads (besides COMMON_KEYS), for command=<name> help=true.
COMMON_KEYS = ("seed", "verbose", "json", "blas", "help", "paths")
SECTIONS: dict[str, tuple[str, ...]] = {
    "help": (),
    "pipeline": ("pipeline",),
    "synth": ("synth", "io"),
    "inspect": ("inspect", "model", "registry"),
    "quantize": ("model", "quant", "io"),
    "sensitivity": ("model", "sensitivity"),
    "sensitivity_merge": ("sensitivity",),
    "allocate": ("model", "allocate", "quant", "io"),
    "rotate": ("model", "fold", "io"),
    "kv_save": ("model", "kv"),
    "kv_generate": ("model", "kv"),
    "kv_ls": ("kv",),
    "kv_verify": ("kv",),
    "kv_gc": ("kv",),
    "registry_scan": ("registry",),
    "registry_ls": ("registry",),
    "registry_resolve": ("model", "registry"),
    "registry_fit": ("model", "registry"),
    "runs": ("runs", "registry"),
    "verify": ("runs",),
}


def command_help(overrides: list[str]) -> str:
    """The chosen command's keys: type, value after the overrides and recipe, schema comment."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from mlxbun import schema

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        raw = OmegaConf.to_container(compose("config", overrides=overrides), resolve=False)
    name = raw["command"]["name"]
    sections = set(COMMON_KEYS) | set(SECTIONS.get(name, ()))
    if name == "pipeline":
        sections |= {s for step in raw["pipeline"]["steps"] for s in SECTIONS.get(step, ())}
    docs = [d for d in schema.key_docs() if d.key.split(".")[0] in sections]
    rows = [(d.key, d.type, _shown(_lookup(raw, d.key)), d.comment) for d in docs]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"command={name}: {COMMANDS[name][1]}", "", "keys (type, value, what it is):"]
    lines += [f"  {k:<{widths[0]}}  {t:<{widths[1]}}  {v:<{widths[2]}}  {c}".rstrip() for k, t, v, c in rows]
    return "\n".join(lines)


def _lookup(data: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        data = data[part]
    return data


def _shown(value: Any, width: int = 40) -> str:
    text = json.dumps(value) if isinstance(value, (list, dict, bool)) or value is None else str(value)
    return text if len(text) <= width else text[: width - 1] + "…"


def _help_overrides(argv: list[str]) -> list[str]:
    return [a for a in argv if "=" in a and not a.startswith(("-", "help=", "hydra.", "hydra/"))]


def main() -> None:
    """Console entry: check the recipe, make Hydra errors one line, then run the Hydra app."""
    import hydra
    from hydra._internal import utils as hydra_utils

    from mlxbun import schema

    # transformers (imported by mlx-lm for tokenizers) advises installing PyTorch on every run.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    argv = sys.argv[1:]
    if "--version" in argv or "-V" in argv:
        print(f"mlxbun {_version()}")
        return
    schema.register()
    try:
        check_argv(argv)
        if (_argv_value(argv, "help") or "").lower() in ("true", "1", "yes"):
            _print_or_quit(command_help(_help_overrides(argv)))
            return
    except InputError as e:
        sys.stderr.write(f"error: {e}\n")
        sys.exit(2)
    except Exception as e:
        sys.stderr.write(f"error: {_config_error(e)}\n")
        sys.exit(2)
    hydra_utils.run_and_report = _report
    app = hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")(_task)
    app()


def _print_or_quit(text: str) -> None:
    try:
        print(text, flush=True)
    except BrokenPipeError:
        _quiet_stdout()
        sys.exit(128 + signal.SIGPIPE)
