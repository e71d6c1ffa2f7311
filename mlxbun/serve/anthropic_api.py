"""Anthropic's Messages API: ``POST /v1/messages`` (streaming or not) and
``/v1/messages/count_tokens``, in Anthropic's shapes.

``system``, ``stop_sequences``, ``temperature`` (0 to 1), ``top_p`` and ``top_k`` are served; a
last message from the assistant is continued, as Anthropic's API does. Text content only:
other blocks (images, tools) are refused with a 400 naming them, as are unimplemented fields
unless null or at the value that changes nothing. ``cache_control`` marks are accepted and
needed nowhere: every prompt's cache is kept. Usage counts the prompt tokens read from the
prompt cache as ``cache_read_input_tokens``; ``input_tokens`` are the rest, as Anthropic counts.
"""

from __future__ import annotations

import uuid
from typing import Any

from mlxbun.serve import checks, prompts
from mlxbun.serve.checks import BadRequest
from mlxbun.serve.engine import Job, Request
from mlxbun.serve.text import Choice, Context, started

FIELDS = {
    "model", "max_tokens", "messages", "system", "stop_sequences", "stream", "temperature",
    "top_p", "top_k", "metadata",
}  # fmt: skip
NOOP = {
    "tools": [[]], "tool_choice": [{"type": "none"}, {"type": "auto"}],
    "thinking": [{"type": "disabled"}], "service_tier": ["auto", "standard_only"],
}  # fmt: skip
ERRORS = {
    400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
    411: "invalid_request_error", 413: "request_too_large", 500: "api_error", 503: "overloaded_error",
}  # fmt: skip
STOP = {"eos": "end_turn", "stop": "stop_sequence", "length": "max_tokens"}


def error_body(e: BadRequest) -> dict[str, Any]:
    kind = ERRORS.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def conversation(body: dict[str, Any]) -> tuple[list[dict[str, str]], bool]:
    """The messages (``system`` first) and whether the last one, the assistant's, is continued."""
    value = body.get("messages")
    if not isinstance(value, list) or not value:
        raise BadRequest(
            "messages: a non-empty list of {role, content} objects is required", param="messages"
        )
    out = []
    system = body.get("system")
    if system is not None:
        out.append({"role": "system", "content": prompts.text_of(system, "system")})
    for i, m in enumerate(value):
        where = f"messages.{i}"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise BadRequest(f"{where}: an object with role user or assistant is required", param=where)
        out.append({"role": m["role"], "content": prompts.text_of(m.get("content"), f"{where}.content")})
    return out, out[-1]["role"] == "assistant"


def tokens(body: dict[str, Any], ctx: Context) -> list[int]:
    messages, continued = conversation(body)
    return prompts.chat_tokens(ctx.tokenizer, messages, continue_final=continued)


def request(body: dict[str, Any], ctx: Context) -> tuple[Request, dict[str, Any]]:
    """The engine's request and the reply's options (stream, stop) of a body."""
    bad = sorted(k for k, v in body.items() if k not in FIELDS and v is not None and v not in NOOP.get(k, []))
    if bad:
        raise BadRequest(
            f"{bad[0]}: unsupported field(s): {', '.join(bad)}; remove, or set to null", param=bad[0]
        )
    if not isinstance(body.get("model"), str):
        raise BadRequest("model: a string is required", param="model")
    if body.get("max_tokens") is None:
        raise BadRequest("max_tokens: field required", param="max_tokens")
    asked = checks.integer(body, "max_tokens", lo=1, hi=2**62, default=None)
    sampling = checks.sampling(body, ctx.limits, max_temperature=1.0)
    prompt = tokens(body, ctx)
    n = checks.budget(
        len(prompt), asked, default=asked or 1, limits=ctx.limits, param="messages", key="max_tokens"
    )
    stop = checks.stop_words(body.get("stop_sequences"), key="stop_sequences")
    return Request("messages", prompt, n, sampling), {"stream": checks.flag(body, "stream"), "stop": stop}


def message(ctx: Context, choice: Choice | None, cached: int, prompt: int) -> dict[str, Any]:
    """The message object: whole, or (``choice`` None) as ``message_start`` opens a stream."""
    made = len(choice.pieces) if choice else 0
    return {
        "id": f"msg_{uuid.uuid4().hex}",
        "type": "message",
        "role": "assistant",
        "model": ctx.model_id,
        "content": [{"type": "text", "text": choice.text}] if choice else [],
        "stop_reason": STOP[choice.reason or "eos"] if choice else None,
        "stop_sequence": choice.stop_word if choice else None,
        "usage": {
            "input_tokens": prompt - cached,
            "output_tokens": made,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
        },
    }


def reply(job: Job, out: Any, ctx: Context, opts: dict[str, Any]) -> None:
    """Answer a submitted job through ``out``: one message, or Anthropic's stream of events."""
    prompt, stream = len(job.request.tokens), opts["stream"]
    choice = Choice(ctx.tokenizer, opts["stop"])
    if (begun := started(job, out, error_body)) is None:
        return
    flow, cached = begun
    if stream:
        out.open_stream()
        out.event({"type": "message_start", "message": message(ctx, None, cached, prompt)}, "message_start")
        start = {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
        out.event(start, "content_block_start")
        out.event({"type": "ping"}, "ping")
    for event in flow:
        if event[0] == "error":
            body = error_body(BadRequest(event[2], status=event[1]))
            out.event(body, "error") if stream else out.json(event[1], body)
            return out.close_stream() if stream else None
        if event[0] == "token":
            _, _, token, logprob, top, finish = event
            if choice.add(token, logprob, top, finish) and finish is None:
                job.stop(0)  # cut at a stop sequence
            delta, _ = choice.ready()
            if stream and delta:
                text = {"type": "text_delta", "text": delta}
                out.event({"type": "content_block_delta", "index": 0, "delta": text}, "content_block_delta")
    if not stream:
        out.json(200, message(ctx, choice, cached, prompt))
        return
    out.event({"type": "content_block_stop", "index": 0}, "content_block_stop")
    end = {"stop_reason": STOP[choice.reason or "eos"], "stop_sequence": choice.stop_word}
    out.event(
        {"type": "message_delta", "delta": end, "usage": {"output_tokens": len(choice.pieces)}},
        "message_delta",
    )
    out.event({"type": "message_stop"}, "message_stop")
    out.close_stream()
