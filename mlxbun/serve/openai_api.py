"""OpenAI's shapes: ``POST /v1/completions`` and ``/v1/chat/completions`` in, their exact
response and chunk objects out, errors as ``{"error": {"message", "type", "param", "code"}}``.

Fields this server does not implement are refused with a 400 naming them, unless null or at
the value that changes nothing (``echo: false``, ``tools: []``, ...); ``user`` and ``metadata``
are labels and accepted. ``n`` choices are honored (at most :data:`checks.MAX_N`), each a
sequence of its own in the batch.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from mlxbun.serve import checks, prompts
from mlxbun.serve.checks import BadRequest
from mlxbun.serve.engine import Job, Request
from mlxbun.serve.text import Choice, Context, Piece, TokenText, started

COMMON = {
    "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "n", "stream",
    "stream_options", "stop", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "logit_bias", "user", "metadata",
}  # fmt: skip
FIELDS = {
    "text": COMMON | {"prompt", "logprobs"},
    "chat": COMMON | {"messages", "logprobs", "top_logprobs", "max_completion_tokens"},
}
# fields served only at the value that changes nothing
NOOP = {
    "echo": [False], "best_of": [1], "suffix": [""], "tools": [[]], "functions": [[]],
    "tool_choice": ["none"], "function_call": ["none"], "parallel_tool_calls": [True, False],
    "response_format": [{"type": "text"}], "store": [False], "modalities": [["text"]],
    "service_tier": ["auto", "default"],
}  # fmt: skip
MAX_LEGACY_LOGPROBS = 5
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


def error_body(e: BadRequest) -> dict[str, Any]:
    kind = "server_error" if e.status >= 500 else "invalid_request_error"
    return {"error": {"message": e.message, "type": kind, "param": e.param, "code": e.code}}


def refuse_unknown(body: dict[str, Any], known: set[str]) -> None:
    bad = sorted(
        k for k, v in body.items() if k not in known and v is not None and not (k in NOOP and v in NOOP[k])
    )
    if bad:
        raise BadRequest(
            f"unsupported field(s): {', '.join(bad)}; this server does not implement "
            f"{'it' if len(bad) == 1 else 'them'} (remove, or set to null)",
            param=bad[0],
        )


def messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise BadRequest("messages must be a non-empty list of {role, content} objects", param="messages")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BadRequest(f"{where} must be an object with a role of {', '.join(ROLES)}", param=where)
        extra = sorted(
            k for k, v in m.items() if k not in ("role", "content", "name") and v not in (None, [])
        )
        if extra:
            raise BadRequest(
                f"{where}: unsupported field(s): {', '.join(extra)}", param=f"{where}.{extra[0]}"
            )
        content = m.get("content")
        text = (
            ""
            if content is None and m["role"] == "assistant"
            else prompts.text_of(content, f"{where}.content")
        )
        out.append({"role": ROLES[m["role"]], "content": text})
    return out


def max_tokens(body: dict[str, Any], kind: str) -> tuple[int | None, str]:
    key = (
        "max_completion_tokens"
        if kind == "chat" and body.get("max_completion_tokens") is not None
        else "max_tokens"
    )
    return checks.integer(body, key, lo=1, hi=2**62, default=None), key


def request(kind: str, body: dict[str, Any], ctx: Context) -> tuple[Request, dict[str, Any]]:
    """The engine's request and the reply's options (stream, stop, include_usage) of a body."""
    refuse_unknown(body, FIELDS[kind])
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise BadRequest(f"model must be a string, not {checks.shown(body['model'])}", param="model")
    stream = checks.flag(body, "stream")
    opts = body.get("stream_options")
    if opts is not None and (not stream or not isinstance(opts, dict) or set(opts) - {"include_usage"}):
        raise BadRequest(
            "stream_options takes only include_usage, and only with stream: true", param="stream_options"
        )
    sampling = checks.sampling(body, ctx.limits)
    n = checks.integer(body, "n", lo=1, hi=checks.MAX_N, default=1)
    if kind == "text":
        tokens = prompts.completion_tokens(ctx.tokenizer, body.get("prompt"), ctx.limits.vocab)
        k = checks.integer(body, "logprobs", lo=0, hi=MAX_LEGACY_LOGPROBS, default=None)
    else:
        tokens = prompts.chat_tokens(ctx.tokenizer, messages(body.get("messages")))
        top = checks.integer(body, "top_logprobs", lo=0, hi=checks.MAX_TOP_LOGPROBS, default=None)
        if top is not None and not checks.flag(body, "logprobs"):
            raise BadRequest("top_logprobs needs logprobs: true", param="top_logprobs")
        k = (top or 0) if checks.flag(body, "logprobs") else None
    asked, key = max_tokens(body, kind)
    where = "prompt" if kind == "text" else "messages"
    budget = checks.budget(
        len(tokens), asked, default=ctx.default_max_tokens, limits=ctx.limits, param=where, key=key
    )
    reply = {
        "stream": stream,
        "stop": checks.stop_words(body.get("stop")),
        "include_usage": bool((opts or {}).get("include_usage")),
    }
    return Request(kind, tokens, budget, sampling, n, k), reply


class Shapes:
    """The response objects of one request (ids, timestamps and logprobs in OpenAI's form)."""

    def __init__(self, kind: str, ctx: Context, *, stream: bool, include_usage: bool) -> None:
        self.kind, self.ctx, self.stream, self.include_usage = kind, ctx, stream, include_usage
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def base(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        if self.kind == "chat":
            obj = "chat.completion.chunk" if self.stream else "chat.completion"
        else:
            obj = "text_completion"
        doc = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.ctx.model_id,
            "system_fingerprint": None,
            "choices": choices,
        }
        if self.stream and self.include_usage:
            doc["usage"] = None
        return doc

    def logprobs(self, pieces: list[Piece], wanted: bool) -> dict[str, Any] | None:
        if not wanted:
            return None
        tt = self.ctx.token_text
        if self.kind == "chat":
            return {"content": [chat_entry(tt, p) for p in pieces], "refusal": None}
        return {
            "tokens": [tt.text(p.token) for p in pieces],
            "token_logprobs": [p.logprob for p in pieces],
            "top_logprobs": [
                {tt.text(i): g for i, g in p.top or []} | {tt.text(p.token): p.logprob} for p in pieces
            ],
            "text_offset": [p.offset for p in pieces],
        }

    def whole(self, choices: list[Choice], cached: int, prompt: int, wanted: bool) -> dict[str, Any]:
        out = []
        for i, c in enumerate(choices):
            entry: dict[str, Any] = {"index": i}
            if self.kind == "chat":
                entry["message"] = {"role": "assistant", "content": c.text, "refusal": None}
            else:
                entry["text"] = c.text
            entry["logprobs"] = self.logprobs(c.pieces, wanted)
            entry["finish_reason"] = FINISH.get(c.reason or "", "stop")
            out.append(entry)
        return self.base(out) | {"usage": usage(choices, prompt, cached)}

    def chunk(
        self, i: int, delta: str | None, pieces: list[Piece], wanted: bool, finish: str | None
    ) -> dict[str, Any]:
        """One choice's chunk: ``delta`` None is the chat role chunk that opens a choice."""
        entry: dict[str, Any] = {"index": i}
        if self.kind == "chat":
            if delta is None:
                entry["delta"] = {"role": "assistant", "content": ""}
            else:
                entry["delta"] = {"content": delta} if delta else {}
        else:
            entry["text"] = delta or ""
        entry["logprobs"] = self.logprobs(pieces, wanted) if pieces else None
        entry["finish_reason"] = FINISH.get(finish) if finish else None
        return self.base([entry])

    def usage_chunk(self, choices: list[Choice], prompt: int, cached: int) -> dict[str, Any]:
        return self.base([]) | {"usage": usage(choices, prompt, cached)}


def chat_entry(tt: TokenText, p: Piece) -> dict[str, Any]:
    def one(token: int, logprob: float) -> dict[str, Any]:
        raw = tt.bytes(token)
        return {"token": raw.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(raw)}

    return one(p.token, p.logprob) | {"top_logprobs": [one(i, g) for i, g in p.top or []]}


def usage(choices: list[Choice], prompt: int, cached: int) -> dict[str, Any]:
    made = sum(len(c.pieces) for c in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": made,
        "total_tokens": prompt + made,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def models(model_id: str, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [model(model_id, created)]}


def model(model_id: str, created: int) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "mlxbun"}


def reply(job: Job, out: Any, ctx: Context, opts: dict[str, Any]) -> None:
    """Answer a submitted job through ``out`` (the HTTP layer's writer): one JSON object, or
    server-sent chunks ending in ``data: [DONE]``."""
    req, stream = job.request, opts["stream"]
    shapes = Shapes(req.kind, ctx, stream=stream, include_usage=opts["include_usage"])
    choices = [Choice(ctx.tokenizer, opts["stop"]) for _ in range(req.n)]
    wanted = req.logprobs is not None
    if (begun := started(job, out, error_body)) is None:
        return
    flow, cached = begun
    if stream:
        out.open_stream()
        for i in range(req.n if req.kind == "chat" else 0):
            out.event(shapes.chunk(i, None, [], wanted, None))
    for event in flow:
        if event[0] == "error":
            body = error_body(BadRequest(event[2], status=event[1]))
            out.event(body) if stream else out.json(event[1], body)
            break
        if event[0] == "token":
            _, i, token, logprob, top, finish = event
            if choices[i].add(token, logprob, top, finish) and finish is None:
                job.stop(i)  # cut at a stop word: the engine stops this choice at the next token
            if stream:
                send_ready(out, shapes, choices[i], i, wanted)
    else:
        if not stream:
            out.json(200, shapes.whole(choices, cached, len(req.tokens), wanted))
            return
        if opts["include_usage"]:
            out.event(shapes.usage_chunk(choices, len(req.tokens), cached))
    if stream:
        out.raw(b"data: [DONE]\n\n")
        out.close_stream()


def send_ready(out: Any, shapes: Shapes, c: Choice, i: int, wanted: bool) -> None:
    delta, pieces = c.ready()
    if delta or pieces:
        out.event(shapes.chunk(i, delta, pieces, wanted, None))
    if c.reason is not None and not c.closed:
        c.closed = True
        out.event(shapes.chunk(i, "", [], wanted, c.reason))
