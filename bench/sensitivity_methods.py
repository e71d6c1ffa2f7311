"""Sensitivity methods compared: cost, agreement with exact KL, and the held-out KL of their plans.

Run: .venv/bin/python bench/sensitivity_methods.py [--fixtures llama-text-3m llama-text-12l]
         [--methods exact fisher fisher+refine exact@calib1 fisher@calib1]
         [--samples 8] [--seq-len 256] [--reuse]
         [--label-seed K]
         [--lock /work/timing.lock]
         [--out bench/results/sensitivity_methods.md]

For each committed fixture and each ``sensitivity.method`` (each in its own child process, one
after another, on the built-in calibration set, bits 2,3,4,5,6,8 affine g64):

- wall time and peak RSS of the child;
- forward-pass equivalents over the calibration set: exact runs one partial forward per
  (module, candidate) from the module's block, counted as (blocks run + head) / (blocks + head);
  fisher is 3 (forward + backward) + one forward per candidate + its calibration forwards;
  ``fisher+refine`` is fisher with every module probed exactly at 4 bits on the calibration subset;
- Spearman rank correlation of the method's per-module KL against exact's, over all
  (module, bits) pairs and per bit width (the minimum is shown);
- the held-out KL of the plan it yields at the byte size of each of mlx-lm's q3, mixed_3_6, q4,
  mixed_4_6, q4 g32 and q6 (each quantized by the project's quantize, size read from disk; the
  plan is allocated with that size as ``budget_bytes``, by the summed objective alone: what
  ``allocate.interactions`` adds is ``bench/allocate_interactions.py``), and that plan's KL / exact's;
- the allocator's objective by exact's numbers (exact's per-module KLs summed over each plan's
  choices) / exact's plan's: how well the method reproduces what exact optimizes, apart from
  what neither sees (how modules interact; ``bench/plan_interactions.py``).

Held-out text: CPython modules that neither fixture was trained on (``HELD_OUT``) and that are not
in the calibration set. ``--reuse`` keeps the sensitivities (and their timings) of an earlier run
in ``--work``; delete a method's directory to remeasure it. A method named ``<method>@calib<K>``
runs on calibration samples drawn with seed K; with exact run on the same draws, the report adds
each method's plan KL averaged over the draws against exact's, and exact's own spread.
``--label-seed K`` draws fisher's sampled labels from seed + 1000 K (the calibration tokens, and
so exact, stay the same): the spread of its plans over K is the estimate's own noise.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

BITS = [2, 3, 4, 5, 6, 8]
VARIANTS = {  # bench names that are not a sensitivity.method: the keyword arguments they stand for
    "fisher+refine": {"method": "fisher", "refine": 1.0, "refine_bits": [4]},
}


def variant(name: str) -> dict:
    """The sensitivity() keyword arguments of a bench name: a method, a VARIANTS name, or either
    followed by ``@calib<K>`` (calibration samples drawn with seed K: exact@calib1 against exact
    is the method's own spread over calibration draws)."""
    base, _, calib = name.partition("@calib")
    kw = dict(VARIANTS.get(base, {"method": base}))
    if calib:
        kw["seed"] = int(calib)
    return kw


HELD_OUT = ["locale", "zipfile", "tarfile", "mailbox", "doctest", "ftplib"]
SIZES = [  # label, quantize keyword arguments (the mlx-lm option whose size is the budget)
    ("q3", {"bits": 3, "group_size": 64}),
    ("mixed_3_6", {"mixed": "mixed_3_6", "group_size": 64}),
    ("q4", {"bits": 4, "group_size": 64}),
    ("mixed_4_6", {"mixed": "mixed_4_6", "group_size": 64}),
    ("q4 g32", {"bits": 4, "group_size": 32}),
    ("q6", {"bits": 6, "group_size": 64}),
]


# ------------------------------------------------------------------------------- child stage


def stage_sensitivity(args: argparse.Namespace) -> dict:
    from mlxbun import blas

    blas.load()
    from mlxbun.quant.sensitivity.command import sensitivity

    dest = args.work / args.method
    if args.label_seed:
        from mlxbun.quant.sensitivity import fisher

        estimate = fisher.estimate

        def relabelled(*a, seed: int, **kw):
            return estimate(*a, seed=seed + 1000 * args.label_seed, **kw)

        fisher.estimate = relabelled  # sensitivity imports it when it runs
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    doc = sensitivity(
        model_dir=args.model, out_dir=dest, work_dir=dest / "cache", bits=BITS, samples=args.samples,
        seq_len=args.seq_len, batch_size=args.batch_size, **variant(args.method),
    )  # fmt: skip
    seconds = time.perf_counter() - t0
    fpe = doc.get("estimate", {}).get("forward_equivalents") or exact_forward_equivalents(doc)
    return {
        "seconds": seconds,
        "forward_equivalents": fpe,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "layers": len(doc["layers"]),
        "load_avg": [round(load0, 1), round(os.getloadavg()[0], 1)],  # 1-min load at start, end
    }


def exact_forward_equivalents(doc: dict) -> float:
    """One reference forward + per (module, candidate) the blocks from its group on, plus the head."""
    n = doc["model"]["num_layers"]
    probes = sum((n - r["group"] + 1) / (n + 1) for r in doc["layers"] for _ in doc["bits"])
    return 1.0 + probes


def run_stage(args: argparse.Namespace, method: str) -> dict:
    cmd = ["flock", str(args.lock)] if args.lock else []  # timed stages never overlap other timings
    cmd += [sys.executable, __file__, "--stage", "sens", "--method", method, "--model", str(args.model)]
    cmd += ["--work", str(args.work), "--samples", str(args.samples), "--seq-len", str(args.seq_len)]
    cmd += ["--batch-size", str(args.batch_size), "--label-seed", str(args.label_seed)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        sys.stderr.write(out.stderr)
        raise SystemExit(f"sensitivity method={method} failed on {args.model}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------- evaluation


class Evaluator:
    """Reference log-probs of the held-out tokens once; KL of any quantized model against them."""

    def __init__(self, model_dir: Path, tokens: np.ndarray) -> None:
        import mlx.core as mx

        from mlxbun.kl import log_probs
        from mlxbun.quant.probe import load_model

        ref, _, _ = load_model(model_dir)
        self.batches = [mx.array(tokens[i : i + 4]) for i in range(0, len(tokens), 4)]
        self.refs = [np.asarray(log_probs(ref(b))) for b in self.batches]
        self.n = len(tokens)

    def kl(self, model_dir: Path) -> float:
        from mlxbun.kl import kl_rows
        from mlxbun.quant.probe import load_model

        cur, _, _ = load_model(model_dir)
        rows = [np.asarray(kl_rows(r, cur(b))) for b, r in zip(self.batches, self.refs, strict=True)]
        return float(sum(r.sum() for r in rows)) / self.n


def held_out_tokens(model: Path, work: Path, *, samples: int, seq_len: int) -> np.ndarray:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from mlxbun.quant.calibration import load_calibration

    parts = [Path(f"/usr/lib/python3.11/{m}.py").read_text(errors="replace") for m in HELD_OUT]
    path = work / "held_out.txt"
    path.write_text("\n\n".join(parts))
    tok = load_tokenizer(model)
    return load_calibration(tokenizer=tok, path=str(path), samples=samples, seq_len=seq_len, seed=1).tokens


class Plans:
    def __init__(self, args: argparse.Namespace) -> None:
        from mlxbun.quant.allocate import budget

        self.args, self.n = args, 0
        self.source = budget.read_source(args.model)
        tokens = held_out_tokens(args.model, args.work, samples=args.samples, seq_len=args.seq_len)
        self.eval = Evaluator(args.model, tokens)

    def quantize(self, **kw) -> dict:
        from mlxbun.quant.allocate import budget
        from mlxbun.quant.quantize.command import quantize_model_dir

        self.n += 1
        out = self.args.work / "models" / f"{self.n:02d}"
        res = quantize_model_dir(
            self.args.model, out, dtype="bfloat16", partial_root=self.args.work / "partial", **kw
        )
        size = budget.measure(res.out, parameters=self.source.parameters)
        return {"file_bytes": size.file_bytes, "kl": self.eval.kl(res.out)}

    def plan(self, method: str, limit: int) -> dict:
        from mlxbun.io.atomic import atomic_write_json
        from mlxbun.quant.allocate.allocation import allocate
        from mlxbun.quant.sensitivity.file import load_sensitivity

        sens = load_sensitivity(self.args.work / method / "sensitivity.json")
        plan = allocate(sens, model_dir=self.args.model, budget_bytes=limit)
        path = self.args.work / "plans" / f"{method}_{limit}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, plan.to_json())
        return self.quantize(plan=path)


# ------------------------------------------------------------------------------- agreement


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def module_kls(work: Path, method: str) -> dict[str, dict[str, float]]:
    """``method``'s per-module KL by bit width, from its sensitivity.json."""
    return {
        r["path"]: r["kl"] for r in json.loads((work / method / "sensitivity.json").read_text())["layers"]
    }


def agreement(work: Path, method: str) -> dict:
    exact, mine = module_kls(work, "exact"), module_kls(work, method)
    paths = sorted(exact)
    per_bit = {}
    for b in map(str, BITS):
        per_bit[b] = spearman(np.array([exact[p][b] for p in paths]), np.array([mine[p][b] for p in paths]))
    x = np.array([exact[p][b] for p in paths for b in map(str, BITS)])
    y = np.array([mine[p][b] for p in paths for b in map(str, BITS)])
    return {"all": spearman(x, y), "per_bit": per_bit}


# ------------------------------------------------------------------------------- one fixture


def fixture(args: argparse.Namespace) -> dict:
    import shutil

    args.work.mkdir(parents=True, exist_ok=True)
    stats_file = args.work / "stats.json"
    stats = json.loads(stats_file.read_text()) if args.reuse and stats_file.is_file() else {}
    for m in ["exact", *[m for m in args.methods if m != "exact"]]:
        if m not in stats or not (args.work / m / "sensitivity.json").is_file():
            shutil.rmtree(args.work / m, ignore_errors=True)
            stats[m] = run_stage(args, m)
            stats_file.write_text(json.dumps(stats, indent=1))
        print(f"{args.model.name} {m}: {stats[m]}", flush=True)
    shutil.rmtree(args.work / "models", ignore_errors=True)
    plans = Plans(args)
    sizes = {}
    for label, kw in SIZES:
        base = plans.quantize(**kw)
        row = {"mlx-lm": base}
        for m in stats:
            row[m] = plans.plan(m, base["file_bytes"])
        sizes[label] = row
        print(f"{args.model.name} {label}: {json.dumps(row)}", flush=True)
    agree = {m: agreement(args.work, m) for m in stats if m != "exact"}
    numbers = {m: module_kls(args.work, m) for m in stats}
    for row in sizes.values():
        limit = row["mlx-lm"]["file_bytes"]
        for m in stats:
            ref = next(
                (e for e in stats if e.partition("@calib")[0] == "exact" and draw(e) == draw(m)), "exact"
            )
            row[m]["summed"] = summed(args.work, m, numbers[ref], limit)
            row[m]["summed_ref"] = summed(args.work, ref, numbers[ref], limit)
    return {"stats": stats, "sizes": sizes, "agreement": agree}


def draw(method: str) -> str:
    return method.partition("@calib")[2] or "0"


def summed(work: Path, method: str, kl: dict[str, dict[str, float]], limit: int) -> float:
    """The allocator's objective at the numbers ``kl`` (a reference's :func:`module_kls`), summed
    over the choices of ``method``'s plan at ``limit`` bytes."""
    plan = json.loads((work / "plans" / f"{method}_{limit}.json").read_text())
    return sum(kl[p][str(c["bits"])] for p, c in plan["choices"].items() if p in kl)


# ------------------------------------------------------------------------------- report


def report(args: argparse.Namespace, results: dict[str, dict], seconds: float) -> str:
    lines = [
        "# Sensitivity methods: cost, agreement with exact, held-out KL of their plans",
        "",
        f"Command: `{' '.join(['.venv/bin/python', 'bench/sensitivity_methods.py', *sys.argv[1:]])}`",
        f"Calibration: built-in set, {args.samples} x {args.seq_len} tokens; held-out: CPython "
        f"{', '.join(HELD_OUT)} ({args.samples} x {args.seq_len} tokens); bits {BITS} affine g64. "
        f"Total bench time {seconds:.0f} s (a shared 2-core machine: ratios, not seconds, carry over).",
        "",
    ]
    for name, res in results.items():
        lines += _fixture_table(name, res)
    return "\n".join(lines) + "\n"


def _fixture_table(name: str, res: dict) -> list[str]:
    stats, sizes = res["stats"], res["sizes"]
    ex = stats["exact"]
    labels = [label for label, _ in SIZES]
    lines = [
        f"## {name}",
        "",
        "| method | wall s | x faster than exact | forward-pass equiv. | peak RSS MB | Spearman all | min per bit |"
        + "".join(f" KL @ {lb} |" for lb in labels),
        "|---" * (7 + len(labels)) + "|",
    ]
    mlx = " | ".join(f"{sizes[lb]['mlx-lm']['kl']:.3g}" for lb in labels)
    lines.append(f"| mlx-lm option itself | | | | | | | {mlx} |")
    for m, st in stats.items():
        ag = res["agreement"].get(m)
        rho = f"{ag['all']:.3f} | {min(ag['per_bit'].values()):.3f}" if ag else "1 | 1"
        kls = " | ".join(
            f"{sizes[lb][m]['kl']:.3g}"
            + ("" if m == "exact" else f" ({sizes[lb][m]['kl'] / sizes[lb]['exact']['kl']:.2f}x)")
            for lb in labels
        )
        lines.append(
            f"| {m} | {st['seconds']:.1f} | {ex['seconds'] / st['seconds']:.1f} | {st['forward_equivalents']:.1f}"
            f" | {st['peak_rss_mb']:.0f} | {rho} | {kls} |"
        )
    sizes_row = " | ".join(f"{sizes[lb]['mlx-lm']['file_bytes']:,}" for lb in labels)
    lines += ["", f"Budgets (bytes on disk of the mlx-lm option): {sizes_row}.", ""]
    loads = ", ".join(
        f"{m} {st.get('load_avg', ['?', '?'])[0]}-{st.get('load_avg', ['?', '?'])[1]}"
        for m, st in stats.items()
    )
    lines.append(f"1-minute load average (start-end) while each method ran, on 2 cores: {loads}.")
    for m, ag in res["agreement"].items():
        per = ", ".join(f"{b}-bit {v:.3f}" for b, v in ag["per_bit"].items())
        lines.append(f"Spearman of {m} vs exact per bit width: {per}.")
    if all("summed" in sizes[lb][m] for lb in labels for m in stats):
        lines += [
            "",
            "The allocator's objective by exact's numbers (exact's per-module KL at the same calibration "
            "draw, summed over each plan's choices) / exact's plan's; and, for exact's plan, its "
            "held-out KL / that sum (the sum leaves out how modules interact, and is taken on the "
            "calibration text; `bench/plan_interactions.py` measures single decisions):",
            "",
            *_head(["method"], labels),
        ]
        for m in stats:
            cells = " | ".join(f"{sizes[lb][m]['summed'] / sizes[lb][m]['summed_ref']:.3f}" for lb in labels)
            lines.append(f"| {m} | {cells} |")
        ratio = " | ".join(f"{sizes[lb]['exact']['kl'] / sizes[lb]['exact']['summed']:.2f}" for lb in labels)
        lines.append(f"| exact: held-out KL / the sum | {ratio} |")
    return lines + [""] + _draws_table(stats, sizes, labels)


def _head(first: list[str], labels: list[str]) -> list[str]:
    """A markdown table's header and rule: the ``first`` columns, then one per size label."""
    head = "| " + " | ".join(first) + " |" + "".join(f" {lb} |" for lb in labels)
    return [head, "|---" * (len(first) + len(labels)) + "|"]


def _draws_table(stats: dict, sizes: dict, labels: list[str]) -> list[str]:
    """Per method, its plans' KL averaged over the calibration draws run (``@calib<K>``; the plain
    name is draw 0) / exact's averaged over the same draws, and the spread of single draws."""
    draws: dict[str, list[str]] = {}
    for m in stats:
        draws.setdefault(m.partition("@calib")[0], []).append(m)
    if all(len(ms) == 1 for ms in draws.values()):
        return []
    ks = {m: draw(m) for m in stats}
    lines = [
        "Over calibration draws (each method's mean plan KL / exact's mean over the same draws; "
        "in brackets the range of single draws, each / exact at the same draw; for exact, each "
        "draw / draw 0, its own spread):",
        "",
        *_head(["method", "draws"], labels),
    ]
    exact_at = {ks[m]: m for m in draws.get("exact", [])}
    for base, ms in draws.items():
        same = [m for m in ms if ks[m] in exact_at]
        if not same:
            continue
        cells = []
        for lb in labels:
            mean = np.mean([sizes[lb][m]["kl"] for m in same])
            ref = np.mean([sizes[lb][exact_at[ks[m]]]["kl"] for m in same])
            single = [sizes[lb][m]["kl"] / sizes[lb][exact_at[ks[m]]]["kl"] for m in same]
            if base == "exact":  # exact's own spread: each draw against draw 0
                single = [sizes[lb][m]["kl"] / sizes[lb]["exact"]["kl"] for m in same]
            cells.append(f"{mean / ref:.3f} ({min(single):.2f}-{max(single):.2f})")
        lines.append(f"| {base} | {', '.join(ks[m] for m in same)} | " + " | ".join(cells) + " |")
    return lines + [""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fixtures", nargs="+", default=["llama-text-3m", "llama-text-12l"])
    ap.add_argument("--methods", nargs="+", default=["exact", "fisher"])
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--work", type=Path, default=Path("/tmp/mlxbun-bench-sensitivity"))
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "sensitivity_methods.md")
    ap.add_argument("--reuse", action="store_true")
    ap.add_argument("--label-seed", type=int, default=0, help="fisher's labels from seed + 1000 K")
    ap.add_argument("--lock", type=Path, default=None, help="run each timed stage under flock LOCK")
    ap.add_argument("--stage", choices=["sens"], default=None)
    ap.add_argument("--method", default=None)
    ap.add_argument("--model", type=Path, default=None)
    args = ap.parse_args()
    if args.stage:
        print(json.dumps(stage_sensitivity(args)))
        return
    from mlxbun import blas

    blas.load()
    t0, results, root = time.perf_counter(), {}, args.work
    for name in args.fixtures:
        args.model = (REPO / "tests" / "fixtures" / name).resolve()
        args.work = root / name
        results[name] = fixture(args)
        (root / "results.json").write_text(json.dumps(results, indent=1))
    text = report(args, results, time.perf_counter() - t0)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
