"""mlxbun: a declarative, config-driven command suite for MLX model artifacts."""

import importlib.util
import sys
from pathlib import Path
from typing import Any

__version__ = "0.1.0"
# The checkout mlxbun runs from: conf/ and recipes/ sit beside the package.
REPO_ROOT = Path(__file__).resolve().parent.parent


def _defer_mlx_lm_init() -> None:
    """Register the ``mlx_lm`` package with its ``__init__`` deferred to the first attribute asked
    of it.

    mlx-lm's ``__init__`` imports ``mlx_lm.utils`` and with it ``transformers`` (seconds of start-up),
    which the parts mlxbun imports at the top of its modules (model classes, KV caches, switch
    layers) do not need. Registered this way, ``import mlx_lm.models.cache`` loads that module
    alone, and ``from mlx_lm import load`` (any attribute) runs the ``__init__`` then, so callers
    see the usual package.
    """
    if "mlx_lm" in sys.modules or (spec := importlib.util.find_spec("mlx_lm")) is None:
        return
    pkg = importlib.util.module_from_spec(spec)

    def __getattr__(attr: str) -> Any:  # noqa: N807 - module-level __getattr__ (PEP 562)
        del pkg.__dict__["__getattr__"]
        spec.loader.exec_module(pkg)
        return getattr(pkg, attr)

    pkg.__getattr__ = __getattr__  # type: ignore[attr-defined]
    sys.modules["mlx_lm"] = pkg


_defer_mlx_lm_init()
