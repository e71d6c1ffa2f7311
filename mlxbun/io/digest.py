"""File and stream hashes: one constructor per kind, the one file-hash helper, and job keys.

Kinds: ``sha256`` (manifests, the HF cache's names), ``xxh3_128`` (staging records, shard
journals), ``crc32`` (shard checksums; zlib releases the GIL), ``none`` (no check).
A job key (:func:`job_key`) names a cached or resumable piece of work by everything it depends on.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from pathlib import Path
from typing import Any

import xxhash

HASH_CHUNK = 16 << 20
JOB_KEY_CHARS = 20  # hex digits of a job key: 80 bits, a cache entry's or staging dir's name


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


def job_key(kind: str, version: int, *parts: Any) -> str:
    """The key of a ``kind`` job (``calibrate``, ``sensitivity``, ``tune`` ...) whose producer is at
    ``version``, from everything its result depends on (``parts``, JSON-able): the sha256 of them as
    canonical JSON, its first :data:`JOB_KEY_CHARS` hex digits. A change of any part, of the kind or
    of the version gives another key, so a cache is reused only for the same inputs.

    Example:
        >>> job_key("calibrate", 1, {"model": "ab12", "calibration": {"samples": 8}})
        'bfd63aa68956854bea70'
    """
    doc = json.dumps([kind, version, *parts], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(doc.encode()).hexdigest()[:JOB_KEY_CHARS]
