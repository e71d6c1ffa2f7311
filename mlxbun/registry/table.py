"""Terminal formatting of registry answers: the model table of ``registry_ls`` and the fit report."""

from __future__ import annotations

from typing import Any

from mlxbun.progress import human_bytes, human_count
from mlxbun.registry.memory import FitReport


def _human(n: int | None) -> str:
    """A size cell: two decimals in binary units, ``?`` when the size is unknown."""
    return "?" if n is None else human_bytes(n, digits=2)


def _count(n: int | None) -> str:
    """A parameter-count cell, ``?`` when the count is unknown."""
    return human_count(n) if n else "?"


def _display_name(r: dict[str, Any]) -> str:
    """The name, with the revision when it is not the one refs/main points at."""
    if r["revision"] and "main" not in (r["refs"] or "").split(","):
        return f"{r['name']}@{r['revision'][:8]}"
    return r["name"]


def _vision_cell(r: dict[str, Any]) -> str:
    """The sidecar's size; "yes" for a vision tower without one (inside the weights); else "-"."""
    if r["vision_bytes"]:
        return _human(r["vision_bytes"])
    return "yes" if r["has_vision"] else "-"


def format_table(rows: list[dict[str, Any]]) -> str:
    """A terminal table of :func:`ls` rows: size, vision, params, type, quantization, flags."""
    head = f"{'size':>10} {'vision':>10} {'params':>8}  {'type':<16} {'quant':<10} {'flags':<5} {'license':<12} name"
    lines = [head]
    for r in rows:
        quant = f"{r['quant_bits']}b/g{r['quant_group_size']}" if r["quant_bits"] else "-"
        flags = "".join(c for c, on in (("V", r["has_vision"]), ("T", r["has_tools"]), ("K", r["has_kv_config"]),
                                         ("E", r["expert_bytes"]), ("D", r["is_drafter"]), ("!", r["warning"])) if on)  # fmt: skip
        params = _count(r["param_count"])
        lines.append(
            f"{_human(r['total_bytes']):>10} {_vision_cell(r):>10} "
            f"{params:>8}  {str(r['text_model_type'] or '-'):<16} {quant:<10} {flags or '-':<5} "
            f"{str(r['license'] or '-'):<12} {_display_name(r)}"
        )
    lines.append(
        f"{len(rows)} model(s); vision: the vision sidecar's size, yes for a tower inside the weights; "
        "flags: V vision, T tool calling, K kv_config, E experts, D drafter, ! unreadable"
    )
    return "\n".join(lines)


def format_fit(r: FitReport) -> str:
    verdict = "fits" if r.fits else "does NOT fit"
    lines = [
        f"{r.name}: {verdict} in {_human(r.budget_bytes)} at {r.context} tokens of context",
        f"  weights (active)   {_human(r.active_weight_bytes):>12}   of {_human(r.weight_bytes)} on disk",
        f"  experts (active)   {_human(r.active_expert_bytes):>12}   of {_human(r.expert_bytes)}",
        f"  vision sidecar     {_human(r.vision_bytes):>12}",
        f"  KV cache           {_human(r.kv_bytes):>12}",
        f"  total              {_human(r.total_bytes):>12}   headroom {_human(r.budget_bytes - r.total_bytes)}",
    ]
    return "\n".join(lines + [f"  note: {n}" for n in r.notes])
