"""command=serve: an OpenAI- and Anthropic-compatible server whose prompt caches survive restarts.

    python -m mlxbun command=serve model.name=<model> serve.port=8080 [kv.store=<dir>]

Loads the model, opens its prompt caches (an LRU under ``serve.cache_gb`` in memory over the KV
store on disk; ``serve.persist=false``: memory only), starts the batching engine and serves HTTP
until SIGTERM or Ctrl-C, which end the requests in flight and flush (``serve.flush=true``) or
drop the saves still waiting. The run's record counts the requests, the largest batch and the
background saves written, dropped and failed. The package's modules:

    httpd.py          the HTTP layer: routes, bodies read with limits, JSON errors, streams
    openai_api.py     OpenAI's request fields and response shapes
    anthropic_api.py  Anthropic's Messages API
    prompts.py        prompts into token ids (the chat template, or a fallback)
    checks.py         every request field checked before anything is compiled or queued
    engine.py         continuous batching: requests join and leave at token boundaries
    solo.py           one sequence at a time, for caches mlx-lm cannot batch (serve.kv_bits)
    text.py           tokens into reply text: detokenizing, stop words, token bytes
    caches.py         the keyspace every cached prompt is made under
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlxbun.errors import Interrupted
from mlxbun.io.safetensors import read_config
from mlxbun.kv import gc, tiers
from mlxbun.kv.commands import digest_cache, load_model, store_of
from mlxbun.runs.provenance import RunResult
from mlxbun.serve import engine, httpd, prompts
from mlxbun.serve.caches import keyspace
from mlxbun.serve.checks import Limits
from mlxbun.serve.text import Context, TokenText
from mlxbun.source.model import model_dir

log = logging.getLogger("mlxbun")

CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "n_ctx")
NO_CONTEXT = 2**24  # the cap when a config names no context


def upcast(model: Any) -> None:
    """serve.float32: every floating weight in float32 (quantized codes stay as they are)."""

    model.set_dtype(mx.float32)
    mx.eval(model.parameters())  # here: a lazy array is evaluated only on the thread that made it
    log.info("serve: computing in float32 (serve.float32=true)")


def limits(loaded: Any) -> Limits:
    """The model's context (from its config) and logits width (from one token's forward)."""

    vocab = int(loaded.model(mx.array([[0]]), cache=make_prompt_cache(loaded.model)).shape[-1])
    config = read_config(loaded.path)
    config = config | config.get("text_config", {})
    context = next(
        (config[k] for k in CONTEXT_KEYS if isinstance(config.get(k), int) and config[k] > 0), None
    )
    if context is None:
        log.warning(
            "serve: %s/config.json names no context length; requests are capped at %d tokens",
            loaded.path,
            NO_CONTEXT,
        )
    return Limits(context=context or NO_CONTEXT, vocab=vocab)


def chat_fallback(tokenizer: Any) -> None:
    """Give a tokenizer without a chat template the fallback, and say so (once)."""
    if prompts.ensure_template(tokenizer):
        log.warning(
            "serve: the tokenizer has no chat template; chat requests use mlx-lm's server transcript"
            " (USER: ... lines, then ASSISTANT:)"
        )


def start(
    server: httpd.Server,
    loaded: Any,
    caches: tiers.PromptCaches,
    *,
    model_id: str,
    s: Any,
    begin: bool = True,
) -> httpd.App:
    """Attach the engine and the request context to a bound server and start the engine
    (``s``: the serve settings: max_tokens, max_batch, prefill_step, kv_bits, kv_group_size;
    ``begin=False``: the caller starts ``app.engine`` when it chooses)."""
    chat_fallback(loaded.tokenizer)
    batch = engine.batchable(loaded.model, s.kv_bits)
    if not batch:
        log.info(
            "serve: this cache setting cannot be batched (mlx-lm batches no quantized KV); one request at a time"
        )

    def make() -> Any:
        return engine.generator(
            loaded.model,
            batch=batch,
            stop_tokens=set(loaded.tokenizer.eos_token_ids),
            max_batch=s.max_batch,
            prefill_step=s.prefill_step,
            kv_bits=s.kv_bits,
            kv_group_size=s.kv_group_size,
        )

    ctx = Context(loaded.tokenizer, limits(loaded), model_id, s.max_tokens, TokenText(loaded.tokenizer))
    created = int(os.stat(loaded.path / "config.json").st_mtime)
    app = httpd.App(engine.Engine(loaded.model, caches, make_generator=make), ctx, created)
    server.app = app
    if begin:
        app.engine.start()
    return app


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
    server = httpd.listen(s.host, s.port, None)  # a bad address fails before the model loads
    try:
        loaded = load_model(model_dir(cfg), cache_dir=digest_cache(cfg))
        if s.float32:
            upcast(loaded.model)
        chat_fallback(loaded.tokenizer)  # before the keyspace, which hashes the template
        space = keyspace(loaded, kv_bits=s.kv_bits, kv_group_size=s.kv_group_size, float32=s.float32)
        caches = build_caches(cfg, loaded, space)
        app = start(server, loaded, caches, model_id=loaded.name or cfg.model.name or loaded.path.name, s=s)
    except BaseException:
        server.server_close()
        raise
    disk = len(caches.disk.index) if caches.disk else 0
    where = f"kv.store={caches.disk.store.root}" if caches.disk else "memory only"
    print(
        f"serving {app.ctx.model_id!r} ({loaded.path}) on http://{s.host}:{server.server_address[1]}"
        f" ({where}, {disk} stored prompt(s))",
        flush=True,
    )
    why = "stopped"
    try:
        server.serve_forever()
    except Interrupted as e:  # SIGTERM or Ctrl-C is how a server is stopped: a clean exit
        why = f"stopped by {signal.Signals(e.signum).name}"
    finally:
        server.server_close()
        stop(app, caches, flush=s.flush)
    return result(app, caches, why)


def result(app: httpd.App, caches: tiers.PromptCaches, why: str) -> RunResult:
    rec, p = app.engine.record, caches.persister
    metrics = {
        "requests": rec.requests,
        "cached_tokens": rec.cached_tokens,
        "tokens": rec.tokens,
        "peak_batch": rec.peak_batch,
        "failed_requests": rec.failed,
        "dropped_requests": rec.dropped,
        "saves_written": p.written if p else 0,
        "saves_dropped": p.dropped if p else 0,
        "saves_failed": p.failed if p else 0,
    }
    message = f"{why} after {rec.requests} request(s), largest batch {rec.peak_batch}"
    if metrics["saves_failed"]:
        message += f"; {metrics['saves_failed']} background save(s) failed (the log names them)"
    return RunResult(metrics=metrics, message=message)


def stop(app: httpd.App, caches: tiers.PromptCaches, *, flush: bool) -> None:
    """End the requests in flight, then flush or drop the saves still waiting."""
    app.engine.stop()
    p = caches.persister
    if p is None:
        return
    waiting = p.waiting()
    p.close(flush=flush)
    log.info(
        "serve: stopped; %d save(s) written, %d dropped, %d failed (%d waiting at the signal, %s)",
        p.written,
        p.dropped,
        p.failed,
        waiting,
        "flushed" if flush else "dropped",
    )
