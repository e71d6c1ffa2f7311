"""The registry commands: ``registry_scan``, ``registry_ls``, ``registry_resolve``, ``registry_fit``.

``command=registry_<name>`` runs :func:`<name>` here, as ``command=kv_<name>`` runs
``mlxbun.kv.commands:<name>``. Each unpacks the config into the library call and formats the answer.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from mlxbun.errors import InputError
from mlxbun.registry import database, index, memory, query, table
from mlxbun.runs.provenance import RunResult


def _open(cfg: Any) -> None:
    database.open_db(url=cfg.registry.url, path=cfg.registry.path)


def _model_query(cfg: Any) -> str:
    if not cfg.model.name:
        raise InputError("model.name is not set; pass model.name=<org/name | name | part of one | directory>")
    return cfg.model.name


def scan(cfg: Any) -> RunResult:
    """command=registry_scan: index the hub cache, registry.paths and the run outputs."""
    _open(cfg)
    r = index.scan(hub_cache=cfg.registry.hub_cache, paths=cfg.registry.paths, runs_root=cfg.registry.runs_root,
             progress=True)  # fmt: skip
    metrics = {"models": r.models, "read": r.read, "unchanged": r.unchanged, "pruned": r.pruned,
               "warnings": len(r.warnings), "seconds": round(r.seconds, 3)}  # fmt: skip
    msg = (f"indexed {r.models} directories ({r.read} read, {r.unchanged} unchanged, {r.pruned} pruned, "
           f"{len(r.warnings)} warnings) in {r.seconds:.2f}s")  # fmt: skip
    if cfg.json:
        msg = json.dumps({**metrics, "warning_list": list(r.warnings)}, indent=2, sort_keys=True)
    return RunResult(metrics=metrics, message=msg)


def ls(cfg: Any) -> RunResult:
    """command=registry_ls: the models matching registry.filter.*, smallest first.

    Refreshes the index first (incremental: only changed directories are read), so the
    answer is current without a separate registry_scan.
    """
    _open(cfg)
    index.scan(hub_cache=cfg.registry.hub_cache, paths=cfg.registry.paths, runs_root=cfg.registry.runs_root)
    rows = query.ls(**asdict(cfg.registry.filter))
    if cfg.json:
        return RunResult(message=json.dumps(rows, indent=2, sort_keys=True, default=str))
    return RunResult(message=table.format_table(rows))


def resolve(cfg: Any) -> RunResult:
    """command=registry_resolve: the one model directory model.name names."""
    _open(cfg)
    path = query.resolve(_model_query(cfg), hub_cache=cfg.registry.hub_cache, paths=cfg.registry.paths)
    msg = json.dumps({"query": cfg.model.name, "path": str(path)}, sort_keys=True) if cfg.json else str(path)
    return RunResult(message=msg, provides={"model.name": str(path)})


def fit(cfg: Any) -> RunResult:
    """command=registry_fit: does model.name fit registry.fit.budget_gb at registry.fit.context?

    The answer is the exit code too: 0 when it fits, 1 when it does not.
    """
    _open(cfg)
    f = cfg.registry.fit
    r = memory.fit(_model_query(cfg), budget_gb=f.budget_gb, context=f.context, vision=f.vision,
            hub_cache=cfg.registry.hub_cache, paths=cfg.registry.paths)  # fmt: skip
    msg = json.dumps(asdict(r), indent=2, sort_keys=True) if cfg.json else table.format_fit(r)
    return RunResult(message=msg, metrics=asdict(r), exit_code=0 if r.fits else 1)
