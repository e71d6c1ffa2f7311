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


# A sitecustomize.py body: the writer finishes its second shard, then the process is SIGKILLed
# (put it on PYTHONPATH of a child to test resume after a crash).
KILL_AFTER_SECOND_SHARD = """
import os, signal
from mlxbun.io import shards
real = shards.ShardedWriter._write_shard
def write_then_die(self, k, items):
    real(self, k, items)
    if k == 2:
        os.kill(os.getpid(), signal.SIGKILL)
shards.ShardedWriter._write_shard = write_then_die
"""
