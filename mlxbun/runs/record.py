"""A run's manifest and RunRecord, kept truthful whatever ends the run; what ended it, in one line.

A run is ``running`` in both while its command runs and ends ``ok``, ``failed`` or
``interrupted`` (SIGTERM from Slurm preemption, SIGINT) with the reason, wherever that can be
written. The CLI (``mlxbun.cli``) wraps every recording command in a :class:`RunRecorder` inside
:func:`signals_raise`.
"""

from __future__ import annotations

import hashlib
import json
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mlxbun.errors import DriftError, EnvironmentFailure, InputError, Interrupted, NumericFailure
from mlxbun.runs.provenance import Manifest


def _registry_module() -> Any:
    # deferred: the registry pulls in peewee, the hub scanner and numpy, which `command=help` never needs
    from mlxbun import registry

    return registry


def one_line(e: BaseException) -> str:
    """An exception's text on one line (its type name when it has none)."""
    text = " ".join(str(e).split())
    return text or type(e).__name__


def config_hash(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()


def registry_label(cfg: Any) -> str:
    """The registry a config points at (its URL, or the sqlite file), to name in errors."""
    try:
        return cfg.registry.url or str(Path(cfg.registry.path).expanduser())
    except Exception:  # an unresolvable interpolation: name it generically
        return "database"


def describe(e: BaseException, *, registry: str = "database") -> tuple[str, int, str]:
    """(one line, exit code, run status) for whatever stopped a run."""
    if isinstance(e, Interrupted):
        return f"interrupted by {e}", e.exit_code, "interrupted"
    if isinstance(e, KeyboardInterrupt):
        return "interrupted by SIGINT", 128 + signal.SIGINT, "interrupted"
    if isinstance(e, (InputError, DriftError, EnvironmentFailure, NumericFailure)):
        return one_line(e), e.exit_code, "failed"
    if isinstance(e, OSError) and e.filename is not None:
        where = f"{e.filename} -> {e.filename2}" if e.filename2 is not None else str(e.filename)
        return f"{where}: {e.strerror or one_line(e)}", 1, "failed"
    if type(e).__module__.split(".")[0] in ("peewee", "sqlite3", "psycopg2"):
        return f"registry {registry}: {type(e).__name__}: {one_line(e)}", 1, "failed"
    where = _path_in_traceback(e)
    at = f"{where}: " if where else ""
    return f"{at}{type(e).__name__}: {one_line(e)} (verbose=true shows the traceback)", 1, "failed"


def _path_in_traceback(e: BaseException) -> str | None:
    """The path the innermost mlxbun frame was working on (a Path local), to name in the error."""
    package = str(Path(__file__).resolve().parents[1])  # mlxbun/
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


class RunRecorder:
    """The manifest and the RunRecord of one run, kept truthful whatever ends the run.

    Both say ``running`` while the command runs and end ``ok``, ``failed`` or ``interrupted``
    (with the reason) wherever they can be written. A manifest that cannot be rewritten is
    removed, so a run directory never claims a state it did not reach. Bad input leaves neither.
    """

    def __init__(
        self,
        cfg: Any,
        *,
        resolved: dict[str, Any],
        overrides: list[str],
        recipe: str | None,
        blas_info: dict[str, Any],
    ) -> None:
        self.cfg, self.run_id = cfg, None
        self.run_dir = Path(cfg.paths.run_dir).resolve()
        self.overrides, self.recipe = overrides, recipe
        self.registry = registry_label(cfg)
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
        registry = _registry_module()

        problem = self._registry(
            lambda: registry.open_db(url=self.cfg.registry.url, path=self.cfg.registry.path, writable=True)
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
        registry = _registry_module()

        self.run_id = registry.record_run_start(
            command=self.cfg.command.name,
            recipe=self.recipe,
            overrides=self.overrides,
            config_hash=self.config_hash,
            output_dir=str(self.run_dir),
        )

    def _delete_row(self) -> None:
        registry = _registry_module()

        with registry.write_txn():
            registry.RunRecord.delete_by_id(self.run_id)

    def _registry(self, call: Any) -> str | None:
        """Run a registry call; an environment failure becomes a line naming the database."""
        try:
            call()
        except InputError:
            raise
        except EnvironmentFailure as e:  # already names the registry key and value
            return one_line(e)
        except Exception as e:
            return f"registry {self.registry}: {type(e).__name__}: {one_line(e)}"
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
        registry = _registry_module()

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
        remove_empty_dirs(self.run_dir)
        return True


def record_unmade(
    *, command: str, url: str | None, path: str, output_dir: str, overrides: list[str], recipe: str | None,
    config: dict[str, Any], error: str,
) -> None:  # fmt: skip
    """A run whose directory could not be made: a ``failed`` row, when the registry is reachable
    (it is the run's only record; an unreachable registry leaves the error line alone)."""
    registry = _registry_module()
    try:
        registry.open_db(url=url, path=path)
        run_id = registry.record_run_start(
            command=command,
            recipe=recipe,
            overrides=overrides,
            config_hash=config_hash(config),
            output_dir=output_dir,
        )
        registry.record_run_end(run_id, status="failed", error=error)
    except Exception:  # the run directory's error is the one to report
        return


def remove_empty_dirs(run_dir: Path) -> None:
    """Remove ``run_dir`` and then its parent, each only when empty."""
    for d in (run_dir, run_dir.parent):
        try:
            d.rmdir()
        except OSError:  # not empty or not there
            return
