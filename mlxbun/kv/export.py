"""command=kv_export: write a stored snapshot (any layout or format version) as a plain mlx-lm
prompt-cache file, written by mlx-lm's own ``save_prompt_cache``.

    python -m mlxbun command=kv_export kv.name=system kv.file=system.safetensors
    python -m mlx_lm generate --prompt-cache-file system.safetensors --prompt "..."

The snapshot is restored verified first (a corrupt one exits 1 and writes nothing); the file is
written to a hidden temporary sibling, fsync'd and renamed. Its metadata holds what
``cache_prompt`` writes: ``model`` and ``tokenizer_config``. ``mlx_lm generate`` loads ``model``
when given no ``--model``, and refuses a ``--model`` spelt otherwise, so ``model`` is
``model.name`` as given (checked to be the snapshot's model), else the snapshot's repo id, else
the directory the store recorded for its fingerprint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mlx_lm.models.cache import save_prompt_cache

from mlxbun.errors import InputError
from mlxbun.io.atomic import atomic_save
from mlxbun.kv.commands import digest_cache, model_reference, store_of
from mlxbun.kv.store import check_snapshot_name
from mlxbun.runs.provenance import RunResult
from mlxbun.source.fingerprint import model_fingerprint
from mlxbun.source.model import model_dir


def export(store: Any, name: str, path: Path, *, model_ref: str | None = None) -> dict[str, Any]:
    """Write snapshot ``name`` of ``store`` to ``path`` atomically; returns what was written.
    ``model_ref``: the ``model`` key (default: the snapshot's repo id or recorded directory)."""
    restored = store.load(name, model=None, verify=True)
    _, header = store.header(name)
    ref = model_ref or header.get("model_name") or store.model_of(header["model"]) or ""
    meta = {"model": ref, "tokenizer_config": header.get("tokenizer_config", "{}")}
    atomic_save(path, lambda name: save_prompt_cache(name, restored.cache, meta))
    chat = header.get("chat_template") if isinstance(header.get("chat_template"), bool) else None
    return {"tokens": len(restored.tokens), "model": ref, "bytes": path.stat().st_size, "chat_template": chat}


def model_ref(cfg: Any, fingerprint: str) -> str | None:
    """``model.name`` as the user spelt it (what ``mlx_lm generate --model`` must equal), or the
    directory of ``model.synthetic``; None when neither is given. InputError when it is another
    model than the snapshot's."""
    if not (cfg.model.name or cfg.model.synthetic):
        return None
    path = model_dir(cfg)
    have = model_fingerprint(path, cache_dir=digest_cache(cfg))
    if have != fingerprint:
        raise InputError(
            f"model.name={cfg.model.name or str(path)!r} is another model than snapshot {cfg.kv.name!r} was saved for "
            f"(fingerprint {have[:12]}, the snapshot's {fingerprint[:12]}); pass its model or leave model.name unset"
        )
    given = cfg.model.name if cfg.model.name and Path(cfg.model.name).expanduser().is_dir() else None
    return given or model_reference(path) or str(path)


def how_to_continue(path: Path, done: dict[str, Any]) -> str:
    """The ``mlx_lm generate`` line that continues the exported file ``path``."""
    if not done["model"]:
        return "; no model reference stored: pass model.name=<model> to kv_export"
    flag = " --ignore-chat-template" if done["chat_template"] is False else ""
    return (
        f"; continue it with: python -m mlx_lm generate --prompt-cache-file {path} --prompt '...'{flag}"
        f" (it names the model {done['model']!r}; a --model must be spelt exactly so)"
    )


MODEL_FILES = ("config.json", "model.safetensors.index.json")  # a directory holding one is a model's


def check_target(path: Path, *, store_root: Path, overwrite: bool) -> None:
    """Refuse a ``kv.file`` that would destroy something: a file inside the KV store or a model
    directory (never, even with ``kv.overwrite``), or any existing file unless ``overwrite``."""
    where = path.resolve()
    if where.is_relative_to(store_root.resolve()):
        raise InputError(
            f"kv.file={str(path)!r} is inside the KV store {str(store_root)!r}; write outside it"
        )
    model_dir = next((d for d in where.parents if any((d / f).is_file() for f in MODEL_FILES)), None)
    if model_dir is not None:
        raise InputError(
            f"kv.file={str(path)!r} is inside the model directory {str(model_dir)!r}; write outside it"
        )
    if (path.exists() or path.is_symlink()) and not overwrite:
        raise InputError(
            f"kv.file={str(path)!r} exists; choose a new file, or pass kv.overwrite=true to replace it"
        )
    if path.exists() and not path.is_file():
        raise InputError(f"kv.file={str(path)!r} exists and is not a regular file")


def run(cfg: Any) -> Any:
    """command=kv_export: kv.name -> kv.file (a plain mlx-lm prompt-cache file)."""

    if not cfg.kv.name:
        raise InputError("kv.name is not set; pass kv.name=<snapshot name>")
    check_snapshot_name(cfg.kv.name)
    if not cfg.kv.file:
        raise InputError("kv.file is not set; pass kv.file=<output .safetensors file>")
    path = Path(cfg.kv.file).expanduser()
    if path.suffix != ".safetensors":
        raise InputError(f"kv.file={cfg.kv.file!r} must end in .safetensors (mlx-lm loads no other name)")
    if not path.parent.is_dir():
        raise InputError(f"kv.file={cfg.kv.file!r}: directory {str(path.parent)!r} does not exist")
    store = store_of(cfg)
    check_target(path, store_root=store.root, overwrite=cfg.kv.overwrite)
    ref = model_ref(cfg, store.header(cfg.kv.name)[1]["model"])
    done = export(store, cfg.kv.name, path, model_ref=ref)
    msg = f"exported {cfg.kv.name!r} ({done['tokens']} tokens) to {path}{how_to_continue(path, done)}"
    if cfg.json:
        msg = json.dumps(done | {"name": cfg.kv.name, "file": str(path)}, indent=2, sort_keys=True)
    return RunResult(outputs=[path], metrics=done, message=msg)
