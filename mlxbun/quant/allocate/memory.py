"""What allocate.interactions holds in memory: a batch size that bounds its logits, and whether it fits.

Interactions hold the float32 model twice (original and fake-quantized weights) and one batch's
float64 logits, probabilities and their product (24 bytes per token and vocabulary entry).

Example:
    >>> interactions_batch(batch_size=8, seq_len=512, vocab=151936)
    1
"""

from __future__ import annotations

from mlxbun.host import available_memory
from mlxbun.progress import human_bytes

MEMORY_SHARE = 0.8  # what interactions may take of the available memory
LOGITS_BYTES = 1 << 30  # a batch's float64 logits and probabilities: at most this (>= 1 sample)


def interactions_batch(*, batch_size: int, seq_len: int, vocab: int) -> int:
    """Samples per forward: ``batch_size``, fewer when a batch's float64 logits, probabilities
    and their product would pass ``LOGITS_BYTES`` (large vocabularies)."""
    per_sample = 24 * seq_len * max(vocab, 1)
    return max(1, min(batch_size, LOGITS_BYTES // per_sample))


def interactions_skip_memory(*, parameters: int, batch: int, seq_len: int, vocab: int) -> str | None:
    """Why interactions would not fit in memory (None: they fit): the float32 model twice and one
    batch's float64 logits, probabilities and their product against ``MEMORY_SHARE`` of what is
    available."""
    logits = 24 * batch * seq_len * vocab
    need = 8 * parameters + logits
    avail = available_memory()
    if avail is None or need <= MEMORY_SHARE * avail:
        return None
    return (
        f"they need about {human_bytes(need)} and {human_bytes(avail)} is available;"
        " the plan minimises the summed KL alone (allocate.interactions=0 says so without this warning)"
    )
