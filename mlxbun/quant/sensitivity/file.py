"""sensitivity.json: the per-module KL file, its writer (with CSV and PNG views), checks, readers, merges.

Written by ``command=sensitivity`` (and ``sensitivity_merge``), read by ``allocate`` and by a
pipeline's budget check::

    <run_dir>/
        sensitivity.json    versioned results (schema below), sorted keys
        sensitivity.csv     path, group, in_features, out_features, params, kl_<bits>...
        sensitivity.png     heatmap, modules x bits, log10 KL

sensitivity.json: {"version": 1, "kind": "mlxbun.sensitivity", "metric": ..., "method",
"bits", "group_size", "mode", "model": {fingerprint, model_type, num_layers, quantized},
"calibration": {fingerprint, source, samples, seq_len, seed, stream_tokens}, "runtime": {mlx, blas},
the method's settings (``METHOD_SETTINGS``), "estimate" (fisher), "all_layers": [...],
"layers": [{"path", "group", "in_features", "out_features", "params", "current", "kl": {"4": ..}}],
"candidates" (with ``sensitivity.candidates``: what was scored, its Hessians and probes).
A "kl" key is a bit width at the file's group size and mode (RTN), or ``mode:bits:group[:method]``
for any other candidate (``setting_key``), e.g. ``"affine:3:32:gptq"``, ``"mxfp4:4:32"``.
"shard": null | {"index", "count", "groups"}}.

A KL is a finite number >= 0 at a setting MLX has (``check_sensitivity``). Shards of one sweep
combine into the single-job document (``combine_shards``); runs of one model and calibration at
other group sizes or modes combine into one set of candidates (``merge_sensitivities``).

Example:
    >>> sens = load_sensitivity("outputs/sensitivity/2026-12-02_10-00-00/sensitivity.json")
    >>> sens.layers["model.layers.0.mlp.down_proj"].kl[QuantSpec(bits=4, group_size=64)]
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mlxbun.errors import InputError
from mlxbun.io.atomic import atomic_write_bytes, atomic_write_json
from mlxbun.quant.plan import input_file
from mlxbun.quant.probe import Target
from mlxbun.quant.spec import ALL_BITS, QuantSpec, spec_for

SENSITIVITY_FILE = "sensitivity.json"
SCHEMA_VERSION = 1
KIND = "mlxbun.sensitivity"
METRIC = "kl(ref||cur) of float32 logits (float64 softmax), mean over tokens, then over samples"
# The method's own settings that change the numbers, kept in sensitivity.json (fisher: the last three).
METHOD_SETTINGS = ("batch_size", "refine", "refine_bits", "estimator")
# A measured KL may round a hair below zero; anything lower is not a KL.
KL_TOLERANCE = 1e-9


# ---------------------------------------------------------------- writer


def row(t: Target) -> dict[str, Any]:
    """A module's entry in "layers", without its "kl": the target but its source dtype, and its size."""
    return {k: v for k, v in asdict(t).items() if k != "dtype"} | {"params": t.in_features * t.out_features}


def document(
    *, tgts: list[Target], kls: dict[str, dict], settings: dict[str, Any], shard: dict | None
) -> dict[str, Any]:
    """The sensitivity.json document for the targets whose results are in ``kls``."""
    layers = [row(t) | {"kl": kls[t.path]} for t in tgts if t.path in kls]
    return {
        "version": SCHEMA_VERSION,
        "kind": KIND,
        "metric": METRIC,
        "method": settings["method"],
        "bits": settings["bits"],
        "group_size": settings["group_size"],
        "mode": settings["mode"],
        "model": settings["model"],
        "calibration": settings["calibration"],
        "runtime": settings["runtime"],
        **{k: settings[k] for k in METHOD_SETTINGS if k in settings},
        "all_layers": [t.path for t in tgts],
        "layers": layers,
        "shard": shard,
    }


def write_reports(doc: dict[str, Any], out_dir: Path) -> list[Path]:
    """sensitivity.json, .csv and .png in ``out_dir`` (each written atomically)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "sensitivity.json", out_dir / "sensitivity.csv", out_dir / "sensitivity.png"]
    atomic_write_json(paths[0], doc)
    atomic_write_bytes(paths[1], to_csv(doc).encode())
    atomic_write_bytes(paths[2], heatmap_png(doc))
    return paths


def to_csv(doc: dict[str, Any]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["path", "group", "in_features", "out_features", "params"] + [f"kl_{b}" for b in doc["bits"]])
    for r in doc["layers"]:
        kl = [repr(r["kl"][str(b)]) for b in doc["bits"]]
        w.writerow([r["path"], r["group"], r["in_features"], r["out_features"], r["params"], *kl])
    return buf.getvalue()


def heatmap_png(doc: dict[str, Any]) -> bytes:
    """Modules x bits heatmap of log10 KL (zeros masked), deterministic PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["layers"]
    data = np.array([[r["kl"][str(b)] for b in doc["bits"]] for r in rows], dtype=np.float64).reshape(
        len(rows), len(doc["bits"])
    )
    shown = np.ma.masked_less_equal(data, 0.0)
    fig, ax = plt.subplots(figsize=(2.5 + 0.9 * len(doc["bits"]), 1.5 + 0.16 * max(len(rows), 1)))
    im = ax.imshow(np.ma.log10(shown), aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_xticks(range(len(doc["bits"])), [f"{b}-bit" for b in doc["bits"]])
    ax.set_yticks(range(len(rows)), [r["path"] for r in rows], fontsize=6)
    ax.set_title(f"log10 KL, {doc['mode']} g{doc['group_size']}", fontsize=9)
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()


# ---------------------------------------------------------------- checks


def check_sensitivity(doc: Mapping[str, Any], *, source: str) -> None:
    """Refuse a sensitivity.json whose setting (mode, bits, group size) MLX does not have, or a
    module whose KL is not a finite number >= 0 (NaN, Inf, negative): a plan would be built on it.
    Errors name ``source`` (the key and file), the module and the value."""
    mode, group = doc.get("mode", "affine"), doc.get("group_size")
    bits = doc.get("bits") if isinstance(doc.get("bits"), list) else []
    for b in bits or [None]:
        _check_setting(mode, b, group, source=source)
    layers = doc.get("layers")
    for row in layers.values() if isinstance(layers, Mapping) else layers or ():
        if not isinstance(row, Mapping):
            continue  # the reader says what is wrong with its structure
        for b, value in dict(row.get("kl") or {}).items():
            parse_setting_key(b, group=group, mode=mode, source=source)
            if value is not None and not (
                isinstance(value, (int, float)) and math.isfinite(value) and value >= -KL_TOLERANCE
            ):
                raise InputError(
                    f"{source}: module {row.get('path')!r} has kl[{b!r}]={value!r}; a KL is a finite"
                    " number >= 0 (remeasure with command=sensitivity)"
                )


def setting_key(spec: QuantSpec, *, group: int, mode: str) -> str:
    """A setting's key in a layer's "kl": its bits when RTN at the file's ``group`` and ``mode``,
    else ``mode:bits:group`` with ``:method`` when not RTN."""
    if (spec.group_size, spec.mode, spec.method) == (group, mode, "rtn"):
        return str(spec.bits)
    tail = "" if spec.method == "rtn" else f":{spec.method}"
    return f"{spec.mode}:{spec.bits}:{spec.group_size}{tail}"


def parse_setting_key(text: Any, *, group: Any, mode: Any, source: str) -> QuantSpec:
    """The setting a "kl" key names (:func:`setting_key`), checked; errors name ``source``."""
    parts = str(text).split(":")
    if len(parts) == 1 and parts[0].isdigit():
        try:
            return spec_for(mode, int(parts[0]), group, key="sensitivity")
        except InputError as e:
            raise InputError(f"{source}: {e}") from None
    if len(parts) not in (3, 4) or not (parts[1].isdigit() and parts[2].isdigit()):
        raise InputError(
            f"{source}: kl key {text!r} is not a bit width or MODE:BITS:GROUP[:METHOD]; choose bits from"
            f" {', '.join(str(b) for b in ALL_BITS)}"
        )
    entry = {"mode": parts[0], "bits": int(parts[1]), "group_size": int(parts[2])}
    try:
        return QuantSpec.from_dict(
            entry | ({"method": parts[3]} if len(parts) == 4 else {}), key="sensitivity"
        )
    except InputError as e:
        raise InputError(f"{source}: kl key {text!r}: {e}") from None


def _check_setting(mode: Any, bits: Any, group: Any, *, source: str) -> None:
    try:
        spec_for(mode, bits, group, key="sensitivity")
    except InputError as e:
        raise InputError(f"{source}: {e}") from None


# ---------------------------------------------------------------- readers


@dataclass(frozen=True)
class LayerSensitivity:
    """Measured KL of one module at each setting it was probed with."""

    path: str
    params: int
    kl: Mapping[QuantSpec, float]


@dataclass(frozen=True)
class Sensitivity:
    """A sensitivity.json: per-module KL, and fingerprints of the model and calibration."""

    layers: Mapping[str, LayerSensitivity]
    model_fingerprint: str | None = None
    calibration_fingerprint: str | None = None
    path: Path | None = None
    calibration: Mapping[str, Any] = field(default_factory=dict)


def _setting_keys(entry: Mapping[str, Any], top: Mapping[str, Any]) -> dict[QuantSpec, float]:
    """KL per setting from a layer entry: {"kl": {"4": x}} at the file's group size and mode."""
    group, mode = top.get("group_size", 64), top.get("mode", "affine")
    out = {}
    for key, value in dict(entry.get("kl") or {}).items():
        if value is not None:
            out[parse_setting_key(key, group=group, mode=mode, source="sensitivity.json")] = float(value)
    return out


def load_sensitivity(path: str | Path, *, key: str = "allocate.sensitivity") -> Sensitivity:
    """Read a sensitivity.json (or the run directory holding one).

    Example:
        >>> sens = load_sensitivity("outputs/sensitivity/2026-12-02_10-00-00/sensitivity.json")
        >>> sens.layers["model.layers.0.mlp.down_proj"].kl[QuantSpec(bits=4, group_size=64)]
    """
    what = "a sensitivity.json or its run dir"
    p = input_file(key, path, what=what, directory=True)
    if p.is_dir():
        p = input_file(key, p / SENSITIVITY_FILE, what=what)
    try:
        data = json.loads(p.read_text())
        check_sensitivity(data, source=f"{key}={str(path)!r}")
        entries = data["layers"]
        entries = entries.values() if isinstance(entries, dict) else entries
        layers = {
            e["path"]: LayerSensitivity(e["path"], int(e.get("params", 0)), _setting_keys(e, data))
            for e in entries
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise InputError(f"{key}={str(path)!r} is not a sensitivity.json ({e!r})") from None
    if data.get("version", 1) != 1:
        raise InputError(
            f"{key}={str(path)!r} has schema version {data.get('version')!r}; this reads version 1"
        )
    if data.get("shard"):
        raise InputError(
            f"{key}={str(path)!r} is shard {data['shard'].get('index')} of {data['shard'].get('count')};"
            " combine the shards with command=sensitivity_merge first"
        )
    model, calib = data.get("model") or {}, data.get("calibration") or {}
    return Sensitivity(layers, model.get("fingerprint"), calib.get("fingerprint"), p, calib)


def read_shard(path: Path) -> dict[str, Any]:
    """A sensitivity.json as written (``sensitivity_merge``'s input): this version and kind, checked."""
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


# ---------------------------------------------------------------- merges


def merge_sensitivities(parts: Sequence[Sensitivity]) -> Sensitivity:
    """One Sensitivity from runs at other group sizes or modes of the same model and calibration.

    Their settings become extra candidates of each module; runs must agree on fingerprints.
    """
    first = parts[0]
    for other in parts[1:]:
        for what, a, b in (
            ("model", first.model_fingerprint, other.model_fingerprint),
            ("calibration", first.calibration_fingerprint, other.calibration_fingerprint),
        ):
            if a != b:
                raise InputError(
                    f"allocate.extra_sensitivity={str(other.path)!r} has another {what} fingerprint than"
                    f" allocate.sensitivity={str(first.path)!r}; measure both on the same {what}"
                )
    layers: dict[str, LayerSensitivity] = {}
    for part in parts:
        for path, layer in part.layers.items():
            kl = {**(layers[path].kl if path in layers else {}), **layer.kl}
            layers[path] = LayerSensitivity(path, layer.params, kl)
    return Sensitivity(
        layers, first.model_fingerprint, first.calibration_fingerprint, first.path, first.calibration
    )


# What every shard of one sweep must agree on.
SHARD_SAME = (
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


def combine_shards(docs: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """The merged document; raises InputError on mismatched settings, overlaps or gaps."""
    first = docs[0]
    for doc, name in zip(docs[1:], names[1:], strict=True):
        for key in SHARD_SAME:
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
