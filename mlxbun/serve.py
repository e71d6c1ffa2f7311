"""command=serve: an OpenAI-compatible HTTP server whose prompt caches survive restarts.

    python -m mlxbun command=serve model.name=<model> serve.port=8080 [kv.store=<dir>]

Serves ``POST /v1/completions`` and ``/v1/chat/completions`` (streaming with ``"stream": true``
or not) as mlx-lm's server does, plus ``GET /v1/models`` and ``/health``. Each request starts
from the longest cached prefix of its prompt: from memory (an LRU under ``serve.cache_gb``),
else from the KV store on disk (mlxbun.kv.tiers); finished prompts are persisted in the
background, so after a restart a prompt seen before starts from disk. The reuse is reported as
``usage.prompt_tokens_details.cached_tokens`` and in one log line per request. Generation runs
one request at a time on one thread (mlx streams belong to a thread); SIGTERM stops the server
and flushes (``serve.flush=true``) or drops the saves still waiting.
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from mlxbun.errors import InputError, Interrupted
from mlxbun.kv import gc, tiers
from mlxbun.kv.commands import digest_cache, load_model, store_of
from mlxbun.runs.provenance import RunResult
from mlxbun.source.model import model_dir

log = logging.getLogger("mlxbun")

KV_GROUPS = (32, 64, 128)  # mlx-lm's QuantizedKVCache group sizes
SAMPLING = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}


class BadRequest(ValueError):
    """A request the server answers with HTTP 400 and this message."""


@dataclass
class Job:
    """One request on its way through the engine; ``out`` carries its events to the handler."""

    kind: str  # "chat" or "text"
    body: dict[str, Any]
    max_tokens: int
    out: queue.Queue = field(default_factory=queue.Queue)
    cancelled: bool = False
    arrived: float = field(default_factory=time.perf_counter)


@dataclass
class Stats:
    prompt: int
    cached: int
    source: str
    generated: int = 0
    restore_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    ttft_s: float = 0.0

    def line(self, path: str) -> str:
        new = self.prompt - self.cached
        return (
            f"serve: {path}: prompt {self.prompt} tokens, cached {self.cached} ({self.source}), "
            f"restore {self.restore_s:.3f} s, prefill {new} at {rate(new, self.prefill_s)} tok/s, "
            f"decode {self.generated} at {rate(self.generated, self.decode_s)} tok/s, "
            f"first token after {self.ttft_s:.3f} s"
        )


def rate(n: int, seconds: float) -> str:
    return f"{n / seconds:.1f}" if seconds > 0 else "-"


class Engine:
    """Runs jobs one at a time on its own thread: tokenize, fetch the cache, generate, keep it."""

    def __init__(
        self, loaded: Any, caches: tiers.PromptCaches, *, kv_bits: int | None, kv_group_size: int
    ) -> None:
        self.loaded, self.caches = loaded, caches
        self.kv_bits, self.kv_group_size = kv_bits, kv_group_size
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.served = self.cached_tokens = 0
        self.stopping = False
        self.current: Job | None = None
        self.thread = threading.Thread(target=self._loop, name="serve-generate", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        if not self.thread.is_alive():
            raise RuntimeError("the generation thread has stopped")
        self.jobs.put(job)

    def stop(self) -> None:
        """Cut the running generation short, refuse the queued ones (503) and end the thread."""
        self.stopping = True
        if (job := self.current) is not None:
            job.cancelled = True
        self.jobs.put(None)
        self.thread.join(timeout=60)

    def _loop(self) -> None:
        while (job := self.jobs.get()) is not None:
            if self.stopping:
                job.out.put(("error", 503, "the server is stopping"))
                continue
            self.current = job
            try:
                self._run(job)
            except BadRequest as e:
                job.out.put(("error", 400, str(e)))
            except Exception as e:  # the server keeps serving; the client gets a 500
                log.exception("serve: request failed")
                job.out.put(("error", 500, f"{type(e).__name__}: {e}"))
            finally:
                self.current = None

    def prompt_tokens(self, job: Job) -> list[int]:
        tok = self.loaded.tokenizer
        if job.kind == "text":
            prompt = job.body.get("prompt")
            if not isinstance(prompt, str) or not prompt:
                raise BadRequest("prompt must be a non-empty string")
            return list(tok.encode(prompt))
        messages = job.body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise BadRequest("messages must be a non-empty list of {role, content} objects")
        if not getattr(tok, "chat_template", None):
            raise BadRequest("the model's tokenizer has no chat template; use /v1/completions")
        try:
            return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
        except Exception as e:
            raise BadRequest(f"messages cannot be formatted by the chat template: {e}") from None

    def _run(self, job: Job) -> None:
        from mlx_lm.models.cache import make_prompt_cache

        tokens = self.prompt_tokens(job)
        sampler = make_sampler(job.body)
        start = time.perf_counter()
        hit = self.caches.fetch(tokens)
        cache = hit.cache if hit.cache is not None else make_prompt_cache(self.loaded.model)
        stats = Stats(len(tokens), hit.reused, hit.source, restore_s=time.perf_counter() - start)
        job.out.put(("start", stats))
        seen = self._generate(job, tokens[hit.reused :], cache, sampler, stats)
        job.out.put(("end", stats))
        self._keep(tokens + seen, cache)
        self.served += 1
        self.cached_tokens += stats.cached
        log.info(stats.line(job.kind))
        for note in hit.notes:
            log.info("serve: note: %s", note)

    def _generate(self, job: Job, rest: list[int], cache: list[Any], sampler: Any, stats: Stats) -> list[int]:
        """Prefill ``rest`` into ``cache`` and decode, sending each token to the job; returns
        every token fed back (an end-of-sequence token too: the cache may hold it)."""
        import mlx.core as mx
        from mlx_lm.generate import stream_generate

        if job.body.get("seed") is not None:
            mx.random.seed(job.body["seed"])
        seen: list[int] = []
        begun = time.perf_counter()
        for r in stream_generate(
            self.loaded.model,
            self.loaded.tokenizer,
            rest,
            max_tokens=job.max_tokens,
            sampler=sampler,
            prompt_cache=cache,
            kv_bits=self.kv_bits,
            kv_group_size=self.kv_group_size,
            quantized_kv_start=0,
            prompt_progress_callback=lambda done, total: job.out.put(("progress", done, total)),
        ):
            if not seen:
                stats.prefill_s = time.perf_counter() - begun
                stats.ttft_s = time.perf_counter() - job.arrived
            seen.append(int(r.token))
            ended = r.finish_reason == "stop"  # the end-of-sequence token is not part of the answer
            stats.generated += not ended
            logprob = None if ended else float(r.logprobs[r.token])
            job.out.put(("token", r.text, int(r.token), logprob, r.finish_reason))
            if job.cancelled:
                break
        stats.decode_s = time.perf_counter() - begun - stats.prefill_s
        return seen

    def _keep(self, known: list[int], cache: list[Any]) -> None:
        """Hand the cache to the tiers with the tokens it holds (mlx-lm computes one step
        ahead, so it may hold a token never returned: trimmed when it can be, else not kept)."""
        from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

        extra = tiers.offset(cache) - len(known)
        if extra > 0:
            if not can_trim_prompt_cache(cache):
                return
            trim_prompt_cache(cache, extra)
        self.caches.put(known[: tiers.offset(cache)], cache)


def make_sampler(body: dict[str, Any]) -> Any:
    """mlx-lm's sampler for the request's temperature, top_p, top_k and min_p (checked with
    its seed)."""
    from mlx_lm.sample_utils import make_sampler as mlx_sampler

    got = {}
    for key, default in SAMPLING.items():
        value = body.get(key, default)
        if value is None:
            value = default
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise BadRequest(f"{key} must be a number >= 0, not {value!r}")
        got[key] = value
    if got["top_p"] > 1 or got["min_p"] > 1:
        raise BadRequest("top_p and min_p must be at most 1")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise BadRequest(f"seed must be an integer >= 0, not {seed!r}")
    top_p = 0.0 if got["top_p"] >= 1 else float(got["top_p"])
    return mlx_sampler(float(got["temperature"]), top_p, float(got["min_p"]), top_k=int(got["top_k"]))


class Handler(BaseHTTPRequestHandler):
    """The OpenAI routes; one instance per connection, on the server's handler threads."""

    engine: Engine
    model_id: str
    default_max_tokens: int
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # the engine logs each request
        pass

    def do_GET(self) -> None:
        if self.path == "/health":
            self._json(200, {"status": "ok"})
        elif self.path.startswith("/v1/models"):
            self._json(
                200, {"object": "list", "data": [{"id": self.model_id, "object": "model", "created": 0}]}
            )
        else:
            self._json(404, {"error": f"no route {self.path}"})

    def do_POST(self) -> None:
        kinds = {"/v1/completions": "text", "/v1/chat/completions": "chat", "/chat/completions": "chat"}
        if self.path not in kinds:
            self._json(404, {"error": f"no route {self.path}"})
            return
        try:
            body = self._body()
            job = Job(kinds[self.path], body, max_tokens=self._max_tokens(body))
            stream = body.get("stream", False)
            if not isinstance(stream, bool):
                raise BadRequest(f"stream must be true or false, not {stream!r}")
            stop = stop_words(body.get("stop"))
        except BadRequest as e:
            self._json(400, {"error": str(e)})
            return
        self.engine.submit(job)
        event = job.out.get()
        if event[0] == "error":
            self._json(event[1], {"error": event[2]})
            return
        reply = Reply(self, job, stream=stream, stop=stop)
        try:
            reply.send(event[1])
        except (BrokenPipeError, ConnectionResetError):
            job.cancelled = True

    def _body(self) -> dict[str, Any]:
        try:
            n = int(self.headers.get("Content-Length", ""))
        except ValueError:
            raise BadRequest("a Content-Length header with the body's size is required") from None
        try:
            body = json.loads(self.rfile.read(n))
        except ValueError as e:
            raise BadRequest(f"the body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        return body

    def _max_tokens(self, body: dict[str, Any]) -> int:
        n = body.get("max_completion_tokens", body.get("max_tokens", self.default_max_tokens))
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise BadRequest(f"max_tokens must be an integer >= 1, not {n!r}")
        return n

    def _json(self, code: int, doc: dict[str, Any]) -> None:
        data = json.dumps(doc).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def stop_words(value: Any) -> list[str]:
    if value is None:
        return []
    words = [value] if isinstance(value, str) else value
    if not isinstance(words, list) or not all(isinstance(w, str) and w for w in words):
        raise BadRequest(f"stop must be a string or a list of non-empty strings, not {value!r}")
    return words


class Reply:
    """Turns a job's token events into one JSON response or a stream of server-sent events,
    cutting the text at the first stop word."""

    def __init__(self, handler: Handler, job: Job, *, stream: bool, stop: list[str]) -> None:
        self.h, self.job, self.stream, self.stop = handler, job, stream, stop
        self.chat = job.kind == "chat"
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4()}"
        self.created = int(time.time())
        self.hold = max((len(w) for w in stop), default=1) - 1  # text that may start a stop word
        opts = job.body.get("stream_options") or {}
        self.include_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))

    def send(self, stats: Stats) -> None:
        text, sent, tokens, logprobs, finish = "", 0, [], [], None
        if self.stream:
            self.h.send_response(200)
            self.h.send_header("Content-Type", "text/event-stream")
            self.h.send_header("Cache-Control", "no-cache")
            self.h.send_header("Transfer-Encoding", "chunked")
            self.h.end_headers()
        while True:
            event = self.job.out.get()
            if event[0] == "end":
                stats = event[1]
                break
            if event[0] == "error":  # the engine logged it; nothing more comes for this job
                if not self.stream:
                    self.h._json(500, {"error": event[2]})
                    return
                finish = "error"
                break
            if event[0] == "progress":  # a long prefill: keep the stream's client waiting
                if self.stream:
                    self._raw(f": keepalive {event[1]}/{event[2]}\n\n".encode())
                continue
            if self.job.cancelled:  # cut at a stop word: the rest is drained, not sent
                continue
            _, piece, token, logprob, reason = event
            text += piece
            if logprob is not None:
                tokens.append(token)
                logprobs.append(logprob)
            cut = min((i for w in self.stop if (i := text.find(w)) >= 0), default=-1)
            if cut >= 0:
                text, finish, self.job.cancelled = text[:cut], "stop", True
            elif reason is not None:
                finish = reason
            if self.stream:
                upto = len(text) if finish else max(sent, len(text) - self.hold)
                if upto > sent:
                    self._event(self._chunk(text[sent:upto], None))
                    sent = upto
        if not self.stream:
            self._whole(text, finish or "stop", stats, tokens, logprobs)
            return
        if sent < len(text):
            self._event(self._chunk(text[sent:], None))
        self._event(self._chunk("", finish or "stop"))
        if self.include_usage:
            self._event(self._base([]) | {"usage": usage(stats)})
        self._raw(b"data: [DONE]\n\n")
        self._raw(b"")

    def _base(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        kind = (
            ("chat.completion.chunk" if self.stream else "chat.completion")
            if self.chat
            else "text_completion"
        )
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.h.model_id,
            "system_fingerprint": self.h.model_id,
            "choices": choices,
        }

    def _chunk(self, text: str, finish: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": text} if text else {}
        else:
            choice["text"] = text
        return self._base([choice])

    def _whole(self, text: str, finish: str, stats: Stats, tokens: list[int], logprobs: list[float]) -> None:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if self.job.body.get("logprobs"):
            choice["logprobs"] = {
                "content": [{"id": t, "logprob": g} for t, g in zip(tokens, logprobs, strict=True)]
            }
        self.h._json(200, self._base([choice]) | {"usage": usage(stats)})

    def _event(self, doc: dict[str, Any]) -> None:
        self._raw(f"data: {json.dumps(doc)}\n\n".encode())

    def _raw(self, data: bytes) -> None:
        self.h.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.h.wfile.flush()


def usage(stats: Stats) -> dict[str, Any]:
    return {
        "prompt_tokens": stats.prompt,
        "completion_tokens": stats.generated,
        "total_tokens": stats.prompt + stats.generated,
        "prompt_tokens_details": {"cached_tokens": stats.cached},
    }


def keyspace(loaded: Any, *, kv_bits: int | None, kv_group_size: int) -> tiers.Keyspace:
    """The keyspace of this model, tokenizer, chat template and cache configuration."""
    from mlx_lm.models.cache import make_prompt_cache

    if kv_bits:
        check_kv_group(loaded.model, kv_group_size)
    classes = [type(c).__name__ for c in tiers.leaf_caches(make_prompt_cache(loaded.model))]
    if kv_bits:  # mlx-lm turns each KVCache into a QuantizedKVCache at the first step
        classes = ["QuantizedKVCache" if c == "KVCache" else c for c in classes]
    template = getattr(loaded.tokenizer, "chat_template", None) or ""
    if not isinstance(template, str):
        template = json.dumps(template, sort_keys=True)
    return tiers.Keyspace(
        model=loaded.model_fp,
        tokenizer=loaded.tokenizer_fp,
        template=hashlib.sha256(template.encode()).hexdigest(),
        cache=tiers.cache_kind(classes, bits=kv_bits, group_size=kv_group_size),
    )


def check_kv_group(model: Any, group_size: int) -> None:
    """Refuse a KV group size that does not divide the model's head width (one token's step
    tells it), before a request fails on it."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array([[0]]), cache=cache)
    widths = {int(s.keys.shape[-1]) for s in tiers.leaf_caches(cache) if getattr(s, "keys", None) is not None}
    bad = sorted(w for w in widths if w % group_size)
    if not bad:
        return
    fits = [str(g) for g in KV_GROUPS if all(w % g == 0 for w in widths)]
    fix = (
        f"choose one of {', '.join(fits)}" if fits else "no KV group size fits it: leave serve.kv_bits unset"
    )
    raise InputError(
        f"serve.kv_group_size={group_size} does not divide the model's KV head width {bad[0]}; {fix}"
    )


def build_caches(cfg: Any, loaded: Any, space: tiers.Keyspace) -> tiers.PromptCaches:
    memory = tiers.MemoryTier(max_bytes=int(cfg.serve.cache_gb * 2**30))
    if not cfg.serve.persist:
        return tiers.PromptCaches(space, memory)
    store = store_of(cfg)
    store.check_writable()
    store.remember_model(loaded.model_fp, loaded.name or str(loaded.path))
    disk = tiers.DiskTier(store, space, verify=cfg.kv.verify)
    writer = tiers.Persister(
        store, layout=cfg.kv.layout, model_name=loaded.name, max_pending=cfg.serve.max_pending
    )
    evict = None if cfg.kv.cap_bytes is None else evictor(store, cfg.kv.cap_bytes)
    return tiers.PromptCaches(space, memory, disk, writer, evict=evict)


def evictor(store: Any, cap_bytes: int) -> Any:
    """kv_gc's plan and execute (under the store's exclusive lock, so no restore in progress
    loses its data), run after each save: the least recently used snapshots go first."""

    def evict() -> list[str]:
        plan = gc.plan(store, cap_bytes=cap_bytes)
        if not (plan.evict or plan.blocks):
            return []
        gc.execute(store, plan)
        log.info("serve: kv.cap_gb: evicted %d snapshot(s), %d bytes", len(plan.evict), plan.bytes_freed)
        return [name for name, _ in plan.evict]

    return evict


def run(cfg: Any) -> Any:
    """command=serve: load the model, open the caches, serve until SIGTERM or Ctrl-C."""
    s = cfg.serve
    handler = type("BoundHandler", (Handler,), {"default_max_tokens": s.max_tokens})
    server = listen(s.host, s.port, handler)  # a busy port fails before the model loads
    try:
        loaded = load_model(model_dir(cfg), cache_dir=digest_cache(cfg))
        caches = build_caches(cfg, loaded, keyspace(loaded, kv_bits=s.kv_bits, kv_group_size=s.kv_group_size))
    except BaseException:
        server.server_close()
        raise
    handler.engine = Engine(loaded, caches, kv_bits=s.kv_bits, kv_group_size=s.kv_group_size)
    handler.model_id = loaded.name or loaded.path.name
    disk = len(caches.disk.index) if caches.disk else 0
    where = f"kv.store={caches.disk.store.root}" if caches.disk else "memory only"
    print(
        f"serving {loaded.path} on http://{s.host}:{server.server_address[1]} ({where}, {disk} stored prompt(s))",
        flush=True,
    )
    why = "stopped"
    try:
        server.serve_forever()
    except Interrupted as e:  # SIGTERM or Ctrl-C is how a server is stopped: a clean exit
        why = f"stopped by {signal.Signals(e.signum).name}"
    finally:
        server.server_close()
        stop(handler.engine, caches, flush=s.flush)
    served = handler.engine.served
    metrics = {"requests": served, "cached_tokens": handler.engine.cached_tokens}
    return RunResult(metrics=metrics, message=f"{why} after {served} request(s)")


def listen(host: str, port: int, handler: type) -> ThreadingHTTPServer:
    try:
        server = ThreadingHTTPServer((host, port), handler)
    except OSError as e:
        raise InputError(
            f"serve.port={port}: cannot listen on {host}:{port} ({e.strerror}); choose another serve.port"
            " (0 picks a free one) or serve.host"
        ) from None
    server.daemon_threads = True
    return server


def stop(engine: Engine, caches: tiers.PromptCaches, *, flush: bool) -> None:
    """Finish the running generation, then flush or drop the saves still waiting."""
    engine.stop()
    if caches.persister is not None:
        waiting = caches.persister.waiting()
        caches.persister.close(flush=flush)
        p = caches.persister
        log.info(
            "serve: stopped; %d save(s) written, %d dropped, %d failed (%d waiting at the signal, %s)",
            p.written,
            p.dropped,
            p.failed,
            waiting,
            "flushed" if flush else "dropped",
        )
