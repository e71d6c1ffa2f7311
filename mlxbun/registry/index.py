"""Scanning: find model directories (HF cache, local paths, run outputs, registered) and index them.

A scan is incremental: a directory is re-read only when the names, sizes, mtimes or inodes of its
top-level entries changed (hub snapshots: the stats of the snapshot and blob directories); rows
whose directory vanished are pruned. A bad entry becomes a warning naming it; the scan goes on.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, fields, replace
from datetime import datetime
from pathlib import Path
from typing import Any, NamedTuple

import peewee as pw

from mlxbun.errors import InputError
from mlxbun.progress import Progress
from mlxbun.registry.database import ModelRecord, column_max, db, log, require_db, utcnow, write_txn
from mlxbun.source import hub


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
            warn = lambda p, w: log.warning("registry: %s: %s", p, w)  # noqa: E731
            subs = sorted(
                e.path for e in os.scandir(root) if not e.name.startswith(".") and hub.is_dir(e, warn)
            )
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


def storable(info: hub.ModelInfo) -> hub.ModelInfo:
    """``info`` with every value the database cannot hold (an int out of range, text that is not
    UTF-8) reset to its default and named in one warning."""
    reset, why = {}, []
    for f in fields(info):
        v = getattr(info, f.name)
        if isinstance(v, int) and not isinstance(v, bool) and not 0 <= v <= column_max(f.name):
            reset[f.name] = f.default
            why.append(f"{f.name}={v} is out of range (0 to {column_max(f.name)})")
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
    require_db()
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
    require_db()
    c = Candidate(str(p), "registered", str(p), name or p.name)
    warnings: list[str] = []
    row = _read(c, {}, utcnow(), warnings)
    for w in warnings:
        log.warning("registry: %s", w)
    _write([row], [], [])
    return ModelRecord.get(ModelRecord.path == str(p)).to_dict()


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
