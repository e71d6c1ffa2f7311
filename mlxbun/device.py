"""Which device MLX computes on: its default (the GPU where there is one: Apple silicon's, or a
CUDA build's), or the CPU or GPU by ``device=cpu|gpu``."""

from __future__ import annotations

from mlxbun.errors import InputError

CHOICES = ("auto", "cpu", "gpu")


def select(setting: str = "auto") -> str:
    """Make ``setting`` MLX's default device (after :func:`mlxbun.blas.load`); returns its name."""
    import mlx.core as mx

    if setting not in CHOICES:
        raise InputError(f"device={setting!r} is not allowed; choose one of {', '.join(CHOICES)}")
    if setting == "gpu" and not mx.is_available(mx.gpu):
        raise InputError(
            "device=gpu: this MLX has no GPU (install mlx with Metal or a CUDA build); use auto or cpu"
        )
    if setting != "auto":
        mx.set_default_device(mx.cpu if setting == "cpu" else mx.gpu)
    return name()


def name() -> str:
    """The default device, e.g. "gpu" or "cpu"."""
    import mlx.core as mx

    return "gpu" if mx.default_device() == mx.gpu else "cpu"
