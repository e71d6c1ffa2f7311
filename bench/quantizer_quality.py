"""Quantizers at uniform bits: mlxbun's rtn / clip / gptq / awq against mlx-lm's convert, gptq and awq.

Run: .venv/bin/python bench/quantizer_quality.py [--model tests/fixtures/llama-text-3m ...]
         [--samples 8] [--seq-len 256] [--eval-samples 16] [--no-mlx-gptq] [--out bench/results/quantizers.md]

For each model and bits in (3, 4), all at group size 64:

1. Input Hessians on the calibration tokens (``mlxbun.quant.calibrate.calibrate``, streamed
   block by block), in a child process: wall time and peak RSS.
2. mlxbun's ``quantize_model_dir`` with ``method`` rtn, clip, gptq and awq (wall time of the
   quantize call, in this process).
3. Anchors in child processes (stages of ``bench/allocation_quality.py``, same calibration
   tokens): ``mlx_lm.convert`` q3/q4; ``mlx_lm.quant.gptq`` at 4 bits (it supports 2, 4, 8) with
   its embedding/head fallback at 4 bits (so the bytes match; float32 Hessians, as its bf16 ones
   give NaN here);
   ``mlx_lm.quant.awq`` (its own defaults for the embedding: the bytes differ, shown).
4. KL(reference || model) on held-out text: CPython modules that are in neither fixture's
   training corpus (``FIXTURE.json`` of both), so both fixtures are scored on the same text.

Writes ``bench/results/quantizers.md``. Quality only (runs niced): wall times are kept in the
work directory's records, not reported.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import allocation_quality as aq  # noqa: E402  (the anchors' child stages and the KL evaluator)

FIXTURES = [REPO / "tests" / "fixtures" / "llama-text-3m", REPO / "tests" / "fixtures" / "llama-text-12l"]
METHODS = ("rtn", "clip", "gptq", "awq")
GPTQ_BITS = (2, 4, 8)  # mlx_lm.quant.gptq asserts these
CANDIDATES = aq.HELD_OUT + aq.HELD_OUT_MORE + ["locale", "zipfile", "nntplib", "poplib", "netrc", "sched"]


def held_out_text(work: Path, model: Path) -> Path:
    """Eight CPython modules in no fixture's training corpus, as one text file."""
    seen = set()
    for fx in FIXTURES:
        record = fx / "FIXTURE.json"
        if record.is_file():
            seen |= {Path(c["file"]).stem for c in json.loads(record.read_text())["corpus"]}
    names = [
        m
        for m in dict.fromkeys(CANDIDATES)
        if m not in seen and Path(f"/usr/lib/python3.11/{m}.py").is_file()
    ]
    names = names[:8]
    path = work / "held_out.txt"
    path.write_text(
        "\n\n".join(Path(f"/usr/lib/python3.11/{m}.py").read_text(errors="replace") for m in names)
    )
    (work / "held_out.json").write_text(json.dumps(names))
    return path


def mlxbun_row(fx: aq.Fixture, bits: int, method: str, hessians: Path, embed: bool = False) -> dict:
    """mlxbun's quantize at ``bits`` g64; ``embed``: the embedding (the tied head) at 4-bit g32,
    the layout mlx-lm's awq writes, so that row has its bytes."""
    from mlxbun.quant.quantize import quantize_model_dir
    from mlxbun.quant.spec import Plan, QuantSpec

    tag = f"{bits}-{method}" + ("-e4g32" if embed else "")
    out = fx.work / "uniform" / tag
    record = out.with_suffix(".row.json")
    if record.is_file():  # a finished row of an earlier run with the same --work
        return json.loads(record.read_text())
    shutil.rmtree(out, ignore_errors=True)
    kw = {} if method == "rtn" else {"method": method, "hessians": hessians}
    if embed:
        layers = {"model.embed_tokens": QuantSpec(bits=4, group_size=32)}
        kw["plan"] = Plan(default=QuantSpec(bits=bits, group_size=64), layers=layers)
    else:
        kw.update(bits=bits, group_size=64)
    t0 = time.perf_counter()
    res = quantize_model_dir(fx.model, out, partial_root=fx.work / "partial", **kw)
    seconds = time.perf_counter() - t0
    label = f"mlxbun {method}" + (", embedding 4-bit g32" if embed else "")
    row = {"label": label, "seconds": seconds, **aq._size(res.out, fx.source.parameters)} | fx.eval.kl(
        res.out
    )
    record.write_text(json.dumps(row))
    return row


def run_model(model: Path, args: argparse.Namespace) -> dict:
    fx = aq.Fixture(model, args)
    hdir, hstats = fx.stage("hessians", "hessians")
    rows: dict[int, list[dict]] = {}
    for bits in (3, 4):
        rows[bits] = [fx.anchor(f"mlx-lm convert q{bits}", f"convert:{bits}:64:")]
        for method in METHODS:
            rows[bits].append(mlxbun_row(fx, bits, method, hdir / "hessians.safetensors"))
        awq_label = f"mlx-lm awq {bits}-bit (embedding 4-bit g32)"
        done = (fx.work / f"anchor-awq_{bits}.stage.json").is_file()
        if f"awq:{bits}" in args.skip and not done:
            rows[bits].append({"label": awq_label, "skipped": True})
        else:
            rows[bits].append(fx.anchor(awq_label, f"awq:{bits}"))
        for method in ("rtn", "gptq", "awq"):
            rows[bits].append(mlxbun_row(fx, bits, method, hdir / "hessians.safetensors", embed=True))
        if args.mlx_gptq and bits in GPTQ_BITS:
            rows[bits].append(
                fx.anchor(f"mlx-lm gptq {bits}-bit (fallback {bits})", f"gptq:{bits}:{bits}:f32")
            )
        write_report(args, {**args.done, str(model): {"hessians": hstats, "rows": rows}})
    return {"hessians": hstats, "rows": rows}


def lines_for(model: str, res: dict) -> list[str]:
    h = res["hessians"]
    out = [
        f"### {Path(model).name}",
        "",
        f"Hessians (streamed capture): peak RSS {h.get('peak_rss_mb', 0):.0f} MB.",
        "",
        "| bits | method | held-out KL | × mlx-lm convert | bytes |",
        "|---|---|---:|---:|---:|",
    ]
    for bits, rows in res["rows"].items():
        anchor = rows[0]["held_out"]
        for r in rows:
            if r.get("skipped"):
                out.append(f"| {bits} | {r['label']} | not run (--skip) | | |")
                continue
            out.append(
                f"| {bits} | {r['label']} | {r['held_out']:.4f} | {r['held_out'] / anchor:.2f} | "
                f"{r['file_bytes']} |"
            )
    return out + [""]


def write_report(args: argparse.Namespace, done: dict) -> None:
    held = (
        json.loads((args.work / "held_out.json").read_text())
        if (args.work / "held_out.json").is_file()
        else []
    )
    text = [
        "# Quantizers at uniform bits (group size 64), held-out KL",
        "",
        f"Command: `{' '.join(['.venv/bin/python', 'bench/quantizer_quality.py', *sys.argv[1:]])}`",
        f"Calibration: {args.samples} × {args.seq_len} tokens; held-out: {args.eval_samples} × {args.seq_len}"
        f" tokens of {', '.join(held)} (in neither fixture's corpus).",
        "",
    ]
    for model, res in done.items():
        text += lines_for(model, res)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(text))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, action="append", default=None)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--eval-samples", type=int, default=16)
    ap.add_argument("--work", type=Path, default=Path("/tmp/mlxbun-bench-quantizers"))
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "quantizers.md")
    ap.add_argument("--no-mlx-gptq", dest="mlx_gptq", action="store_false", help="skip mlx-lm's gptq (slow)")
    ap.add_argument(
        "--skip", nargs="*", default=[], help="anchor stages not to run (unless already done), e.g. awq:3"
    )
    args = ap.parse_args()
    from mlxbun import blas

    blas.load()
    args.work.mkdir(parents=True, exist_ok=True)
    aq.held_out_text = held_out_text  # one held-out text for every fixture
    args.done = {}
    for model in args.model or FIXTURES:
        args.done[str(model)] = run_model(model.resolve(), args)
    write_report(args, args.done)
    print(args.out.read_text())


if __name__ == "__main__":
    main()
