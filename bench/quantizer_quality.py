"""Quantizers at uniform bits: mlxbun's rtn / clip / gptq / awq against mlx-lm's convert, gptq and awq.

Run: .venv/bin/python bench/quantizer_quality.py [--model tests/fixtures/llama-narrow-6l ...]
         [--samples 32] [--seq-len 128] [--eval-tokens 8192] [--no-mlx-gptq] [--out bench/results/quantizers.md]

For each model and bits in (3, 4), all at group size 64, everything through mlxbun's CLI:

1. ``python -m mlxbun command=calibrate``: input Hessians on the calibration tokens.
2. ``python -m mlxbun command=quantize quant.bits=<b> quant.method=<m> quant.hessians=<that run>``
   for rtn, clip, gptq and awq.
3. Anchors in child processes (stages of ``bench/allocation_quality.py``, same calibration
   tokens): ``mlx_lm.convert`` q3/q4; ``mlx_lm.quant.awq`` (its own defaults for the embedding: the
   bytes differ, shown); ``mlx_lm.quant.gptq`` at 4 bits (it supports 2, 4, 8) with its
   embedding/head fallback at 4 bits (float32 Hessians, as its bf16 ones give NaN here).
4. ``python -m mlxbun command=eval``: KL(reference || model) on the built-in held-out text.

Writes ``bench/results/quantizers.md``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

import allocation_quality as aq  # noqa: E402  (the anchors' child stages, the CLI runner, eval)

FIXTURES = [REPO / "tests" / "fixtures" / "llama-narrow-6l", REPO / "tests" / "fixtures" / "llama-narrow-8l"]

METHODS = ("rtn", "clip", "gptq", "awq")
GPTQ_BITS = (2, 4, 8)  # mlx_lm.quant.gptq asserts these


def anchor(label: str, spec: str, model: Path, args: argparse.Namespace, work: Path) -> dict:
    dest, _ = aq.anchor(spec, model, args, work)
    return {"label": label, "path": str(dest.resolve())}


def run_model(model: Path, args: argparse.Namespace) -> dict:
    work = args.work / model.name
    calib = [f"sensitivity.calib.samples={args.samples}", f"sensitivity.calib.seq_len={args.seq_len}"]
    hessians, _ = aq.cli("command=calibrate", f"model.name={model}", *calib, work=work)
    rows: dict[int, list[dict]] = {}
    for bits in (3, 4):
        rows[bits] = [anchor(f"mlx-lm convert q{bits}", f"convert:{bits}:64:", model, args, work)]
        for method in METHODS:
            run, _ = aq.cli(
                "command=quantize", f"model.name={model}", f"quant.bits={bits}", "quant.group_size=64",
                f"quant.method={method}", f"quant.hessians={hessians}", work=work,
            )  # fmt: skip
            rows[bits].append({"label": f"mlxbun {method}", "path": str(run / "model")})
        rows[bits].append(
            anchor(f"mlx-lm awq {bits}-bit (embedding 4-bit g32)", f"awq:{bits}", model, args, work)
        )
        if args.mlx_gptq and bits in GPTQ_BITS:
            rows[bits].append(
                anchor(
                    f"mlx-lm gptq {bits}-bit (fallback {bits})", f"gptq:{bits}:{bits}:f32", model, args, work
                )
            )
    paths = [r["path"] for rs in rows.values() for r in rs]
    kl = aq.evaluate(model, paths, args, work)
    for rs in rows.values():
        for r in rs:
            r |= {
                "kld": kl[str(Path(r["path"]).resolve())]["kld_mean"],
                "bytes": aq.file_bytes(Path(r["path"])),
            }
    return {"rows": rows}


def report(args: argparse.Namespace, done: dict) -> str:
    text = [
        "# Quantizers at uniform bits (group size 64), held-out KL",
        "",
        f"Command: `{' '.join(['.venv/bin/python', 'bench/quantizer_quality.py', *sys.argv[1:]])}`  ",
        f"Calibration: {args.samples} × {args.seq_len} tokens; held-out: the built-in held-out text,"
        f" {args.eval_tokens} tokens in windows of {args.seq_len} (`command=eval`).",
        "",
    ]
    for model, res in done.items():
        text += [f"## {Path(model).name}", "", "| bits | method | held-out KL | × mlx-lm convert | bytes |"]
        text += ["|---|---|---:|---:|---:|"]
        for bits, rows in res["rows"].items():
            for r in rows:
                text.append(
                    f"| {bits} | {r['label']} | {r['kld']:.4f} | {r['kld'] / rows[0]['kld']:.2f} | {r['bytes']} |"
                )
        text.append("")
    return "\n".join(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, action="append", default=None)
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--eval-tokens", type=int, default=8192)
    ap.add_argument("--work", type=Path, default=Path("/tmp/mlxbun-bench-quantizers"))
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "quantizers.md")
    ap.add_argument("--no-mlx-gptq", dest="mlx_gptq", action="store_false", help="skip mlx-lm's gptq")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    done = {str(m): run_model(m.resolve(), args) for m in (args.model or FIXTURES)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report(args, done))
    print(args.out.read_text())


if __name__ == "__main__":
    main()
