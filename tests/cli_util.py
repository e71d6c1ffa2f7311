"""Run ``python -m mlxbun`` in a subprocess with outputs, cache and registry inside a tmp dir."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def isolated_args(tmp: Path) -> list[str]:
    return [
        f"paths.outputs={tmp / 'outputs'}",
        f"paths.cache={tmp / 'cache'}",
        f"registry.path={tmp / 'registry.db'}",
        f"registry.hub_cache={tmp / 'hub'}",
    ]


def run_cli(
    *args: str, tmp: Path, isolate: bool = True, timeout: float = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run the CLI; ``isolate`` appends overrides that keep every write under ``tmp``."""
    argv = [sys.executable, "-m", "mlxbun", *args] + (isolated_args(tmp) if isolate else [])
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=full_env)
