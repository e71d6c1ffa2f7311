"""command=help and ``help=true``: the commands and recipes, or one command's keys.

``python -m mlxbun`` lists the commands and the recipes; ``python -m mlxbun command=quantize
help=true`` lists the keys quantize reads with their type, value (after the recipe and the
overrides) and the one-line comment from ``mlxbun/schema.py``.
"""

from __future__ import annotations

import json
from typing import Any

from mlxbun import schema
from mlxbun.cli import COMMANDS, CONF_DIR, available_recipes, recipe_summary
from mlxbun.provenance import RunResult

# The config sections each command reads (besides COMMON_KEYS), for command=<name> help=true.
COMMON_KEYS = ("seed", "verbose", "json", "blas", "help", "paths")
SECTIONS: dict[str, tuple[str, ...]] = {
    "help": (),
    "pipeline": ("pipeline",),
    "synth": ("synth", "io"),
    "inspect": ("inspect", "model", "registry"),
    "quantize": ("model", "quant", "io"),
    "sensitivity": ("model", "sensitivity"),
    "sensitivity_merge": ("sensitivity",),
    "allocate": ("model", "allocate", "quant", "io"),
    "rotate": ("model", "fold", "io"),
    "eval": ("model", "eval", "registry"),
    "kv_save": ("model", "kv"),
    "kv_generate": ("model", "kv"),
    "kv_ls": ("kv",),
    "kv_verify": ("kv",),
    "kv_gc": ("kv",),
    "registry_scan": ("registry",),
    "registry_ls": ("registry",),
    "registry_resolve": ("model", "registry"),
    "registry_fit": ("model", "registry"),
    "runs": ("runs", "registry"),
    "verify": ("runs",),
}


def command_help(argv: list[str]) -> str:
    """The chosen command's keys: type, value after the overrides and recipe, schema comment."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        raw = OmegaConf.to_container(compose("config", overrides=_help_overrides(argv)), resolve=False)
    name = raw["command"]["name"]
    sections = set(COMMON_KEYS) | set(SECTIONS.get(name, ()))
    if name == "pipeline":
        sections |= {s for step in raw["pipeline"]["steps"] for s in SECTIONS.get(step, ())}
    docs = [d for d in schema.key_docs() if d.key.split(".")[0] in sections]
    rows = [(d.key, d.type, _shown(_lookup(raw, d.key)), d.comment) for d in docs]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"command={name}: {COMMANDS[name][1]}", "", "keys (type, value, what it is):"]
    lines += [f"  {k:<{widths[0]}}  {t:<{widths[1]}}  {v:<{widths[2]}}  {c}".rstrip() for k, t, v, c in rows]
    return "\n".join(lines)


def _lookup(data: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        data = data[part]
    return data


def _shown(value: Any, width: int = 40) -> str:
    text = json.dumps(value) if isinstance(value, (list, dict, bool)) or value is None else str(value)
    return text if len(text) <= width else text[: width - 1] + "…"


def _help_overrides(argv: list[str]) -> list[str]:
    return [a for a in argv if "=" in a and not a.startswith(("-", "help=", "hydra.", "hydra/"))]


def run(cfg: Any) -> Any:
    """command=help: the commands and the recipes, one line each."""
    width = max(len(n) for n in COMMANDS)
    lines = ["usage: python -m mlxbun command=<name> [key=value ...] | +recipe=<name>"]
    lines += ["       python -m mlxbun command=<name> help=true   (that command's keys)", "", "commands:"]
    lines += [f"  {n:<{width}}  {d}" for n, (_, d) in COMMANDS.items()]
    recipes = available_recipes()
    rwidth = max((len(r) for r in recipes), default=0)
    lines += ["", "recipes (+recipe=<name>):"]
    lines += [f"  {r:<{rwidth}}  {recipe_summary(r)}" for r in recipes]
    return RunResult(message="\n".join(lines))
