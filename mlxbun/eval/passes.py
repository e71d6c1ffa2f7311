"""Forward passes over eval's windows, handed on in slices of scored tokens, on MLX's default device.

A batch of windows runs once; its logits ``[batch, seq_len - 1, vocab]`` (float32: models run
dequantized in float32) go on as ``[rows, vocab]`` slices of at most ``SLICE_BYTES`` with their
next tokens, so the per-token math never holds every token's vocabulary at once (150K-262K wide).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from mlxbun.progress import Progress

SLICE_BYTES = 64 << 20  # one float32 [rows, vocab] slice; its math holds a few such temporaries


def slice_rows(vocab: int) -> int:
    return max(1, SLICE_BYTES // (4 * vocab))


def slices(model: Any, tokens: np.ndarray, *, batch_size: int, desc: str) -> Iterator[tuple[int, Any, Any]]:
    """Yield (first row, float32 logits ``[rows, vocab]``, next tokens ``[rows]``) over every window,
    rows numbered window by window; progress (rate and ETA) on stderr."""
    import mlx.core as mx

    prog = Progress(total=tokens.shape[0] * (tokens.shape[1] - 1), unit="tok", desc=desc, heartbeat=True)
    at = 0
    try:
        for i in range(0, len(tokens), batch_size):
            batch = mx.array(tokens[i : i + batch_size])
            logits = model(batch)[:, :-1].astype(mx.float32)
            vocab = logits.shape[-1]
            flat, targets = logits.reshape(-1, vocab), batch[:, 1:].reshape(-1)
            mx.eval(flat)
            step = slice_rows(vocab)
            for r in range(0, flat.shape[0], step):
                yield at + r, flat[r : r + step], targets[r : r + step]
            at += flat.shape[0]
            prog.update(flat.shape[0])
    finally:
        prog.close()
