"""Where a command's model comes from: a synthetic spec, a local directory, or the registry.

Every command that reads a model calls :func:`model_dir` with its config; ``model.name`` may be a
path, a registry name or an HF repo id in the local cache (resolved by ``mlxbun.registry``), and
``model.synthetic=true`` builds (once, cached) a random checkpoint shaped by the ``synth`` section.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from mlxbun.errors import InputError


def expand(path: str) -> Path:
    return Path(path).expanduser()


def model_dir(cfg: Any) -> Path:
    """The model directory named by ``cfg.model`` (and ``cfg.synth`` when synthetic)."""
    if cfg.model.synthetic:
        from mlxbun import synth

        spec = {k: v for k, v in asdict(cfg.synth).items() if k != "out"}
        return synth.ensure_synthetic(cache_dir=expand(cfg.paths.cache) / "synth", **spec)
    name = cfg.model.name
    if not name:
        raise InputError(
            "model.name is not set; pass model.name=<dir | registry name | org/repo> or model.synthetic=true"
        )
    path = expand(name)
    if path.is_dir():
        return path.resolve()
    if path.exists():
        raise InputError(f"model.name={name!r} is a file; pass the model directory that holds it")
    from mlxbun import registry

    registry.open_db(url=cfg.registry.url, path=cfg.registry.path)
    return registry.resolve(name, hub_cache=cfg.registry.hub_cache, paths=cfg.registry.paths)
