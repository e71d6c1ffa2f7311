"""Run records: one row per run of a command, written at its start and at its end."""

from __future__ import annotations

import json
import logging
import platform
import sqlite3
from typing import Any

import peewee as pw

from mlxbun.registry.database import RunRecord, utcnow, write_txn

log = logging.getLogger("mlxbun")
# What reading one row can raise: sqlite3's own error escapes peewee while rows are iterated.
ROW_ERRORS = (pw.DatabaseError, sqlite3.DatabaseError, ValueError)


def record_run_start(
    *, command: str, recipe: str | None, overrides: list[str], config_hash: str, output_dir: str
) -> int:
    with write_txn():
        rec = RunRecord.create(
            command=command,
            recipe=recipe,
            overrides=json.dumps(overrides),
            config_hash=config_hash,
            status="running",
            output_dir=output_dir,
            started_at=utcnow(),
            host=platform.node() or None,
        )
    return rec.id


def record_run_end(
    run_id: int, *, status: str, metrics: dict[str, Any] | None = None, error: str | None = None
) -> None:
    with write_txn():
        rec = RunRecord.get_by_id(run_id)
        rec.status, rec.error, rec.finished_at = status, error, utcnow()
        rec.metrics = json.dumps(metrics or {}, sort_keys=True, default=str)
        rec.duration_s = (rec.finished_at - rec.started_at).total_seconds()
        rec.save()


def list_runs(
    *, command: str | None = None, recipe: str | None = None, status: str | None = None, limit: int = 50
) -> list[dict[str, Any]]:
    """The newest runs, newest first. A row that cannot be read (metrics that are not JSON, a
    timestamp that is not one, text that is not UTF-8) is listed as ``{"id", "malformed": why}``
    and warned about; the others are listed as usual."""
    q = RunRecord.select().order_by(RunRecord.id.desc()).limit(limit)
    if command:
        q = q.where(RunRecord.command == command)
    if recipe:
        q = q.where(RunRecord.recipe == recipe)
    if status:
        q = q.where(RunRecord.status == status)
    try:
        rows: list[Any] = list(q)
    except ROW_ERRORS:  # sqlite fails the whole fetch on one non-UTF-8 text
        rows = [_fetch(row.id) for row in q.columns(RunRecord.id)]
    return [_as_dict(r) for r in rows]


def _fetch(run_id: int) -> Any:
    try:
        return RunRecord.get_by_id(run_id)
    except ROW_ERRORS as e:
        return (run_id, e)


def _as_dict(row: Any) -> dict[str, Any]:
    """``row.to_dict()``, or ``{"id", "malformed"}`` naming why it cannot be read (a warning)."""
    try:
        if isinstance(row, tuple):
            raise row[1]
        return row.to_dict()
    except (*ROW_ERRORS, TypeError, AttributeError) as e:
        run_id = row[0] if isinstance(row, tuple) else row.id
        why = f"{type(e).__name__}: {' '.join(str(e).split())[:120]}"
        log.warning("runs: row %d of the registry is malformed (%s); listed as such", run_id, why)
        return {"id": run_id, "malformed": why}


def eval_results(
    *, reference: str | None = None, max_bytes: int | None = None, limit: int = 50
) -> list[dict[str, Any]]:
    """One row per candidate of every finished ``eval`` run, best mean KLD first.

    Args:
        reference: only runs whose reference path contains this text.
        max_bytes: only candidates at most this many bytes on disk.

    Example:
        >>> eval_results(reference="Qwen3-8B", max_bytes=4 << 30)[0]["name"]   # best KLD under 4 GiB
    """
    q = RunRecord.select().where((RunRecord.command == "eval") & (RunRecord.status == "ok"))
    rows = []
    for rec in q.order_by(RunRecord.id.desc()):
        m = json.loads(rec.metrics or "{}")
        if reference and reference not in str(m.get("reference", "")):
            continue
        for c in m.get("candidates", []):
            if max_bytes is None or c["bytes"] <= max_bytes:
                rows.append({"run": rec.id, "reference": m.get("reference"), **c})
    return sorted(rows, key=lambda r: r["kld_mean"])[:limit]
