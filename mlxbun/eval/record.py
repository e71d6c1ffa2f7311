"""The reference's top-K record: what every candidate is scored against, made on the device, cached.

Per scored token (a row), float32 in the reference's own logit frame (logits as its forward gave
them, so a candidate's logit shifts are differences of logits, never of log-probs near -log V)::

    idx     [rows, K] int32    the K most likely token ids, ascending
    logit   [rows, K] float32  their logits
    lse     [rows]    float32  logsumexp of all V logits (a log-prob is logit - lse)
    tail    [rows]    float32  logsumexp of the other V - K logits (-inf when K = V)
    target  [rows]    float32  the logit of the text's next token
    top     [rows]    int32    argmax, the first of ties (for "same top p")

Disk::

    <paths.cache>/eval/<sha256(key)[:20]>/
        reference.npz      the arrays above + "key": the JSON of KEY, checked on every read
        meta.json          the key and the text's record, for people

KEY: the record's format version, the reference's content fingerprint (every byte of config.json
and the shards), its tokenizer's, the sha256 of the exact window token ids, their shape and K. A
file whose stored key or shapes differ, or that does not read, is computed again (with a warning).
"""

from __future__ import annotations

import io
import json
import logging
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from mlxbun.errors import NumericFailure
from mlxbun.eval.inputs import text_json
from mlxbun.eval.passes import slices
from mlxbun.io.atomic import atomic_write_bytes, atomic_write_json
from mlxbun.io.digest import job_key
from mlxbun.quant.calibration import Windows
from mlxbun.source.fingerprint import model_fingerprint, tokenizer_fingerprint

VERSION = 2  # 1: float64 log-probs, the key outside the file
FIELDS = ("idx", "logit", "lse", "tail", "target", "top")

log = logging.getLogger("mlxbun")


def tail_lse(z: Any, idx: Any) -> Any:
    """logsumexp of each row of ``z`` outside the columns ``idx`` (its own max subtracted: no cancellation)."""
    import mlx.core as mx

    return mx.logsumexp(mx.put_along_axis(z, idx, mx.array(-np.inf, dtype=mx.float32), axis=-1), axis=-1)


def make(logits: Any, targets: Any, *, k: int) -> dict[str, Any]:
    """The record (module docstring) of float32 ``logits [rows, vocab]`` and next tokens ``targets``."""
    import mlx.core as mx

    z = logits.astype(mx.float32)
    rows, vocab = z.shape
    top = z.max(axis=-1, keepdims=True)
    e = mx.exp(z - top)  # one exponential pass serves both sums (CPU backends pay per pass)
    lse = top[:, 0] + mx.log(e.sum(axis=-1))
    if k >= vocab:
        idx = mx.broadcast_to(mx.arange(vocab, dtype=mx.int32), (rows, vocab))
        tail = mx.full((rows,), -np.inf, dtype=mx.float32)
    else:
        idx = mx.sort(mx.argpartition(z, kth=vocab - k, axis=-1)[:, vocab - k :].astype(mx.int32), axis=-1)
        rest = mx.put_along_axis(e, idx, mx.array(0.0, dtype=mx.float32), axis=-1).sum(axis=-1)
        tail = top[:, 0] + mx.log(rest)  # -inf when the rest underflows: no mass outside the record
    return {
        "idx": idx,
        "logit": mx.take_along_axis(z, idx, axis=-1),
        "lse": lse,
        "tail": tail,
        "target": mx.take_along_axis(z, targets[:, None].astype(mx.int32), axis=-1)[:, 0],
        "top": mx.argmax(z, axis=-1).astype(mx.int32),
    }


def on_device(rec: dict[str, np.ndarray], start: int, stop: int) -> dict[str, Any]:
    """Rows ``[start, stop)`` of a host record as MLX arrays on the default device."""
    import mlx.core as mx

    return {k: mx.array(rec[k][start:stop]) for k in FIELDS}


def key_of(ref_dir: Path, text: Windows, *, k: int, digests: Path) -> dict[str, Any]:
    return {
        "version": VERSION,
        "model": model_fingerprint(ref_dir, cache_dir=digests),
        "tokenizer": tokenizer_fingerprint(ref_dir),
        "tokens": text.fingerprint,
        "windows": list(text.tokens.shape),
        "top_k": k,
    }


def _key_bytes(key: dict[str, Any]) -> bytes:
    return json.dumps(key, sort_keys=True).encode()


def load(path: Path, key: dict[str, Any]) -> dict[str, np.ndarray] | None:
    """The record at ``path`` if it was made for ``key`` and has its shapes; else None (warned)."""
    if not path.is_file():
        return None
    try:
        with np.load(path) as z:
            rec = {f: z[f] for f in (*FIELDS, "key")}
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
        log.warning("eval: the cached reference %s is unreadable (%s); computing it again", path, e)
        return None
    n, length = key["windows"]
    rows, width = n * (length - 1), key["top_k"]
    shapes = {"idx": (rows, width), "logit": (rows, width)} | {
        f: (rows,) for f in ("lse", "tail", "target", "top")
    }
    if rec.pop("key").tobytes() != _key_bytes(key):
        log.warning("eval: the cached reference %s was made for other inputs; computing it again", path)
        return None
    if any(rec[f].shape != s for f, s in shapes.items()):
        log.warning("eval: the cached reference %s has the wrong shape; computing it again", path)
        return None
    return rec


def compute(model: Any, text: Windows, *, k: int, batch_size: int, ref_dir: Path) -> dict[str, np.ndarray]:
    """The record of every scored token, from one forward pass of ``model``; non-finite logits stop it."""
    import mlx.core as mx

    parts = []
    for at, logits, targets in slices(model, text.tokens, batch_size=batch_size, desc="eval reference"):
        part = make(logits, targets, k=k)
        mx.eval(part)
        part = {f: np.array(v) for f, v in part.items()}
        # a NaN or +Inf logit reaches lse; -Inf on a kept or next token leaves it non-finite there
        ok = np.isfinite(part["lse"]) & np.isfinite(part["target"]) & np.isfinite(part["logit"]).all(axis=-1)
        if not ok.all():
            raise NumericFailure(
                f"model.name={str(ref_dir)!r}: the reference's logits are not finite (NaN or Inf) at scored"
                f" token {at + int(np.argmin(ok))}; nothing was cached or written"
            )
        parts.append(part)
    return {f: np.concatenate([p[f] for p in parts]) for f in FIELDS}


def reference(
    ref_dir: Path, text: Windows, *, k: int, cache: Path, batch_size: int, loader: Any
) -> tuple[dict[str, np.ndarray], bool]:
    """The reference's record over every scored token, from ``cache`` or one forward pass
    (``loader(dir)`` -> model). Returns (record, hit): a hit did no reference forward."""
    key = key_of(ref_dir, text, k=k, digests=cache / "digests")
    d = cache / "eval" / job_key("eval", VERSION, key)
    path = d / "reference.npz"
    rec = load(path, key)
    if rec is not None:
        return rec, True
    rec = compute(loader(ref_dir), text, k=k, batch_size=batch_size, ref_dir=ref_dir)
    buf = io.BytesIO()
    np.savez(buf, **rec, key=np.frombuffer(_key_bytes(key), dtype=np.uint8))
    d.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, buf.getvalue())
    atomic_write_json(d / "meta.json", key | {"text": text_json(text)})
    return rec, False
