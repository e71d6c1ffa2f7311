"""f32 matmul throughput of MLX on Linux CPU: bundled reference BLAS vs an optimized BLAS.

Run: .venv/bin/python bench/blas_speedup.py [--n 2048] [--reps 3]
Each side runs in a fresh child process (the BLAS must be chosen before mlx.core is imported),
one with blas=off and one with mlxbun.blas.load("auto"); prints GFLOP/s of each and the ratio.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, sys, time
from mlxbun import blas
info = blas.load(sys.argv[1])
import mlx.core as mx
n, reps = int(sys.argv[2]), int(sys.argv[3])
a = mx.random.normal((n, n), key=mx.random.key(0)); b = mx.random.normal((n, n), key=mx.random.key(1))
mx.eval(a @ b)  # warm-up
best = float("inf")
for _ in range(reps):
    t = time.perf_counter(); mx.eval(a @ b); best = min(best, time.perf_counter() - t)
print(json.dumps({"blas": info, "seconds": best, "gflops": 2 * n**3 / best / 1e9}))
"""


def measure(setting: str, n: int, reps: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, setting, str(n), str(reps)], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    ref = measure("off", args.n, args.reps)
    opt = measure("auto", args.n, args.reps)
    print(f"f32 matmul {args.n}^3, best of {args.reps}")
    print(f"  bundled BLAS : {ref['gflops']:8.2f} GFLOP/s ({ref['seconds']:.3f} s)")
    lib = opt["blas"]["library"] or "none found"
    print(f"  optimized    : {opt['gflops']:8.2f} GFLOP/s ({opt['seconds']:.3f} s)  [{lib}]")
    print(f"  speedup      : {opt['gflops'] / ref['gflops']:.1f}x")


if __name__ == "__main__":
    main()
