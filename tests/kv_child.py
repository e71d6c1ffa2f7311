"""A child process for the kv fault tests: waits for a line on stdin, then saves versions in a loop.

python tests/kv_child.py <store> <layout> <rounds> <name> <version> [<version> ...]

``rounds`` is a count, or ``until:<path>`` to keep saving until that file exists.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as C


def version_cache(v: int, tokens: int = 1500) -> tuple[list, list[int]]:
    """A deterministic 2-layer cache (about 12 MB) that differs per version ``v``."""
    rng = np.random.default_rng(v)
    out = []
    for _ in range(2):
        c = C.KVCache()
        k = rng.standard_normal((1, 4, tokens, 128), dtype=np.float32)
        c.update_and_fetch(mx.array(k), mx.array(-k))
        out.append(c)
    return out, [v] * tokens


def main(root: str, layout: str, rounds: str, name: str, *versions: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from mlxbun.kv.store import Store

    store = Store(root, block_kib=64)
    caches = [version_cache(int(v)) for v in versions]
    print("ready", flush=True)
    sys.stdin.readline()
    stop = Path(rounds[len("until:") :]) if rounds.startswith("until:") else None
    count = itertools.count() if stop else range(int(rounds))
    for i in count:
        if stop and stop.exists():
            break
        cache, toks = caches[i % len(caches)]
        print(f"start {i}", flush=True)
        store.save(name, cache, tokens=toks, model="m", layout=layout)
        print(f"end {i}", flush=True)
    print("done", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
