"""command=inspect: tensors, totals, metadata and quantization of a model (read-only).

Reads only safetensors headers and ``config.json`` (never tensor bytes), so it is instant even
for a 27B checkpoint::

    python -m mlxbun command=inspect inspect.path=outputs/quantize/<run>/model
    python -m mlxbun command=inspect model.name=Qwen3-0.6B inspect.tensors=false json=true

"True bits per weight" counts every stored byte (packed weights, scales, biases, norms,
embeddings) over the logical parameter count, as ``mlx_lm.utils.compute_bits_per_weight`` does.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from mlxbun import registry
from mlxbun.errors import InputError
from mlxbun.io.parameters import quant_params, quantization_block
from mlxbun.io.safetensors import ModelDir, TensorInfo, open_model
from mlxbun.progress import human_bytes, human_count
from mlxbun.runs.provenance import RunResult
from mlxbun.source.model import model_dir


def _quantized_modules(model: ModelDir, block: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """module path -> {bits, group_size, mode, source, parameters, bytes} for packed weights."""
    infos = model.infos()
    out: dict[str, dict[str, Any]] = {}
    for name, info in infos.items():
        module, _, leaf = name.rpartition(".")
        scales = infos.get(f"{module}.scales")
        if leaf != "weight" or info.dtype != "U32" or scales is None:
            continue
        try:
            qp = quant_params(
                module,
                weight_shape=info.shape,
                scales_shape=scales.shape,
                scales_dtype=scales.dtype,
                quantization=block,
            )
        except InputError:  # odd shapes: report the module, counted as its words (as the total is)
            qp = {"bits": 32, "group_size": None, "mode": "unknown", "source": "unknown"}
        parts = [info, scales] + ([infos[f"{module}.biases"]] if f"{module}.biases" in infos else [])
        params = info.size * 32 // qp["bits"]
        nbytes = sum(p.nbytes for p in parts)
        out[module] = {
            **qp,
            "parameters": params,
            "bytes": nbytes,
            "bits_per_weight": round(nbytes * 8 / params, 4) if params else None,
        }
    return out


def _quant_summary(model: ModelDir, params: int) -> dict[str, Any] | None:
    block = quantization_block(model.config)
    modules = _quantized_modules(model, block)
    if not modules and block is None:
        return None
    groups: Counter[tuple] = Counter()
    group_params: Counter[tuple] = Counter()
    for m in modules.values():
        key = (m["bits"], m["group_size"], m["mode"])
        groups[key] += 1
        group_params[key] += m["parameters"]
    qparams = sum(m["parameters"] for m in modules.values())
    qbytes = sum(m["bytes"] for m in modules.values())
    return {
        "config": block,
        "modules": modules,
        "by_bits": [
            {"bits": b, "group_size": g, "mode": mo, "modules": n, "parameters": group_params[(b, g, mo)]}
            for (b, g, mo), n in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0, kv[0][2]))
        ],
        "quantized_parameters": qparams,
        "unquantized_parameters": params - qparams,
        "quantized_bits_per_weight": round(qbytes * 8 / qparams, 4) if qparams else None,
    }


def inspect_model(path: str | Path) -> dict[str, Any]:
    """A JSON-able report of a model directory or a single ``.safetensors`` file.

    Args:
        path: model directory (sharded or not) or one safetensors file.

    Example:
        >>> r = inspect_model("outputs/quantize/run/model")
        >>> r["parameters"], r["bits_per_weight"], r["quantization"]["by_bits"]
    """
    with open_model(path) as model:
        infos = model.infos()
        params = model.total_parameters
        total = model.total_bytes
        return {
            "path": str(Path(path)),
            "files": [{"file": f.name, "bytes": f.stat().st_size} for f in model.files],
            "tensors": [_tensor_row(i) for i in infos.values()],
            "total_tensors": len(infos),
            "total_bytes": total,
            "file_bytes": sum(f.stat().st_size for f in model.files),
            "parameters": params,
            "bits_per_weight": round(total * 8 / params, 4) if params else None,
            "dtypes": dict(sorted(Counter(i.dtype for i in infos.values()).items())),
            "metadata": model.metadata,
            "model_type": model.config.get("model_type"),
            "quantization": _quant_summary(model, params),
        }


def _tensor_row(info: TensorInfo) -> dict[str, Any]:
    return {
        "name": info.name,
        "dtype": info.dtype,
        "shape": list(info.shape),
        "bytes": info.nbytes,
        "shard": info.file.name,
    }


def _tensor_table(rows: list[dict[str, Any]]) -> list[str]:
    w = max([len("name")] + [len(r["name"]) for r in rows])
    s = max([len("shape")] + [len(str(tuple(r["shape"]))) for r in rows])
    lines = [f"{'name':<{w}}  {'dtype':<7} {'shape':<{s}} {'bytes':>14}  shard"]
    for r in rows:
        lines.append(
            f"{r['name']:<{w}}  {r['dtype']:<7} {str(tuple(r['shape'])):<{s}} {r['bytes']:>14,}  {r['shard']}"
        )
    return lines


def _quant_lines(q: dict[str, Any]) -> list[str]:
    block = q["config"] or {}
    default = ", ".join(f"{k}={block[k]}" for k in ("bits", "group_size", "mode") if k in block) or "none"
    lines = [f"quantization: config default {default}; {len(q['modules'])} packed modules"]
    lines.append(f"  {'bits':>4} {'group':>5} {'mode':<7} {'modules':>7} {'parameters':>14}")
    for g in q["by_bits"]:
        lines.append(
            f"  {g['bits']:>4} {g['group_size'] or '-':>5} {g['mode']:<7} {g['modules']:>7} {g['parameters']:>14,}"
        )
    differ = [
        m
        for m, v in q["modules"].items()
        if (v["bits"], v["group_size"]) != (block.get("bits"), block.get("group_size"))
    ]
    if block and differ:
        lines.append(
            "  differ from the default: " + ", ".join(f"{m}={q['modules'][m]['bits']}b" for m in differ)
        )
    if q["quantized_bits_per_weight"] is not None:
        lines.append(
            f"  bits per weight of packed modules (with scales/biases): {q['quantized_bits_per_weight']:.3f}"
        )
    lines.append(f"  unquantized parameters: {q['unquantized_parameters']:,}")
    return lines


def format_report(report: dict[str, Any], *, tensors: bool = True) -> str:
    """The human-readable form of :func:`inspect_model`'s report."""
    lines = [f"model: {report['path']} ({len(report['files'])} file(s), {human_bytes(report['file_bytes'])})"]
    if tensors:
        lines += _tensor_table(report["tensors"]) + [""]
    bpw = report["bits_per_weight"]
    lines.append(
        f"tensors: {report['total_tensors']:,}   bytes: {report['total_bytes']:,} ({human_bytes(report['total_bytes'])})"
        f"   parameters: {report['parameters']:,} ({human_count(report['parameters'])})"
        + (f"   true bits/weight: {bpw:.3f}" if bpw is not None else "")
    )
    lines.append("dtypes: " + ", ".join(f"{k}={v}" for k, v in report["dtypes"].items()))
    meta = ", ".join(f"{k}={v}" for k, v in sorted(report["metadata"].items())) or "none"
    lines.append(
        f"metadata: {meta}" + (f"   model_type: {report['model_type']}" if report["model_type"] else "")
    )
    if report["quantization"] is not None:
        lines += _quant_lines(report["quantization"])
    return "\n".join(lines)


def _brief(report: dict[str, Any]) -> dict[str, Any]:
    """The report without per-tensor rows and per-module entries (inspect.tensors=false)."""
    out = {k: v for k, v in report.items() if k != "tensors"}
    if out["quantization"] is not None:
        out["quantization"] = {k: v for k, v in out["quantization"].items() if k != "modules"}
    return out


def _target(cfg: Any) -> Path:
    """inspect.path, else model.name (a dir, a .safetensors file or a registry name)."""
    if cfg.inspect.path:
        p = Path(cfg.inspect.path).expanduser()
        if p.exists():
            return p

        registry.open_db(url=cfg.registry.url, path=cfg.registry.path)
        return registry.resolve(
            cfg.inspect.path, hub_cache=cfg.registry.hub_cache, paths=cfg.registry.paths, key="inspect.path"
        )
    name = cfg.model.name
    if name and not cfg.model.synthetic and Path(name).expanduser().is_file():
        return Path(name).expanduser()

    return model_dir(cfg)


def run(cfg: Any) -> Any:

    path = _target(cfg)
    if path.is_file() and path.suffix != ".safetensors":
        raise InputError(f"inspect.path={str(path)!r} is not a .safetensors file or a model directory")
    report = inspect_model(path)
    if cfg.json:
        message = json.dumps(_brief(report) if not cfg.inspect.tensors else report, indent=2, sort_keys=True)
    else:
        message = format_report(report, tensors=cfg.inspect.tensors)
    metrics = {k: report[k] for k in ("total_tensors", "total_bytes", "parameters", "bits_per_weight")}
    return RunResult(inputs=[path], metrics=metrics, message=message)
