"""The config's keys: which ones a command reads, the refusal of unknown or unread keys, and the
per-key help (type, default, and the comment above the field).
"""

from __future__ import annotations

import ast
import difflib
import functools
import sys
from dataclasses import MISSING, dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any, get_type_hints

from mlxbun.commands import COMMANDS
from mlxbun.config.schema import Config
from mlxbun.errors import InputError

# Keys every command reads: where runs go and are recorded, where models are found.
COMMON_KEYS = (
    "command", "seed", "verbose", "json", "blas", "device", "help", "paths",
    "registry.url", "registry.path", "registry.hub_cache", "registry.paths",
)  # fmt: skip


def reads(command: str, data: dict[str, Any]) -> tuple[str, ...]:
    """The keys and sections ``command`` reads with the composed config ``data`` (a pipeline:
    its steps')."""
    found = list(COMMON_KEYS) + list(_reads(command))
    if command == "pipeline":
        for step in (data.get("pipeline") or {}).get("steps") or ():
            found += _reads(step)
    return tuple(found)


def _reads(command: str) -> tuple[str, ...]:
    return COMMANDS[command].reads if command in COMMANDS else ()


def is_read(key: str, read: tuple[str, ...]) -> bool:
    """Whether dotted ``key`` is one of ``read`` or inside a section of it."""
    return any(key == r or key.startswith(r + ".") for r in read)


def check_unread(data: dict[str, Any], defaults: dict[str, Any], *, given: list[str]) -> None:
    """Refuse a key given on the command line (``given``: Hydra's overrides), set away from its
    default, that the chosen command does not read: it would be silently ignored
    (``command=allocate quant.method=gptq``). Recipes are held to the same rule by a test."""
    command = str((data.get("command") or {}).get("name"))
    if command not in COMMANDS:
        return
    read, keys = reads(command, data), [override_key(o) for o in given]
    for key, value, default in _leaves(data, defaults):
        if value != default and not is_read(key, read) and is_read(key, tuple(keys)):
            raise InputError(
                f"{key}={value!r} is not read by command={command}, so it would be ignored; drop it"
                f" (`python -m mlxbun command={command} help=true` lists the keys it reads)"
            )


def override_key(override: str) -> str:
    """The dotted key of a Hydra override: ``+quant.bits=4`` -> ``quant.bits``."""
    return override.partition("=")[0].lstrip("+~")


def _leaves(data: dict[str, Any], defaults: dict[str, Any], prefix: str = "") -> list[tuple[str, Any, Any]]:
    out = []
    for key, value in data.items():
        default = defaults.get(key) if isinstance(defaults, dict) else None
        if isinstance(value, dict) and isinstance(default, dict):
            out += _leaves(value, default, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", value, default))
    return out


def check_keys(data: dict[str, Any], cls: type = None, prefix: str = "") -> None:
    """Raise an InputError naming the first key of ``data`` that ``cls`` (default Config) lacks.

    Hydra lets ``+key=value`` add keys to a structured config; they would be silently ignored.
    """
    known = _sections(cls or Config)
    for key, value in data.items():
        if key not in known:
            raise InputError(unknown_key_message(f"{prefix}{key}"))
        sub = known[key]
        if sub is not None and isinstance(value, dict):
            check_keys(value, sub, f"{prefix}{key}.")


def _sections(cls: type) -> dict[str, type | None]:
    """Each field of ``cls`` -> its dataclass type when it is a section, else None."""
    hints = get_type_hints(cls)
    return {
        f.name: hints[f.name] if isinstance(hints[f.name], type) and is_dataclass(hints[f.name]) else None
        for f in fields(cls)
    }


def all_keys(cls: type = None, prefix: str = "") -> list[str]:
    """Every leaf key of ``cls`` (default Config) as a dotted path, e.g. "quant.bits"."""
    keys = []
    for name, sub in _sections(cls or Config).items():
        keys += all_keys(sub, f"{prefix}{name}.") if sub else [f"{prefix}{name}"]
    return keys


def unknown_key_message(dotted: str) -> str:
    """One line for an unknown key: its full path and the closest known keys."""
    keys = all_keys()
    section, _, leaf = dotted.rpartition(".")
    near = difflib.get_close_matches(dotted, keys, n=1, cutoff=0.6)
    if not near and section:  # a wrong leaf in a right section
        siblings = [k for k in keys if k.rpartition(".")[0] == section]
        near = [k for k in siblings if k.rpartition(".")[2].startswith(leaf)][:1]
        near = near or difflib.get_close_matches(dotted, siblings, n=1, cutoff=0.5)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    return (
        f"unknown config key {dotted!r}{hint} (`python -m mlxbun command=<name> help=true` lists a"
        " command's keys)"
    )


@dataclass(frozen=True)
class KeyDoc:
    """One config key for per-command help: dotted path, type, default, one-line comment."""

    key: str
    type: str
    default: Any
    comment: str


def key_docs(cls: type = None, prefix: str = "") -> list[KeyDoc]:
    """Every leaf key of ``cls`` (default Config) with its type, default and schema comment."""
    cls = cls or Config
    comments = _field_comments(sys.modules[cls.__module__].__file__).get(cls.__name__, {})
    sections = _sections(cls)
    docs = []
    for f in fields(cls):
        sub = sections[f.name]
        if sub is not None:
            docs += key_docs(sub, f"{prefix}{f.name}.")
            continue
        default = f.default_factory() if f.default is MISSING else f.default
        docs.append(KeyDoc(f"{prefix}{f.name}", str(f.type), default, comments.get(f.name, "")))
    return docs


@functools.cache
def _field_comments(module_file: str) -> dict[str, dict[str, str]]:
    """Class name -> field -> the comment lines right above the field, joined into one line, for
    the classes of the module in ``module_file``."""
    source = Path(module_file).read_text()
    lines = source.splitlines()
    found: dict[str, dict[str, str]] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                above, i = [], stmt.lineno - 2
                while i >= 0 and lines[i].strip().startswith("#"):
                    above.insert(0, lines[i].strip().lstrip("#").strip())
                    i -= 1
                found.setdefault(node.name, {})[stmt.target.id] = " ".join(above)
    return found
