"""command=serve: a running server answered over HTTP, its prompt caches across restarts and faults."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx_lm
import pytest
from cli_util import REPO, isolated_args, run_cli
from mlx_lm.models.cache import make_prompt_cache
from serve_util import load

from mlxbun.kv import commands
from mlxbun.kv.store import Store
from mlxbun.serve.text import TokenText

SYSTEM = "You answer in one word. " * 8
PROMPT = "the quick brown fox jumps over the lazy dog; " * 4

# A sitecustomize.py body: the first snapshot save stops after its data is written (a marker
# file says so) until the file named by STALL_RELEASE exists (or the process is killed).
STALL_MID_SAVE = """
import os, time
from mlxbun.kv import snapshot
real = snapshot.write_snapshot
def stalled(path, layers, base, **kw):
    step = kw.pop("on_step")
    def on_step(name):
        step(name)
        if name == "tail" and not os.path.exists(os.environ["STALL_MARKER"]):
            open(os.environ["STALL_MARKER"], "w").close()
            while not os.path.exists(os.environ.get("STALL_RELEASE", "/nonexistent")):
                time.sleep(0.05)
    return real(path, layers, base, on_step=on_step, **kw)
snapshot.write_snapshot = stalled
"""


def stalling(tmp: Path) -> tuple[dict[str, str], Path, Path]:
    """Environment for a server whose first save stalls; (env, marker, release file)."""
    (tmp / "site").mkdir(exist_ok=True)
    (tmp / "site" / "sitecustomize.py").write_text(STALL_MID_SAVE)
    marker, release = tmp / "stalled", tmp / "release"
    env = {"PYTHONPATH": f"{tmp / 'site'}{os.pathsep}{REPO}", "STALL_MARKER": str(marker)}
    return env | {"STALL_RELEASE": str(release)}, marker, release


def wait_for(path: Path) -> None:
    for _ in range(400):
        if path.exists():
            return
        time.sleep(0.05)
    raise AssertionError(f"{path} never appeared")


# requests the server refuses: (route, body, HTTP status, the error's param, its message)
BAD = [
    (
        "/v1/completions",
        b"{not json",
        400,
        None,
        "the body is not JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)",
    ),
    (
        "/v1/completions",
        b'{"prompt": "x", "temperature": -1}',
        400,
        "temperature",
        "temperature must be a number from 0 to 2, not -1",
    ),
    (
        "/v1/completions",
        b'{"prompt": "x", "max_tokens": 0}',
        400,
        "max_tokens",
        "max_tokens must be an integer from 1 to 4611686018427387904, not 0",
    ),
    (
        "/v1/completions",
        b'{"prompt": "x", "seed": "s"}',
        400,
        "seed",
        "seed must be an integer from -2^63 to 2^63-1, not 's'",
    ),
    ("/v1/completions", b'{"prompt": ""}', 400, "prompt", "prompt is empty: there is no token to start from"),
    (
        "/v1/chat/completions",
        b'{"messages": "hi"}',
        400,
        "messages",
        "messages must be a non-empty list of {role, content} objects",
    ),
    ("/v1/embeddings", b"{}", 404, None, "no route POST /v1/embeddings"),
]


def error(status: int, param: str | None, message: str) -> dict:
    kind = "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


@pytest.fixture(scope="module")
def loaded():
    return load()


RUNNING: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def no_server_left():
    """A failed test must not leave its server running."""
    yield
    while RUNNING:
        proc = RUNNING.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


class Server:
    """``python -m mlxbun command=serve`` in a subprocess on a free port."""

    def __init__(self, model: Path, tmp: Path, *extra: str, env: dict[str, str] | None = None) -> None:
        argv = [sys.executable, "-m", "mlxbun", "command=serve", f"model.name={model}", "serve.port=0"]
        argv += [f"kv.store={tmp / 'kv'}", *extra, *isolated_args(tmp)]
        self.log = tmp / f"server-{time.monotonic_ns()}.log"
        self.proc = subprocess.Popen(
            argv,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=self.log.open("w"),
            text=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
        )
        RUNNING.append(self.proc)
        line = self.proc.stdout.readline()
        found = re.search(r"http://127\.0\.0\.1:(\d+)", line)
        assert found, f"no address in {line!r}; log: {self.log.read_text()}"
        self.port = int(found.group(1))

    def call(self, path: str, body: bytes) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())

    def post(self, path: str, body: dict) -> dict:
        status, reply = self.call(path, json.dumps(body).encode())
        assert status == 200, reply
        return reply

    def stream(self, path: str, body: dict) -> list[dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        conn.request("POST", path, json.dumps(body | {"stream": True}), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.getheader("Content-Type") == "text/event-stream"
        events = [ln[len("data: ") :] for ln in resp.read().decode().splitlines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]"
        return [json.loads(e) for e in events[:-1]]

    def hang_up(self, path: str, body: dict) -> None:
        """Open a stream, read its first chunk and close the connection."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        conn.request("POST", path, json.dumps(body | {"stream": True}), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.fp.readline()
        conn.sock.close()
        conn.close()
        for _ in range(600):  # the server notices at its next look, then frees the place
            health = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
            health.request("GET", "/health")
            if json.loads(health.getresponse().read())["running"] == 0:
                return
            time.sleep(0.1)
        raise AssertionError("the hung-up stream still runs")

    def stop(self, sig: int = signal.SIGTERM) -> str:
        self.proc.send_signal(sig)
        self.proc.wait(timeout=60)
        self.proc.stdout.close()
        return self.log.read_text()


def scratch(loaded, tokens: list[int], n: int) -> list[int]:
    return commands.greedy(loaded, tokens, make_prompt_cache(loaded.model), max_tokens=n)


def ids(reply: dict) -> list[str]:
    """The reply's tokens, as its logprobs give them (their text)."""
    logprobs = reply["choices"][0]["logprobs"]
    return logprobs["tokens"] if "tokens" in logprobs else [e["token"] for e in logprobs["content"]]


def texts(loaded, tokens: list[int]) -> list[str]:
    return [TokenText(loaded.tokenizer).text(t) for t in tokens]


def cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_greedy_tokens_equal_mlx_lm_and_survive_a_restart(loaded, tmp_path):
    text = {"prompt": PROMPT, "max_tokens": 12, "logprobs": 0}
    tokens = list(loaded.tokenizer.encode(PROMPT))
    want = texts(loaded, scratch(loaded, tokens, 12))
    server = Server(loaded.path, tmp_path)
    first = server.post("/v1/completions", text)
    assert ids(first) == want and cached(first) == 0
    assert first["usage"]["prompt_tokens"] == len(tokens)
    whole = mlx_lm.generate(loaded.model, loaded.tokenizer, tokens, max_tokens=12)
    assert first["choices"][0]["text"] == whole and len(whole) >= 4
    stop = whole[2:4]
    cut = server.post("/v1/completions", text | {"stop": [stop]})["choices"][0]
    assert cut == cut | {"text": whole[: whole.find(stop)], "finish_reason": "stop"}
    chunks = server.stream("/v1/completions", text | {"stop": stop})
    assert "".join(c["choices"][0]["text"] for c in chunks) == cut["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"

    chat = {
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}],
        "max_tokens": 8,
    }
    whole = server.post("/v1/chat/completions", chat)
    chunks = server.stream("/v1/chat/completions", chat | {"stream_options": {"include_usage": True}})
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert streamed == whole["choices"][0]["message"]["content"]
    assert cached(chunks[-1]) == chunks[-1]["usage"]["prompt_tokens"] - 1  # the same prompt, from memory
    for route, body, code, param, message in BAD:
        assert server.call(route, body) == (code, error(code, param, message))
    server.hang_up("/v1/completions", {"prompt": PROMPT, "max_tokens": 900, "logit_bias": {"0": -100}})
    log = server.stop()
    assert server.proc.returncode == 0, log
    assert re.search(r"serve: text: prompt \d+ tokens, cached 0 \(none\).*tok/s", log)
    assert "stopped: the client hung up" in log and "Traceback" not in log and "Broken" not in log
    assert "the tokenizer has no chat template; chat requests use mlx-lm's server transcript" in log

    again = Server(loaded.path, tmp_path)
    second = again.post("/v1/completions", text)
    log = again.stop()
    assert ids(second) == want
    assert cached(second) == len(tokens) - 1, log  # all but the token the model must see
    assert f"cached {len(tokens) - 1} (disk)" in log


def served_once(loaded, tmp: Path) -> tuple[dict, list[int]]:
    """A request served (and persisted) by a server that is then stopped: (request, tokens)."""
    text = {"prompt": PROMPT, "max_tokens": 10, "logprobs": 0}
    want = texts(loaded, scratch(loaded, list(loaded.tokenizer.encode(PROMPT)), 10))
    server = Server(loaded.path, tmp)
    assert ids(server.post("/v1/completions", text)) == want
    server.stop()
    return text, want


def test_a_flipped_byte_is_a_miss_recomputed_and_replaced(loaded, tmp_path):
    text, want = served_once(loaded, tmp_path)
    store = Store(tmp_path / "kv")
    (name,) = store.names()
    path = store.path_of(name)
    raw = bytearray(path.read_bytes())
    raw[-40] ^= 0x01  # a byte of K/V data
    path.write_bytes(bytes(raw))
    assert store.verify()[1]

    server = Server(loaded.path, tmp_path)
    reply = server.post("/v1/completions", text)
    log = server.stop()
    assert ids(reply) == want and cached(reply) == 0
    assert f"snapshot {name!r} cannot be used" in log and "a miss, recomputed and replaced" in log
    assert store.verify() == (store.verify()[0], [])  # replaced by a good copy


def test_a_damaged_block_is_replaced_so_the_next_restart_reuses_it(loaded, tmp_path):
    """kv.layout=blocks: a block of the right size and other bytes is a miss; the log says it was
    replaced, and it was: the next server reuses the prompt from disk."""
    text = {"prompt": PROMPT, "max_tokens": 10, "logprobs": 0}
    tokens = list(loaded.tokenizer.encode(PROMPT))
    server = Server(loaded.path, tmp_path, "kv.layout=blocks")
    want = ids(server.post("/v1/completions", text))
    server.stop()
    store = Store(tmp_path / "kv")
    block = next(p for p in sorted((tmp_path / "kv" / "blocks").iterdir()) if not p.name.startswith("."))
    good = block.read_bytes()
    block.write_bytes(bytes([good[0] ^ 0x01]) + good[1:])
    assert store.verify()[1]

    server = Server(loaded.path, tmp_path, "kv.layout=blocks")
    reply = server.post("/v1/completions", text)
    log = server.stop()
    assert ids(reply) == want and cached(reply) == 0
    assert "a miss, recomputed and replaced" in log
    assert block.read_bytes() == good and store.verify()[1] == []

    again = Server(loaded.path, tmp_path, "kv.layout=blocks")
    reply = again.post("/v1/completions", text)
    log = again.stop()
    assert ids(reply) == want and cached(reply) == len(tokens) - 1, log
    assert f"cached {len(tokens) - 1} (disk)" in log


def test_eight_parallel_clients_share_a_system_prompt(loaded, tmp_path):
    server = Server(loaded.path, tmp_path)
    users = [f"question {i}: what is {i} plus {i}?" for i in range(9)]

    def ask(user: str) -> dict:
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
        return server.post("/v1/chat/completions", {"messages": msgs, "max_tokens": 6, "logprobs": True})

    first = ask(users[0])  # its cache holds the system prompt the other eight start from
    with ThreadPoolExecutor(8) as pool:
        replies = [first, *pool.map(ask, users[1:])]
    server.stop()
    shared = len(loaded.tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}], tokenize=True))
    assert cached(first) == 0 and all(cached(r) >= shared for r in replies[1:]), [cached(r) for r in replies]
    for user, reply in zip(users, replies, strict=True):
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
        prompt = loaded.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        assert ids(reply) == texts(loaded, scratch(loaded, list(prompt), 6))
    assert len(Store(tmp_path / "kv").names()) == 9


def test_sigkill_mid_persist_leaves_a_store_that_verifies_and_serves(loaded, tmp_path):
    text, want = served_once(loaded, tmp_path)
    env, marker, _ = stalling(tmp_path)
    server = Server(loaded.path, tmp_path, env=env)
    longer = server.post("/v1/completions", text | {"prompt": PROMPT + "and again"})
    assert cached(longer) > 0  # the response did not wait for the stalled save
    wait_for(marker)
    server.stop(signal.SIGKILL)
    store = Store(tmp_path / "kv")
    assert store.verify()[1] == [] and len(store.names()) == 1

    server = Server(loaded.path, tmp_path)
    reply = server.post("/v1/completions", text)
    server.stop()
    assert ids(reply) == want and cached(reply) > 0


def test_a_kv_group_size_that_does_not_divide_the_heads_is_refused(loaded, tmp_path):
    res = run_cli(
        "command=serve",
        f"model.name={loaded.path}",
        "serve.kv_bits=8",
        "serve.kv_group_size=128",
        tmp=tmp_path,
    )
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines()[-1] == (
        "error: serve.kv_group_size=128 does not divide the model's KV head width 64; choose one of 32, 64"
    )


def test_a_cache_of_other_kv_quantization_is_never_a_hit(loaded, tmp_path):
    text = {"prompt": PROMPT, "max_tokens": 6, "logprobs": 0}
    server = Server(loaded.path, tmp_path, "serve.kv_bits=8", "serve.kv_group_size=64")
    quantized = server.post("/v1/completions", text)
    server.stop()
    assert cached(quantized) == 0
    plain = Server(loaded.path, tmp_path)  # the same store, unquantized KV: another keyspace
    reply = plain.post("/v1/completions", text)
    plain.stop()
    assert cached(reply) == 0 and ids(reply) == texts(
        loaded, scratch(loaded, list(loaded.tokenizer.encode(PROMPT)), 6)
    )
    again = Server(loaded.path, tmp_path, "serve.kv_bits=8", "serve.kv_group_size=64")
    reply = again.post("/v1/completions", text)
    log = again.stop()
    assert cached(reply) == reply["usage"]["prompt_tokens"] - 1, log  # its own keyspace, from disk
    assert ids(reply) == ids(quantized)


def test_memory_tier_keeps_the_longest_prefix_under_its_byte_cap(loaded):
    from mlxbun.kv import tiers

    def filled(tokens):
        cache = make_prompt_cache(loaded.model)
        commands.prefill(loaded.model, tokens, cache)
        return cache

    a, b = list(range(1, 41)), list(range(1, 21)) + list(range(100, 120))
    size = tiers.nbytes(filled(a))
    memory = tiers.MemoryTier(max_bytes=size * 2)
    memory.insert(a, filled(a))
    memory.insert(b, filled(b))
    hit = memory.nearest(a[:30] + [7, 7])
    assert hit.reused == 30 and tiers.offset(hit.cache) == 30 and hit.source == "memory"
    assert memory.nearest(a).reused == 39  # the model must see the last token
    assert memory.nearest([300, 301]) is None
    memory.insert(list(range(200, 240)), filled(list(range(200, 240))))  # over the cap: b was used least
    assert len(memory) == 2 and memory.bytes <= size * 2
    assert memory.nearest(b).reused == 20  # b is gone; a still serves the first 20


def test_a_busy_port_is_refused_before_the_model_loads(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = run_cli(
            "command=serve", f"model.name={tmp_path / 'no-model'}", f"serve.port={port}", tmp=tmp_path
        )
    assert res.returncode == 2, res.stderr
    assert (
        res.stderr.strip()
        .splitlines()[-1]
        .startswith(
            f"error: serve.port={port}: cannot listen on 127.0.0.1:{port} (Address already in use); choose another"
        )
    )


@pytest.mark.parametrize("flush", [True, False])
def test_sigterm_flushes_or_drops_the_waiting_saves(loaded, tmp_path, flush):
    env, marker, release = stalling(tmp_path)
    server = Server(loaded.path, tmp_path, f"serve.flush={str(flush).lower()}", env=env)
    for i in range(3):  # the first save stalls while it runs; the other two wait behind it
        server.post("/v1/completions", {"prompt": f"{i} {PROMPT}", "max_tokens": 4})
    wait_for(marker)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(2)  # the waiting saves are written or dropped at the signal, before the release
    release.touch()
    log = server.stop()
    assert server.proc.returncode == 0, log
    written = 3 if flush else 1
    assert f"{written} save(s) written, {3 - written} dropped" in log
    store = Store(tmp_path / "kv")
    assert len(store.names()) == written and store.verify()[1] == []


def test_kv_cap_gb_keeps_the_store_under_its_size(loaded, tmp_path):
    cap = 0.0003  # GiB: 322 KB, room for about two of these prompts
    server = Server(loaded.path, tmp_path, f"kv.cap_gb={cap}")
    for i in range(4):
        server.post("/v1/completions", {"prompt": f"{i} {PROMPT}", "max_tokens": 4})
    log = server.stop()
    infos = Store(tmp_path / "kv").list()[0]
    assert 1 <= len(infos) < 4 and sum(i.file_bytes for i in infos) <= cap * 2**30, log
    assert "serve: kv.cap_gb: evicted" in log


def test_a_bad_host_names_serve_host(tmp_path):
    res = run_cli(
        "command=serve",
        f"model.name={tmp_path / 'no-model'}",
        "serve.host=no.such.host.invalid",
        tmp=tmp_path,
    )
    assert res.returncode == 2, res.stderr
    assert (
        res.stderr.strip()
        .splitlines()[-1]
        .startswith("error: serve.host='no.such.host.invalid': not an address")
    )


# A sitecustomize.py body: every snapshot save fails as a full disk does.
DISK_FULL = """
import errno
from mlxbun.kv import snapshot
def full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")
snapshot.write_snapshot = full
"""


def test_a_failed_background_save_is_counted_in_the_runs_record(loaded, tmp_path):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(DISK_FULL)
    server = Server(loaded.path, tmp_path, env={"PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{REPO}"})
    reply = server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
    assert reply["usage"]["completion_tokens"] == 4  # the reply never waits for the disk
    log = server.stop()
    assert server.proc.returncode == 0, log
    assert "No space left on device" in log
    (manifest,) = (tmp_path / "outputs").rglob("manifest.json")
    record = json.loads(manifest.read_text())
    assert record["metrics"]["saves_failed"] == 1 and record["metrics"]["saves_written"] == 0, record
