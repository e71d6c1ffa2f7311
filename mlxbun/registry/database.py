"""The registry's database: peewee models, connection, schema versions and write transactions.

sqlite runs in WAL mode with a busy timeout, and every write is an IMMEDIATE transaction: with
deferred transactions, parallel sweep jobs lose rows to ``database is locked``. The schema is
versioned (table ``schema_version``) and upgraded in place by ordered :data:`MIGRATIONS`.
"""

from __future__ import annotations

import json
import logging
import os
import random
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import peewee as pw
from playhouse.db_url import connect as url_connect
from playhouse.migrate import SchemaMigrator, migrate

from mlxbun.errors import EnvironmentFailure, InputError

log = logging.getLogger("mlxbun")
db = pw.DatabaseProxy()
# busy_timeout first: every later pragma (the WAL switch above all) may wait on another process.
SQLITE_PRAGMAS = {"busy_timeout": 60000, "journal_mode": "wal", "synchronous": "normal", "foreign_keys": 1}
CONNECT_DEADLINE_S = 60.0
DEFAULT_DB = "~/.cache/mlxbun/registry.db"
GB = (
    1 << 30
)  # every *_gb key is GiB (mlxbun/config/checks.py): registry.filter.max_gb, registry.fit.budget_gb
PG_LOCK_KEY = 0x6D6C7862  # advisory lock serializing schema upgrades on PostgreSQL
_target: tuple[str | None, str | None] | None = None


class BaseModel(pw.Model):
    class Meta:
        database = db


class SchemaVersion(BaseModel):
    version = pw.IntegerField()

    class Meta:
        table_name = "schema_version"


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
    host = pw.CharField(null=True)  # schema v2: which machine ran it (Slurm sweeps share one db)

    class Meta:
        table_name = "runrecord"

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
            "host": self.host,
        }


class ModelRecord(BaseModel):
    """One model directory: a hub snapshot, an mlxbun output, a local or registered directory."""

    path = pw.TextField(unique=True)
    source = pw.CharField(index=True)  # hub | run | local | registered
    root = pw.TextField(index=True)  # the hub cache / outputs root / local path it was found under
    name = pw.TextField(index=True)  # repo id for hub rows, else a directory name or given name
    repo_id = pw.TextField(null=True, index=True)
    revision = pw.CharField(null=True)
    refs = pw.TextField(default="")  # comma-separated refs pointing at this revision ("main")
    fingerprint = pw.TextField(default="")
    digest = pw.CharField(
        default=""
    )  # of the indexed fields: a re-read that finds no change keeps scanned_at
    model_type = pw.CharField(null=True, index=True)
    text_model_type = pw.CharField(null=True)
    architectures = pw.TextField(null=True)
    param_count = pw.BigIntegerField(null=True)
    weight_bytes = pw.BigIntegerField(default=0)
    vision_bytes = pw.BigIntegerField(default=0)
    expert_bytes = pw.BigIntegerField(default=0)
    total_bytes = pw.BigIntegerField(default=0, index=True)
    quant_bits = pw.IntegerField(null=True)
    quant_group_size = pw.IntegerField(null=True)
    quant_mode = pw.CharField(null=True)
    has_vision = pw.BooleanField(default=False)
    has_kv_config = pw.BooleanField(default=False)
    has_tools = pw.BooleanField(default=False)
    num_layers = pw.IntegerField(null=True)
    hidden_size = pw.IntegerField(null=True)
    vocab_size = pw.IntegerField(null=True)
    num_kv_heads = pw.IntegerField(null=True)
    head_dim = pw.IntegerField(null=True)
    kv_dtype_bytes = pw.IntegerField(default=2)
    sliding_window = pw.IntegerField(null=True)
    num_sliding_layers = pw.IntegerField(default=0)
    num_experts = pw.IntegerField(null=True)
    experts_per_tok = pw.IntegerField(null=True)
    license = pw.CharField(null=True)
    is_drafter = pw.BooleanField(default=False)
    warning = pw.TextField(null=True)  # why this directory is not a usable model, if it is not
    scanned_at = pw.DateTimeField()

    class Meta:
        table_name = "model_record"

    def to_dict(self) -> dict[str, Any]:
        out = {
            f: getattr(self, f) for f in self._meta.sorted_field_names if f not in ("fingerprint", "digest")
        }
        out["scanned_at"] = _iso(self.scanned_at)
        return out


MODELS: list[type[BaseModel]] = [SchemaVersion, RunRecord, ModelRecord]


def _iso(t: datetime | None) -> str | None:
    return t.isoformat() if t is not None else None


def utcnow() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)


def _v2_run_host(migrator: SchemaMigrator) -> None:
    migrate(migrator.add_column("runrecord", "host", pw.CharField(null=True)))


def _v3_model_record(migrator: SchemaMigrator) -> None:
    migrator.database.create_tables([ModelRecord], safe=True)


def _v4_model_digest(migrator: SchemaMigrator) -> None:
    # v3 tables created by the current class already have it; early v3 tables do not.
    if "digest" not in {c.name for c in migrator.database.get_columns("model_record")}:
        migrate(migrator.add_column("model_record", "digest", pw.CharField(default="")))


# (version reached, what it does, step): applied in order to databases below that version.
# Version 1 is the first released layout: table `runrecord` only, no `schema_version`.
MIGRATIONS = [
    (2, "runrecord.host column", _v2_run_host),
    (3, "model_record table", _v3_model_record),
    (4, "model_record.digest column", _v4_model_digest),
]
SCHEMA_VERSION = MIGRATIONS[-1][0]


def open_db(*, url: str | None = None, path: str | Path | None = None, writable: bool = False) -> pw.Database:
    """Connect the registry to ``url`` (any playhouse.db_url URL) or to sqlite at ``path``.

    Creates missing tables and upgrades an older schema in place. Calling it again with the
    same target is cheap; another target re-points the registry. ``writable``: first refuse a
    sqlite ``path`` this process cannot write (:func:`check_writable`), as a run that records
    itself needs to.

    Example:
        >>> open_db(path="~/.cache/mlxbun/registry.db")
        >>> open_db(url="postgresql://user:pw@127.0.0.1:5432/mlxbun")
    """
    global _target
    if writable and not url:
        check_writable(path)
    target = (url or None, None if url else str(Path(os.path.expanduser(str(path or DEFAULT_DB)))))
    if _target == target and db.obj is not None:
        return db.obj
    try:
        database = _connect(url=target[0], path=target[1])
        db.initialize(database)
        _connect_retrying(database)
        upgrade_schema(database)
    except pw.DatabaseError as e:
        where = f"registry.url={url!r}" if url else f"registry.path={str(path or DEFAULT_DB)!r}"
        raise EnvironmentFailure(
            f"{where}: not a usable registry database ({_root_cause(e)}); point it at a database"
            " file mlxbun may create, or repair or remove this one"
        ) from e
    _target = target
    return database


def check_writable(path: str | Path | None) -> None:
    """InputError naming registry.path when the sqlite file there cannot be written: a read-only
    file, or a directory (or file system) where sqlite cannot create it or its journal beside it.
    Tried, not inferred from modes (root ignores them; a read-only mount refuses root too)."""
    given = str(path or DEFAULT_DB)
    p = Path(os.path.expanduser(given))
    where = "its directory"
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        if p.is_file():
            where = "the file"
            os.close(os.open(p, os.O_RDWR))
            where = "its directory"
        fd, probe = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise InputError(
            f"registry.path={given!r} cannot be written ({where}: {e.strerror or e}); every run is"
            " recorded there: point registry.path at a database file mlxbun may create and write"
        ) from None


def _root_cause(e: BaseException) -> str:
    """The first database error of a chain (sqlite's "disk I/O error", not peewee's failed rollback)."""
    while type(e.__context__).__module__.split(".")[0] in ("peewee", "sqlite3", "psycopg2"):
        e = e.__context__
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


def _connect_retrying(database: pw.Database) -> None:
    """Connect, retrying while sqlite reports the file locked.

    Switching a new file to WAL needs an exclusive lock, and sqlite may answer SQLITE_BUSY at
    once (no busy handler) when several sweep jobs open the registry together.
    """
    deadline = time.monotonic() + CONNECT_DEADLINE_S
    delay = 0.01
    while True:
        try:
            database.connect(reuse_if_open=True)
            return
        except pw.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() + delay > deadline:
                raise
        time.sleep(delay * (1 + random.random()))
        delay = min(delay * 2, 1.0)


def _connect(*, url: str | None, path: str | None) -> pw.Database:
    if url:
        try:
            database = url_connect(url)
        except Exception as e:  # peewee raises several types for a malformed URL
            raise InputError(f"registry.url={url!r} is not a usable database URL ({e})") from None
        if isinstance(database, pw.SqliteDatabase):
            database.init(database.database, pragmas=SQLITE_PRAGMAS)
        return database
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    return pw.SqliteDatabase(str(p), pragmas=SQLITE_PRAGMAS)


def schema_version(database: pw.Database) -> int:
    """0 for an empty database, 1 for the unversioned first layout, else the recorded version."""
    tables = set(database.get_tables())
    if "schema_version" in tables:
        row = database.execute_sql("SELECT MAX(version) FROM schema_version").fetchone()
        return int(row[0] or 0)
    return 1 if "runrecord" in tables else 0


def upgrade_schema(database: pw.Database) -> int:
    """Bring ``database`` to :data:`SCHEMA_VERSION` (one write transaction); return the old version."""
    found = schema_version(database)
    if found == SCHEMA_VERSION:
        return SCHEMA_VERSION
    if found > SCHEMA_VERSION:
        raise InputError(
            f"the registry database {database.database!r} has schema v{found}, newer than this mlxbun "
            f"(v{SCHEMA_VERSION}); upgrade mlxbun or point registry.path / registry.url elsewhere"
        )
    with write_txn():
        if isinstance(database, pw.PostgresqlDatabase):
            database.execute_sql("SELECT pg_advisory_xact_lock(%s)", (PG_LOCK_KEY,))
        old = schema_version(database)  # again, under the lock: another process may have done it
        if old == 0:
            database.create_tables(MODELS, safe=True)
        else:
            database.create_tables([SchemaVersion], safe=True)
            migrator = SchemaMigrator.from_database(database)
            for version, what, step in MIGRATIONS:
                if version > old:
                    log.info("registry: migrating schema to v%d (%s)", version, what)
                    step(migrator)
        if old != SCHEMA_VERSION:
            SchemaVersion.delete().execute()
            SchemaVersion.create(version=SCHEMA_VERSION)
    return old


def require_db() -> None:
    if db.obj is None:
        open_db(path=DEFAULT_DB)


@contextmanager
def write_txn() -> Iterator[None]:
    """A write transaction: IMMEDIATE on sqlite (takes the write lock up front), plain elsewhere."""
    if isinstance(db.obj, pw.SqliteDatabase):
        with db.atomic("IMMEDIATE"):
            yield
    else:
        with db.atomic():
            yield


def column_max(name: str) -> int:
    """The largest value ModelRecord column ``name`` holds on every backend (INTEGER is 32-bit on
    PostgreSQL)."""
    big = isinstance(ModelRecord._meta.fields[name], pw.BigIntegerField)
    return 2**63 - 1 if big else 2**31 - 1
