"""The registry: a peewee index of local models and of every run (sqlite by default, any db_url).

Models come from the HF hub cache (see :mod:`mlxbun.hub` for the tree), from model directories
that mlxbun runs wrote under the outputs root (a ``manifest.json`` in an enclosing run dir),
from local directories (``registry.paths``) and from explicit :func:`register_model` calls. A
scan is incremental: a directory is re-read only when the names, sizes, mtimes or inodes of its
top-level entries changed; rows whose directory vanished are pruned, and reads never return one.

sqlite runs in WAL mode with a busy timeout, and every write is an IMMEDIATE transaction: with
deferred transactions, parallel sweep jobs lose rows to ``database is locked``. The schema is
versioned (table ``schema_version``) and upgraded in place by ordered :data:`MIGRATIONS`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import random
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NamedTuple

import peewee as pw
from playhouse.db_url import connect as url_connect
from playhouse.migrate import SchemaMigrator, migrate

from mlxbun import hub
from mlxbun.errors import InputError

log = logging.getLogger("mlxbun")
db = pw.DatabaseProxy()
# busy_timeout first: every later pragma (the WAL switch above all) may wait on another process.
SQLITE_PRAGMAS = {"busy_timeout": 60000, "journal_mode": "wal", "synchronous": "normal", "foreign_keys": 1}
CONNECT_DEADLINE_S = 60.0
DEFAULT_DB = "~/.cache/mlxbun/registry.db"
GB = 10**9
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


# --------------------------------------------------------------------------- connection, schema


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


def open_db(*, url: str | None = None, path: str | Path | None = None) -> pw.Database:
    """Connect the registry to ``url`` (any playhouse.db_url URL) or to sqlite at ``path``.

    Creates missing tables and upgrades an older schema in place. Calling it again with the
    same target is cheap; another target re-points the registry.

    Example:
        >>> open_db(path="~/.cache/mlxbun/registry.db")
        >>> open_db(url="postgresql://user:pw@127.0.0.1:5432/mlxbun")
    """
    global _target
    target = (url or None, None if url else str(Path(os.path.expanduser(str(path or DEFAULT_DB)))))
    if _target == target and db.obj is not None:
        return db.obj
    database = _connect(url=target[0], path=target[1])
    db.initialize(database)
    _connect_retrying(database)
    upgrade_schema(database)
    _target = target
    return database


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


def _require_db() -> None:
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


# --------------------------------------------------------------------------- runs


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


# --------------------------------------------------------------------------- scan


@dataclass(frozen=True)
class Candidate:
    """A directory that may hold a model, and how it was found."""

    path: str
    source: str
    root: str
    name: str
    repo_id: str | None = None
    revision: str | None = None
    refs: str = ""
    key: str | None = None  # hub snapshots: a cheap change key from stats (nothing inside is read)


@dataclass(frozen=True)
class ScanReport:
    """What a scan did: directories read, kept as they were, and rows pruned."""

    read: int
    unchanged: int
    pruned: int
    warnings: tuple[str, ...]
    seconds: float

    @property
    def models(self) -> int:
        return self.read + self.unchanged


def _abs(p: str | os.PathLike) -> str:
    return os.path.abspath(os.path.expanduser(str(p)))


def hub_candidates(hub_dir: Path, warnings: list[str]) -> list[Candidate]:
    root = _abs(hub_dir)
    snaps = hub.iter_snapshots(root, lambda p, w: warnings.append(f"{p}: {w}"))
    return [
        Candidate(s.path, "hub", root, s.repo_id, s.repo_id, s.revision, ",".join(s.refs), s.key)
        for s in snaps
    ]


def _is_model_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json"))


def local_candidates(paths: Iterable[str | os.PathLike]) -> list[Candidate]:
    """Each path is a model directory, or a directory whose subdirectories are model directories."""
    out = []
    for p in paths:
        root = _abs(p)
        if _is_model_dir(root):
            out.append(Candidate(root, "local", root, os.path.basename(root)))
            continue
        try:
            subs = sorted(e.path for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
        except OSError:
            log.warning("registry: registry.paths entry %s is not a directory; skipped", root)
            continue
        out += [Candidate(s, "local", root, os.path.basename(s)) for s in subs if _is_model_dir(s)]
    return out


def run_candidates(runs_root: str | os.PathLike, *, max_depth: int = 6) -> list[Candidate]:
    """Model directories inside mlxbun run directories (a ``manifest.json`` above or beside them).

    Hidden directories (unpublished partial outputs) are never entered.
    """
    root = _abs(runs_root)
    out: list[Candidate] = []

    def walk(d: str, depth: int, in_run: bool) -> None:
        try:
            entries = [e for e in os.scandir(d) if not e.name.startswith(".")]
        except OSError:
            return
        names = {e.name for e in entries}
        in_run = in_run or "manifest.json" in names
        if in_run and "config.json" in names:
            out.append(Candidate(d, "run", root, os.path.relpath(d, root)))
            return
        if depth < max_depth:
            for e in sorted(entries, key=lambda e: e.name):
                if e.is_dir(follow_symlinks=False):
                    walk(e.path, depth + 1, in_run)

    walk(root, 0, False)
    return out


def _utf8_only(cands: list[Candidate], warnings: list[str]) -> list[Candidate]:
    """The candidates whose path the database can store; each other one costs a warning."""
    bad = [c for c in cands if not hub.is_utf8(c.path)]
    warnings += [f"{hub.printable(c.path)}: path is not UTF-8; not indexed" for c in bad]
    return [c for c in cands if hub.is_utf8(c.path)] if bad else cands


def _column_max(name: str) -> int:
    """The largest value column ``name`` holds on every backend (INTEGER is 32-bit on PostgreSQL)."""
    big = isinstance(ModelRecord._meta.fields[name], pw.BigIntegerField)
    return 2**63 - 1 if big else 2**31 - 1


def storable(info: hub.ModelInfo) -> hub.ModelInfo:
    """``info`` with every value the database cannot hold (an int out of range, text that is not
    UTF-8) reset to its default and named in one warning."""
    reset, why = {}, []
    for f in fields(info):
        v = getattr(info, f.name)
        if isinstance(v, int) and not isinstance(v, bool) and not 0 <= v <= _column_max(f.name):
            reset[f.name] = f.default
            why.append(f"{f.name}={v} is out of range (0 to {_column_max(f.name)})")
        elif isinstance(v, str) and not hub.is_utf8(v):
            reset[f.name] = f.default
            why.append(f"{f.name}='{hub.printable(v)}' is not UTF-8 text")
    if not why:
        return info
    return replace(info, **reset, warnings=(*info.warnings, "not stored: " + "; ".join(why)))


class Known(NamedTuple):
    fingerprint: str
    refs: str
    root: str
    digest: str
    scanned_at: datetime


def _row(c: Candidate, info: hub.ModelInfo, fp: str, now: datetime, old: Known | None) -> dict[str, Any]:
    row = dict(vars(info))
    del row["warnings"]
    row.update(
        source=c.source, root=c.root, name=c.name, repo_id=c.repo_id, revision=c.revision,
        total_bytes=info.weight_bytes + info.vision_bytes, warning="; ".join(info.warnings) or None,
    )  # fmt: skip
    digest = hashlib.sha1(repr(list(row.items())).encode()).hexdigest()  # key order is fixed by code
    unchanged = old is not None and old.digest == digest
    row.update(path=c.path, refs=c.refs, fingerprint=fp, digest=digest)
    row["scanned_at"] = old.scanned_at if unchanged else now
    return row


def _read(c: Candidate, known: dict[str, Known], now: datetime, report: list[str]) -> Any:
    """A row dict when ``c`` changed, the string "refs" when only its refs moved, else None.

    Hub snapshots are compared by their stat key before anything inside them is listed; other
    directories (edited in place) by the names, sizes, mtimes and inodes of their entries.
    """
    old = known.get(c.path)
    if c.key and old is not None and old.fingerprint == c.key:
        return "refs" if old.refs != c.refs else None
    try:
        files = hub.list_files(c.path, stat_all=c.key is None)
    except OSError as e:
        report.append(f"{c.path}: unreadable directory ({e})")
        files = []
    fp = c.key if c.key is not None else hub.printable(hub.fingerprint(files))
    if c.key is None and old is not None and old.fingerprint == fp:
        return "refs" if old.refs != c.refs else None
    try:
        info = hub.read_model_dir(c.path, files, repo_id=c.repo_id or c.name)
    except Exception as e:  # a hostile file must cost a warning, never the scan
        info = hub.ModelInfo(warnings=(f"could not be read ({type(e).__name__}: {str(e)[:80]})",))
    info = storable(info)
    info = replace(info, warnings=tuple(map(hub.printable, info.warnings)))
    for w in info.warnings:
        report.append(f"{c.path}: {w}")
    return _row(c, info, fp, now, old)


def scan(
    *,
    hub_cache: str | os.PathLike | None = None,
    paths: Iterable[str | os.PathLike] = (),
    runs_root: str | os.PathLike | None = None,
    registered: bool = True,
    progress: bool = False,
) -> ScanReport:
    """Index the hub cache, ``paths`` and the run outputs under ``runs_root``; re-read only changes.

    Args:
        hub_cache: the HF hub cache (None: HF_HUB_CACHE, HF_HOME/hub, ~/.cache/huggingface/hub).
        paths: model directories, or directories of model directories.
        runs_root: the mlxbun outputs root; None skips run outputs.
        registered: also re-check directories added with :func:`register_model`.
        progress: show a progress line (models) while reading.

    Example:
        >>> open_db(path="/tmp/registry.db")
        >>> scan(paths=["~/models"]).models
    """
    _require_db()
    t0, warnings = time.perf_counter(), []
    if hub_cache and not os.path.isdir(os.path.expanduser(str(hub_cache))):
        warnings.append(f"registry.hub_cache={str(hub_cache)!r} is not a directory; no HF cache indexed")
    cands = hub_candidates(hub.hub_cache_dir(hub_cache), warnings) + local_candidates(paths)
    if runs_root:
        cands += run_candidates(runs_root)
    cands = _utf8_only(cands, warnings)
    roots = sorted({c.root for c in cands} | {_abs(hub.hub_cache_dir(hub_cache))})
    roots += [_abs(runs_root)] if runs_root else []
    roots += [_abs(p) for p in paths]
    cands, gone = _with_registered(cands, recheck=registered)
    known = _known(roots, cands)
    rows, moved = _read_all(cands, known, warnings, progress)
    seen, scanned = {c.path for c in cands}, set(roots)
    stale = [p for p, k in known.items() if p not in seen and k.root in scanned] + gone
    _write(rows, moved, stale)
    warnings = [hub.printable(w) for w in warnings]
    for w in warnings:
        log.warning("registry: %s", w)
    return ScanReport(
        len(rows), len(cands) - len(rows), len(stale), tuple(warnings), time.perf_counter() - t0
    )


def _with_registered(cands: list[Candidate], *, recheck: bool) -> tuple[list[Candidate], list[str]]:
    """Candidates with registered directories keeping their source and given name; and, with
    ``recheck``, the registered directories found nowhere else (plus the vanished ones, to drop)."""
    q = ModelRecord.select(ModelRecord.path, ModelRecord.root, ModelRecord.name)
    reg = {p: (root, name) for p, root, name in q.where(ModelRecord.source == "registered").tuples()}
    out = [Candidate(c.path, "registered", *reg[c.path]) if c.path in reg else c for c in cands]
    if not recheck:
        return out, []
    have, gone = {c.path for c in cands}, []
    for p, (root, name) in reg.items():
        if p in have:
            continue
        if os.path.isdir(p):
            out.append(Candidate(p, "registered", root, name))
        else:
            gone.append(p)
    return out, gone


def _known(roots: list[str], cands: list[Candidate]) -> dict[str, Known]:
    """What is stored for rows under ``roots`` or at a candidate's path, by path."""
    M = ModelRecord
    q = M.select(M.path, M.fingerprint, M.refs, M.root, M.digest, M.scanned_at)
    out = {r[0]: Known(*r[1:]) for r in q.where(M.root.in_(roots)).tuples()}
    extra = [c.path for c in cands if c.root not in roots and c.path not in out]  # registered dirs
    for chunk in pw.chunked(extra, 500):
        out.update({r[0]: Known(*r[1:]) for r in q.where(M.path.in_(chunk)).tuples()})
    return out


def _read_all(cands: list[Candidate], known: dict, warnings: list[str], progress: bool) -> tuple[list, list]:
    from mlxbun.progress import Progress

    bar = Progress(total=len(cands), unit="models", desc="registry scan") if progress else None
    now, rows, moved = utcnow(), [], []
    for c in cands:
        got = _read(c, known, now, warnings)
        if got == "refs":
            moved.append(c)
        elif got is not None:
            rows.append(got)
        if bar:
            bar.update(1)
    if bar:
        bar.close()
    return rows, moved


def _write(rows: list[dict[str, Any]], moved: list[Candidate], delete: list[str]) -> None:
    """Upsert changed rows, update moved refs, delete stale paths: one write transaction, if any."""
    if not (rows or moved or delete):
        return
    with write_txn():
        for chunk in pw.chunked(rows, 500):
            _upsert(chunk)
        for c in moved:
            ModelRecord.update(refs=c.refs).where(ModelRecord.path == c.path).execute()
        for chunk in pw.chunked(delete, 500):
            ModelRecord.delete().where(ModelRecord.path.in_(chunk)).execute()


def _upsert(rows: list[dict[str, Any]]) -> None:
    """INSERT .. ON CONFLICT(path) DO UPDATE for many rows in one executemany (sqlite and PostgreSQL).

    peewee's insert_many builds SQL per value; at thousands of rows that costs more than the scan.
    """
    database, cols = db.obj, list(rows[0])
    names = ", ".join(f'"{c}"' for c in cols)
    sets = ", ".join(f'"{c}" = EXCLUDED."{c}"' for c in cols if c != "path")
    marks = ", ".join([database.param] * len(cols))
    sql = f'INSERT INTO "{ModelRecord._meta.table_name}" ({names}) VALUES ({marks}) ON CONFLICT ("path") DO UPDATE SET {sets}'
    # Values are plain str/int/bool/None but for scanned_at, stored as peewee stores it on sqlite.
    when = cols.index("scanned_at")
    sqlite = isinstance(database, pw.SqliteDatabase)
    params = []
    for r in rows:
        values = [r[c] for c in cols]
        values[when] = str(values[when]) if sqlite else values[when]
        params.append(values)
    database.cursor().executemany(sql, params)


def register_model(path: str | os.PathLike, *, name: str | None = None) -> dict[str, Any]:
    """Index one model directory (e.g. a fresh quantize output) so later recipes can name it.

    Args:
        path: the model directory (config.json + safetensors).
        name: the name ``model.name=`` resolves; defaults to the directory name.

    Example:
        >>> register_model("outputs/quantize/2026-12-02_10-00-00/model", name="qwen3-4b-4bit")
    """
    p = Path(_abs(path))
    if not p.is_dir():
        raise InputError(f"path={str(path)!r} is not a directory; pass a model directory")
    _require_db()
    c = Candidate(str(p), "registered", str(p), name or p.name)
    warnings: list[str] = []
    row = _read(c, {}, utcnow(), warnings)
    for w in warnings:
        log.warning("registry: %s", w)
    _write([row], [], [])
    return ModelRecord.get(ModelRecord.path == str(p)).to_dict()


# --------------------------------------------------------------------------- queries


def _alive(rows: Iterable[ModelRecord]) -> list[ModelRecord]:
    """Rows whose directory still exists (reads never return a vanished model)."""
    return [r for r in rows if os.path.isdir(r.path)]


def canonical(rows: list[ModelRecord]) -> list[ModelRecord]:
    """One row per repo: the revision refs/main points at, else the most recently scanned, ties by path.

    Directories registered under one name form a group too (the latest registration wins);
    any other row is its own group.
    """
    groups: dict[tuple[str, str], list[ModelRecord]] = {}
    for r in rows:
        key = (
            ("repo", r.repo_id)
            if r.repo_id
            else ("name", r.name)
            if r.source == "registered"
            else ("path", r.path)
        )
        groups.setdefault(key, []).append(r)

    def rank(r: ModelRecord) -> tuple:
        return ("main" not in r.refs.split(","), -r.scanned_at.timestamp(), r.path)

    return [min(g, key=rank) for g in groups.values()]


def ls(
    *,
    vision: bool | None = None,
    max_gb: float | None = None,
    query: str | None = None,
    license: str | None = None,
    model_type: str | None = None,
    quantized: bool | None = None,
    all_revisions: bool = False,
    broken: bool = False,
) -> list[dict[str, Any]]:
    """Indexed models matching every given filter, smallest first.

    Args:
        vision: only models with (True) or without (False) a vision tower.
        max_gb: total weight bytes (language + vision sidecar) at most this many GB (10^9 bytes).
        query: case-insensitive substring of the repo id, name or model type.
        license: license from README front matter (case-insensitive).
        model_type: config model_type or text_config model_type (case-insensitive).
        quantized: only quantized (True) or unquantized (False) models.
        all_revisions: list every cached revision, not only each repo's canonical one.
        broken: also list directories that could not be read (their warning says why).

    Example:
        >>> [m["name"] for m in ls(vision=True, max_gb=10)]
    """
    _require_db()
    M = ModelRecord
    q = M.select()
    if vision is not None:
        q = q.where(M.has_vision == vision)
    if max_gb is not None:
        q = q.where(M.total_bytes <= min(int(max_gb * GB), _column_max("total_bytes")))
    if query:
        q = q.where(M.name.contains(query) | M.repo_id.contains(query) | M.model_type.contains(query)
                    | M.text_model_type.contains(query))  # fmt: skip
    if license:
        q = q.where(pw.fn.LOWER(M.license) == license.lower())
    if model_type:
        mt = model_type.lower()
        q = q.where((pw.fn.LOWER(M.model_type) == mt) | (pw.fn.LOWER(M.text_model_type) == mt))
    if quantized is not None:
        q = q.where(M.quant_bits.is_null(not quantized))
    if not broken:
        q = q.where(M.warning.is_null())
    rows = _alive(q)
    rows = rows if all_revisions else canonical(rows)
    return [r.to_dict() for r in sorted(rows, key=lambda r: (r.total_bytes, r.name, r.path))]


def _looks_like_repo_id(query: str) -> bool:
    parts = query.split("/")
    return len(parts) == 2 and all(parts) and not query.startswith((".", "~"))


def resolve(
    query: str,
    *,
    hub_cache: str | os.PathLike | None = None,
    paths: Iterable[str | os.PathLike] = (),
    key: str = "model.name",
) -> Path:
    """The one model directory ``query`` names: an existing path, an exact repo id or name, else fuzzy.

    The hub cache and ``paths`` are scanned first (incremental: only changed directories are
    read), so a repo id resolves without a prior ``registry_scan``. Fuzzy matching is a
    case-insensitive substring of the repo id or name. Revisions of one repo collapse to the
    canonical one; speculative-decoding drafters and unreadable directories are never fuzzy
    candidates (an exact repo id or name still selects a drafter).

    Args:
        query: a directory, ``org/name``, a registered name, or part of one.
        hub_cache: the HF hub cache (None: HF_HUB_CACHE, HF_HOME/hub, ~/.cache/huggingface/hub).
        paths: local model directories (or directories of them) to index too.
        key: the config key named in errors.

    Example:
        >>> resolve("Qwen3-0.6B")
        PosixPath('/home/me/.cache/huggingface/hub/models--Qwen--Qwen3-0.6B/snapshots/c1899d...')
    """
    p = Path(query).expanduser()
    if p.is_dir():
        return p.resolve()
    _require_db()
    scan(hub_cache=hub_cache, paths=paths, registered=False)
    usable = [r for r in _alive(ModelRecord.select().where(ModelRecord.warning.is_null()))]
    exact = [r for r in usable if query in (r.repo_id, r.name, r.path)]
    exact = exact or [r for r in usable if query.lower() in ((r.repo_id or "").lower(), r.name.lower())]
    hits = canonical(exact)
    if not hits:
        q = query.lower()
        fuzzy = [
            r for r in usable if not r.is_drafter and (q in (r.repo_id or "").lower() or q in r.name.lower())
        ]
        hits = canonical(fuzzy)
    if len(hits) == 1:
        return Path(hits[0].path)
    if hits:
        names = sorted(h.repo_id or f"{h.name} ({h.path})" for h in hits)
        shown = ", ".join(names[:12]) + (f" (+{len(names) - 12} more)" if len(names) > 12 else "")
        raise InputError(f"{key}={query!r} matches {len(hits)} models: {shown}; name one exactly")
    raise InputError(_not_found(query, key=key, hub_cache=hub_cache))


def _not_found(query: str, *, key: str, hub_cache: Any) -> str:
    where = hub.hub_cache_dir(hub_cache)
    if _looks_like_repo_id(query):
        return (
            f"{key}={query!r} is not in the local HF cache ({where}); fetch it with "
            f"`hf download {query}` (or `huggingface-cli download {query}`), or pass a local directory"
        )
    return (
        f"{key}={query!r} matches no indexed model (HF cache {where}, registry.paths, registered "
        "models); see `python -m mlxbun command=registry_ls`, or pass a directory or org/name"
    )


def record_for(path: str | os.PathLike) -> ModelRecord:
    """The stored row of a model directory; indexes it (as ``local``) when it is not stored yet."""
    p = _abs(path)
    rec = ModelRecord.get_or_none(ModelRecord.path == p)
    if rec is None:
        c = Candidate(p, "local", p, os.path.basename(p))
        warnings: list[str] = []
        _write([_read(c, {}, utcnow(), warnings)], [], [])
        rec = ModelRecord.get(ModelRecord.path == p)
    return rec


# --------------------------------------------------------------------------- fit


@dataclass(frozen=True)
class FitReport:
    """Memory needed to run a model at a context length, against a budget (bytes)."""

    name: str
    path: str
    budget_bytes: int
    context: int
    weight_bytes: int  # every language weight on disk
    active_weight_bytes: int  # what decode touches: dense weights + active experts' share
    expert_bytes: int
    active_expert_bytes: int
    vision_bytes: int  # the sidecar, counted only when asked
    kv_bytes: int | None  # None when the config lacks the KV shape
    total_bytes: int
    fits: bool
    notes: tuple[str, ...] = ()


def kv_cache_bytes(rec: Any, context: int) -> int | None:
    """K and V for ``context`` tokens: layers x kv_heads x head_dim x 2 x dtype bytes, windows honoured."""
    if not (rec.num_layers and rec.num_kv_heads and rec.head_dim):
        return None
    per_token_layer = rec.num_kv_heads * rec.head_dim * 2 * rec.kv_dtype_bytes
    sliding = min(rec.num_sliding_layers or 0, rec.num_layers)
    window = min(context, rec.sliding_window) if rec.sliding_window else context
    return per_token_layer * ((rec.num_layers - sliding) * context + sliding * window)


def fit_record(rec: Any, *, budget_bytes: int, context: int, vision: bool = False) -> FitReport:
    """Does ``rec`` (a ModelRecord or anything with its fields) fit ``budget_bytes``?"""
    notes = []
    active_experts = rec.expert_bytes
    if rec.expert_bytes and rec.num_experts and rec.experts_per_tok:
        active_experts = rec.expert_bytes * rec.experts_per_tok // rec.num_experts
        notes.append(f"MoE: {rec.experts_per_tok} of {rec.num_experts} experts active per token")
    elif rec.expert_bytes:
        notes.append("expert tensors found but no num_experts/num_experts_per_tok: all counted")
    active = rec.weight_bytes - rec.expert_bytes + active_experts
    kv = kv_cache_bytes(rec, context)
    if kv is None:
        notes.append("KV cache unknown: config lacks layers / KV heads / head_dim")
    if rec.num_sliding_layers:
        notes.append(f"{rec.num_sliding_layers} sliding-window layers keep {rec.sliding_window} tokens")
    vis = rec.vision_bytes if vision else 0
    if vision and not rec.vision_bytes:
        notes.append("no vision sidecar")
    total = active + vis + (kv or 0)
    return FitReport(
        name=rec.repo_id or rec.name, path=rec.path, budget_bytes=budget_bytes, context=context,
        weight_bytes=rec.weight_bytes, active_weight_bytes=active, expert_bytes=rec.expert_bytes,
        active_expert_bytes=active_experts, vision_bytes=vis, kv_bytes=kv, total_bytes=total,
        fits=total <= budget_bytes, notes=tuple(notes),
    )  # fmt: skip


def fit(
    model: str | os.PathLike,
    *,
    budget_gb: float = 16.0,
    context: int = 8192,
    vision: bool = False,
    hub_cache: str | os.PathLike | None = None,
    paths: Iterable[str | os.PathLike] = (),
) -> FitReport:
    """Does ``model`` (anything :func:`resolve` takes) fit ``budget_gb`` at ``context`` tokens?

    Example:
        >>> r = fit("Qwen3-30B-A3B", budget_gb=24, context=32768)
        >>> r.fits, r.active_weight_bytes, r.kv_bytes
    """
    path = resolve(str(model), hub_cache=hub_cache, paths=paths)
    return fit_record(record_for(path), budget_bytes=int(budget_gb * GB), context=context, vision=vision)


# --------------------------------------------------------------------------- commands


def _human(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, scale in (("GB", GB), ("MB", 10**6), ("KB", 10**3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _open(cfg: Any) -> None:
    open_db(url=cfg.registry.url, path=cfg.registry.path)


def run_scan(cfg: Any) -> Any:
    """command=registry_scan: index the hub cache, registry.paths and the run outputs."""
    from mlxbun.provenance import RunResult

    _open(cfg)
    r = scan(hub_cache=cfg.registry.hub_cache, paths=cfg.registry.paths, runs_root=cfg.registry.runs_root,
             progress=True)  # fmt: skip
    metrics = {"models": r.models, "read": r.read, "unchanged": r.unchanged, "pruned": r.pruned,
               "warnings": len(r.warnings), "seconds": round(r.seconds, 3)}  # fmt: skip
    msg = (f"indexed {r.models} directories ({r.read} read, {r.unchanged} unchanged, {r.pruned} pruned, "
           f"{len(r.warnings)} warnings) in {r.seconds:.2f}s")  # fmt: skip
    if cfg.json:
        msg = json.dumps({**metrics, "warning_list": list(r.warnings)}, indent=2, sort_keys=True)
    return RunResult(metrics=metrics, message=msg)


def _filters(cfg: Any) -> dict[str, Any]:
    return asdict(cfg.registry.filter)


def _count(n: int | None) -> str:
    if not n:
        return "?"
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else str(n)


def _display_name(r: dict[str, Any]) -> str:
    """The name, with the revision when it is not the one refs/main points at."""
    if r["revision"] and "main" not in (r["refs"] or "").split(","):
        return f"{r['name']}@{r['revision'][:8]}"
    return r["name"]


def _vision_cell(r: dict[str, Any]) -> str:
    """The sidecar's size; "yes" for a vision tower without one (inside the weights); else "-"."""
    if r["vision_bytes"]:
        return _human(r["vision_bytes"])
    return "yes" if r["has_vision"] else "-"


def format_table(rows: list[dict[str, Any]]) -> str:
    """A terminal table of :func:`ls` rows: size, vision, params, type, quantization, flags."""
    head = f"{'size':>10} {'vision':>10} {'params':>8}  {'type':<16} {'quant':<10} {'flags':<5} {'license':<12} name"
    lines = [head]
    for r in rows:
        quant = f"{r['quant_bits']}b/g{r['quant_group_size']}" if r["quant_bits"] else "-"
        flags = "".join(c for c, on in (("V", r["has_vision"]), ("T", r["has_tools"]), ("K", r["has_kv_config"]),
                                         ("E", r["expert_bytes"]), ("D", r["is_drafter"]), ("!", r["warning"])) if on)  # fmt: skip
        params = _count(r["param_count"])
        lines.append(
            f"{_human(r['total_bytes']):>10} {_vision_cell(r):>10} "
            f"{params:>8}  {str(r['text_model_type'] or '-'):<16} {quant:<10} {flags or '-':<5} "
            f"{str(r['license'] or '-'):<12} {_display_name(r)}"
        )
    lines.append(
        f"{len(rows)} model(s); vision: the vision sidecar's size, yes for a tower inside the weights; "
        "flags: V vision, T tool calling, K kv_config, E experts, D drafter, ! unreadable"
    )
    return "\n".join(lines)


def run_ls(cfg: Any) -> Any:
    """command=registry_ls: the models matching registry.filter.*, smallest first.

    Refreshes the index first (incremental: only changed directories are read), so the
    answer is current without a separate registry_scan.
    """
    from mlxbun.provenance import RunResult

    _open(cfg)
    scan(hub_cache=cfg.registry.hub_cache, paths=cfg.registry.paths, runs_root=cfg.registry.runs_root)
    rows = ls(**_filters(cfg))
    if cfg.json:
        return RunResult(message=json.dumps(rows, indent=2, sort_keys=True, default=str))
    return RunResult(message=format_table(rows))


def _model_query(cfg: Any) -> str:
    if not cfg.model.name:
        raise InputError("model.name is not set; pass model.name=<org/name | name | part of one | directory>")
    return cfg.model.name


def run_resolve(cfg: Any) -> Any:
    """command=registry_resolve: the one model directory model.name names."""
    from mlxbun.provenance import RunResult

    _open(cfg)
    path = resolve(_model_query(cfg), hub_cache=cfg.registry.hub_cache, paths=cfg.registry.paths)
    msg = json.dumps({"query": cfg.model.name, "path": str(path)}, sort_keys=True) if cfg.json else str(path)
    return RunResult(message=msg, provides={"model.name": str(path)})


def format_fit(r: FitReport) -> str:
    verdict = "fits" if r.fits else "does NOT fit"
    lines = [
        f"{r.name}: {verdict} in {_human(r.budget_bytes)} at {r.context} tokens of context",
        f"  weights (active)   {_human(r.active_weight_bytes):>12}   of {_human(r.weight_bytes)} on disk",
        f"  experts (active)   {_human(r.active_expert_bytes):>12}   of {_human(r.expert_bytes)}",
        f"  vision sidecar     {_human(r.vision_bytes):>12}",
        f"  KV cache           {_human(r.kv_bytes):>12}",
        f"  total              {_human(r.total_bytes):>12}   headroom {_human(r.budget_bytes - r.total_bytes)}",
    ]
    return "\n".join(lines + [f"  note: {n}" for n in r.notes])


def run_fit(cfg: Any) -> Any:
    """command=registry_fit: does model.name fit registry.fit.budget_gb at registry.fit.context?

    The answer is the exit code too: 0 when it fits, 1 when it does not.
    """
    from mlxbun.provenance import RunResult

    _open(cfg)
    f = cfg.registry.fit
    r = fit(_model_query(cfg), budget_gb=f.budget_gb, context=f.context, vision=f.vision,
            hub_cache=cfg.registry.hub_cache, paths=cfg.registry.paths)  # fmt: skip
    msg = json.dumps(asdict(r), indent=2, sort_keys=True) if cfg.json else format_fit(r)
    return RunResult(message=msg, metrics=asdict(r), exit_code=0 if r.fits else 1)
