"""The batching engine: requests join and leave one running batch at token boundaries.

One thread owns the model (mlx work stays on one thread). Each :meth:`Engine.step` is one token
boundary: requests that arrived are admitted (each starts from its longest cached prefix in
memory or on disk, :mod:`mlxbun.kv.tiers`, and is inserted into mlx-lm's ``BatchGenerator`` with
that cache), requests whose client hung up or whose reply was cut by a stop word are removed,
then the batch advances one token, and a new prompt one chunk of ``prefill_step`` tokens, so
running streams keep their pace while a long prompt is read. A finished or removed sequence's
cache goes back to the tiers (memory at once, disk in the background). Every event reaches the
request's handler through its :class:`Job`'s queue::

    ("start", cached, source)                     the prompt's cache was found (or not)
    ("token", choice, id, logprob, top, finish)   one generated token of one choice
    ("end", Stats)                                every choice has finished or was removed
    ("error", status, message)                    nothing more comes
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache

from mlxbun.kv import tiers
from mlxbun.serve.checks import Sampling, processors, sampler

log = logging.getLogger("mlxbun")

PREFILL_BATCH = 8  # prompts read together (mlx-lm's server default)


@dataclass
class Request:
    """What an API hands the engine, checked.

    Args:
        kind: the route, named in the log line (text, chat, messages).
        tokens: the prompt's token ids.
        max_tokens: generated tokens at most, per choice.
        n: choices, each one sequence in the batch.
        logprobs: None for none; k for each token's logprob and the k likeliest tokens.
    """

    kind: str
    tokens: list[int]
    max_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    n: int = 1
    logprobs: int | None = None


class Job:
    """A request in flight; its handler reads :attr:`out` and may stop it at any time."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self.out: queue.Queue[tuple] = queue.Queue()
        self.gone = False  # the client hung up: every choice stops at the next token
        self.cut: set[int] = set()  # choices the reply ended (a stop word)
        self.arrived = time.perf_counter()

    def stop(self, choice: int | None = None) -> None:
        if choice is None:
            self.gone = True
        else:
            self.cut.add(choice)


@dataclass
class Stats:
    """One request, as the log line and the reply's usage tell it."""

    kind: str
    prompt: int
    cached: int
    source: str
    restore_s: float
    choices: int
    generated: int = 0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    gone: bool = False  # the client hung up first

    def line(self) -> str:
        rate = f"{self.generated / self.decode_s:.1f}" if self.decode_s > 0 else "-"
        return (
            f"serve: {self.kind}: prompt {self.prompt} tokens, cached {self.cached} ({self.source}), "
            f"restore {self.restore_s:.3f} s, first token after {self.ttft_s:.3f} s, "
            f"{self.generated} token(s) in {self.choices} choice(s) at {rate} tok/s"
            + (", stopped: the client hung up" if self.gone else "")
        )


@dataclass
class _Live:
    """A job being generated: its stats and how many of its choices are still running."""

    job: Job
    stats: Stats
    left: int
    first: float | None = None


@dataclass
class _Seq:
    live: _Live
    choice: int


@dataclass
class Record:
    """What the engine did, for the run's record: the batch sizes say whether requests overlapped."""

    requests: int = 0
    cached_tokens: int = 0
    steps: int = 0
    tokens: int = 0
    peak_batch: int = 0
    failed: int = 0
    dropped: int = 0  # requests whose client hung up before their end

    def step(self, batch: int) -> None:
        self.steps += batch > 0
        self.tokens += batch
        self.peak_batch = max(self.peak_batch, batch)


class Engine:
    """Admits, steps and retires sequences of one model; :meth:`start` runs it on its own thread
    (or a test calls :meth:`step` itself).

    Args:
        model: the mlx-lm model.
        caches: the prompt caches (memory, then disk).
        make_generator: builds the generator (a ``BatchGenerator`` or a
            :class:`mlxbun.serve.solo.Solo`) on the thread that runs it.
    """

    def __init__(self, model: Any, caches: tiers.PromptCaches, *, make_generator: Any) -> None:
        self.model, self.caches, self.make_generator = model, caches, make_generator
        self.inbox: queue.Queue[Job | None] = queue.Queue()
        self.seqs: dict[int, _Seq] = {}
        self.record = Record()
        self.gen: Any = None
        self.stopping = False
        self.thread: threading.Thread | None = None

    @property
    def running(self) -> int:
        return len(self.seqs)

    def start(self) -> None:
        self.thread = threading.Thread(target=self._loop, name="serve-engine", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        if self.stopping or (self.thread is not None and not self.thread.is_alive()):
            job.out.put(("error", 503, "the server is stopping"))
            return
        self.inbox.put(job)

    def stop(self) -> None:
        """End every request in flight (503) and the thread."""
        self.stopping = True
        self.inbox.put(None)
        if self.thread is not None:
            self.thread.join(timeout=60)

    def _loop(self) -> None:
        while not self.stopping:
            try:
                if not self.seqs:
                    job = self.inbox.get()
                    if job is None:
                        break
                    self._admit(job)
                self.step()
            except Exception as e:  # no request may end the engine: these get a 500
                log.exception("serve: the engine failed")
                self._abort(f"{type(e).__name__}: {e}", 500)
        self._abort("the server is stopping", 503)

    @property
    def alive(self) -> bool:
        return self.thread is None or self.thread.is_alive()

    def step(self) -> int:
        """One token boundary: admit, drop, advance; returns how many sequences made a token."""
        while True:
            try:
                job = self.inbox.get_nowait()
            except queue.Empty:
                break
            if job is None:
                self.stopping = True
                break
            self._admit(job)
        self._drop_stopped()
        if not self.seqs:
            return 0
        try:
            _, responses = self._generator().next()
        except Exception as e:  # the server keeps serving; these requests get a 500
            log.exception("serve: generation failed")
            self._abort(f"generation failed: {type(e).__name__}: {e}", 500)
            return 0
        self.record.step(len(responses))
        for r in responses:
            self._emit(r)
        return len(responses)

    def _generator(self) -> Any:
        if self.gen is None:
            self.gen = self.make_generator()
        return self.gen

    def _admit(self, job: Job) -> None:
        req = job.request
        begun = time.perf_counter()
        try:
            hit = self.caches.fetch(req.tokens)
        except Exception as e:
            log.exception("serve: request failed")
            job.out.put(("error", 500, f"{type(e).__name__}: {e}"))
            return
        stats = Stats(req.kind, len(req.tokens), hit.reused, hit.source, time.perf_counter() - begun, req.n)
        live = _Live(job, stats, left=req.n)
        n, known = req.n, req.tokens[: hit.reused]
        caches = [hit.cache] + [copy.deepcopy(hit.cache) for _ in range(n - 1)]
        seeds = [req.sampling.seed if req.sampling.seed is None else req.sampling.seed + i for i in range(n)]
        try:
            uids = self._generator().insert(
                [req.tokens[hit.reused :]] * n,
                max_tokens=[req.max_tokens] * n,
                caches=caches,
                all_tokens=[list(known) for _ in range(n)],
                samplers=[sampler(dataclasses.replace(req.sampling, seed=s)) for s in seeds],
                logits_processors=[processors(req.sampling) for _ in range(n)],
            )
        except Exception as e:
            log.exception("serve: request failed")
            job.out.put(("error", 500, f"{type(e).__name__}: {e}"))
            return
        for choice, uid in enumerate(uids):
            self.seqs[uid] = _Seq(live, choice)
        job.out.put(("start", hit.reused, hit.source))
        for note in hit.notes:
            log.info("serve: note: %s", note)

    def _emit(self, r: Any) -> None:
        seq = self.seqs.get(r.uid)
        if seq is None:
            return
        live, want = seq.live, seq.live.job.request.logprobs
        if live.first is None:
            live.first = time.perf_counter()
            live.stats.ttft_s = live.first - live.job.arrived
        logprob = top = None
        if want is not None and r.finish_reason != "stop":
            logprob, top = token_logprobs(r.logprobs, r.token, want)
        live.stats.generated += r.finish_reason != "stop"  # the end-of-sequence token is no text
        live.job.out.put(("token", seq.choice, r.token, logprob, top, r.finish_reason))
        if r.finish_reason is not None:
            self._retire(r.uid, r.prompt_cache, r.all_tokens)

    def _drop_stopped(self) -> None:
        drop = [uid for uid, s in self.seqs.items() if s.live.job.gone or s.choice in s.live.job.cut]
        if not drop:
            return
        got = self._generator().remove(drop, return_prompt_caches=True)
        for uid in drop:
            self._retire(uid, *got.get(uid, (None, None)))

    def _retire(self, uid: int, cache: list[Any] | None, tokens: list[int] | None) -> None:
        live = self.seqs.pop(uid).live
        self._keep(cache, tokens, live.stats.cached)
        live.left -= 1
        if live.left:
            return
        if live.first is not None:
            live.stats.decode_s = time.perf_counter() - live.first
        self.record.requests += 1
        self.record.cached_tokens += live.stats.cached
        self.record.dropped += live.job.gone
        live.stats.gone = live.job.gone
        live.job.out.put(("end", live.stats))
        log.info(live.stats.line())

    def _keep(self, cache: list[Any] | None, tokens: list[int] | None, cached: int) -> None:
        """Hand a sequence's cache to the tiers with the tokens it holds (only when it holds
        more than the prefix it started from)."""

        if cache is None or not tokens or len(tokens) <= cached:
            return
        held = tiers.offset(cache)
        if held != len(tokens):  # the cache and its tokens disagree: not kept, never a wrong hit
            log.warning("serve: a cache of %d tokens was handed %d tokens; not kept", held, len(tokens))
            return
        try:
            mx.eval([c.state for c in cache])  # on this thread, before the writer reads it
            self.caches.put(list(tokens), cache)
        except Exception:
            log.exception("serve: keeping a prompt cache failed")

    def _abort(self, message: str, status: int) -> None:
        """End every request in flight and waiting with an error; start a fresh generator."""
        jobs = {id(s.live.job): s.live.job for s in self.seqs.values()}
        while True:
            try:
                job = self.inbox.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                jobs[id(job)] = job
        for job in jobs.values():
            job.out.put(("error", status, message))
        self.record.failed += len(jobs) if status == 500 else 0
        self.seqs.clear()
        self.gen = None


def token_logprobs(logprobs: Any, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """The token's logprob and the ``k`` likeliest (id, logprob), likeliest first."""

    if k == 0:
        return float(logprobs[token].item()), []
    ids = mx.argpartition(-logprobs, kth=k - 1)[:k]
    values = logprobs[ids]
    mx.eval(ids, values)
    top = sorted(zip(ids.tolist(), values.tolist(), strict=True), key=lambda p: -p[1])
    return float(logprobs[token].item()), top


def generator(
    model: Any,
    *,
    batch: bool,
    stop_tokens: set[int],
    max_batch: int,
    prefill_step: int,
    kv_bits: int | None,
    kv_group_size: int,
) -> Any:
    """mlx-lm's ``BatchGenerator`` (``batch``), else one sequence at a time."""

    if not batch:
        from mlxbun.serve.solo import Solo

        return Solo(
            model,
            stop_tokens=stop_tokens,
            prefill_step=prefill_step,
            kv_bits=kv_bits,
            kv_group_size=kv_group_size,
        )

    return BatchGenerator(
        model,
        stop_tokens=[[t] for t in sorted(stop_tokens)],
        completion_batch_size=max_batch,
        prefill_batch_size=min(max_batch, PREFILL_BATCH),
        prefill_step_size=prefill_step,
        stream=mx.default_stream(mx.default_device()),  # this thread's stream, as mlx-lm's server does
    )


def batchable(model: Any, kv_bits: int | None) -> bool:
    """Whether mlx-lm can batch this model's caches (a quantized KV cache it cannot)."""

    return kv_bits is None and all(hasattr(c, "merge") for c in make_prompt_cache(model))
