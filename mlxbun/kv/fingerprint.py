"""Fingerprints that tie a KV snapshot to the model and tokenizer that produced it.

A model fingerprint hashes ``config.json``, each safetensors shard's name, size and header, and
16 evenly spaced 64 KiB samples of its data: cheap for a 27B model, yet two random checkpoints of
the same shape (different seeds) differ. A tokenizer fingerprint hashes the tokenizer files.
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path
from typing import Any

SAMPLES = 16
SAMPLE_BYTES = 64 << 10
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)


def _shard(h: Any, path: Path) -> None:
    size = path.stat().st_size
    h.update(f"{path.name}\0{size}\0".encode())
    with open(path, "rb") as f:
        raw = f.read(8)
        n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else 0
        h.update(raw + f.read(min(n, size)))
        start = 8 + n
        span = max(0, size - start - SAMPLE_BYTES)
        for i in range(SAMPLES):
            f.seek(start + span * i // max(1, SAMPLES - 1))
            h.update(f.read(SAMPLE_BYTES))


def model_fingerprint(model_dir: str | Path) -> str:
    """sha256 over config.json and each shard's name, size, header and sampled data.

    Example:
        >>> model_fingerprint("~/models/llama-3.2-1b-4bit")[:12]
    """
    d = Path(model_dir).expanduser()
    h = hashlib.sha256(b"mlxbun.kv.model/1\0")
    cfg = d / "config.json"
    if cfg.is_file():
        h.update(cfg.read_bytes())
    for shard in sorted(d.glob("*.safetensors")):
        _shard(h, shard)
    return h.hexdigest()


def tokenizer_fingerprint(model_dir: str | Path) -> str:
    """sha256 over the tokenizer files present (empty string when there are none)."""
    d = Path(model_dir).expanduser()
    found = [d / n for n in TOKENIZER_FILES if (d / n).is_file()]
    if not found:
        return ""
    h = hashlib.sha256(b"mlxbun.kv.tokenizer/1\0")
    for p in found:
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()
