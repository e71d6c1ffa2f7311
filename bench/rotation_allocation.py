"""Rotation at equal bytes: rotate -> sensitivity -> allocate against sensitivity -> allocate, held-out KL.

Run: .venv/bin/python bench/rotation_allocation.py [--model tests/fixtures/llama-text-3m ...]
         [--samples 8] [--seq-len 256] [--eval-samples 16] [--out bench/results/rotation_allocation.md]

For each trained fixture (default: both):

1. ``mlxbun.rotate.rotate_model_dir`` (seed 0; verified against the source; a tied head whose
   final gain is not 1 is untied, so the rotated model holds one more matrix).
2. ``sensitivity`` (fisher, the default method) at 2/3/4/5/6/8 bits, group 64, on the plain and
   the rotated model, same calibration tokens.
3. Budgets: the file bytes of ``mlx_lm.convert`` q3 and q4 of the plain model (the anchors of
   ``bench/allocation_quality.py``). ``allocate`` a plan for each model at each budget (bytes on
   disk), quantize it with mlxbun (rtn), and measure KL(plain float model || quantized) on
   held-out text in neither fixture's corpus (the rotated float model equals the plain one
   within float error, so one reference serves both). Uniform q3/q4 of both models are shown too.

Writes ``bench/results/rotation_allocation.md``. Quality only (run niced); no wall times.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import allocation_quality as aq  # noqa: E402  (anchor stages, KL evaluator, sizes)
import quantizer_quality as qq  # noqa: E402  (the held-out text shared by both fixtures)

BITS = [2, 3, 4, 5, 6, 8]


def sensitivity_of(model: Path, dest: Path, args: argparse.Namespace) -> Path:
    from mlxbun.quant.sensitivity import sensitivity

    if not (dest / "sensitivity.json").is_file():
        sensitivity(
            model_dir=model, out_dir=dest, work_dir=dest / "cache", bits=BITS, group_size=64,
            samples=args.samples, seq_len=args.seq_len, batch_size=8,
        )  # fmt: skip
    return dest / "sensitivity.json"


def planned(fx: aq.Fixture, model: Path, sens: Path, budget: int, name: str) -> dict:
    from mlxbun.errors import InputError
    from mlxbun.quant.allocate import allocate
    from mlxbun.quant.quantize import quantize_model_dir
    from mlxbun.quant.sensitivity_file import load_sensitivity

    try:
        plan = allocate(load_sensitivity(sens), model_dir=model, budget_bytes=budget)
    except InputError as e:
        return {"label": name, "error": str(e).splitlines()[0]}
    out = fx.work / "rot" / name
    shutil.rmtree(out, ignore_errors=True)
    res = quantize_model_dir(model, out, plan=plan.plan, partial_root=fx.work / "partial")
    return {"label": name, **aq._size(res.out, fx.source.parameters)} | fx.eval.kl(res.out)


def uniform(fx: aq.Fixture, model: Path, bits: int, name: str) -> dict:
    from mlxbun.quant.quantize import quantize_model_dir

    out = fx.work / "rot" / name
    shutil.rmtree(out, ignore_errors=True)
    res = quantize_model_dir(model, out, bits=bits, group_size=64, partial_root=fx.work / "partial")
    return {"label": name, **aq._size(res.out, fx.source.parameters)} | fx.eval.kl(res.out)


def run_model(model: Path, args: argparse.Namespace) -> list[dict]:
    from mlxbun.rotate import rotate_model_dir

    fx = aq.Fixture(model, args)
    rotated = fx.work / "rotated"
    if not (rotated / "config.json").is_file():
        shutil.rmtree(rotated, ignore_errors=True)
        rotate_model_dir(model, rotated, seed=0)
    sens = {
        "plain": sensitivity_of(model, fx.work / "sens-plain", args),
        "rotated": sensitivity_of(rotated, fx.work / "sens-rotated", args),
    }
    rows = []
    for bits in (3, 4):
        anchor = fx.anchor(f"mlx-lm convert q{bits}", f"convert:{bits}:64:")
        rows.append({**anchor, "bits": bits})
        budget = anchor["file_bytes"]
        for kind, src in (("plain", model), ("rotated", rotated)):
            rows.append({**uniform(fx, src, bits, f"{kind} uniform q{bits}"), "bits": bits})
            rows.append(
                {**planned(fx, src, sens[kind], budget, f"{kind} plan @ q{bits} bytes"), "bits": bits}
            )
        write(args, {**args.done, str(model): rows})
    return rows


def write(args: argparse.Namespace, done: dict) -> None:
    held = (
        json.loads((args.work / "held_out.json").read_text())
        if (args.work / "held_out.json").is_file()
        else []
    )
    text = [
        "# Rotation at equal bytes (held-out KL; plans by fisher sensitivity + knapsack, rtn rounding)",
        "",
        f"Command: `{' '.join(['.venv/bin/python', 'bench/rotation_allocation.py', *sys.argv[1:]])}`",
        f"Calibration {args.samples} × {args.seq_len} tokens; held-out {args.eval_samples} × {args.seq_len} tokens"
        f" of {', '.join(held)}.",
        "",
    ]
    for model, rows in done.items():
        text += [
            f"## {Path(model).name}",
            "",
            "| bits | model | held-out KL | × mlx-lm | bytes |",
            "|---|---|---:|---:|---:|",
        ]
        anchors = {r["bits"]: r["held_out"] for r in rows if r["label"].startswith("mlx-lm")}
        for r in rows:
            if "error" in r:
                text.append(f"| {r['bits']} | {r['label']} | — ({r['error']}) | | |")
                continue
            ratio = r["held_out"] / anchors[r["bits"]]
            text.append(
                f"| {r['bits']} | {r['label']} | {r['held_out']:.4f} | {ratio:.2f} | {r['file_bytes']} |"
            )
        text.append("")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(text))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, action="append", default=None)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--eval-samples", type=int, default=16)
    ap.add_argument("--work", type=Path, default=Path("/tmp/mlxbun-bench-rotation-allocation"))
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "rotation_allocation.md")
    args = ap.parse_args()
    from mlxbun import blas

    blas.load()
    args.work.mkdir(parents=True, exist_ok=True)
    aq.held_out_text = qq.held_out_text
    args.done = {}
    for model in args.model or qq.FIXTURES:
        args.done[str(model)] = run_model(model.resolve(), args)
    write(args, args.done)
    print(args.out.read_text())


if __name__ == "__main__":
    main()
