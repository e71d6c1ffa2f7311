"""command=synth: write a deterministic synthetic checkpoint (see :mod:`mlxbun.synth.write`).

Run ``python -m mlxbun command=synth synth.arch=qwen3 synth.preset=tiny`` (or ``+recipe=quickstart``).
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from mlxbun.io.staging import stable_root
from mlxbun.progress import human_bytes
from mlxbun.runs.provenance import RunResult
from mlxbun.synth.values import plan
from mlxbun.synth.write import check_room, resolve_spec, write_spec


def run(cfg: Any) -> Any:
    """command=synth: write the model into ``synth.out`` or ``<run_dir>/model``."""

    fields = {k: v for k, v in asdict(cfg.synth).items() if k != "out"}
    spec = resolve_spec(**fields)
    out = Path(cfg.synth.out).expanduser() if cfg.synth.out else Path(cfg.paths.run_dir) / "model"
    # Into a fresh run dir: keep the partial build at a stable place so a re-run resumes it.
    root = None if cfg.synth.out else stable_root(cfg.paths.outputs, out)
    check_room(spec, out=out, partial_root=root)
    start = time.perf_counter()
    path = write_spec(spec, out, shard_bytes=cfg.io.shard_bytes, partial_root=root)
    seconds = time.perf_counter() - start
    tensors = plan(spec)
    nbytes, params = sum(t.nbytes for t in tensors), sum(t.numel for t in tensors)
    s = spec.shape
    return RunResult(
        outputs=[path],
        metrics={"params": params, "bytes": nbytes, "seconds": round(seconds, 3), "spec_hash": spec.hash},
        message=(
            f"synth {spec.arch} {s.num_layers}x{s.hidden_size} vocab {s.vocab_size}: {params / 1e6:,.1f}M params,"
            f" {human_bytes(nbytes)} in {seconds:.1f}s -> {path}"
        ),
        provides={"model.name": str(path)},
    )
