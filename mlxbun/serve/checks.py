"""What a request may ask for, checked before anything is compiled or queued.

Every field is checked at the boundary (finite, in range, ``top_k`` at most the vocabulary,
token ids inside it), so a bad request is a 400 naming its field and never reaches mlx: an
out-of-range ``top_k`` once failed inside mlx-lm's compiled sampler and broke every later
request. :class:`Sampling` is the checked result; :func:`sampler` and :func:`processors` turn it
into mlx-lm's per-sequence callables.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, greedy_sampler, make_logits_processors

MAX_SEED = 2**63  # seeds are int64, as OpenAI takes them
MAX_TOP_LOGPROBS = 20  # OpenAI's chat limit; the legacy completions limit is 5
MAX_STOP = 4  # OpenAI's limit on stop words
MAX_N = 16  # choices per request: each is one sequence in the batch


class BadRequest(ValueError):
    """A request answered with an error body: HTTP ``status``, the offending ``param``, an
    OpenAI ``code`` (e.g. ``context_length_exceeded``)."""

    def __init__(
        self, message: str, *, param: str | None = None, code: str | None = None, status: int = 400
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status


@dataclass(frozen=True)
class Limits:
    """What the served model allows: its context (tokens) and its logits' width."""

    context: int
    vocab: int


@dataclass(frozen=True)
class Sampling:
    """A request's checked sampling settings (temperature 0: greedy)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)


def shown(value: Any) -> str:
    """A request's value in an error line: short, and never the repr of a deep structure."""
    if isinstance(value, dict | list):
        return f"a JSON {'object' if isinstance(value, dict) else 'array'} of {len(value)}"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def number(body: dict[str, Any], key: str, *, lo: float, hi: float, default: float) -> float:
    """``body[key]`` as a finite number in [lo, hi] (``default`` when absent or null)."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        raise BadRequest(f"{key} must be a number from {lo:g} to {hi:g}, not {shown(value)}", param=key)
    return float(value)


def integer(body: dict[str, Any], key: str, *, lo: int, hi: int, default: int | None) -> int | None:
    """``body[key]`` as an integer in [lo, hi] (``default`` when absent or null)."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise BadRequest(f"{key} must be an integer from {lo} to {hi}, not {shown(value)}", param=key)
    return value


def flag(body: dict[str, Any], key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"{key} must be true or false, not {shown(value)}", param=key)
    return value


def sampling(body: dict[str, Any], limits: Limits, *, max_temperature: float = 2.0) -> Sampling:
    """The sampling fields of a request (OpenAI's ranges; Anthropic's temperature tops at 1)."""
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or abs(seed) >= MAX_SEED):
        raise BadRequest(f"seed must be an integer from -2^63 to 2^63-1, not {shown(seed)}", param="seed")
    top_k = integer(body, "top_k", lo=0, hi=limits.vocab, default=0)
    return Sampling(
        temperature=number(body, "temperature", lo=0, hi=max_temperature, default=0.0),
        top_p=number(body, "top_p", lo=0, hi=1, default=1.0),
        top_k=0 if top_k == limits.vocab else top_k,  # all of the vocabulary: no filter
        min_p=number(body, "min_p", lo=0, hi=1, default=0.0),
        seed=seed,
        presence_penalty=number(body, "presence_penalty", lo=-2, hi=2, default=0.0),
        frequency_penalty=number(body, "frequency_penalty", lo=-2, hi=2, default=0.0),
        repetition_penalty=number(body, "repetition_penalty", lo=0, hi=10, default=0.0),
        logit_bias=logit_bias(body.get("logit_bias"), limits.vocab),
    )


def logit_bias(value: Any, vocab: int) -> dict[int, float]:
    """OpenAI's ``logit_bias``: token ids (as JSON keys) to biases from -100 to 100."""
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > 300:
        raise BadRequest("logit_bias must be an object of at most 300 token ids", param="logit_bias")
    out = {}
    for key, bias in value.items():
        if not key.isdigit() or int(key) >= vocab:
            raise BadRequest(f"logit_bias: {key!r} is not a token id below {vocab}", param="logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100 <= bias <= 100:
            raise BadRequest(
                f"logit_bias[{key}] must be a number from -100 to 100, not {shown(bias)}", param="logit_bias"
            )
        out[int(key)] = float(bias)
    return out


def stop_words(value: Any, *, key: str = "stop") -> list[str]:
    """A stop string or a list of at most :data:`MAX_STOP` non-empty strings."""
    if value is None:
        return []
    words = [value] if isinstance(value, str) else value
    if not isinstance(words, list) or not all(isinstance(w, str) and w for w in words):
        raise BadRequest(
            f"{key} must be a string or a list of non-empty strings, not {shown(value)}", param=key
        )
    if len(words) > MAX_STOP and key == "stop":
        raise BadRequest(f"stop takes at most {MAX_STOP} strings, not {len(words)}", param=key)
    return words


def budget(prompt: int, asked: int | None, *, default: int, limits: Limits, param: str, key: str) -> int:
    """Completion tokens for a prompt of ``prompt`` tokens: ``asked`` (a 400 when the prompt
    and it do not fit the context, as OpenAI answers), else ``default`` capped by the context
    left."""
    left = limits.context - prompt
    if left < 1:
        raise BadRequest(
            f"the prompt is {prompt} tokens; the model's context is {limits.context} tokens, with room"
            " for at least one generated token",
            param=param,
            code="context_length_exceeded",
        )
    if asked is None:
        return min(default, left)
    if asked > left:
        raise BadRequest(
            f"this model's maximum context length is {limits.context} tokens; you requested"
            f" {prompt + asked} tokens ({prompt} in the prompt, {asked} in {key}); reduce {key} to at"
            f" most {left} or shorten the prompt",
            param=key,
            code="context_length_exceeded",
        )
    return asked


def no_surrogates(body: Any) -> None:
    """Refuse a lone surrogate (``"\\ud800"`` parses, but is no text a tokenizer can take),
    naming the field that holds it (walked without recursion: JSON may nest deep)."""
    todo: list[tuple[Any, str]] = [(body, "body")]
    while todo:
        value, where = todo.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                bad = value[e.start : e.end].encode("unicode_escape").decode()
                raise BadRequest(
                    f"{where} holds a lone surrogate ({bad}), which is not text", param=where
                ) from None
        elif isinstance(value, dict):
            todo += [(k, where) for k in value]
            todo += [(v, k if where == "body" else f"{where}.{k}") for k, v in value.items()]
        elif isinstance(value, list):
            todo += [(v, f"{where}[{i}]") for i, v in enumerate(value)]


def sampler(s: Sampling) -> Any:
    """mlx-lm's greedy sampler for temperature 0; else a sampler with its own random key (from
    ``seed``, or fresh), so a seeded request draws the same tokens whatever else is in the batch."""

    if s.temperature == 0:
        return greedy_sampler
    steps = []
    if 0 < s.top_p < 1:
        steps.append(lambda x: apply_top_p(x, s.top_p))
    if s.min_p > 0:
        steps.append(lambda x: apply_min_p(x, s.min_p))
    if s.top_k:
        steps.append(lambda x: apply_top_k(x, s.top_k))
    seed = s.seed if s.seed is not None else secrets.randbits(63)
    key = [mx.random.key(seed % 2**64)]
    scale = 1.0 / s.temperature

    def sample(logprobs: Any) -> Any:
        for step in steps:
            logprobs = step(logprobs)
        key[0], now = mx.random.split(key[0])
        return mx.random.categorical(logprobs * scale, key=now)

    return sample


def processors(s: Sampling) -> list[Any]:
    """mlx-lm's logits processors for the penalties and biases (none: the batch's fast path)."""

    return make_logits_processors(
        s.logit_bias or None,
        s.repetition_penalty or None,
        presence_penalty=s.presence_penalty or None,
        frequency_penalty=s.frequency_penalty or None,
    )
