"""GPTQ (or clip) rounding speed: this tree's ``mlxbun.quant.rounding`` against an earlier commit's, side by side.

Run: flock /work/timing.lock .venv/bin/python bench/gptq_speed.py [--baseline c9f955c] [--reps 1]
         [--method gptq|clip] [--shapes qwen3-0.6b|qwen2-0.5b] [--out bench/results/gptq_speed.md]

For each layer shape (Qwen3-0.6B: q_proj 2048x1024, gate/up 3072x1024, down 3072 wide; Qwen2-0.5B:
q/o 896x896, gate/up 4864x896, down 4864 wide) and 3/4 bits: a bf16 weight with a spread of
column scales, a Hessian from 2048 heavy-tailed activations; both implementations quantize it
(best of ``--reps``, alternating), and both results' output error ``trace(dW H dW^T)`` is shown
so a speed-up does not hide a quality change, with the peak MLX memory of each.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SHAPES = {
    "qwen3-0.6b": [(2048, 1024), (3072, 1024), (1024, 3072)],
    "qwen2-0.5b": [(896, 896), (4864, 896), (896, 4864)],
}


def baseline_module(rev: str):
    src = subprocess.run(
        ["git", "show", f"{rev}:mlxbun/quant/rounding.py"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    path = Path(tempfile.mkdtemp()) / "rounding_baseline.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("rounding_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def case(rows: int, cols: int, seed: int = 0):
    import mlx.core as mx

    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)) * 0.02 * np.exp(0.3 * rng.standard_normal(cols))
    x = rng.standard_t(4, (2048, cols)) * np.exp(rng.standard_normal(cols))
    return mx.array(w.astype(np.float32)).astype(mx.bfloat16), (x.T @ x).astype(np.float32)


def timed(mod, w, h, bits: int, method: str) -> tuple[float, float, int]:
    import mlx.core as mx

    from mlxbun.quant.hessian import output_error

    mx.reset_peak_memory()
    t0 = time.perf_counter()
    parts = mod.quantize(w, bits=bits, group_size=64, method=method, hessian=h)
    mx.eval(*parts)
    seconds = time.perf_counter() - t0
    peak = mx.get_peak_memory()
    dw = mx.dequantize(*parts, group_size=64, bits=bits).astype(mx.float32) - w.astype(mx.float32)
    return seconds, output_error(dw, mx.array(h)), peak


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", default="c9f955c")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--method", choices=("gptq", "clip"), default="gptq")
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="qwen3-0.6b")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "gptq_speed.md")
    args = ap.parse_args()
    from mlxbun import blas

    blas.load()
    from mlxbun.quant import rounding

    old = baseline_module(args.baseline)
    lines = [
        f"# {args.method} rounding speed (one layer, group size 64, {args.shapes} shapes)",
        "",
        f"Command: `flock /work/timing.lock .venv/bin/python bench/gptq_speed.py {' '.join(sys.argv[1:])}`".rstrip(),
        f"Machine: {platform.machine()}, {os.cpu_count()} cores; load before: {os.getloadavg()[0]:.2f}",
        "",
        f"| shape (out x in) | bits | {args.baseline} s | this tree s | speed-up | output error after / before "
        "| peak MB before / after |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for rows, cols in SHAPES[args.shapes]:
        w, h = case(rows, cols)
        for bits in (3, 4):
            best = {"old": float("inf"), "new": float("inf")}
            err, peak = {}, {}
            for _ in range(args.reps):
                for name, mod in (("old", old), ("new", rounding)):
                    s, err[name], peak[name] = timed(mod, w, h, bits, args.method)
                    best[name] = min(best[name], s)
            lines.append(
                f"| {rows}x{cols} | {bits} | {best['old']:.2f} | {best['new']:.2f} | "
                f"{best['old'] / best['new']:.2f}x | {err['new'] / err['old']:.4f} "
                f"| {peak['old'] / 1e6:.0f} / {peak['new'] / 1e6:.0f} |"
            )
            print(lines[-1], flush=True)
    lines += ["", f"Load after: {os.getloadavg()[0]:.2f}", ""]
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
