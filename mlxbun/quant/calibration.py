"""Calibration tokens for sensitivity: N samples x L tokens, chosen deterministically by seed.

Sources:
- the built-in set ``mlxbun/data/calibration.txt`` (prose, code, dialogue, math; about twenty
  languages), written for this project;
- a user text file: documents start at lines ``### <kind> [<lang>]`` (the built-in format); a file
  without such lines is one document;
- a user JSONL file: one record a line, ``{"text": ...}``, ``{"messages": [{"role", "content"}]}``
  or ``{"prompt": ..., "completion": ...}``.

Dialogue (``### dialogue`` documents with ``user:``/``assistant:`` lines, JSONL ``messages`` and
prompt/completion records) is rendered with the tokenizer's chat template when it has one, else
as plain ``role: text`` lines. The seed shuffles the documents, which are joined (EOS between
them) into one token stream; N windows of L tokens are then drawn from it, disjoint when the
stream is long enough.

Example:
    >>> calib = load_calibration(tokenizer=tok, samples=8, seq_len=256, seed=0)
    >>> calib.tokens.shape, calib.fingerprint[:12]
    ((8, 256), '3f1c...')
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mlxbun.errors import InputError

BUILTIN = Path(__file__).resolve().parent.parent / "data" / "calibration.txt"
_HEADER = re.compile(r"^### (\w+)(?: (\S+))?\s*$")
_TURN = re.compile(r"^(user|assistant|system): ?(.*)$")


@dataclass(frozen=True)
class Document:
    kind: str  # prose, code, math, dialogue, text
    text: str = ""
    messages: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class WindowKeys:
    """The config keys that set a caller's windows, named when they do not fit the text."""

    samples: str = "sensitivity.calib.samples"
    seq_len: str = "sensitivity.calib.seq_len"
    path: str = "sensitivity.calib.path"


CALIB_KEYS = WindowKeys()


@dataclass(frozen=True)
class Windows:
    """Token windows drawn from a text and where they came from: the calibration samples, and
    eval's held-out windows. ``fingerprint`` is the sha256 of the tokens; ``to_dict`` is the
    calibration record (sensitivity.json's ``"calibration"``)."""

    tokens: np.ndarray  # (samples, seq_len) int32
    fingerprint: str
    source: str
    seed: int
    stream_tokens: int

    def to_dict(self) -> dict[str, Any]:
        n, length = self.tokens.shape
        return {
            "fingerprint": self.fingerprint,
            "source": self.source,
            "samples": int(n),
            "seq_len": int(length),
            "seed": self.seed,
            "stream_tokens": self.stream_tokens,
        }


def parse_text(text: str) -> list[Document]:
    """Split ``### kind [lang]`` sections into documents; dialogue sections become messages."""
    docs: list[Document] = []
    kind, lines = None, []
    for line in text.splitlines() + ["### end"]:
        m = _HEADER.match(line)
        if not m:
            lines.append(line)
            continue
        if kind is not None or "\n".join(lines).strip():
            docs.append(_document(kind or "text", lines))
        kind, lines = m.group(1), []
    return [d for d in docs if d.text.strip() or d.messages]


def _document(kind: str, lines: list[str]) -> Document:
    if kind != "dialogue":
        return Document(kind=kind, text="\n".join(lines).strip("\n") + "\n")
    turns: list[list[str]] = []
    for line in lines:
        m = _TURN.match(line)
        if m:
            turns.append([m.group(1), m.group(2)])
        elif turns:
            turns[-1][1] += "\n" + line
    return Document(kind=kind, messages=tuple((r, t.strip()) for r, t in turns))


def parse_jsonl(text: str, *, name: str) -> list[Document]:
    docs = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"sensitivity.calib.path={name!r}: line {i} is not JSON ({e.msg})") from None
        docs.append(_record(rec, name=name, line=i))
    return docs


def _record(rec: Any, *, name: str, line: int) -> Document:
    if isinstance(rec, dict) and isinstance(rec.get("text"), str):
        return Document(kind="text", text=rec["text"])
    if isinstance(rec, dict) and isinstance(rec.get("messages"), list):
        msgs = tuple((str(m["role"]), str(m["content"])) for m in rec["messages"])
        return Document(kind="dialogue", messages=msgs)
    if isinstance(rec, dict) and "prompt" in rec and "completion" in rec:
        msgs = (("user", str(rec["prompt"])), ("assistant", str(rec["completion"])))
        return Document(kind="dialogue", messages=msgs)
    raise InputError(
        f"sensitivity.calib.path={name!r}: line {line} has no 'text', 'messages' or 'prompt'/'completion'"
    )


def read_documents(path: str | Path | None) -> tuple[list[Document], str]:
    """Documents of ``path`` (None: the built-in set) and a name for the source."""
    if path is None:
        return parse_text(BUILTIN.read_text(encoding="utf-8")), "builtin:calibration.txt"
    p = Path(path).expanduser()
    if not p.is_file():
        raise InputError(f"sensitivity.calib.path={str(path)!r} is not a file; pass a .txt or .jsonl file")
    text = p.read_text(encoding="utf-8")
    docs = parse_jsonl(text, name=str(path)) if p.suffix in (".jsonl", ".json") else parse_text(text)
    if not docs:
        raise InputError(f"sensitivity.calib.path={str(path)!r} holds no text")
    return docs, str(p.resolve())


def render(doc: Document, tokenizer: Any) -> tuple[list[int], bool]:
    """Token ids of one document; the flag says whether the chat template was used."""
    if not doc.messages:
        return _encode(tokenizer, doc.text), False
    if getattr(tokenizer, "chat_template", None):
        msgs = [{"role": r, "content": t} for r, t in doc.messages]
        text = tokenizer.apply_chat_template(msgs, tokenize=False)
        return _encode(tokenizer, text), True
    return _encode(tokenizer, "\n".join(f"{r}: {t}" for r, t in doc.messages) + "\n"), False


def _encode(tokenizer: Any, text: str) -> list[int]:
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))
    except TypeError:
        return list(tokenizer.encode(text))


def token_stream(docs: list[Document], tokenizer: Any, *, seed: int) -> tuple[np.ndarray, int]:
    """The seed-shuffled documents as one int32 stream (EOS between documents)."""
    order = np.random.default_rng(seed).permutation(len(docs))
    eos = getattr(tokenizer, "eos_token_id", None)
    parts, templated = [], 0
    for i in order:
        ids, used = render(docs[int(i)], tokenizer)
        templated += used
        parts.append(ids + ([int(eos)] if eos is not None else []))
    return np.fromiter((t for p in parts for t in p), dtype=np.int32), templated


def choose_windows(
    n_tokens: int,
    *,
    samples: int,
    seq_len: int,
    seed: int,
    keys: WindowKeys = CALIB_KEYS,
    text: str = "the calibration text",
) -> np.ndarray:
    """Start offsets of ``samples`` windows: disjoint when the stream allows, else overlapping.
    ``keys`` and ``text`` name the caller's settings and text when they do not fit."""
    if n_tokens < seq_len:
        raise InputError(
            f"{keys.seq_len}={seq_len} is longer than {text} ({n_tokens} tokens); lower it or pass"
            f" a longer {keys.path}"
        )
    rng = np.random.default_rng([seed, 1])
    if n_tokens // seq_len >= samples:
        slots = rng.choice(n_tokens // seq_len, size=samples, replace=False)
        return np.sort(slots) * seq_len
    if n_tokens - seq_len + 1 < samples:
        raise InputError(
            f"{keys.samples}={samples} x {keys.seq_len}={seq_len} does not fit {text} ({n_tokens} tokens)"
        )
    return np.sort(rng.choice(n_tokens - seq_len + 1, size=samples, replace=False))


def fingerprint(tokens: np.ndarray) -> str:
    arr = np.ascontiguousarray(tokens, dtype="<i4")
    head = json.dumps({"shape": list(arr.shape), "dtype": "int32"}).encode()
    return hashlib.sha256(head + arr.tobytes()).hexdigest()


_CHAT_NOTE = re.compile(r" \(chat template on \d+ dialogues\)$")


def recorded_settings(record: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``{path, samples, seq_len, seed}`` a :meth:`Windows.to_dict` record was made with
    (``path`` None for the built-in set), or None when the record does not say."""
    try:
        source = _CHAT_NOTE.sub("", str(record["source"]))
        path = None if source.startswith("builtin:") else source
        return {k: int(record[k]) for k in ("samples", "seq_len", "seed")} | {"path": path}
    except (KeyError, TypeError, ValueError):
        return None


def split_kinds(docs: list[Document], kinds: tuple[str, ...]) -> tuple[list[Document], list[Document], str]:
    """(training documents, validation documents, how they were split): the documents of
    ``kinds`` are validation; when the text has none of those kinds (or only those), every
    fourth document is."""
    val = [d for d in docs if d.kind in kinds]
    if val and len(val) < len(docs):
        return [d for d in docs if d.kind not in kinds], val, f"kinds {', '.join(sorted(set(kinds)))}"
    return [d for j, d in enumerate(docs) if j % 4 != 3], docs[3::4], "every fourth document"


def load_calibration(
    *,
    tokenizer: Any,
    path: str | Path | None = None,
    samples: int = 24,
    seq_len: int = 512,
    seed: int = 0,
    documents: Callable[[list[Document]], list[Document]] | None = None,
    label: str = "",
    keys: WindowKeys = CALIB_KEYS,
) -> Windows:
    """Calibration tokens from ``path`` (None: the built-in set), deterministic for a seed.

    Args:
        tokenizer: anything with ``encode`` (and optionally ``chat_template``/``eos_token_id``).
        path: a text or JSONL file; None uses ``mlxbun/data/calibration.txt``.
        samples: number of windows N.
        seq_len: tokens per window L.
        seed: shuffles documents and picks windows.
        documents: keeps some of the documents (e.g. one side of :func:`split_kinds`); ``label``
            says which in the record's source.
        keys: the caller's config keys of ``samples``, ``seq_len`` and ``path``, for its errors.
    """
    docs, source = read_documents(path)
    if documents is not None:
        docs, source = documents(docs), f"{source} ({label})" if label else source
    stream, templated = token_stream(docs, tokenizer, seed=seed)
    text = f"the calibration text's {label} documents" if label else "the calibration text"
    starts = choose_windows(len(stream), samples=samples, seq_len=seq_len, seed=seed, keys=keys, text=text)
    tokens = np.stack([stream[s : s + seq_len] for s in starts]).astype(np.int32)
    if templated:
        source += f" (chat template on {templated} dialogues)"
    return Windows(
        tokens=tokens, fingerprint=fingerprint(tokens), source=source, seed=seed, stream_tokens=len(stream)
    )
