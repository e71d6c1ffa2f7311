"""Rotation at equal bytes: rotate -> sensitivity -> allocate against sensitivity -> allocate, held-out KL.

Run: .venv/bin/python bench/rotation_allocation.py [--model tests/fixtures/llama-narrow-6l ...]
         [--samples 32] [--seq-len 128] [--eval-tokens 8192] [--out bench/results/rotation_allocation.md]

For each model (default: both representative fixtures), everything through mlxbun's CLI:

1. ``command=rotate`` (seed 0; verified against the source; a tied head whose final gain is not 1
   is untied, so the rotated model holds one more matrix).
2. ``command=sensitivity`` (fisher, the default method) at 2/3/4/5/6/8 bits, group 64, on the plain
   and the rotated model, same calibration tokens.
3. Budgets: the file bytes of ``mlx_lm.convert`` q3 and q4 of the plain model (the anchors of
   ``bench/allocation_quality.py``). ``command=allocate`` a plan for each model at each budget
   (bytes on disk), ``command=quantize quant.plan=<it>`` (rtn), and ``command=eval`` against the
   plain float model on the built-in held-out text (the rotated float model equals the plain one
   within float error, so one reference serves both). Uniform q3/q4 of both models are shown too.

Writes ``bench/results/rotation_allocation.md``. Quality only; no wall times.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

import allocation_quality as aq  # noqa: E402  (anchor stages, the CLI runner, eval, bytes)
import quantizer_quality as qq  # noqa: E402  (the default models)

BITS = [2, 3, 4, 5, 6, 8]


def run_model(model: Path, args: argparse.Namespace) -> list[dict]:
    work = args.work / model.name
    rot, _ = aq.cli("command=rotate", f"model.name={model}", "fold.seed=0", work=work)
    sources = {"plain": model, "rotated": rot / "model"}
    calib = [f"sensitivity.calib.samples={args.samples}", f"sensitivity.calib.seq_len={args.seq_len}"]
    bits = f"sensitivity.bits=[{','.join(map(str, BITS))}]"
    sens = {
        kind: aq.cli(
            "command=sensitivity", f"model.name={src}", bits, "sensitivity.group_size=64", *calib, work=work
        )[0]
        for kind, src in sources.items()
    }
    rows = []
    for b in (3, 4):
        a = qq.anchor(f"mlx-lm convert q{b}", f"convert:{b}:64:", model, args, work)
        rows.append({**a, "bits": b})
        budget = aq.file_bytes(Path(a["path"]))
        for kind, src in sources.items():
            run, _ = aq.cli(
                "command=quantize", f"model.name={src}", f"quant.bits={b}", "quant.group_size=64", work=work
            )
            rows.append({"label": f"{kind} uniform q{b}", "path": str(run / "model"), "bits": b})
            try:
                plan, _ = aq.cli(
                    "command=allocate", f"model.name={src}", f"allocate.sensitivity={sens[kind]}",
                    f"allocate.budget_bytes={budget}", work=work,
                )  # fmt: skip
            except SystemExit as e:  # e.g. a budget under the smallest plan (rotation unties the head)
                rows.append({"label": f"{kind} plan @ q{b} bytes", "error": str(e).split(":")[0], "bits": b})
                continue
            run, _ = aq.cli(
                "command=quantize", f"model.name={src}", f"quant.plan={plan / 'plan.json'}", work=work
            )
            rows.append({"label": f"{kind} plan @ q{b} bytes", "path": str(run / "model"), "bits": b})
    kl = aq.evaluate(model, [r["path"] for r in rows if "path" in r], args, work)
    for r in rows:
        if "path" in r:
            r |= {
                "kld": kl[str(Path(r["path"]).resolve())]["kld_mean"],
                "bytes": aq.file_bytes(Path(r["path"])),
            }
    return rows


def report(args: argparse.Namespace, done: dict) -> str:
    text = [
        "# Rotation at equal bytes (held-out KL; plans by fisher sensitivity + knapsack, rtn rounding)",
        "",
        f"Command: `{' '.join(['.venv/bin/python', 'bench/rotation_allocation.py', *sys.argv[1:]])}`  ",
        f"Calibration {args.samples} × {args.seq_len} tokens; held-out: the built-in held-out text,"
        f" {args.eval_tokens} tokens in windows of {args.seq_len} (`command=eval`).",
        "",
    ]
    for model, rows in done.items():
        text += [f"## {Path(model).name}", "", "| bits | model | held-out KL | × mlx-lm | bytes |"]
        text += ["|---|---|---:|---:|---:|"]
        anchors = {r["bits"]: r["kld"] for r in rows if r["label"].startswith("mlx-lm")}
        for r in rows:
            if "error" in r:
                text.append(f"| {r['bits']} | {r['label']} | — ({r['error']}) | | |")
                continue
            text.append(
                f"| {r['bits']} | {r['label']} | {r['kld']:.4f} | {r['kld'] / anchors[r['bits']]:.2f} | {r['bytes']} |"
            )
        text.append("")
    return "\n".join(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, action="append", default=None)
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--eval-tokens", type=int, default=8192)
    ap.add_argument("--work", type=Path, default=Path("/tmp/mlxbun-bench-rotation-allocation"))
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "rotation_allocation.md")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    done = {str(m): run_model(m.resolve(), args) for m in (args.model or qq.FIXTURES)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report(args, done))
    print(args.out.read_text())


if __name__ == "__main__":
    main()
