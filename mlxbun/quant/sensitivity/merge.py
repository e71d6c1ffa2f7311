"""command=sensitivity_merge: combine the shards of a sharded sensitivity sweep into one result.

Inputs (``sensitivity.inputs``): shard run directories, their ``sensitivity.json`` files, or a
Hydra multirun sweep directory (its numbered job directories are read)::

    outputs/multirun/sensitivity/<time>/
        0/sensitivity.json     shard 0 of 2   {"shard": {"index": 0, "count": 2, "groups": [...]}}
        1/sensitivity.json     shard 1 of 2

The shards must agree on model and calibration fingerprints and on every setting; together they
must cover every module exactly once. The merged document equals a single-job run with the same
settings (``shard`` is null, layers in model order), written with its CSV and PNG: byte-identical
when the jobs ran with the same BLAS thread count. (Hydra's joblib launcher gives each worker
cpu_count // n_jobs BLAS threads; OpenBLAS's float32 rounding then differs at ~1e-7 relative.)

Example:
    >>> merge(inputs=["outputs/multirun/sensitivity/2026-12-02_10-00-00"], out_dir="out")
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlxbun.errors import InputError
from mlxbun.quant.sensitivity.file import combine_shards, read_shard, write_reports
from mlxbun.runs.provenance import RunResult


def find_files(inputs: list[str]) -> list[Path]:
    """sensitivity.json files named by ``inputs`` (files, run dirs or sweep dirs), sorted, unique."""
    if not inputs:
        raise InputError(
            "sensitivity.inputs is empty; pass shard run dirs, sensitivity.json files or a sweep dir"
        )
    found: list[Path] = []
    for item in inputs:
        p = Path(item).expanduser()
        if p.is_file():
            found.append(p)
        elif (p / "sensitivity.json").is_file():
            found.append(p / "sensitivity.json")
        elif p.is_dir() and sorted(p.glob("*/sensitivity.json")):
            found += sorted(p.glob("*/sensitivity.json"), key=lambda f: _natural(f.parent.name))
        else:
            raise InputError(f"sensitivity.inputs has {item!r}, which holds no sensitivity.json")
    return list(dict.fromkeys(f.resolve() for f in found))


def _natural(name: str) -> tuple:
    return (0, int(name)) if name.isdigit() else (1, name)


def merge(*, inputs: list[str], out_dir: str | Path) -> tuple[dict[str, Any], list[Path], list[Path]]:
    """Merge the shard results named by ``inputs`` into ``out_dir``; (document, inputs, outputs)."""
    files = find_files(inputs)
    docs = [read_shard(f) for f in files]
    merged = combine_shards(docs, [str(f) for f in files])
    outputs = write_reports(merged, Path(out_dir))
    return merged, files, outputs


def run(cfg: Any) -> Any:
    """command=sensitivity_merge: unpack the config and call :func:`merge`."""
    run_dir = Path(cfg.paths.run_dir)
    doc, files, outputs = merge(inputs=list(cfg.sensitivity.inputs), out_dir=run_dir)
    return RunResult(
        outputs=outputs,
        inputs=files,
        metrics={"shards": len(files), "layers": len(doc["layers"])},
        message=f"merged {len(files)} shards: {len(doc['layers'])} layers -> {outputs[0]}",
        provides={"allocate.sensitivity": str(outputs[0])},
    )
