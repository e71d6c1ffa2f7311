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
real = shards.ShardedWriter._end_shard
def end_then_die(self, shard):
    real(self, shard)
    if len(self._shards) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
shards.ShardedWriter._end_shard = end_then_die
"""

# A sitecustomize.py body that SIGKILLs the process at the point named by MLXBUN_TEST_KILL_AT:
#   step:<name>        at mlxbun.io.staging.reached(<name>) (a step of the staging protocol)
#   finish             when a ShardedWriter.finish() returns
#   shard:<k>          when a ShardedWriter has written its k-th shard
#   rename-in:<prefix> before the first os.replace into a directory whose name starts with <prefix>
# Unset, it does nothing.
KILL_AT = """
import os, signal
where = os.environ.get("MLXBUN_TEST_KILL_AT", "")
kind, _, arg = where.partition(":")
def die():
    os.kill(os.getpid(), signal.SIGKILL)
if kind == "step":
    from mlxbun.io import staging
    def reached(step):
        if step == arg:
            die()
    staging.reached = reached
elif kind in ("finish", "shard"):
    from mlxbun.io import shards
    real_finish, real_end = shards.ShardedWriter.finish, shards.ShardedWriter._end_shard
    def finish(self):
        layout = real_finish(self)
        if kind == "finish":
            die()
        return layout
    def end_shard(self, shard):
        real_end(self, shard)
        if kind == "shard" and len(self._shards) == int(arg):
            die()
    shards.ShardedWriter.finish, shards.ShardedWriter._end_shard = finish, end_shard
elif kind == "rename-in":
    real_replace = os.replace
    def replace(src, dst, **kw):
        if os.path.basename(os.path.dirname(os.path.abspath(dst))).startswith(arg):
            die()
        return real_replace(src, dst, **kw)
    os.replace = replace
"""


def kill_hook(tmp: Path) -> Path:
    """A directory holding the KILL_AT sitecustomize.py; put it first on a child's PYTHONPATH."""
    hook = tmp / "kill-hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(KILL_AT)
    return hook


def run_python(
    code: str, *, tmp: Path, kill_at: str | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter importing this checkout; ``kill_at`` as in KILL_AT."""
    path = [str(kill_hook(tmp)), str(REPO)] if kill_at else [str(REPO)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "HF_HUB_OFFLINE": "1"}
    if kill_at:
        env["MLXBUN_TEST_KILL_AT"] = kill_at
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env
    )


def other_model(src: Path, dst: Path, *, metadata: dict | None = None) -> Path:
    """A copy of the model ``src`` with every weight scaled by 1.01: the same config, names and
    shapes, other weights (another training run of the same architecture)."""
    import mlx.core as mx

    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    arrays, meta = mx.load(str(src / "model.safetensors"), return_metadata=True)
    mx.save_safetensors(
        str(dst / "model.safetensors"),
        {k: (v * 1.01).astype(v.dtype) for k, v in arrays.items()},
        metadata={**meta, **(metadata or {})},
    )
    return dst
