"""Load an optimized BLAS into the global symbol scope before ``mlx.core`` is imported.

MLX's Linux CPU wheel bundles the reference netlib BLAS, which is slow. A BLAS loaded with
RTLD_GLOBAL first (Debian's OpenBLAS, or MKL from PyPI) supplies the same symbols and runs much
faster. Harmless when none is found; never done on macOS (Accelerate).
"""

from __future__ import annotations

import ctypes
import glob
import os
import platform
import sys
from typing import Any

from mlxbun.errors import InputError

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)
_loaded: dict[str, Any] | None = None


def find() -> str | None:
    """The first optimized BLAS on this machine: Debian/RHEL OpenBLAS, then MKL in the prefix."""
    for path in CANDIDATES:
        if os.path.exists(path):
            return path
    mkl = sorted(glob.glob(os.path.join(sys.prefix, "lib", "libmkl_rt.so*")))
    return mkl[0] if mkl else None


def load(setting: str = "auto") -> dict[str, Any]:
    """Load the BLAS named by ``setting`` ("auto", "off" or a path); report what happened.

    Returns a dict for the manifest: {"setting", "library", "loaded", "reason"}.
    """
    global _loaded
    if _loaded is not None:
        return _loaded
    info: dict[str, Any] = {"setting": setting, "library": None, "loaded": False, "reason": ""}
    if setting == "off":
        info["reason"] = "disabled by blas=off"
    elif platform.system() != "Linux":
        info["reason"] = f"not needed on {platform.system()}"
    elif "mlx.core" in sys.modules:
        info["reason"] = "mlx.core was imported first; the bundled BLAS is in use"
    else:
        path = find() if setting == "auto" else setting
        if path is None:
            info["reason"] = "no optimized BLAS found (apt-get install libopenblas0-pthread)"
        elif setting != "auto" and not os.path.exists(path):
            raise InputError(f"blas={setting!r} does not exist; use auto, off or a path to a BLAS .so")
        else:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            info.update(library=path, loaded=True, reason="loaded before mlx.core")
    _loaded = info
    return info
