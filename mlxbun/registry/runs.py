"""Run records: one row per run of a command, written at its start and at its end."""

from __future__ import annotations

import json
import platform
from typing import Any

from mlxbun.registry.database import RunRecord, utcnow, write_txn


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
    q = RunRecord.select().order_by(RunRecord.id.desc()).limit(limit)
    if command:
        q = q.where(RunRecord.command == command)
    if recipe:
        q = q.where(RunRecord.recipe == recipe)
    if status:
        q = q.where(RunRecord.status == status)
    return [r.to_dict() for r in q]


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
