"""Tokens into reply text, on the handler's thread: detokenized per choice, cut at the first
stop word, each token's bytes for logprobs, and the pump that reads a job's events while
watching for a client that hung up."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from mlx_lm.tokenizer_utils import _byte_decoder

from mlxbun.serve.checks import BadRequest

POLL_S = 0.1  # how often a waiting handler checks that its client is still there


class ClientGone(Exception):
    """The client closed its connection; its job was stopped."""


class TokenText:
    """Each token's bytes (byte-level BPE and SentencePiece byte tokens give their raw bytes,
    which may be part of one character) and text, from mlx-lm's detokenizer's token map."""

    def __init__(self, tokenizer: Any) -> None:
        det = tokenizer.detokenizer
        self.kind = type(det).__name__
        self.map = getattr(det, "tokenmap", None)
        self.tokenizer = tokenizer

    def bytes(self, token: int) -> bytes:
        if self.map is None or token >= len(self.map):
            return self.tokenizer.decode([token]).encode("utf-8")
        piece = self.map[token]
        if self.kind == "SPMStreamingDetokenizer":
            return piece.replace("\u2581".encode(), b" ")
        if self.kind == "BPEStreamingDetokenizer":
            table = _byte_decoder()
            return b"".join(bytes([table[c]]) if c in table else c.encode("utf-8") for c in piece)
        return self.tokenizer.decode([token]).encode("utf-8")

    def text(self, token: int) -> str:
        return self.bytes(token).decode("utf-8", "replace")


@dataclass
class Context:
    """What every request is read and answered with."""

    tokenizer: Any
    limits: Any  # mlxbun.serve.checks.Limits
    model_id: str
    default_max_tokens: int
    token_text: TokenText


@dataclass
class Piece:
    """A generated token in a reply: its logprob and likeliest alternatives (when asked for),
    and where its text starts in the choice's text."""

    token: int
    logprob: float | None
    top: list[tuple[int, float]] | None
    offset: int


class Choice:
    """One choice's text as its tokens arrive.

    ``reason`` is set when it ends: ``eos`` (the model's end-of-sequence token), ``stop`` (a
    stop word, named in ``stop_word``; the text ends before it) or ``length``. While it runs,
    :meth:`ready` holds back the text a stop word might start with.
    """

    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self.detok = tokenizer.detokenizer
        self.stop = stop
        self.hold = max((len(w) for w in stop), default=1) - 1
        self.text, self.searched, self.sent = "", 0, 0
        self.pieces: list[Piece] = []
        self.sent_pieces = 0
        self.reason: str | None = None
        self.stop_word: str | None = None
        self.closed = False  # a stream has sent its end

    def add(self, token: int, logprob: float | None, top: Any, finish: str | None) -> bool:
        """Take one token (``finish``: the engine's reason, if it was the last); True when the
        choice has just ended."""
        if self.reason is not None:
            return False
        if finish != "stop":  # mlx-lm's "stop" is the end-of-sequence token: no text
            self.pieces.append(Piece(token, logprob, top, len(self.detok.text)))
            self.detok.add_token(token)
        if finish is not None:
            self.detok.finalize()
        self.text = self.detok.text
        if self._cut():
            return True
        if finish is not None:
            self.reason = "eos" if finish == "stop" else "length"
        return self.reason is not None

    def _cut(self) -> bool:
        start = max(0, self.searched - self.hold)
        found = [(i, w) for w in self.stop if (i := self.text.find(w, start)) >= 0]
        self.searched = len(self.text)
        if not found:
            return False
        at, self.stop_word = min(found)
        self.text, self.reason = self.text[:at], "stop"
        self.pieces = [p for p in self.pieces if p.offset < at]
        return True

    def ready(self) -> tuple[str, list[Piece]]:
        """The text and tokens not sent yet that can be sent now (all of them once ended)."""
        upto = len(self.text) if self.reason else max(self.sent, len(self.text) - self.hold)
        delta = self.text[self.sent : upto]
        n = len(self.pieces) if self.reason else sum(p.offset < upto for p in self.pieces)
        n = max(n, self.sent_pieces)
        pieces = self.pieces[self.sent_pieces : n]
        self.sent, self.sent_pieces = upto, n
        return delta, pieces


def started(
    job: Any, out: Any, error_body: Callable[[BadRequest], dict[str, Any]]
) -> tuple[Iterator[tuple], int] | None:
    """A job's events once it has started, and how many prompt tokens came from the cache; None
    when it failed before its first token (answered through ``out`` in the API's ``error_body``)."""
    flow = events(job, out.alive)
    first = next(flow)
    if first[0] == "error":
        out.json(first[1], error_body(BadRequest(first[2], status=first[1])))
        return None
    return flow, first[1]


def events(job: Any, alive: Callable[[], bool]) -> Iterator[tuple]:
    """A job's events up to its end or error; a client found gone (checked every
    :data:`POLL_S` while waiting or reading) stops the job and raises :class:`ClientGone`."""
    checked = time.monotonic()
    while True:
        try:
            event = job.out.get(timeout=POLL_S)
        except queue.Empty:
            event = None
        if event is None or time.monotonic() - checked > POLL_S:
            checked = time.monotonic()
            if not alive():
                job.stop()
                raise ClientGone
        if event is None:
            continue
        yield event
        if event[0] in ("end", "error"):
            return
