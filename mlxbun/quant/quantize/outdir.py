"""A quantized model directory besides its weights: config.json, side files, and the record by
which a later run recognises the conversion and verifies its output.

In ``<out>/`` (see :mod:`mlxbun.quant.quantize.command` for the whole layout)::

    config.json               with "quantization" and "quantization_config", as mlx-lm saves it
    tokenizer files, generation_config.json, *.py   copied from the source (COPY_PATTERNS)
    .mlxbun-quantize.json     record: {"format", "settings", "source" (source_identity: no paths,
                              no mtimes), "content" (source_content), "quantization",
                              "files": {name: {"xxh3_128", "size"}}}

A later run reuses ``<out>`` only for the same format, settings and source identity (else it is
refused as another conversion's) and the same content identity (else it is converted again):
the header identity is the same in every copy of a source, the content identity changes with any
tensor byte. The content identity costs a full read of the source once; its shards' digests are
remembered per file identity (:func:`mlxbun.runs.provenance.cached_sha256`, the digests the
run's manifest takes), so an unchanged source costs a stat per shard.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlxbun.errors import InputError
from mlxbun.io.atomic import atomic_write_bytes, atomic_write_json, fsync_dir
from mlxbun.io.staging import damaged_files, digest_files, discard_dir, read_json_object
from mlxbun.quant.mlxlm import encode_tagged_floats
from mlxbun.quant.skeleton import Skeleton
from mlxbun.source.fingerprint import model_fingerprint

log = logging.getLogger("mlxbun")

MARKER = ".mlxbun-quantize.json"
FORMAT_VERSION = 2  # of the record: a change gives every output a new fingerprint
# Files mlx-lm's output carries besides weights and config (its tokenizer save + copies).
COPY_PATTERNS = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "*.tiktoken",
    "tiktoken.model",
    "generation_config.json",
    "*.py",
)


# ------------------------------------------------------------------------------- identity


def source_identity(src: Path, tensors: str | None = None) -> str:
    """Digest of what defines the source and is the same in every copy of it: config.json, and
    each weight file's name, size and safetensors header (``model_fingerprint(depth="header")``)
    — or, for a synthetic source, its spec's identity (``mlxbun.source.model.identity``)."""
    if tensors is None:
        return model_fingerprint(src, depth="header")
    h = hashlib.sha256((src / "config.json").read_bytes())
    h.update(tensors.encode())
    return h.hexdigest()


def source_content(src: Path, tensors: str | None = None, *, cache_dir: Path | None = None) -> str:
    """Digest of every byte of the source: config.json and each shard's full sha256
    (``model_fingerprint(depth="content")``, digests remembered in ``cache_dir``) — or, for a
    synthetic source, its spec's identity, which fixes every byte."""
    if tensors is not None:
        return source_identity(src, tensors)
    return model_fingerprint(src, depth="content", cache_dir=cache_dir)


def fingerprint(src: Path, settings: dict[str, Any], *, tensors: str | None = None) -> str:
    """Key of a conversion's staging dir: source identity, the weight files' inodes, mtimes and
    ctimes (a source rewritten in place, even with its mtime set back, is never resumed into),
    settings."""
    h = hashlib.sha256(source_identity(src, tensors).encode())
    for f in sorted(src.glob("model*.safetensors*")) if tensors is None else []:
        st = f.stat()
        h.update(f"{f.name}:{st.st_ino}:{st.st_mtime_ns}:{st.st_ctime_ns}\n".encode())
    h.update(json.dumps({"format": FORMAT_VERSION, **settings}, sort_keys=True).encode())
    return h.hexdigest()


# ------------------------------------------------------------------------------- record


def reusable(
    out: Path, identity: dict[str, Any], content: Callable[[], str]
) -> tuple[dict[str, Any], list[str]] | None:
    """(quantization, weight files) of ``out`` if it is this conversion's intact output of the
    same source bytes; None when there is no ``out``, or when it is ours but made from other bytes
    (``content()``: this source's :func:`source_content`) or damaged (it is then discarded, to be
    converted again). Another conversion's ``out`` is refused."""
    if not out.exists():
        return None
    record = read_json_object(out / MARKER)
    if record is None or {k: record.get(k) for k in identity} != identity:
        raise InputError(
            f"quant.out={str(out)!r} already exists and is not this conversion's output; choose"
            " another quant.out or delete it"
        )
    if record.get("content") != content():
        log.warning(
            "quantize: %s was converted from other bytes of the source (same config and headers,"
            " other tensor bytes%s); converting again",
            out, "" if record.get("content") else ", or none recorded",
        )  # fmt: skip
        discard_dir(out)
        return None
    bad = damaged_files(out, record.get("files") or {}) if record.get("files") else ["no digests recorded"]
    if bad:
        log.warning("quantize: %s is damaged (%s); converting again", out, "; ".join(bad[:3]))
        discard_dir(out)
        return None
    return record.get("quantization", {}), sorted(p.name for p in out.glob("model*.safetensors"))


def written_files(out: Path) -> list[Path]:
    """What the conversion in ``out`` wrote: the files its record lists, and the record (a file
    someone added to ``out`` later is not among them)."""
    record = read_json_object(out / MARKER) or {}
    return [out / name for name in sorted(record.get("files") or {})] + [out / MARKER]


def write_record(
    d: Path,
    identity: dict[str, Any],
    quantization: dict[str, Any] | None,
    *,
    content: str,
    known: dict[str, str],
) -> None:
    """The record that lets a later run recognise and verify this output (hidden, last file).
    ``content``: the source's :func:`source_content`; ``known``: file name -> xxh3_128 computed
    while it was written (not read again)."""
    files = digest_files(d, known=known)
    record = {**identity, "content": content, "quantization": quantization, "files": files}
    atomic_write_json(d / MARKER, record)


# ------------------------------------------------------------------------------- side files


def config_text(sk: Skeleton) -> str:
    """config.json exactly as ``mlx_lm.utils.save_config`` writes it for this model."""
    config = json.loads(json.dumps(sk.config))
    config["quantization"] = sk.quantization
    config.pop("_name_or_path", None)
    if "vision_tower" not in getattr(sk.model, "model", {}):
        config.pop("vision_config", None)
    config["quantization_config"] = config["quantization"]
    return json.dumps(encode_tagged_floats(dict(sorted(config.items()))), indent=4)


# Any one of these is a vocabulary transformers' AutoTokenizer (so mlx_lm.load) can build from.
VOCABULARY = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "tiktoken.model", "*.tiktoken")


def tokenizer_warning(src: Path) -> str | None:
    """One line when ``src`` has no tokenizer vocabulary: its output would not load in mlx_lm."""
    if any(f.is_file() for pattern in VOCABULARY for f in src.glob(pattern)):
        return None
    return (
        f"{src} has no tokenizer files ({', '.join(VOCABULARY)}; none found): the output loads in"
        " mlx_lm only once the model's tokenizer files (one of those, with tokenizer_config.json)"
        " are copied into it"
    )


def copy_side_files(src: Path, dst: Path) -> list[str]:
    """Copy tokenizer, generation config and code files; each fsync'd."""
    copied = []
    for pattern in COPY_PATTERNS:
        for f in sorted(src.glob(pattern)):
            if f.is_file() and not (dst / f.name).exists():
                atomic_write_bytes(dst / f.name, f.read_bytes())
                copied.append(f.name)
    return copied


def write_side_files(sk: Skeleton, src: Path, d: Path) -> None:
    """config.json and the copied side files, fsync'd with their directory."""
    atomic_write_bytes(d / "config.json", config_text(sk).encode())
    copy_side_files(src, d)
    fsync_dir(d)
