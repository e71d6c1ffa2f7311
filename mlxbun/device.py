"""Which device MLX computes on: its default (the GPU where there is one: Apple silicon's, or a
CUDA build's), or the CPU or GPU by ``device=cpu|gpu``."""

from __future__ import annotations

from mlxbun.errors import InputError

CHOICES = ("auto", "cpu", "gpu")
# MLX keeps freed buffers for reuse up to its memory limit by default: a streamed command's
# slices of logits and per-block weights would stay resident as cache long after use. Batch
# commands keep at most this much; serve keeps MLX's default, where reuse is its throughput.
CACHE_BYTES = 256 << 20


def select(setting: str = "auto", *, bounded_cache: bool = True) -> str:
    """Make ``setting`` MLX's default device (after :func:`mlxbun.blas.load`) and, with
    ``bounded_cache``, MLX's cache of freed buffers at most :data:`CACHE_BYTES`; returns its name."""
    import mlx.core as mx

    if setting not in CHOICES:
        raise InputError(f"device={setting!r} is not allowed; choose one of {', '.join(CHOICES)}")
    if setting == "gpu" and not mx.is_available(mx.gpu):
        raise InputError(
            "device=gpu: this MLX has no GPU (install mlx with Metal or a CUDA build); use auto or cpu"
        )
    if setting != "auto":
        mx.set_default_device(mx.cpu if setting == "cpu" else mx.gpu)
    if bounded_cache:
        mx.set_cache_limit(CACHE_BYTES)
    return name()


def name() -> str:
    """The default device, e.g. "gpu" or "cpu"."""
    import mlx.core as mx

    return "gpu" if mx.default_device() == mx.gpu else "cpu"
