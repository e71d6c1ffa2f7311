"""File and stream hashes: one constructor per kind and the one file-hash helper.

Kinds: ``sha256`` (manifests, the HF cache's names), ``xxh3_128`` (staging records, shard
journals), ``crc32`` (shard checksums; zlib releases the GIL), ``none`` (no check).
"""

from __future__ import annotations

import hashlib
import zlib
from pathlib import Path
from typing import Any

import xxhash

HASH_CHUNK = 16 << 20


class _Crc32:
    """hashlib-like CRC-32."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: Any) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


class _NoHash:
    def update(self, data: Any) -> None:
        pass

    def hexdigest(self) -> str:
        return ""


KINDS = {"crc32": _Crc32, "sha256": hashlib.sha256, "xxh3_128": xxhash.xxh3_128, "none": _NoHash}


def new_hash(kind: str) -> Any:
    """A fresh hashlib-like object of ``kind`` (one of :data:`KINDS`)."""
    return KINDS[kind]()


def file_digest(path: Path, kind: str) -> str:
    """The ``kind`` hex digest of the file at ``path``, read in HASH_CHUNK blocks."""
    h = new_hash(kind)
    with open(path, "rb") as f:
        while block := f.read(HASH_CHUNK):
            h.update(block)
    return h.hexdigest()
