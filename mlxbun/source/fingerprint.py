"""A model directory's fingerprint: sha256 of its config.json and weight files; a tokenizer's.

``model_fingerprint(d, depth=...)`` reads the weight files as deeply as its caller needs. Each
depth's digest is persisted (so each keeps the exact bytes it has always hashed)::

    depth="content"   every byte: config.json, then each ``*.safetensors`` shard's name, size and
                      full-content sha256 (a Hugging Face blob's name, or the digest remembered
                      under the file's identity: :func:`mlxbun.runs.provenance.cached_sha256`).
                      KV snapshots and eval results: a change to any byte of any tensor gives
                      another fingerprint (a sample let a model with sign-flipped unsampled
                      tensors restore another's cache).
    depth="sampled"   each ``*.safetensors`` shard's name, header and 16 chunks of 64 KiB spread
                      over its data (a small file: all of it), then config.json. sensitivity.json
                      and plan.json: a fixed read whatever the model's size, and a model's
                      sensitivity is refused for another.
    depth="header"    config.json, then each ``model*.safetensors*`` file's name, size and header
                      (the index: its bytes). quantize's record: the same in every copy of a
                      source, read without touching the tensors.

Example:
    >>> model_fingerprint("~/models/llama-3.2-1b-4bit", cache_dir="~/.cache/mlxbun/digests")[:12]
    >>> model_fingerprint("tests/fixtures/llama-text-3m", depth="sampled")[:12]
    '4b439876a902'
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from mlxbun.io.safetensors import HEADER_CAP
from mlxbun.runs.provenance import cached_sha256

DEPTHS = ("content", "sampled", "header")
SCHEME = b"mlxbun.kv.model/2\0"  # depth="content" only
HEX64 = re.compile(r"[0-9a-f]{64}")
SAMPLES, CHUNK = 16, 1 << 16  # depth="sampled": chunks per shard, bytes per chunk
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)


def model_fingerprint(
    model_dir: str | Path, *, depth: str = "content", cache_dir: str | Path | None = None
) -> str:
    """sha256 over ``model_dir``'s config.json and weight files, read to ``depth`` (see above).

    Args:
        model_dir: the model directory.
        depth: "content", "sampled" or "header".
        cache_dir: where full-content shard digests are remembered (``paths.cache``/digests;
            depth="content" only); None hashes.
    """
    d = Path(model_dir).expanduser()
    if depth == "content":
        return _content(d, None if cache_dir is None else Path(cache_dir).expanduser())
    if depth == "sampled":
        return _sampled(d)
    if depth == "header":
        return _header(d)
    raise ValueError(f"depth={depth!r} is not one of {', '.join(DEPTHS)}")


def _content(d: Path, cache: Path | None) -> str:
    h = hashlib.sha256(SCHEME)
    cfg = d / "config.json"
    if cfg.is_file():
        h.update(cfg.read_bytes())
    for shard in sorted(d.glob("*.safetensors")):
        size = shard.stat().st_size
        h.update(f"{shard.name}\0{size}\0{shard_sha256(shard, cache_dir=cache)}\0".encode())
    return h.hexdigest()


def _sampled(d: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(d.glob("*.safetensors")) + [d / "config.json"]:
        if not f.is_file():
            continue
        h.update(f.name.encode() + b"\0")
        size = f.stat().st_size
        with open(f, "rb") as fh:
            if f.suffix != ".safetensors" or size <= SAMPLES * CHUNK:
                h.update(fh.read())
                continue
            n = int.from_bytes(fh.read(8), "little")
            h.update(size.to_bytes(8, "little") + fh.read(n))
            for k in range(SAMPLES):
                fh.seek(8 + n + (size - 8 - n - CHUNK) * k // max(SAMPLES - 1, 1))
                h.update(fh.read(CHUNK))
    return h.hexdigest()


def _header(d: Path) -> str:
    h = hashlib.sha256((d / "config.json").read_bytes())
    for f in sorted(d.glob("model*.safetensors*")):
        h.update(f"\n{f.name}:{f.stat().st_size}\n".encode())
        h.update(_safetensors_header(f) if f.suffix == ".safetensors" else f.read_bytes())
    return h.hexdigest()


def _safetensors_header(path: Path) -> bytes:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return f.read(min(n, HEADER_CAP))


def shard_sha256(path: Path, *, cache_dir: Path | None) -> str:
    """Full-content sha256 of one shard: the HF blob name when ``path`` links to one of the
    right size, else the digest cached under the file's identity."""

    real = path.resolve()
    if path.is_symlink() and real.parent.name == "blobs" and HEX64.fullmatch(real.name):
        return real.name
    return cached_sha256(real, cache_dir)


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
