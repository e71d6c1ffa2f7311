"""Fingerprints that tie a KV snapshot to the model and tokenizer that produced it.

A model fingerprint is the sha256 of ``config.json`` and of each safetensors shard's name, size
and full-content sha256, so a change to any byte of any tensor gives another fingerprint (a
sample of the weights let a model with sign-flipped unsampled tensors restore another's cache).
A shard's sha256 is free when it is a Hugging Face cache blob (``blobs/<sha256>``, the name is
the hash of the content); otherwise it is computed once and remembered under the file's identity
(path, device, inode, size, mtime_ns; :func:`mlxbun.provenance.cached_sha256`). A tokenizer
fingerprint hashes the tokenizer files.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from mlxbun.provenance import cached_sha256

SCHEME = b"mlxbun.kv.model/2\0"
HEX64 = re.compile(r"[0-9a-f]{64}")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)


def shard_sha256(path: Path, *, cache_dir: Path | None) -> str:
    """Full-content sha256 of one shard: the HF blob name when ``path`` links to one of the
    right size, else the digest cached under the file's identity."""

    real = path.resolve()
    if path.is_symlink() and real.parent.name == "blobs" and HEX64.fullmatch(real.name):
        return real.name
    return cached_sha256(real, cache_dir)


def model_fingerprint(model_dir: str | Path, *, cache_dir: str | Path | None = None) -> str:
    """sha256 over config.json and each shard's name, size and full-content sha256.

    Args:
        model_dir: the model directory.
        cache_dir: where shard digests are remembered (``paths.cache``/digests); None hashes.

    Example:
        >>> model_fingerprint("~/models/llama-3.2-1b-4bit", cache_dir="~/.cache/mlxbun/digests")[:12]
    """
    d = Path(model_dir).expanduser()
    cache = Path(cache_dir).expanduser() if cache_dir is not None else None
    h = hashlib.sha256(SCHEME)
    cfg = d / "config.json"
    if cfg.is_file():
        h.update(cfg.read_bytes())
    for shard in sorted(d.glob("*.safetensors")):
        size = shard.stat().st_size
        h.update(f"{shard.name}\0{size}\0{shard_sha256(shard, cache_dir=cache)}\0".encode())
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
