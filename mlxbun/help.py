"""command=help and ``help=true``: the commands and recipes, or one command's keys.

``python -m mlxbun`` lists the commands and the recipes; ``python -m mlxbun command=quantize
help=true`` lists the keys quantize reads with their type, value (after the recipe and the
overrides) and the comment above the key in its section (``mlxbun/config/``).
"""

from __future__ import annotations

import json
from typing import Any

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import mlxbun
from mlxbun.commands import COMMANDS, CONF_DIR
from mlxbun.config import keys
from mlxbun.runs.provenance import RunResult

RECIPES_DIR = mlxbun.REPO_ROOT / "recipes"


def available_recipes() -> list[str]:
    return sorted(str(p.relative_to(RECIPES_DIR).with_suffix("")) for p in RECIPES_DIR.rglob("*.yaml"))


def recipe_summary(name: str) -> str:
    """The recipe's first comment line (its one-line description)."""
    for line in (RECIPES_DIR / f"{name}.yaml").read_text().splitlines():
        text = line.lstrip("# ").strip()
        if line.startswith("#") and text and not text.startswith("@package"):
            return text
    return ""


def command_help(argv: list[str]) -> str:
    """The chosen command's keys: type, value after the overrides and recipe, schema comment."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        raw = OmegaConf.to_container(compose("config", overrides=_help_overrides(argv)), resolve=False)
    name = raw["command"]["name"]
    read = keys.reads(name, raw)
    docs = [d for d in keys.key_docs() if keys.is_read(d.key, read) and d.key != "command.name"]
    rows = [(d.key, d.type, _shown(_lookup(raw, d.key)), d.comment) for d in docs]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"command={name}: {COMMANDS[name].summary}", "", "keys (type, value, what it is):"]
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
    lines += [f"  {n:<{width}}  {c.summary}" for n, c in COMMANDS.items()]
    recipes = available_recipes()
    rwidth = max((len(r) for r in recipes), default=0)
    lines += ["", "recipes (+recipe=<name>):"]
    lines += [f"  {r:<{rwidth}}  {recipe_summary(r)}" for r in recipes]
    return RunResult(message="\n".join(lines))
