"""Queries over the index: the canonical revision of each repo, filtered listings, name resolution."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import peewee as pw

from mlxbun.errors import EnvironmentFailure, InputError
from mlxbun.registry.database import GB, ModelRecord, column_max, require_db
from mlxbun.registry.index import scan
from mlxbun.source import hub


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
        max_gb: total weight bytes (language + vision sidecar) at most this many GiB (2^30 bytes).
        query: case-insensitive substring of the repo id, name or model type.
        license: license from README front matter (case-insensitive).
        model_type: config model_type or text_config model_type (case-insensitive).
        quantized: only quantized (True) or unquantized (False) models.
        all_revisions: list every cached revision, not only each repo's canonical one.
        broken: also list directories that could not be read (their warning says why).

    Example:
        >>> [m["name"] for m in ls(vision=True, max_gb=10)]
    """
    require_db()
    M = ModelRecord
    q = M.select()
    if vision is not None:
        q = q.where(M.has_vision == vision)
    if max_gb is not None:
        q = q.where(M.total_bytes <= min(int(max_gb * GB), column_max("total_bytes")))
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
    require_db()
    scan(hub_cache=hub_cache, paths=paths, registered=False)
    usable = [r for r in _alive(ModelRecord.select().where(ModelRecord.warning.is_null()))]
    exact = [r for r in usable if query in (r.repo_id, r.name, r.path)]
    exact = exact or [r for r in usable if query.lower() in ((r.repo_id or "").lower(), r.name.lower())]
    hits = canonical(exact)
    if not hits:
        _refuse_broken_exact(query, key=key)  # an exact name never falls back to a fuzzy match
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


def _refuse_broken_exact(query: str, *, key: str) -> None:
    """Raise naming what is wrong when ``query`` is exactly the repo id or name of models that
    could not be read (each row's warning says why)."""
    broken = [r for r in _alive(ModelRecord.select().where(ModelRecord.warning.is_null(False)))]
    q = query.lower()
    exact = [r for r in broken if q in ((r.repo_id or "").lower(), r.name.lower()) or query == r.path]
    if exact:
        r = canonical(exact)[0]
        raise EnvironmentFailure(
            f"{key}={query!r} is {r.path}, which cannot be used: {r.warning}; repair or re-download it"
            " (an exact name never falls back to another model)"
        )


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
