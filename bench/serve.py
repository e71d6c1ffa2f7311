"""Serving: `command=serve` against `mlx_lm.server`, side by side in one run.

Run: env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python bench/serve.py [--part all|restart|concurrency]
     [--tokens 8192] [--system-tokens 4096] [--conversations 16] [--out bench/results/serve.md]
     [--clients 1,4,8,16] [--rounds 2] [--concurrency-out bench/results/serve_concurrency.md]

Part ``concurrency`` (bench/serve_concurrency.py) drives both servers with 1, 4, 8 and 16 concurrent
streaming clients on tests/fixtures/llama-text-12l; the parts below are ``restart``.

Model: a synthetic checkpoint of Qwen2.5-0.5B's shape (24 layers, hidden 896, 14 heads, 2 KV
heads, head_dim 64, 151,936-token vocabulary, tied embeddings) in float32, so that MLX's CPU
matmuls go through the optimized BLAS (FINDINGS.md); `mlx_lm.server` gets the same BLAS through
LD_PRELOAD. Both servers are driven over HTTP with stdlib clients.

1. Time to first token (a non-streaming request with max_tokens=1: the answer is the first token)
   for a ``--tokens`` prompt: mlxbun cold (empty store); mlxbun after a restart (SIGTERM, new
   process, the same prompt: restored from the store); the same again in that process (memory);
   mlx_lm.server after its restart (new process: its caches are gone) and again in its process
   (its in-memory LRU). Each server first answers a two-word prompt, so model loading is not
   counted.
2. Disk: ``--conversations`` chat conversations sharing a ``--system-tokens`` system prompt,
   served with ``kv.layout=blocks``; the store's bytes against one mlx-lm prompt-cache file per
   conversation. Those files are written by mlx-lm's own ``save_prompt_cache`` from ``KVCache``
   objects filled through ``update_and_fetch`` in 2048-token chunks (mlx-lm's prefill step) with
   the stored K/V of each conversation, so each has the size ``mlx_lm cache_prompt`` writes for
   that many tokens, without another prefill per conversation.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SHAPE = dict(
    arch="qwen2",
    preset="small",
    hidden_size=896,
    intermediate_size=4864,
    num_layers=24,
    num_heads=14,
    num_kv_heads=2,
    head_dim=64,
    vocab_size=151936,
    tie_embeddings=True,
    dtype="float32",
)
WORDS = "river stone cloud lamp orbit quiet maple signal harbor copper violet engine meadow lantern".split()


def text_of(tokenizer, n: int, seed: int) -> str:
    """Text that encodes to about ``n`` tokens (seeded words)."""
    rng = random.Random(seed)
    words: list[str] = []
    while len(tokenizer.encode(" ".join(words))) < n:
        words += [rng.choice(WORDS) for _ in range(max(8, (n - len(tokenizer.encode(" ".join(words)))) // 2))]
    while len(tokenizer.encode(" ".join(words))) > n:
        words.pop()
    return " ".join(words)


class Proc:
    """A server subprocess and the HTTP calls the bench makes to it."""

    def __init__(self, argv: list[str], port: int, log: Path, env: dict[str, str], ready: str | None) -> None:
        self.port, self.log = port, log
        log.parent.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            argv, cwd=REPO, stdout=subprocess.PIPE, stderr=log.open("w"), text=True, env=env
        )
        if ready is not None:
            line = self.proc.stdout.readline()
            assert ready in line, f"{line!r}; log: {log.read_text()[-2000:]}"
        self._wait_health()

    def _wait_health(self) -> None:
        for _ in range(1200):
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"server on {self.port} never became healthy; {self.log.read_text()[-2000:]}")

    def post(self, path: str, body: dict) -> tuple[float, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=3600)
        start = time.perf_counter()
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        took = time.perf_counter() - start
        if resp.status != 200:
            raise RuntimeError(f"{path}: HTTP {resp.status}: {data[:500]!r}")
        return took, json.loads(data)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=600)
        self.proc.stdout.close()
        return code


def env_for(*, preload: str | None = None) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if preload:
        env["LD_PRELOAD"] = preload
    return env


def mlxbun_server(model: Path, root: Path, port: int, tag: str, *extra: str) -> Proc:
    argv = [sys.executable, "-m", "mlxbun", "command=serve", f"model.name={model}", f"serve.port={port}"]
    argv += [f"kv.store={root / 'kv'}", f"paths.outputs={root / 'outputs'}", f"paths.cache={root / 'cache'}"]
    argv += [f"registry.path={root / 'registry.db'}", "serve.cache_gb=4", *extra]
    return Proc(argv, port, root / f"mlxbun-{tag}.log", env_for(), ready="serving")


def mlx_lm_server(model: Path, root: Path, port: int, tag: str, blas: str | None) -> Proc:
    argv = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model), "--port", str(port)]
    argv += ["--host", "127.0.0.1"]
    return Proc(argv, port, root / f"mlx_lm-{tag}.log", env_for(preload=blas), ready=None)


def ttft(server: Proc, prompt: str) -> tuple[float, int, int | None]:
    """Seconds until the first token of ``prompt``; prompt tokens; cached tokens reported."""
    took, reply = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 1, "temperature": 0})
    usage = reply["usage"]
    return took, usage["prompt_tokens"], (usage.get("prompt_tokens_details") or {}).get("cached_tokens")


def part_ttft(
    model: Path, root: Path, prompt: str, blas: str | None
) -> list[tuple[str, float, int, int | None]]:
    rows = []
    first = mlxbun_server(model, root, 18301, "cold")
    first.post("/v1/completions", {"prompt": "hello there", "max_tokens": 1})
    rows.append(("mlxbun serve, cold (empty store)", *ttft(first, prompt)))
    print(rows[-1], flush=True)
    first.stop()
    again = mlxbun_server(model, root, 18302, "restart")
    again.post("/v1/completions", {"prompt": "hello there", "max_tokens": 1})
    rows.append(("mlxbun serve, after a restart (store on disk)", *ttft(again, prompt)))
    print(rows[-1], flush=True)
    rows.append(("mlxbun serve, same process again (memory)", *ttft(again, prompt)))
    again.stop()
    stock = mlx_lm_server(model, root, 18303, "restart", blas)
    stock.post("/v1/completions", {"prompt": "hello there", "max_tokens": 1})
    rows.append(("mlx_lm.server, after a restart", *ttft(stock, prompt)))
    print(rows[-1], flush=True)
    rows.append(("mlx_lm.server, same process again (memory)", *ttft(stock, prompt)))
    stock.stop()
    return rows


def part_disk(model: Path, root: Path, system: str, n: int) -> dict[str, int]:
    server = mlxbun_server(model, root, 18304, "disk", "kv.layout=blocks")
    for i in range(n):
        msgs = [
            {"role": "system", "content": system},
            {"role": "user", "content": f"Conversation {i}: {WORDS[i % 14]}?"},
        ]
        took, reply = server.post("/v1/chat/completions", {"messages": msgs, "max_tokens": 16})
        print(
            f"conversation {i}: {took:.1f} s, cached {reply['usage']['prompt_tokens_details']['cached_tokens']}",
            flush=True,
        )
    server.stop()
    store = root / "kv"
    ours = sum(
        p.stat().st_size for d in ("snapshots", "blocks") for p in (store / d).iterdir() if p.is_file()
    )
    return {
        "conversations": n,
        "mlxbun_blocks": ours,
        "mlx_lm_files": mlx_lm_bytes(store, root / "mlx_lm_files"),
    }


def mlx_lm_bytes(store_dir: Path, out: Path) -> int:
    """Total size of one mlx-lm prompt-cache file per stored conversation (see the docstring)."""
    from mlx_lm.models.cache import KVCache, save_prompt_cache

    from mlxbun.kv.store import Store

    store, total = Store(store_dir), 0
    out.mkdir(parents=True, exist_ok=True)
    for name in store.names():
        restored = store.load(name, model=None)
        caches = []
        for c in restored.cache:
            fresh = KVCache()
            for i in range(0, c.offset, 2048):
                j = min(i + 2048, c.offset)
                fresh.update_and_fetch(c.keys[..., i:j, :], c.values[..., i:j, :])
            caches.append(fresh)
        path = out / f"{name}.safetensors"
        save_prompt_cache(str(path), caches)
        total += path.stat().st_size
        path.unlink()
    return total


def report(rows: list, disk: dict[str, int], args: argparse.Namespace, model_bytes: int) -> str:
    cold = rows[0][1]
    lines = [
        f"# serve: time to first token and disk ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
        "",
        f"Command: `{' '.join(sys.argv)}`; {platform.machine()}, {os.cpu_count()} cores, load average"
        f" {os.getloadavg()[0]:.1f} at the end. Model: Qwen2.5-0.5B shape, float32, {model_bytes / 2**30:.2f} GiB.",
        "",
        "| server | time to first token | prompt tokens | cached tokens | mlxbun cold ÷ this |",
        "|---|---|---|---|---|",
    ]
    for label, secs, prompt, cached in rows:
        lines.append(f"| {label} | {secs:.2f} s | {prompt} | {cached} | {cold / secs:.2f}× |")
    ours, theirs = disk["mlxbun_blocks"], disk["mlx_lm_files"]
    lines += [
        "",
        f"Disk for {disk['conversations']} conversations sharing a {args.system_tokens}-token system prompt:"
        f" mlxbun store (kv.layout=blocks) {ours / 2**20:.1f} MiB, {disk['conversations']} mlx-lm prompt-cache"
        f" files {theirs / 2**20:.1f} MiB: **{ours / theirs:.3f}×**.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("all", "restart", "concurrency"), default="all")
    ap.add_argument("--clients", default="1,4,8,16")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency-out", default=str(REPO / "bench/results/serve_concurrency.md"))
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--system-tokens", type=int, default=4096)
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--out", default=str(REPO / "bench/results/serve.md"))
    args = ap.parse_args()
    if args.part in ("all", "concurrency"):
        sys.path.insert(0, str(REPO / "bench"))
        from serve_concurrency import run as concurrency

        concurrency(
            clients=[int(c) for c in args.clients.split(",")],
            rounds=args.rounds,
            out=Path(args.concurrency_out),
        )
    if args.part == "concurrency":
        return

    from transformers import AutoTokenizer

    from mlxbun import blas
    from mlxbun.synth import write as synth_write

    root = Path(tempfile.mkdtemp(prefix="mlxbun-serve-bench-"))
    model = synth_write.ensure_synthetic(cache_dir=Path.home() / ".cache/mlxbun/synth", **SHAPE)
    model_bytes = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    tok = AutoTokenizer.from_pretrained(str(model))
    prompt, system = text_of(tok, args.tokens, 0), text_of(tok, args.system_tokens, 1)
    rows = part_ttft(model, root / "ttft", prompt, blas.find())
    disk = part_disk(model, root / "disk", system, args.conversations)
    text = report(rows, disk, args, model_bytes)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
