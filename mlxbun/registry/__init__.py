"""The registry: a peewee index of local models and of every run (sqlite by default, any db_url).

Models come from the HF hub cache (see :mod:`mlxbun.source.hub` for the tree), from model directories
that mlxbun runs wrote under the outputs root (a ``manifest.json`` in an enclosing run dir),
from local directories (``registry.paths``) and from explicit :func:`register_model` calls. A
scan is incremental; rows whose directory vanished are pruned, and reads never return one.

One module per concern; this package re-exports the public names::

    database.py   peewee models, connection (WAL, busy timeout), schema migrations, write_txn
    runs.py       run records: start, end, list
    index.py      scanning: candidates, incremental re-reads, bounds on stored values, register
    query.py      canonical revisions, ls filters, resolve (exact, then fuzzy)
    memory.py     the memory-fit estimate (weights, active experts, vision sidecar, KV cache)
    table.py      terminal formatting of ls rows and fit reports
    commands.py   command=registry_{scan,ls,resolve,fit} -> scan, ls, resolve, fit there
"""

from mlxbun.registry.database import (
    DEFAULT_DB,
    GB,
    MIGRATIONS,
    MODELS,
    SCHEMA_VERSION,
    ModelRecord,
    RunRecord,
    SchemaVersion,
    db,
    open_db,
    schema_version,
    upgrade_schema,
    utcnow,
    write_txn,
)
from mlxbun.registry.index import (
    Candidate,
    ScanReport,
    hub_candidates,
    local_candidates,
    record_for,
    register_model,
    run_candidates,
    scan,
    storable,
)
from mlxbun.registry.memory import FitReport, fit, fit_record, kv_cache_bytes
from mlxbun.registry.query import canonical, ls, resolve
from mlxbun.registry.runs import eval_results, list_runs, record_run_end, record_run_start
from mlxbun.registry.table import format_fit, format_table

__all__ = [
    "DEFAULT_DB", "GB", "MIGRATIONS", "MODELS", "SCHEMA_VERSION", "ModelRecord", "RunRecord", "SchemaVersion",
    "db", "open_db", "schema_version", "upgrade_schema", "utcnow", "write_txn",
    "Candidate", "ScanReport", "hub_candidates", "local_candidates", "record_for", "register_model",
    "run_candidates", "scan", "storable",
    "FitReport", "fit", "fit_record", "kv_cache_bytes",
    "canonical", "ls", "resolve",
    "eval_results", "list_runs", "record_run_end", "record_run_start",
    "format_fit", "format_table",
]  # fmt: skip
