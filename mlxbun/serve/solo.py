"""One sequence at a time behind mlx-lm's ``BatchGenerator`` calls, for caches it cannot batch.

mlx-lm batches only caches with a ``merge`` (``KVCache``, ``RotatingKVCache``, ...); a quantized
KV cache (``serve.kv_bits``) has none, so mlx-lm's own server serves such requests one at a
time. :class:`Solo` does the same behind the calls the engine makes of a ``BatchGenerator``
(``insert``, ``next``, ``remove``): the prompt is processed in chunks of ``prefill_step`` tokens,
one chunk a call, so a dropped request stops between chunks, and the cache is quantized as
``mlx_lm.generate.generate_step`` quantizes it (after every model call, from the first token).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.generate import GenerationBatch, maybe_quantize_kv_cache
from mlx_lm.models.cache import make_prompt_cache


@dataclass
class _Seq:
    uid: int
    rest: list[int]  # prompt tokens not yet fed to the model
    max_tokens: int
    cache: list[Any]
    tokens: list[int]  # the tokens the cache holds
    sampler: Any
    processors: list[Any]
    made: int = 0
    last: int | None = None


class Solo:
    """Sequences in arrival order, each generated to its end before the next starts."""

    def __init__(
        self,
        model: Any,
        *,
        stop_tokens: set[int],
        prefill_step: int,
        kv_bits: int | None,
        kv_group_size: int,
    ) -> None:
        self.model, self.stop_tokens, self.prefill_step = model, stop_tokens, prefill_step
        self.kv_bits, self.kv_group_size = kv_bits, kv_group_size
        self.waiting: deque[_Seq] = deque()
        self.current: _Seq | None = None
        self._uid = 0

    def insert(
        self,
        prompts: list[list[int]],
        max_tokens: list[int],
        caches: list[list[Any] | None],
        all_tokens: list[list[int]],
        samplers: list[Any],
        logits_processors: list[list[Any]],
    ) -> list[int]:

        uids = []
        for prompt, m, cache, known, sampler, procs in zip(
            prompts, max_tokens, caches, all_tokens, samplers, logits_processors, strict=True
        ):
            cache = cache if cache is not None else make_prompt_cache(self.model)
            self.waiting.append(_Seq(self._uid, list(prompt), m, cache, known, sampler, list(procs)))
            uids.append(self._uid)
            self._uid += 1
        return uids

    def next(self) -> tuple[list[int], list[Any]]:
        """One chunk of the current prompt, or one generated token: (prompt uids, responses)."""
        if self.current is None:
            if not self.waiting:
                return [], []
            self.current = self.waiting.popleft()
        s = self.current
        if len(s.rest) > 1:
            self._prefill(s)
            return [s.uid], []
        return [], [self._decode(s)]

    def remove(
        self, uids: list[int], return_prompt_caches: bool = False
    ) -> dict[int, tuple[list[Any], list[int]]]:
        gone = set(uids)
        out = {}
        for s in [*([self.current] if self.current else []), *self.waiting]:
            if s.uid in gone:
                out[s.uid] = (s.cache, s.tokens)
        self.waiting = deque(s for s in self.waiting if s.uid not in gone)
        if self.current is not None and self.current.uid in gone:
            self.current = None
        return out if return_prompt_caches else {}

    def _quantize(self, s: _Seq) -> None:

        maybe_quantize_kv_cache(s.cache, 0, self.kv_group_size, self.kv_bits)

    def _prefill(self, s: _Seq) -> None:

        n = min(self.prefill_step, len(s.rest) - 1)
        chunk, s.rest = s.rest[:n], s.rest[n:]
        self.model(mx.array([chunk]), cache=s.cache)
        self._quantize(s)
        mx.eval([c.state for c in s.cache])
        s.tokens += chunk

    def _decode(self, s: _Seq) -> Any:

        x = s.rest.pop() if s.rest else s.last
        logits = self.model(mx.array([[x]]), cache=s.cache)[:, -1, :]
        s.tokens.append(x)
        if s.processors:
            context = mx.array(s.tokens)
            for p in s.processors:
                logits = p(context, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        token = s.sampler(logprobs)
        self._quantize(s)
        mx.eval(token, logprobs)
        s.last, s.made = int(token.item()), s.made + 1
        finish = "stop" if s.last in self.stop_tokens else "length" if s.made >= s.max_tokens else None
        if finish is not None:
            self.current = None
        done = finish is not None
        return GenerationBatch.Response(
            s.uid, s.last, logprobs[0], finish, s.cache if done else None, s.tokens if done else None
        )
