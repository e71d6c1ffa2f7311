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

import json
from pathlib import Path
from typing import Any

from mlxbun.errors import InputError
from mlxbun.quant.sensitivity import KIND, METHOD_SETTINGS, SCHEMA_VERSION, write_reports
from mlxbun.quant.spec import check_sensitivity

SAME = (
    "version",
    "kind",
    "metric",
    "method",
    "bits",
    "group_size",
    "mode",
    "model",
    "calibration",
    "runtime",
    *METHOD_SETTINGS,
    "estimate",
    "all_layers",
)


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


def read(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"sensitivity.inputs: {str(path)!r} is not readable JSON ({e})") from None
    if doc.get("kind") != KIND or doc.get("version") != SCHEMA_VERSION:
        raise InputError(
            f"sensitivity.inputs: {str(path)!r} is not a version-{SCHEMA_VERSION} sensitivity.json"
            f" (kind={doc.get('kind')!r}, version={doc.get('version')!r})"
        )
    check_sensitivity(doc, source=f"sensitivity.inputs: {str(path)!r}")
    return doc


def combine(docs: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """The merged document; raises InputError on mismatched settings, overlaps or gaps."""
    first = docs[0]
    for doc, name in zip(docs[1:], names[1:], strict=True):
        for key in SAME:
            if doc.get(key) != first.get(key):
                lacking = [n for d, n in ((first, names[0]), (doc, name)) if key not in d]
                why = (
                    f"{lacking[0]!r} does not record it (written before {key!r} was recorded); rerun that shard"
                    if len(lacking) == 1
                    else "merge only shards of one sweep (same model, calibration and settings)"
                )
                raise InputError(f"sensitivity.inputs: {name!r} differs from {names[0]!r} in {key!r}; {why}")
    rows: dict[str, dict] = {}
    for doc, name in zip(docs, names, strict=True):
        for row in doc["layers"]:
            if row["path"] in rows and rows[row["path"]] != row:
                raise InputError(
                    f"sensitivity.inputs: {name!r} disagrees on {row['path']!r} with another shard"
                )
            rows[row["path"]] = row
    missing = [p for p in first["all_layers"] if p not in rows]
    if missing:
        counts = sorted({(d["shard"] or {}).get("count") for d in docs}, key=str)
        raise InputError(
            f"sensitivity.inputs cover {len(rows)} of {len(first['all_layers'])} modules "
            f"(missing {missing[0]!r} and {len(missing) - 1} more); pass every shard (num_shards={counts})"
        )
    merged = {k: first[k] for k in first if k not in ("layers", "shard")}
    merged["layers"] = [rows[p] for p in first["all_layers"]]
    merged["shard"] = None
    return merged


def merge(*, inputs: list[str], out_dir: str | Path) -> tuple[dict[str, Any], list[Path], list[Path]]:
    """Merge the shard results named by ``inputs`` into ``out_dir``; (document, inputs, outputs)."""
    files = find_files(inputs)
    docs = [read(f) for f in files]
    merged = combine(docs, [str(f) for f in files])
    outputs = write_reports(merged, Path(out_dir))
    return merged, files, outputs


def run(cfg: Any) -> Any:
    """command=sensitivity_merge: unpack the config and call :func:`merge`."""
    from mlxbun.provenance import RunResult

    run_dir = Path(cfg.paths.run_dir)
    doc, files, outputs = merge(inputs=list(cfg.sensitivity.inputs), out_dir=run_dir)
    return RunResult(
        outputs=outputs,
        inputs=files,
        metrics={"shards": len(files), "layers": len(doc["layers"])},
        message=f"merged {len(files)} shards: {len(doc['layers'])} layers -> {outputs[0]}",
        provides={"allocate.sensitivity": str(outputs[0])},
    )
