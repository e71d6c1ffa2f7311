"""command=serve's batching engine, stepped by the test itself: requests join and leave a running
batch at token boundaries, a long prompt is read in chunks while others keep decoding, and each
sequence's tokens equal mlx-lm's one-request generation. Overlap is read from the engine's own
record of batch sizes, never from clocks."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from serve_util import Local, load

from mlxbun import serve
from mlxbun.kv import tiers
from mlxbun.serve import caches, engine
from mlxbun.serve.text import TokenText

PROMPTS = [
    "the cat sat on the mat and then it",
    "once upon a time there was a little girl who lived",
    "in the beginning",
    "def add(a, b):\n    return",
]


@pytest.fixture(scope="module")
def loaded():
    return load()


def solo(loaded, tokens: list[int], n: int) -> list[int]:
    return [int(t) for t, _ in generate_step(mx.array(tokens), loaded.model, max_tokens=n)]


def make(loaded, *, kv_bits: int | None = None, prefill_step: int = 64) -> engine.Engine:
    space = caches.keyspace(loaded, kv_bits=kv_bits, kv_group_size=64)
    prompt_caches = tiers.PromptCaches(space, tiers.MemoryTier(max_bytes=2**30))

    def generator():
        return engine.generator(
            loaded.model,
            batch=engine.batchable(loaded.model, kv_bits),
            stop_tokens=set(loaded.tokenizer.eos_token_ids),
            max_batch=8,
            prefill_step=prefill_step,
            kv_bits=kv_bits,
            kv_group_size=64,
        )

    return engine.Engine(loaded.model, prompt_caches, make_generator=generator)


def drain(job: engine.Job) -> list[tuple]:
    out = []
    while not job.out.empty():
        out.append(job.out.get())
    return out


def finish(eng: engine.Engine) -> None:
    eng.step()  # admits what was submitted
    while eng.seqs:
        eng.step()


def tokens_of(events: list[tuple]) -> list[int]:
    return [e[2] for e in events if e[0] == "token"]


def job(loaded, text: str, n: int) -> engine.Job:
    return engine.Job(engine.Request("text", list(loaded.tokenizer.encode(text)), n))


def test_requests_join_a_running_batch_and_match_one_at_a_time(loaded):
    eng = make(loaded)
    first, *rest = [job(loaded, p, 10) for p in PROMPTS]
    eng.submit(first)
    batches = [eng.step()]
    while batches[-1] == 0 or len(batches) < 4:  # the first request decodes alone a few tokens
        batches.append(eng.step())
    for j in rest:
        eng.submit(j)
    while eng.seqs:
        batches.append(eng.step())
    assert max(batches) == 4 == eng.record.peak_batch and sum(batches) == 40
    for j in [first, *rest]:
        events = drain(j)
        assert events[0][0] == "start" and events[-1][0] == "end"
        assert tokens_of(events) == solo(loaded, j.request.tokens, 10)
    assert eng.record.requests == 4 and eng.record.tokens == 40


def test_a_long_prompt_is_read_in_chunks_while_others_keep_decoding(loaded):
    eng = make(loaded, prefill_step=16)
    short, long = job(loaded, PROMPTS[0], 40), job(loaded, " ".join(PROMPTS) * 4, 4)
    eng.submit(short)
    while eng.step() == 0:  # until the short one decodes
        pass
    eng.submit(long)
    made = []
    while not any(e[0] == "token" for e in list(long.out.queue)):
        made.append(eng.step())
    chunks = -(-(len(long.request.tokens) - 1) // 16)
    assert len(made) >= chunks - 1 >= 4  # the long prompt took several steps...
    assert made[:-1] == [1] * (len(made) - 1)  # ...and the short one made a token at every one
    while eng.seqs:
        eng.step()
    assert tokens_of(drain(short)) == solo(loaded, short.request.tokens, 40)
    assert tokens_of(drain(long)) == solo(loaded, long.request.tokens, 4)


def test_each_sequence_starts_from_its_cached_prefix(loaded):
    eng = make(loaded)
    a = job(loaded, PROMPTS[1], 6)
    eng.submit(a)
    finish(eng)
    longer = PROMPTS[1] + " and she had a dog"
    b, c = job(loaded, longer, 6), job(loaded, PROMPTS[2], 6)
    eng.submit(b)
    eng.submit(c)
    finish(eng)
    start_b, start_c = drain(b)[0], drain(c)[0]
    shared = len(a.request.tokens) + 5  # the prompt and the answer the cache held, less the last token
    assert start_b[0] == "start" and start_b[2] == "memory" and start_b[1] >= len(a.request.tokens) - 1
    assert start_b[1] <= shared and start_c[1:] == (0, "none")
    again = job(loaded, longer, 6)
    eng.submit(again)
    finish(eng)
    events = drain(again)
    assert events[0][1] == len(again.request.tokens) - 1
    assert tokens_of(events) == solo(loaded, again.request.tokens, 6)


def test_stopped_choices_leave_at_the_next_token(loaded):
    eng = make(loaded)
    a, b = job(loaded, PROMPTS[0], 50), job(loaded, PROMPTS[1], 50)
    eng.submit(a)
    eng.submit(b)
    eng.step()
    eng.step()
    a.stop()
    assert eng.step() == 1 and eng.running == 1
    assert drain(a)[-1][1].gone and eng.record.dropped == 1
    b.stop(0)  # a stop word cut it
    eng.step()
    assert eng.running == 0 and drain(b)[-1][0] == "end"


def test_a_quantized_kv_cache_is_served_one_at_a_time(loaded):
    eng = make(loaded, kv_bits=8)
    jobs = [job(loaded, p, 6) for p in PROMPTS[:3]]
    for j in jobs:
        eng.submit(j)
    finish(eng)
    assert eng.record.peak_batch == 1 and eng.record.requests == 3
    for j in jobs:
        got = tokens_of(drain(j))
        want = [
            int(t)
            for t, _ in generate_step(
                mx.array(j.request.tokens),
                loaded.model,
                max_tokens=6,
                kv_bits=8,
                kv_group_size=64,
                quantized_kv_start=0,
            )
        ]
        assert got == want


def test_concurrent_http_requests_share_one_batch(loaded):
    server = Local(loaded, begin=False)  # requests queue until the engine starts: no race to win
    try:
        bodies = [{"prompt": p, "max_tokens": 8, "logprobs": 0} for p in PROMPTS]
        with ThreadPoolExecutor(len(bodies)) as pool:
            replies = pool.map(lambda b: server.post("/v1/completions", b), bodies)
            while server.engine.inbox.qsize() < len(bodies):
                time.sleep(0.01)
            server.engine.start()
            replies = list(replies)
        assert server.engine.record.peak_batch == len(bodies)
        for body, (status, reply) in zip(bodies, replies, strict=True):
            assert status == 200, reply
            tokens = list(loaded.tokenizer.encode(body["prompt"]))
            want = solo(loaded, tokens, 8)
            assert reply["choices"][0]["logprobs"]["tokens"] == [
                TokenText(loaded.tokenizer).text(t) for t in want
            ]
    finally:
        server.close()


def test_float32_compute_is_its_own_keyspace_with_float32_tokens():
    loaded32 = load()
    serve.upcast(loaded32.model)
    assert caches.keyspace(loaded32, kv_bits=None, kv_group_size=64, float32=True).digest != (
        caches.keyspace(loaded32, kv_bits=None, kv_group_size=64).digest
    )
    server = Local(loaded32, float32=True)
    try:
        status, reply = server.post("/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 8, "logprobs": 0})
    finally:
        server.close()
    want = solo(loaded32, list(loaded32.tokenizer.encode(PROMPTS[1])), 8)
    assert status == 200 and reply["choices"][0]["logprobs"]["tokens"] == [
        TokenText(loaded32.tokenizer).text(t) for t in want
    ]
