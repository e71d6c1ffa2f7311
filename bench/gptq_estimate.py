"""GPTQ's estimated output error (mlxbun.quant.sensitivity.candidates) against the exact one, per module.

Run: .venv/bin/python bench/gptq_estimate.py [--model tests/fixtures/llama-text-12l] [--samples 16] [--seq-len 256]

Captures the input Hessians on mlxbun's calibration text, then for every quantizable module (the
embedding left out) and every bits 2-8 x group 32/64/128: the estimate ``sensitivity.candidates``
uses (closed form from the range search's residual, scaled per bits to one exact GPTQ at g64)
and the exact GPTQ error, trace(dW H dW^T). Prints estimate / exact by group size and bits, and the
seconds of each path.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

BITS = [2, 3, 4, 5, 6, 8]
GROUPS = [32, 64, 128]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=REPO / "tests" / "fixtures" / "llama-text-12l")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    args = ap.parse_args()
    from mlxbun import blas

    blas.load()
    import mlx.core as mx

    from mlxbun.quant.calibrate import calibrate
    from mlxbun.quant.hessian import Hessians
    from mlxbun.quant.probe import load_model, source_dtypes
    from mlxbun.quant.sensitivity import candidates

    with tempfile.TemporaryDirectory() as tmp:
        path = calibrate(model_dir=args.model, out_dir=tmp, samples=args.samples, seq_len=args.seq_len).path
        hessians = {k: v for k, v in Hessians(path).items()}
    model, _, _ = load_model(args.model)
    dtypes = source_dtypes(args.model)
    specs = candidates.settings(BITS, group_sizes=GROUPS, methods=["rtn", "clip", "gptq"], modes=[])
    gptq = [s for s in specs if s.method == "gptq"]
    rows, t_est, t_exact = [], 0.0, 0.0
    for path, mod in model.named_modules():
        if not hasattr(mod, "to_quantized") or "weight" not in mod or path not in hessians or "embed" in path:
            continue
        w = mod.weight.astype(getattr(mx, dtypes.get(path, "bfloat16")))
        t0 = time.perf_counter()
        est, _ = candidates.module_errors(w, hessians[path], specs)
        t_est += time.perf_counter() - t0
        t0 = time.perf_counter()
        exact, _ = candidates.module_errors(w, hessians[path], gptq, exact_gptq=True)
        t_exact += time.perf_counter() - t0
        rows += [(s.bits, s.group_size, est[s] / exact[s]) for s in gptq if exact[s] > 0]
    r = np.array(rows)
    print(f"{args.model.name}: {len(rows) // len(gptq)} modules, {args.samples} x {args.seq_len} tokens")
    print(
        f"estimate path (every rtn/clip error + one GPTQ per bits): {t_est:.0f} s; exact GPTQs: {t_exact:.0f} s"
    )
    print("| group | bits | median estimate / exact | 10th | 90th |")
    print("|---:|---|---:|---:|---:|")
    for g in GROUPS:
        x = r[r[:, 1] == g][:, 2]
        print(f"| {g} | all | {np.median(x):.3f} | {np.percentile(x, 10):.3f} | {np.percentile(x, 90):.3f} |")
        for b in BITS:
            y = r[(r[:, 1] == g) & (r[:, 0] == b)][:, 2]
            print(
                f"| {g} | {b} | {np.median(y):.3f} | {np.percentile(y, 10):.3f} | {np.percentile(y, 90):.3f} |"
            )


if __name__ == "__main__":
    main()
