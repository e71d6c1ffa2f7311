"""The registry: a peewee index of local models and of every run (sqlite by default, any db_url).

sqlite runs in WAL mode with a busy timeout, and every write is an IMMEDIATE transaction: with
deferred transactions, parallel sweep jobs lose rows to ``database is locked``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import peewee as pw
from playhouse.db_url import connect as url_connect

from mlxbun.errors import InputError

db = pw.DatabaseProxy()
SQLITE_PRAGMAS = {"journal_mode": "wal", "busy_timeout": 60000, "synchronous": "normal", "foreign_keys": 1}


class BaseModel(pw.Model):
    class Meta:
        database = db


class RunRecord(BaseModel):
    """One run of one command (a single run or one job of a multirun)."""

    command = pw.CharField(index=True)
    recipe = pw.CharField(null=True, index=True)
    overrides = pw.TextField(default="[]")
    config_hash = pw.CharField(index=True)
    status = pw.CharField(index=True, default="running")
    output_dir = pw.TextField()
    metrics = pw.TextField(default="{}")
    error = pw.TextField(null=True)
    started_at = pw.DateTimeField()
    finished_at = pw.DateTimeField(null=True)
    duration_s = pw.FloatField(null=True)

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "command": self.command,
            "recipe": self.recipe,
            "overrides": json.loads(self.overrides),
            "config_hash": self.config_hash,
            "status": self.status,
            "output_dir": self.output_dir,
            "metrics": json.loads(self.metrics),
            "error": self.error,
            "started_at": _iso(self.started_at),
            "finished_at": _iso(self.finished_at),
            "duration_s": self.duration_s,
        }


MODELS: list[type[BaseModel]] = [RunRecord]


def _iso(t: datetime | None) -> str | None:
    return t.isoformat() if t is not None else None


def utcnow() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)


def open_db(*, url: str | None = None, path: str | Path | None = None) -> pw.Database:
    """Connect the registry to ``url`` (any playhouse.db_url URL) or to sqlite at ``path``.

    Creates missing tables. Calling it again with another target re-points the registry.
    """
    if url:
        try:
            database = url_connect(url)
        except Exception as e:  # peewee raises several types for a malformed URL
            raise InputError(f"registry.url={url!r} is not a usable database URL ({e})") from None
        if isinstance(database, pw.SqliteDatabase):
            database.init(database.database, pragmas=SQLITE_PRAGMAS)
    else:
        p = Path(os.path.expanduser(str(path)))
        p.parent.mkdir(parents=True, exist_ok=True)
        database = pw.SqliteDatabase(str(p), pragmas=SQLITE_PRAGMAS)
    db.initialize(database)
    database.connect(reuse_if_open=True)
    database.create_tables(MODELS, safe=True)
    return database


@contextmanager
def write_txn() -> Iterator[None]:
    """A write transaction: IMMEDIATE on sqlite (takes the write lock up front), plain elsewhere."""
    if isinstance(db.obj, pw.SqliteDatabase):
        with db.atomic("IMMEDIATE"):
            yield
    else:
        with db.atomic():
            yield


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
