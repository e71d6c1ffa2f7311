"""command=runs: the recorded runs, newest first, or (runs.command=eval) evaluated candidates."""

from __future__ import annotations

import json
from typing import Any

from mlxbun import registry
from mlxbun.runs.provenance import RunResult


def run(cfg: Any) -> RunResult:
    """command=runs: a line per recorded run (runs.command, runs.recipe, runs.status, runs.limit)."""
    registry.open_db(url=cfg.registry.url, path=cfg.registry.path)
    if cfg.runs.command == "eval":
        return _eval_runs(cfg)
    rows = registry.list_runs(
        command=cfg.runs.command, recipe=cfg.runs.recipe, status=cfg.runs.status, limit=cfg.runs.limit
    )
    if cfg.json:
        return RunResult(message=json.dumps(rows, indent=2, sort_keys=True))
    head = f"{'id':>5}  {'command':<18} {'recipe':<22} {'status':<8} {'secs':>8}  output_dir"
    return RunResult(message="\n".join([head] + [_run_line(r) for r in rows]))


def _run_line(r: dict[str, Any]) -> str:
    if "malformed" in r:
        return f"{r['id']:>5}  malformed row: {r['malformed']}"
    return (
        f"{r['id']:>5}  {r['command']:<18} {str(r['recipe'] or '-'):<22} {r['status']:<8} "
        f"{(r['duration_s'] or 0):>8.1f}  {r['output_dir']}"
    )


def _eval_runs(cfg: Any) -> RunResult:
    """runs.command=eval: a row per evaluated candidate, best mean KLD first (runs.max_gb, runs.model)."""
    max_bytes = None if cfg.runs.max_gb is None else int(cfg.runs.max_gb * 2**30)
    rows = registry.eval_results(reference=cfg.runs.model, max_bytes=max_bytes, limit=cfg.runs.limit)
    if cfg.json:
        return RunResult(message=json.dumps(rows, indent=2, sort_keys=True))
    head = f"{'run':>5}  {'KLD mean':>10} {'99.9%':>9} {'GiB':>8} {'bpw':>6}  candidate  (reference)"
    lines = [head] + [
        f"{r['run']:>5}  {r['kld_mean']:>10.5f} {r['kld_p99_9']:>9.4f} {r['bytes'] / 2**30:>8.3f} {r['bpw']:>6.3f}"
        f"  {r['name']}  ({r['reference']})"
        for r in rows
    ]
    return RunResult(message="\n".join(lines))
