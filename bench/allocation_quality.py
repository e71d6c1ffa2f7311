"""Quality at equal bytes: ``+recipe=best`` against mlx-lm's convert options, GPTQ, AWQ and dynamic_quant.

Run: .venv/bin/python bench/allocation_quality.py [--model tests/fixtures/llama-text-12l ...]
         [--only convert:3,convert:4] [--samples 16] [--seq-len 256] [--out bench/results/allocate.md]

For each model (several ``--model`` give one section each), everything through mlxbun's CLI:

1. Anchors, each in its own child process (wall time of the whole method, load and save included):
   ``mlx_lm.convert`` at q2, q3, mixed_3_4, mixed_3_6, q4, mixed_4_6, q4 g32, q6;
   ``mlx_lm.quant.gptq.gptq_quantize`` (4-bit g64; its default 6-bit fallback and a 4-bit one);
   ``mlx_lm.quant.awq.awq_quantize`` (3 and 4-bit g64, its default 4-bit g32 embedding);
   ``mlx_lm.quant.dynamic_quant`` (3/4 and 4/5 tiers at their default-style bpw targets);
   ``mlx_lm.quant.dwq.dwq_quantize`` (3 and 4-bit g64 students, :func:`stage_dwq`).
   The learned quantizers get mlxbun's calibration token matrix directly (offline, the same
   tokens as mlxbun's sensitivity).
2. At the bytes of every anchor (its ``.safetensors`` files on disk):
   ``python -m mlxbun +recipe=best model.name=<model> allocate.budget_bytes=<anchor bytes>``, one
   cache for all (the sensitivity and candidate scores are computed once; each budget adds its
   probes, allocate and quantize). Seconds per step from the run's manifest and wall clock.
3. ``python -m mlxbun command=eval model.name=<model> eval.candidates=[every anchor and plan]``:
   held-out KL (mlxbun's built-in held-out text) of each, its bytes.

Writes ``bench/results/allocate.md`` (and prints each row as it is measured).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# Anchors: name -> child-stage spec.
ANCHORS = {
    "mlx-lm q2": "convert:2:64:",
    "mlx-lm q3": "convert:3:64:",
    "mlx-lm mixed_3_4": "convert:3:64:mixed_3_4",
    "mlx-lm mixed_3_6": "convert:3:64:mixed_3_6",
    "mlx-lm q4": "convert:4:64:",
    "mlx-lm mixed_4_6": "convert:4:64:mixed_4_6",
    "mlx-lm q4 g32": "convert:4:32:",
    "mlx-lm q6": "convert:6:64:",
    "mlx-lm gptq 4-bit (fallback 6), float32 Hessians": "gptq:4:6:f32",
    "mlx-lm gptq 4-bit (fallback 4), float32 Hessians": "gptq:4:4:f32",
    "mlx-lm awq 3-bit": "awq:3",
    "mlx-lm awq 4-bit": "awq:4",
    "mlx-lm dynamic_quant 3/4 @ 4.0 bpw": "dq:3:4:4.0",
    "mlx-lm dynamic_quant 4/5 @ 5.0 bpw": "dq:4:5:5.0",
    "mlx-lm dwq 3-bit": "dwq:3",
    "mlx-lm dwq 4-bit": "dwq:4",
}
# mlx-lm's default 1e-6 is for 2,048 long samples; over our ~28 steps a bfloat16 scale would not move
# (narrow-6l q3: held-out KL 0.364 as converted, 0.335 after lr 1e-4, 0.298 after 1e-3).
DWQ_LR = 1e-3
DWQ_EPOCHS = 4  # passes over the calibration windows, in one run (its float32 copy accumulates)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ------------------------------------------------------------------------------- child stages


def _calibration(model_dir: Path, samples: int, seq_len: int):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from mlxbun.quant.calibration import load_calibration

    tok = load_tokenizer(model_dir)
    return load_calibration(tokenizer=tok, samples=samples, seq_len=seq_len, seed=0)


def stage_convert(args: argparse.Namespace, bits: str, group: str, rule: str) -> None:
    from mlx_lm import convert

    convert(
        str(args.model), str(args.dest), quantize=True, q_bits=int(bits), q_group_size=int(group),
        quant_predicate=rule or None,
    )  # fmt: skip


def _load_for_learned(args: argparse.Namespace):
    import mlx.core as mx
    from mlx_lm.utils import load

    model, tok, config = load(str(args.model), return_config=True)
    data = mx.array(_calibration(args.model, args.samples, args.seq_len).tokens)
    mx.random.seed(123)
    return model, tok, config, data


def stage_gptq(args: argparse.Namespace, bits: str, fallback: str, dtype: str = "") -> None:
    """mlx-lm's GPTQ as its command runs it; ``f32``: on a float32 copy (its Hessians accumulate in
    the model's dtype, and in bf16 some came out not positive definite: NaN scales), saved in bf16."""
    import mlx.core as mx
    from mlx_lm.quant.gptq import gptq_quantize
    from mlx_lm.utils import save

    model, tok, config, data = _load_for_learned(args)
    if dtype == "f32":
        model.set_dtype(mx.float32)
    model, config["quantization"] = gptq_quantize(model, data, int(bits), 64, int(fallback), 64)
    if dtype == "f32":
        model.set_dtype(mx.bfloat16)
    save(str(args.dest), str(args.model), model, tok, config)


def stage_awq(args: argparse.Namespace, bits: str) -> None:
    from mlx_lm.quant.awq import AWQ_MODEL_CONFIGS, awq_quantize, update_config
    from mlx_lm.utils import save

    model, tok, config, data = _load_for_learned(args)
    awq_quantize(model, data, AWQ_MODEL_CONFIGS[config["model_type"]], bits=int(bits), group_size=64)
    save(str(args.dest), str(args.model), model, tok, update_config(model, config))


def stage_dq(args: argparse.Namespace, low: str, high: str, target: str) -> None:
    from mlx_lm.quant.dynamic_quant import estimate_sensitivities, estimate_threshold
    from mlx_lm.utils import quantize_model, save

    model, tok, config, data = _load_for_learned(args)
    lo, hi = int(low), int(high)
    sens = dict(estimate_sensitivities(model, data, lo, 64, hi, 64))
    thr = estimate_threshold(model, sens, float(target), lo, 64, hi, 64)

    def predicate(p, m):
        if not hasattr(m, "to_quantized"):
            return False
        return {"bits": hi, "group_size": 64} if sens[p] > thr else True

    model, config = quantize_model(model, config, group_size=64, bits=lo, quant_predicate=predicate)
    save(str(args.dest), str(args.model), model, tok, config)


def stage_dwq(args: argparse.Namespace, bits: str) -> None:
    """mlx-lm's DWQ as its command runs it (student = its ``quantize_model`` at ``bits`` g64, scales and
    biases learned by KL to the reference's logits), on the calibration windows instead of an HF
    dataset: :data:`DWQ_EPOCHS` passes in one run at :data:`DWQ_LR`, validated on 4 of the windows."""
    import copy

    import mlx.core as mx
    import mlx.optimizers as optimizers
    from mlx_lm.quant.dwq import dwq_quantize
    from mlx_lm.utils import quantize_model, save

    model, tok, config, data = _load_for_learned(args)
    windows = [(np.asarray(row).tolist(), 0) for row in np.asarray(data)]
    train, valid = windows[4:] or windows, windows[:4]
    q_model = copy.deepcopy(model)
    _, config = quantize_model(q_model, config, group_size=64, bits=int(bits))
    opt = optimizers.Adam(learning_rate=DWQ_LR, bias_correction=True)
    dwq_quantize(
        q_model, lambda batch, idx, split: model(batch), opt, train * DWQ_EPOCHS, valid,
        batch_size=4, max_seq_length=args.seq_len + 1, seed=123,
    )  # fmt: skip
    mx.eval(q_model.parameters())
    save(str(args.dest), str(args.model), q_model, tok, config)


STAGES = {"convert": stage_convert, "gptq": stage_gptq, "awq": stage_awq, "dq": stage_dq, "dwq": stage_dwq}


def child(spec: str, model: Path, dest: Path, args: argparse.Namespace) -> dict:
    """Run one stage in a fresh process; its wall time and peak RSS."""
    cmd = [sys.executable, __file__, "--stage", spec, "--model", str(model), "--dest", str(dest)]
    cmd += ["--samples", str(args.samples), "--seq-len", str(args.seq_len)]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if out.returncode:
        sys.stderr.write(out.stderr[-4000:])
        raise SystemExit(f"stage {spec} failed")
    return {"seconds": seconds, **json.loads(out.stdout.strip().splitlines()[-1])}


def anchor(spec: str, model: Path, args: argparse.Namespace, work: Path) -> tuple[Path, dict]:
    """The child stage ``spec``'s output under ``work`` and its stats, reused when already run there."""
    dest = work / ("anchor-" + spec.replace(":", "_"))
    record = dest.with_suffix(".stage.json")
    if record.is_file():
        return dest, json.loads(record.read_text())
    shutil.rmtree(dest, ignore_errors=True)
    stats = child(spec, model, dest, args)
    record.write_text(json.dumps(stats))
    return dest, stats


# ------------------------------------------------------------------------------- the product's CLI


def cli(*argv: str, work: Path) -> tuple[Path, float]:
    """``python -m mlxbun ...`` with outputs and cache under ``work``: its run dir and wall seconds."""
    cmd = [
        sys.executable,
        "-m",
        "mlxbun",
        *argv,
        f"paths.outputs={work / 'outputs'}",
        f"paths.cache={work / 'cache'}",
    ]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if out.returncode:
        sys.stderr.write(out.stderr[-4000:])
        raise SystemExit(f"failed ({out.returncode}): {' '.join(argv)}")
    line = next(x for x in out.stdout.splitlines() if x.startswith("outputs:"))
    return Path(line.split(":", 1)[1].strip()), seconds


def file_bytes(model_dir: Path) -> int:
    """Bytes of the ``.safetensors`` files on disk (allocate.budget_bytes counts the same)."""
    return sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))


def best(model: Path, budget: int, args: argparse.Namespace, work: Path) -> dict:
    """``+recipe=best`` at ``budget`` bytes: its model, plan summary and seconds per step."""
    run, wall = cli(
        "+recipe=best", f"model.name={model}", f"allocate.budget_bytes={budget}",
        f"sensitivity.calib.samples={args.samples}", f"sensitivity.calib.seq_len={args.seq_len}",
        work=work,
    )  # fmt: skip
    metrics = json.loads((run / "manifest.json").read_text())["metrics"]
    sens, cand = metrics["sensitivity"], metrics["sensitivity"].get("candidates_seconds", {})
    plan = json.loads((run / "allocate" / "plan.json").read_text())
    used: dict[str, int] = {}
    for e in plan["layers"].values():
        if e:
            key = e["mode"] if e["mode"] != "affine" else f"{e.get('method', 'rtn')} g{e['group_size']}"
            used[key] = used.get(key, 0) + 1
    steps = {
        "sensitivity": sens["seconds"] - sum(cand.values()),
        **{f"candidates {k}": v for k, v in cand.items()},
        "quantize": metrics["quantize"]["seconds"],
        "tune": metrics.get("tune", {}).get("seconds", 0.0),
    }
    steps["allocate and the rest"] = wall - sum(steps.values())
    doc = json.loads((run / "sensitivity" / "sensitivity.json").read_text())
    probes = doc["candidates"]["probes"] if "candidates" in doc else []
    return {
        "path": metrics["provides"]["model.name"],  # tune's model, or quantize's when tune handed it on
        "untuned": str(run / "quantize" / "model"),
        "wall": wall,
        "steps": steps,
        "predicted_bytes": plan["predicted_bytes"],
        "used": used,
        "probes": probes,
    }


def evaluate(model: Path, dirs: list[str], args: argparse.Namespace, work: Path) -> dict[str, dict]:
    """``command=eval``: each candidate directory's held-out row (eval.json) by path."""
    run, _ = cli(
        "command=eval", f"model.name={model}", f"eval.candidates=[{','.join(dirs)}]",
        f"eval.tokens={args.eval_tokens}", f"eval.seq_len={args.seq_len}", work=work,
    )  # fmt: skip
    rows = json.loads((run / "eval.json").read_text())["candidates"]
    return {str(Path(r["path"]).resolve()): r for r in rows}


def run_fixture(model: Path, args: argparse.Namespace) -> dict:
    work = args.work / model.name
    wanted = [w for w in args.only.split(",") if w]
    anchors = {k: v for k, v in ANCHORS.items() if not wanted or any(v.startswith(w) for w in wanted)}
    rows, by_budget = [], {}
    for label, spec in anchors.items():
        dest, stats = anchor(spec, model, args, work)
        option = {
            "label": label,
            "path": str(dest.resolve()),
            "bytes": file_bytes(dest),
            "seconds": stats["seconds"],
        }
        if option["bytes"] not in by_budget:  # options of equal bytes share one run
            by_budget[option["bytes"]] = best(model, option["bytes"], args, work)
        mine = dict(by_budget[option["bytes"]])
        mine["bytes"] = file_bytes(Path(mine["path"]))
        rows.append({"anchor": option, "best": mine})
        print(f"{model.name}: {label}: {json.dumps(rows[-1])}", flush=True)
    paths = [r["anchor"]["path"] for r in rows] + [r["best"][k] for r in rows for k in ("path", "untuned")]
    kl = evaluate(model, list(dict.fromkeys(paths)), args, work)
    for r in rows:
        for side in ("anchor", "best"):
            e = kl[str(Path(r[side]["path"]).resolve())]
            r[side] |= {"kld": e["kld_mean"], "kld_err": e["kld_mean_err"]}
        r["best"]["untuned_kld"] = kl[str(Path(r["best"]["untuned"]).resolve())]["kld_mean"]
    return {"model": str(model), "rows": rows}


# ------------------------------------------------------------------------------- report


def _rel(p: str) -> str:
    path = Path(p)
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def report(args: argparse.Namespace, results: list[dict], seconds: float) -> str:
    import mlx.core as mx

    models = " ".join(f"--model {_rel(r['model'])}" for r in results)
    only = f" --only {args.only}" if args.only else ""
    lines = [
        "# Quality at equal bytes: `+recipe=best` against mlx-lm (bench/allocation_quality.py)",
        "",
        f"Command: `.venv/bin/python bench/allocation_quality.py {models}{only} --samples {args.samples}"
        f" --seq-len {args.seq_len} --eval-tokens {args.eval_tokens}`  ",
        f"Machine: 2-core x86_64 Linux, mlx {mx.__version__} CPU, shared with other jobs (times are noisy)."
        f" Total {seconds:.0f} s.",
        "",
        "Each row: an mlx-lm option, then `python -m mlxbun +recipe=best model.name=<model>"
        " allocate.budget_bytes=<its bytes>`. KL = `command=eval`'s mean KL(reference || model) on the"
        f" built-in held-out text ({args.eval_tokens} tokens, windows of {args.seq_len}); ratio = best /"
        " option. Bytes = the `.safetensors` files on disk. Seconds: the option's whole child process;"
        " best's per step (sensitivity, Hessians, candidate scores, probes, quantize, tune, the rest ="
        " allocate and start-up), the sensitivity and scores cached after the first size; options of"
        " equal bytes share one run. Untuned = best's quantize step, before tune.",
        "",
    ]
    for res in results:
        lines += [f"## {_rel(res['model'])}", ""]
        lines += [
            "| size of | option bytes | option KL | best bytes | best KL | ratio | untuned KL (ratio) | option s | best s (steps) | best's modules |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
        ]
        for r in res["rows"]:
            a, b = r["anchor"], r["best"]
            steps = ", ".join(f"{k} {v:.0f}" for k, v in b["steps"].items())
            used = " ".join(f"{k} {v}" for k, v in sorted(b["used"].items()))
            lines.append(
                f"| {a['label']} | {a['bytes']} | {a['kld']:.5f} | {b['bytes']} | {b['kld']:.5f} |"
                f" **{b['kld'] / a['kld']:.3f}** | {b['untuned_kld']:.5f} ({b['untuned_kld'] / a['kld']:.3f}) | {a['seconds']:.0f} | {b['wall']:.0f} ({steps}) | {used} |"
            )
        probes = res["rows"][0]["best"]["probes"] if res["rows"] else []
        lines += ["", "Probes of the first size (the correction of each quantizer's estimates):", ""]
        lines += [
            f"- {p['key']}: {p['modules']} modules ({p.get('planned', p['modules'])} planned),"
            f" predicted {p['predicted']:.5g}, "
            + (
                f"measured {p['measured']:.5g}"
                if p["measured"] is not None
                else "not probed (under 5% of the KL)"
            )
            + f", factor {p['factor']:.2f}"
            for p in probes
        ]
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, action="append", default=None)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--eval-tokens", type=int, default=8192, help="held-out tokens (eval.tokens)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/mlxbun-bench-allocate"))
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "allocate.md")
    ap.add_argument("--stage", default=None, help="(internal) run one child stage")
    ap.add_argument("--dest", type=Path, default=None, help="(internal) the child stage's output")
    ap.add_argument(
        "--only", default="", help="anchors whose spec starts with one of these, e.g. convert:3,convert:4"
    )
    ap.add_argument(
        "--reuse", action="store_true", help="keep --work: finished anchors and caches are reused"
    )
    args = ap.parse_args()
    models = [m.resolve() for m in (args.model or [REPO / "tests" / "fixtures" / "llama-text-12l"])]
    if args.stage:
        args.model = models[0]
        from mlxbun import blas

        blas.load()  # every method's f32 matmuls go through the same BLAS
        kind, *rest = args.stage.split(":")
        STAGES[kind](args, *rest)
        print(json.dumps({"peak_rss_mb": peak_rss_mb()}))
        return
    t0 = time.perf_counter()
    if not args.reuse:
        shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True, exist_ok=True)
    results = [run_fixture(m, args) for m in models]
    (args.work / "results.json").write_text(json.dumps(results, indent=1))
    text = report(args, results, time.perf_counter() - t0)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
