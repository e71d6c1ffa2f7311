"""Serving many clients at once: `command=serve` against `mlx_lm.server`, side by side in one run.

Run: nice -n 0 .venv/bin/python bench/serve_concurrency.py [--clients 1,4,8,16] [--rounds 3]
     [--tokens 48] [--prompt-tokens 300] [--out bench/results/serve_concurrency.md]
     (also `bench/serve.py --part concurrency`)

Model: tests/fixtures/llama-text-12l (12.6M parameters, bfloat16), both servers up at once on
their defaults (mlxbun with its KV store, so finished prompts are saved in the background as a
user's server does; mlx_lm.server with decode concurrency 32, prompt concurrency 8), and a third,
mlxbun with ``serve.float32=true`` (the bfloat16 weights upcast: OpenBLAS's float32 matmuls;
``--no-float32`` leaves it out), compared with mlx_lm.server in a table of its own. A round starts
N streaming ``/v1/completions`` together (a barrier), each with its own ~``--prompt-tokens`` prompt
(the same for every server, new every round: no cache hits), ``--tokens`` tokens, greedy, ``include_usage``.
Aggregate tokens/s: every completion token over the time until the last stream ends; slowest first
token: the longest time from the start to a stream's first text. The servers take turns within a
round (the order reverses every other one) and the best of ``--rounds`` is kept for each (the
machine is shared). Peak memory is each server process's VmHWM at the end. A dropped stream: a
600-token stream closed after its first chunk, then the time until mlxbun's ``/health`` says
nothing runs (mlx_lm.server reports no such thing).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "tests/fixtures/llama-text-12l"
RESETS: dict[int, int] = {}  # connections reset before an answer, by server port
OURS, STOCK, OURS32 = "mlxbun serve", "mlx_lm.server", "mlxbun serve, serve.float32=true"
PORTS = {OURS: 18311, STOCK: 18312, OURS32: 18313}
WORDS = "river stone cloud lamp orbit quiet maple signal harbor copper violet engine meadow lantern".split()


def prompt_of(tokenizer, n: int, seed: int) -> str:
    rng = random.Random(seed)
    words = [rng.choice(WORDS) for _ in range(n)]
    while len(tokenizer.encode(" ".join(words))) > n:
        words.pop()
    return " ".join(words)


class Server:
    def __init__(self, name: str, argv: list[str], port: int, log: Path) -> None:
        self.name, self.port = name, port
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        self.proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=log.open("w"), env=env)
        for _ in range(600):
            try:
                if self.get("/health")[0] == 200:
                    return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"{name} never became healthy: {log.read_text()[-2000:]}")

    def get(self, path: str) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")

    def peak_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=120)


def stream(port: int, prompt: str, tokens: int, start: float) -> tuple[float, float, int]:
    """One streaming completion: (first text, end, completion tokens), seconds after ``start``."""
    body = {
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    for attempt in range(5):  # a server whose listen backlog overflowed resets the connection
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            break
        except ConnectionResetError:
            RESETS[port] = RESETS.get(port, 0) + 1
            time.sleep(0.05 * (attempt + 1))
    first, made = None, 0
    for line in resp:
        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
            continue
        doc = json.loads(line[6:])
        if first is None and any(c.get("text") for c in doc.get("choices") or []):
            first = time.perf_counter() - start
        if doc.get("usage"):
            made = doc["usage"]["completion_tokens"]
    return first if first is not None else float("nan"), time.perf_counter() - start, made


def round_of(port: int, prompts: list[str], tokens: int) -> tuple[float, float]:
    """N clients at once: (aggregate tokens/s, slowest first token in seconds)."""
    results: list = [None] * len(prompts)
    barrier = threading.Barrier(len(prompts) + 1)
    start = [0.0]

    def client(i: int) -> None:
        barrier.wait()
        results[i] = stream(port, prompts[i], tokens, start[0])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    start[0] = time.perf_counter()
    barrier.wait()
    for t in threads:
        t.join()
    made = sum(r[2] for r in results)
    return made / max(r[1] for r in results), max(r[0] for r in results)


def dropped_stream_s(server: Server, prompt: str) -> float:
    """Seconds from closing a running stream until the server's /health says nothing runs."""
    body = {"prompt": prompt, "max_tokens": 600, "stream": True, "logit_bias": {"0": -100}}
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=600)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    resp.fp.readline()  # the first chunk: it runs
    resp.close()
    conn.close()
    closed = time.perf_counter()
    while server.get("/health")[1].get("running", 0):
        time.sleep(0.02)
    return time.perf_counter() - closed


def mlxbun_argv(root: Path, port: int, *extra: str) -> list[str]:
    argv = [sys.executable, "-m", "mlxbun", "command=serve", f"model.name={MODEL}", f"serve.port={port}"]
    argv += [f"kv.store={root / 'kv'}", f"paths.outputs={root / 'outputs'}", f"paths.cache={root / 'cache'}"]
    return argv + [f"registry.path={root / 'registry.db'}", *extra]


def servers(root: Path, float32: bool) -> list[Server]:
    stock = [sys.executable, "-m", "mlx_lm", "server", "--model", str(MODEL), "--port", str(PORTS[STOCK])]
    up = [
        Server(OURS, mlxbun_argv(root, PORTS[OURS]), PORTS[OURS], root / "mlxbun.log"),
        Server(STOCK, [*stock, "--host", "127.0.0.1"], PORTS[STOCK], root / "mlx_lm.log"),
    ]
    if float32:
        up.append(
            Server(
                OURS32,
                mlxbun_argv(root, PORTS[OURS32], "serve.float32=true"),
                PORTS[OURS32],
                root / "mlxbun32.log",
            )
        )
    return up


def measure(
    clients: list[int], rounds: int, tokens: int, prompt_tokens: int, float32: bool
) -> tuple[dict, dict, float]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(MODEL))
    root = Path(tempfile.mkdtemp(prefix="mlxbun-serve-concurrency-"))
    up = servers(root, float32)
    best: dict = {}
    seed = 0
    try:
        for s in up:  # warm-up: the first calls build kernels
            round_of(s.port, [prompt_of(tok, prompt_tokens, 10_000 + i) for i in range(4)], 8)
        for r in range(rounds):
            for n in clients:
                prompts = [prompt_of(tok, prompt_tokens, seed + i) for i in range(n)]  # the same for each
                seed += n
                for s in up if (r + n) % 2 == 0 else up[::-1]:
                    rate, first = round_of(s.port, prompts, tokens)
                    old = best.get((s.name, n), (0.0, float("inf")))
                    best[(s.name, n)] = (max(old[0], rate), min(old[1], first))
                    print(
                        f"round {r} {s.name} {n} clients: {rate:.1f} tok/s, slowest first token {first:.3f} s",
                        flush=True,
                    )
        drop = dropped_stream_s(up[0], prompt_of(tok, prompt_tokens, 99_999))
        peaks = {s.name: s.peak_mib() for s in up}
        for s in up:
            print(f"{s.name}: {RESETS.get(s.port, 0)} connection(s) reset and retried", flush=True)
    finally:
        for s in up:
            s.stop()
    return best, peaks, drop


def report(best: dict, peaks: dict, drop: float, args: argparse.Namespace, load: tuple[float, float]) -> str:
    lines = [
        f"# serve: many clients at once ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
        "",
        f"Command: `{' '.join(sys.argv)}`; {os.cpu_count()} cores, load average {load[0]:.2f} at the start,"
        f" {load[1]:.2f} at the end. Model: tests/fixtures/llama-text-12l; ~{args.prompt_tokens}-token prompts,"
        f" {args.tokens} tokens, greedy, streamed; best of {args.rounds} rounds.",
        "",
    ]
    for name in [n for n in (OURS, OURS32) if n in peaks]:
        lines += [
            f"| clients | {name} tok/s | mlx_lm tok/s | ratio | {name} slowest first token | mlx_lm | ratio |",
            "|---|---|---|---|---|---|---|",
        ]
        for n in [int(c) for c in args.clients.split(",")]:
            (ra, fa), (rb, fb) = best[(name, n)], best[(STOCK, n)]
            row = f"| {n} | {ra:.1f} | {rb:.1f} | {ra / rb:.2f}× | {fa:.3f} s | {fb:.3f} s | {fa / fb:.2f}× |"
            lines.append(row)
        lines.append("")
    lines += [
        "Peak memory (VmHWM): " + ", ".join(f"{k} {v:.0f} MiB" for k, v in peaks.items()) + ".",
        f"A dropped 600-token stream: mlxbun's batch was empty {drop:.2f} s after the client closed.",
        "Connections reset before an answer (a full listen backlog; retried): "
        + ", ".join(f"{name} {RESETS.get(port, 0)}" for name, port in PORTS.items())
        + ".",
    ]
    return "\n".join(lines) + "\n"


def run(
    *,
    clients: list[int],
    rounds: int,
    out: Path,
    tokens: int = 48,
    prompt_tokens: int = 300,
    float32: bool = True,
) -> str:
    args = argparse.Namespace(
        clients=",".join(map(str, clients)), rounds=rounds, tokens=tokens, prompt_tokens=prompt_tokens
    )
    start_load = os.getloadavg()[0]
    best, peaks, drop = measure(clients, rounds, tokens, prompt_tokens, float32)
    text = report(best, peaks, drop, args, (start_load, os.getloadavg()[0]))
    out.write_text(text)
    print(text)
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", default="1,4,8,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--prompt-tokens", type=int, default=300)
    ap.add_argument("--out", default=str(REPO / "bench/results/serve_concurrency.md"))
    a = ap.parse_args()
    run(
        clients=[int(c) for c in a.clients.split(",")],
        rounds=a.rounds,
        out=Path(a.out),
        tokens=a.tokens,
        prompt_tokens=a.prompt_tokens,
    )


if __name__ == "__main__":
    main()
