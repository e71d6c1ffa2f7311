"""Plans with and without ``allocate.interactions``: held-out KL at mlx-lm's sizes, per method and draw.

Run: .venv/bin/python bench/allocate_interactions.py --work W
         [--fixtures llama-text-3m llama-text-12l] [--methods exact fisher] [--draws 0 1]
         [--sizes q3 mixed_3_6 q4 mixed_4_6 "q4 g32" q6] [--decisions 16] [--rounds 2]
         [--out bench/results/allocate_interactions.md] [--from-json R.json ...]
     .venv/bin/python bench/allocate_interactions.py --cost [--fixtures llama-text-12l]
         [--budgets 3.5 4.5] [--cost-args sensitivity.calib.samples=8 ...]

``--cost``: what one allocation costs against the sensitivity it reads, through the product's
CLI: ``command=sensitivity`` (the default fisher, bits 2-8, the default calibration), then
``command=allocate`` (the default interactions) at each ``--budgets`` bpw, each in its own
process; prints and writes (``bench/results/allocate_cost.md``) wall seconds, peak RSS (wait4)
and the interactions' forward passes. The goal: an allocation costs at most its sensitivity.

``W`` is the ``--work`` directory of a ``bench/sensitivity_methods.py`` run: its sensitivities
(``W/<fixture>/<method>`` for draw 0, ``<method>@calib<K>`` for draw K) are read, not measured
again. For each fixture, draw and size (the bytes of an mlx-lm option, quantized here first):

- the plan ``allocate`` makes from the summed objective alone ("summed"), and the plan it makes
  with ``interactions`` (steps near the threshold re-measured in the quantized model on the
  sensitivity's own calibration draw; ``mlxbun/quant/allocate/interactions.py``);
- each quantized by the project's quantize and scored by KL on held-out text (the same text and
  scoring as ``sensitivity_methods.py``), each / exact's summed plan at the same draw;
- the interactions' cost: forward-pass equivalents over the calibration set and seconds.

The summary table gives each method's mean held-out KL over the draws with interactions against
exact's with interactions, and against exact's summed plan (the reference of the last report).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import sensitivity_methods as sm  # noqa: E402

MODES = ("summed", "interactions")


def sensitivity_dir(work: Path, method: str, d: int) -> Path:
    return work / (method if d == 0 else f"{method}@calib{d}")


def fixture(args: argparse.Namespace, name: str) -> dict:
    """{size: {draw: {method: {mode: {kl, forwards, seconds}}}}} for one fixture."""
    import shutil

    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from mlxbun.io.atomic import atomic_write_json
    from mlxbun.quant.allocate.allocation import allocate
    from mlxbun.quant.allocate.interactions import InModel
    from mlxbun.quant.calibration import load_calibration
    from mlxbun.quant.sensitivity.file import load_sensitivity

    work = args.work / name
    calib = load_sensitivity(sensitivity_dir(work, "exact", 0)).calibration
    scratch = work / "interactions"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    ns = argparse.Namespace(
        model=REPO / "tests" / "fixtures" / name,
        work=scratch,
        samples=calib["samples"],
        seq_len=calib["seq_len"],
    )
    plans = sm.Plans(ns)
    sizes = {label: plans.quantize(**kw)["file_bytes"] for label, kw in sm.SIZES if label in args.sizes}
    tok = load_tokenizer(ns.model)
    out: dict = {label: {} for label in sizes}
    for d in args.draws:
        drawn = load_calibration(tokenizer=tok, samples=calib["samples"], seq_len=calib["seq_len"], seed=d)
        measured = {m: load_sensitivity(sensitivity_dir(work, m, d)) for m in args.methods}
        for method, sens in measured.items():
            if sens.calibration_fingerprint != drawn.fingerprint:
                raise SystemExit(f"{name}: {method} at draw {d} was not measured on calibration draw {d}")
        with InModel(ns.model, drawn.tokens) as in_model:
            for label, limit in sizes.items():
                row = out[label].setdefault(str(d), {})
                for method, sens in measured.items():
                    for mode in MODES:
                        f0, t0 = in_model.forwards, time.perf_counter()
                        plan = allocate(
                            sens, model_dir=ns.model, budget_bytes=limit, in_model=in_model if mode == "interactions" else None,
                            decisions=args.decisions, rounds=args.rounds,
                        )  # fmt: skip
                        seconds = time.perf_counter() - t0
                        path = scratch / "plans" / f"{method}_{d}_{mode}_{limit}.json"
                        path.parent.mkdir(parents=True, exist_ok=True)
                        atomic_write_json(path, plan.to_json())
                        res = plans.quantize(plan=path)
                        assert res["file_bytes"] <= limit, (res, limit)
                        row.setdefault(method, {})[mode] = {
                            "kl": res["kl"], "forwards": in_model.forwards - f0, "seconds": seconds,
                            "calib": [plan.interactions.get("kl_before"), plan.interactions.get("kl_after")],
                        }  # fmt: skip
                        print(
                            f"{name} {label} draw {d} {method} {mode}: {json.dumps(row[method][mode])}",
                            flush=True,
                        )
    return out


def cli(argv: list[str], tmp: Path) -> dict:
    """``python -m mlxbun *argv`` in its own process (outputs, cache, registry under ``tmp``):
    wall seconds and peak RSS (wait4); exits with its stderr when it fails."""
    import os
    import subprocess

    iso = [
        f"paths.outputs={tmp / 'outputs'}",
        f"paths.cache={tmp / 'cache'}",
        f"registry.path={tmp / 'r.db'}",
    ]
    with open(tmp / "stderr.log", "w+b") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-m", "mlxbun", *argv, *iso], cwd=REPO, stdout=err, stderr=err
        )
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode:
            err.seek(0)
            raise SystemExit(f"{' '.join(argv)} failed:\n{err.read().decode()[-3000:]}")
    return {"seconds": seconds, "peak_mb": usage.ru_maxrss / 1024}


def cost(args: argparse.Namespace, name: str) -> dict:
    """Seconds and peak RSS of sensitivity and of one allocation per budget, through the CLI."""
    import shutil
    import tempfile

    model = REPO / "tests" / "fixtures" / name
    rows = {}
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        argv = [
            "command=sensitivity",
            f"model.name={model}",
            "sensitivity.bits=[2,3,4,5,6,8]",
            *args.cost_args,
        ]
        rows["sensitivity"] = cli(argv, tmp)
        run = next((tmp / "outputs" / "sensitivity").iterdir())
        calib = json.loads((run / "sensitivity.json").read_text())["calibration"]
        rows["sensitivity"]["calibration"] = f"{calib['samples']} x {calib['seq_len']}"
        print(f"{name} sensitivity: {json.dumps(rows['sensitivity'])}", flush=True)
        for bpw in args.budgets:
            argv = ["command=allocate", f"model.name={model}", f"allocate.sensitivity={run}"]
            row = cli([*argv, f"allocate.budget_bpw={bpw}"], tmp)
            out = next((tmp / "outputs" / "allocate").iterdir())
            it = json.loads((out / "plan.json").read_text()).get("interactions", {})
            shutil.rmtree(out)
            row |= {k: it.get(k) for k in ("forwards", "skipped", "kl_before", "kl_after")}
            rows[f"allocate {bpw} bpw"] = row
            print(f"{name} allocate {bpw} bpw: {json.dumps(row)}", flush=True)
    return rows


def cost_report(args: argparse.Namespace, results: dict) -> str:
    lines = [
        "# allocate against the sensitivity it reads: seconds and peak RSS, through the CLI",
        "",
        f"Command: `{' '.join(['.venv/bin/python', 'bench/allocate_interactions.py', *sys.argv[1:]])}`",
        "",
        "| fixture | step | seconds | / sensitivity | interactions forwards | peak RSS (MB) |",
        "|---|---|---|---|---|---|",
    ]
    for name, rows in results.items():
        sens = rows["sensitivity"]["seconds"]
        for step, r in rows.items():
            fw = "" if r.get("forwards") is None else f"{r['forwards']:.1f}"
            lines.append(
                f"| {name} | {step} | {r['seconds']:.1f} | {r['seconds'] / sens:.2f} | {fw} | {r.get('peak_mb', 0):.0f} |"
            )
    return "\n".join(lines + [""])


def report(args: argparse.Namespace, results: dict) -> str:
    lines = [
        "# allocate.interactions: held-out KL of plans with and without",
        "",
        f"Command: `{' '.join(['.venv/bin/python', 'bench/allocate_interactions.py', *sys.argv[1:]])}`",
        f"decisions={args.decisions} rounds={args.rounds}; sizes are the bytes of mlx-lm's options.",
        "",
    ]
    for name, res in results.items():
        lines += [
            f"## {name}",
            "",
            "Held-out KL, each / exact's summed plan at the same draw; cost of the interactions:",
            "",
        ]
        lines += [
            "| size | draw | method | summed | interactions | forwards | seconds |",
            "|---|---|---|---|---|---|---|",
        ]
        for label, draws in res.items():
            for d, row in draws.items():
                ref = row["exact"]["summed"]["kl"]
                for method, modes in row.items():
                    s, i = modes["summed"], modes["interactions"]
                    lines.append(
                        f"| {label} | {d} | {method} | {s['kl']:.5f} ({s['kl'] / ref:.3f}) | {i['kl']:.5f} ({i['kl'] / ref:.3f})"
                        f" | {i['forwards']:.1f} | {i['seconds']:.0f} |"
                    )
        lines += [
            "",
            "Mean over draws: method with interactions / exact with interactions (/ exact summed):",
            "",
        ]
        labels = list(res)
        lines += ["| method | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
        for method in args.methods:
            cells = []
            for label in labels:
                draws = res[label].values()
                mine = statistics.mean(r[method]["interactions"]["kl"] for r in draws)
                ctx = statistics.mean(r["exact"]["interactions"]["kl"] for r in draws)
                summed = statistics.mean(r["exact"]["summed"]["kl"] for r in draws)
                cells.append(f"{mine / ctx:.3f} ({mine / summed:.3f})")
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path)
    ap.add_argument("--cost", action="store_true", help="seconds and peak RSS: allocate vs its sensitivity")
    ap.add_argument("--budgets", nargs="+", type=float, default=[3.5, 4.5])
    ap.add_argument(
        "--cost-args", nargs="*", default=[], help="more CLI keys for the sensitivity (calibration)"
    )
    ap.add_argument("--fixtures", nargs="+")
    ap.add_argument("--methods", nargs="+", default=["exact", "fisher"])
    ap.add_argument("--draws", nargs="+", type=int, default=[0])
    ap.add_argument("--sizes", nargs="+", default=[label for label, _ in sm.SIZES])
    ap.add_argument("--decisions", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--from-json", type=Path, nargs="+", help="report these results files instead of running")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "allocate_interactions.md")
    args = ap.parse_args()
    if args.cost:
        args.fixtures = args.fixtures or ["llama-text-12l"]
        results = {name: cost(args, name) for name in args.fixtures}
        text = cost_report(args, results)
        out = REPO / "bench" / "results" / "allocate_cost.md"
        out.write_text(text)
        out.with_suffix(".json").write_text(json.dumps(results, indent=1))
        print(text)
        return
    if args.work is None:
        ap.error("--work is needed (or --cost)")
    args.fixtures = args.fixtures or ["llama-text-3m", "llama-text-12l"]
    if "exact" not in args.methods:
        args.methods.insert(0, "exact")
    from mlxbun import blas

    blas.load()
    if args.from_json:  # results of runs made one fixture or draw at a time, reported together
        results: dict = {}
        for f in args.from_json:
            for name, sizes in json.loads(f.read_text()).items():
                for label, draws in sizes.items():
                    results.setdefault(name, {}).setdefault(label, {}).update(draws)
    else:
        results = {name: fixture(args, name) for name in args.fixtures}
    text = report(args, results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")
    (args.out.with_suffix(".json")).write_text(json.dumps(results, indent=1))
    print(text)


if __name__ == "__main__":
    main()
