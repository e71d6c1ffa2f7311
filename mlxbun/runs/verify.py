"""command=verify: check a run directory against its manifest (see :func:`mlxbun.runs.provenance.verify_run`)."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from mlxbun.errors import DriftError, InputError
from mlxbun.runs.provenance import RunResult, verify_run


def run(cfg: Any) -> RunResult:
    """command=verify: check a run against its manifest; exit 1 listing every difference."""
    if not cfg.runs.dir:
        raise InputError("runs.dir is not set; pass runs.dir=<run directory with manifest.json>")
    drift = verify_run(cfg.runs.dir)
    if cfg.json:
        report = {"run_dir": cfg.runs.dir, "drift": [asdict(d) for d in drift]}
        return RunResult(message=json.dumps(report, indent=2, sort_keys=True), exit_code=1 if drift else 0)
    if drift:
        lines = "; ".join(d.describe() for d in drift)
        raise DriftError(f"{len(drift)} output(s) drifted in {cfg.runs.dir}: {lines}")
    return RunResult(message=f"verified: every output of {cfg.runs.dir} matches its manifest")
