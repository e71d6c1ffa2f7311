"""Per-module input second moments H = sum of x x^T over calibration tokens (the GPTQ Hessian).

The output error of a linear layer on the calibration inputs is ``trace(dW H dW^T)``; its
diagonal is the per-column importance the activation-weighted range search uses. A tied
embedding, when used as the output head, gets the H of the head's inputs under its own path.

On disk::

    hessians.safetensors      one float32 (in, in) tensor per module path;
                              metadata {"format": "mlxbun-hessians", "tokens": "<n>"}

Example:
    >>> h = capture(model, calib.tokens)          # model: float32 mlx-lm model
    >>> save(h, out / "hessians.safetensors", tokens=calib.tokens.size)
    >>> output_error(w_quantized - w, h["model.layers.0.mlp.down_proj"])
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "mlxbun-hessians"


def _accumulate(store: dict, path: str, x: Any) -> None:
    import mlx.core as mx

    xf = x.reshape(-1, x.shape[-1]).astype(mx.float32)
    h = xf.T @ xf
    store[path] = h if path not in store else store[path] + h


def capture(model: Any, tokens: np.ndarray, *, batch_size: int = 8) -> dict[str, Any]:
    """H of every Linear (and a tied embedding's head use) over ``tokens`` (samples, seq_len)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten, tree_unflatten

    class Catcher(nn.Module):
        """Stands in for a Linear: records its input, then calls it."""

        def __init__(self, module: Any, path: str) -> None:
            super().__init__()
            self.module, self.path = module, path

        def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
            _accumulate(store, self.path, x)
            return self.module(x, *args, **kwargs)

    store: dict[str, Any] = {}
    leaves = tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module)
    linears = [(p, m) for p, m in leaves if isinstance(m, nn.Linear)]
    model.update_modules(tree_unflatten([(p, Catcher(m, p)) for p, m in linears]))
    embeds = [(p, m) for p, m in leaves if isinstance(m, nn.Embedding)]
    for p, m in embeds:
        m.as_linear = lambda x, p=p, m=m: (_accumulate(store, p, x), nn.Embedding.as_linear(m, x))[1]
    try:
        for i in range(0, len(tokens), batch_size):
            model(mx.array(tokens[i : i + batch_size]))
            mx.eval(list(store.values()))
    finally:
        model.update_modules(tree_unflatten(linears))
        for _, m in embeds:
            del m.as_linear
    return store


def capture_model_dir(
    model_dir: str | Path,
    out: str | Path,
    *,
    calib_path: str | Path | None = None,
    samples: int = 16,
    seq_len: int = 512,
    seed: int = 0,
) -> Path:
    """Capture the Hessians of ``model_dir`` on calibration text (:mod:`mlxbun.quant.calib`) into ``out``.

    Example:
        >>> capture_model_dir("hf/llama", "llama.hessians.safetensors")
        >>> quantize_model_dir("hf/llama", "llama-3bit", bits=3, method="gptq", hessians="llama.hessians.safetensors")
    """
    from mlxbun.quant.calib import load_calibration
    from mlxbun.quant.sensitivity import load_model

    model, tokenizer, _ = load_model(model_dir)
    calib = load_calibration(
        tokenizer=tokenizer, path=calib_path, samples=samples, seq_len=seq_len, seed=seed
    )
    save(capture(model, calib.tokens), out, tokens=calib.tokens.size)
    return Path(out)


def save(hessians: dict[str, Any], path: str | Path, *, tokens: int) -> None:
    """Write ``hessians`` atomically as one safetensors file."""
    import mlx.core as mx

    from mlxbun.io.atomic import atomic_write_bytes

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.safetensors")
    mx.save_safetensors(str(tmp), dict(sorted(hessians.items())), {"format": FORMAT, "tokens": str(tokens)})
    atomic_write_bytes(path, tmp.read_bytes())
    tmp.unlink()


def load(path: str | Path) -> dict[str, Any]:
    """Read a file written by :func:`save`; refuses anything else."""
    import mlx.core as mx

    from mlxbun.errors import InputError

    arrays, meta = mx.load(str(path), return_metadata=True)
    if meta.get("format") != FORMAT:
        raise InputError(
            f"quant.hessians={str(path)!r} is not an mlxbun hessians file (format={meta.get('format')!r})"
        )
    for name, h in arrays.items():
        if h.ndim != 2 or h.shape[0] != h.shape[1]:
            raise InputError(
                f"quant.hessians={str(path)!r}: {name!r} has shape {tuple(h.shape)}; expected (n, n)"
            )
    return arrays


def output_error(dw: Any, h: Any) -> float:
    """``trace(dW H dW^T)``: summed squared output error of a weight change on the captured inputs."""
    import mlx.core as mx

    dw = dw.astype(mx.float32)
    return float(mx.sum((dw @ h) * dw))
