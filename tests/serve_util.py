"""A server of the serve package in this process (no subprocess start per test), and raw HTTP."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import types
from pathlib import Path

from mlxbun import serve
from mlxbun.kv import commands, tiers
from mlxbun.serve import caches, httpd, prompts

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "llama-text-3m"
SETTINGS = {
    "max_tokens": 16,
    "max_batch": 32,
    "prefill_step": 64,
    "kv_bits": None,
    "kv_group_size": 64,
    "float32": False,
}


def load() -> commands.Loaded:
    loaded = commands.load_model(FIXTURE)
    prompts.ensure_template(loaded.tokenizer)
    return loaded


class Local:
    """``mlxbun.serve.start`` on a free port, memory caches only; :meth:`close` stops it."""

    def __init__(self, loaded: commands.Loaded, *, begin: bool = True, **settings: object) -> None:
        s = types.SimpleNamespace(**(SETTINGS | settings))
        space = caches.keyspace(loaded, kv_bits=s.kv_bits, kv_group_size=s.kv_group_size, float32=s.float32)
        self.caches = tiers.PromptCaches(space, tiers.MemoryTier(max_bytes=2**30))
        self.server = httpd.listen("127.0.0.1", 0, None)
        self.app = serve.start(self.server, loaded, self.caches, model_id="llama-text-3m", s=s, begin=begin)
        self.engine = self.app.engine
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.engine.stop()

    def call(
        self, method: str, path: str, body: bytes | None = None, headers: dict | None = None
    ) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        conn.request(method, path, body, {"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        status, data = resp.status, resp.read()
        conn.close()
        return status, json.loads(data)

    def post(self, path: str, doc: dict) -> tuple[int, dict]:
        return self.call("POST", path, json.dumps(doc).encode())

    def raw(self, data: bytes) -> bytes:
        """Send raw bytes, return everything the server answers before it closes."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=60) as s:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            chunks = []
            while chunk := s.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks)
