"""Allocation quality at equal size: mlxbun's plan vs uniform bits, mlx-lm's mixed rules and dynamic_quant.

Run: .venv/bin/python bench/allocation_quality.py [--model tests/fixtures/llama-text-3m]
         [--samples 16] [--seq-len 256] [--out bench/results/allocate.md]

1. sensitivity (child process): mlxbun's exact per-layer KL at 2, 3, 4, 5, 6, 8 bits (affine g64)
   on the built-in calibration set.
2. dynamic_quant (child process): mlx-lm's first-order estimate
   (``mlx_lm.quant.dynamic_quant.estimate_sensitivities``) on the same calibration tokens, for
   each (low, high) pair of bits it is compared with.
3. For each reference size (uniform 3/4/5-bit g64, mlx-lm ``mixed_3_6``/``mixed_4_6``): quantize
   the baseline with mlxbun's quantize, read its size on disk; plan mlxbun's allocation with that
   size as ``budget_bytes``; plan dynamic_quant's two tiers (every pair whose all-low and all-high
   sizes bracket the target, as mlx-lm requires) at that size (its own threshold rule:
   the highest-scoring modules get the high bits, as many as fit), also with its scores fed to
   mlxbun's knapsack, and beside them mlxbun's exact KLs restricted to the same two tiers (which
   separates the estimate's quality from the richer choice of bits); quantize every plan; measure
   KL(reference || quantized) on the calibration tokens and on held-out text (CPython modules
   the fixture was not trained on).

Every model is written by the project's quantize and its size read from disk, so "same size"
means at most the baseline's bytes on disk. Writes ``bench/results/allocate.md``.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

BITS = [2, 3, 4, 5, 6, 8]
PAIRS = [(2, 3), (3, 4), (3, 6), (4, 5), (4, 6), (4, 8), (5, 6), (5, 8)]
HELD_OUT = ["ast", "configparser", "optparse", "gettext", "pprint", "locale", "tokenize", "zipfile"]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ------------------------------------------------------------------------------- child stages


def stage_sensitivity(args: argparse.Namespace) -> dict:
    from mlxbun import blas

    blas.load()
    from mlxbun.quant.sensitivity import sensitivity

    t0 = time.perf_counter()
    doc = sensitivity(
        model_dir=args.model, out_dir=args.work / "sens", work_dir=args.work / "sens-cache", bits=BITS,
        samples=args.samples, seq_len=args.seq_len, batch_size=8,
    )  # fmt: skip
    return {"seconds": time.perf_counter() - t0, "layers": len(doc["layers"]), "peak_rss_mb": peak_rss_mb()}


def stage_dynamic_quant(args: argparse.Namespace) -> dict:
    from mlxbun import blas

    blas.load()
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.quant.dynamic_quant import estimate_sensitivities

    from mlxbun.quant.calib import load_calibration

    model, tok = load(str(args.model))
    calib = load_calibration(tokenizer=tok, samples=args.samples, seq_len=args.seq_len, seed=0)
    data = mx.array(calib.tokens)
    scores, t0 = {}, time.perf_counter()
    for low, high in PAIRS:
        est = estimate_sensitivities(model, data, low, 64, high, 64, batch_size=4)
        scores[f"{low}_{high}"] = dict(est)
    (args.work / "dynamic_quant.json").write_text(json.dumps(scores, indent=1, sort_keys=True))
    return {"seconds": time.perf_counter() - t0, "pairs": len(PAIRS), "peak_rss_mb": peak_rss_mb()}


def child(stage: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--stage", stage, "--model", str(args.model), "--work", str(args.work)]
    cmd += ["--samples", str(args.samples), "--seq-len", str(args.seq_len)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        sys.stderr.write(out.stderr)
        raise SystemExit(f"stage {stage} failed")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------- evaluation


class Evaluator:
    """Reference log-probs once per token set; KL of any quantized model directory against them."""

    def __init__(self, model_dir: Path, token_sets: dict) -> None:
        import mlx.core as mx

        from mlxbun.kl import log_probs
        from mlxbun.quant.sensitivity import load_model

        ref, _, _ = load_model(model_dir)
        self.sets = {}
        for name, tokens in token_sets.items():
            batches = [mx.array(tokens[i : i + 8]) for i in range(0, len(tokens), 8)]
            refs = [np.asarray(log_probs(ref(b))) for b in batches]
            self.sets[name] = (batches, refs, len(tokens))

    def kl(self, model_dir: Path) -> dict[str, float]:
        from mlxbun.kl import kl_rows
        from mlxbun.quant.sensitivity import load_model

        cur, _, _ = load_model(model_dir)
        out = {}
        for name, (batches, refs, n) in self.sets.items():
            rows = [
                np.asarray(kl_rows(r, cur(b)), dtype=np.float64) for b, r in zip(batches, refs, strict=True)
            ]
            out[name] = float(sum(r.sum() for r in rows)) / n
        return out


def held_out_text(work: Path) -> Path:
    """CPython modules outside the fixture's training list, as one plain-text calibration file."""
    parts = [Path(f"/usr/lib/python3.11/{m}.py").read_text(errors="replace") for m in HELD_OUT]
    path = work / "held_out.txt"
    path.write_text("\n\n".join(parts))
    return path


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        from mlx_lm.tokenizer_utils import load as load_tokenizer

        from mlxbun.quant import budget
        from mlxbun.quant.allocate import load_sensitivity
        from mlxbun.quant.calib import load_calibration

        self.args, self.work = args, args.work
        self.source = budget.read_source(args.model)
        self.sens = load_sensitivity(args.work / "sens" / "sensitivity.json")
        self.dq = json.loads((args.work / "dynamic_quant.json").read_text())
        tok = load_tokenizer(args.model)
        calib = load_calibration(tokenizer=tok, samples=args.samples, seq_len=args.seq_len, seed=0)
        held = load_calibration(
            tokenizer=tok, path=held_out_text(args.work), samples=args.samples, seq_len=args.seq_len, seed=1
        )
        self.eval = Evaluator(args.model, {"calib": calib.tokens, "held_out": held.tokens})
        self.n = 0

    def quantize(self, label: str, **kw) -> dict:
        """Quantize with the project's quantize; size on disk and measured KL."""
        from mlxbun.quant import budget
        from mlxbun.quant.uniform import quantize_model_dir

        self.n += 1
        out = self.work / "models" / f"{self.n:02d}"
        res = quantize_model_dir(
            self.args.model, out, dtype="bfloat16", partial_root=self.work / "partial", **kw
        )
        size = budget.measure(res.out, parameters=self.source.parameters)
        return {"label": label, "file_bytes": size.file_bytes, "bpw": size.bpw, **self.eval.kl(res.out)}

    def write_plan(self, layers: dict, name: str) -> Path:
        from mlxbun.io.atomic import atomic_write_json

        path = self.work / "plans" / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        body = {p: (s.to_dict() if s else False) for p, s in layers.items()}
        atomic_write_json(
            path, {"version": 1, "default": {"bits": 4, "group_size": 64, "mode": "affine"}, "layers": body}
        )
        return path

    def ours(self, limit: int, name: str, tiers: tuple[int, int] | None = None) -> dict:
        from mlxbun.io.atomic import atomic_write_json
        from mlxbun.quant.allocate import allocate
        from mlxbun.quant.spec import QuantSpec

        cands = None if tiers is None else {QuantSpec(bits=b, group_size=64) for b in tiers}
        plan = allocate(self.sens, model_dir=self.args.model, budget_bytes=limit, candidates=cands)
        path = self.work / "plans" / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, plan.to_json())
        label = (
            "mlxbun knapsack (exact KL, 2-8 bits)"
            if tiers is None
            else f"mlxbun exact KL, {tiers[0]}/{tiers[1]} only"
        )
        row = self.quantize(label, plan=path)
        assert row["file_bytes"] == plan.size.file_bytes, "predicted size != written size"
        return row | {"predicted_kl_sum": plan.kl_sum, "exact": plan.solver["exact"]}

    def dq_threshold(self, limit: int, low: int, high: int) -> dict | None:
        """mlx-lm's rule: modules above a score threshold get ``high`` bits; the largest set that fits."""
        from mlxbun.quant.spec import QuantSpec

        scores = self.dq[f"{low}_{high}"]
        order = sorted(scores, key=lambda p: -scores[p])
        layers = {p: QuantSpec(bits=low, group_size=64) for p in scores}
        if self._size(layers) > limit:
            return None
        for p in order:
            trial = {**layers, p: QuantSpec(bits=high, group_size=64)}
            if self._size(trial) > limit:
                break
            layers = trial
        path = self.write_plan(layers, f"dq_{low}_{high}_{limit}")
        return self.quantize(f"dynamic_quant {low}/{high} (threshold)", plan=path)

    def dq_knapsack(self, limit: int, low: int, high: int) -> dict | None:
        """dynamic_quant's scores as the cost of staying low, solved by mlxbun's knapsack."""
        from mlxbun.quant.allocate import LayerSensitivity, Sensitivity, allocate
        from mlxbun.quant.spec import QuantSpec

        scores = self.dq[f"{low}_{high}"]
        sens = Sensitivity(
            {
                p: LayerSensitivity(
                    p,
                    0,
                    {QuantSpec(bits=low, group_size=64): float(s), QuantSpec(bits=high, group_size=64): 0.0},
                )
                for p, s in scores.items()
            }
        )
        try:
            plan = allocate(sens, model_dir=self.args.model, budget_bytes=limit)
        except Exception:
            return None
        path = self.write_plan(plan.layers, f"dqk_{low}_{high}_{limit}")
        return self.quantize(f"dynamic_quant {low}/{high} (knapsack)", plan=path)

    def reaches(self, limit: int, low: int, high: int) -> bool:
        from mlxbun.quant.spec import QuantSpec

        paths = self.dq[f"{low}_{high}"]
        lo = self._size({p: QuantSpec(bits=low, group_size=64) for p in paths})
        hi = self._size({p: QuantSpec(bits=high, group_size=64) for p in paths})
        return lo <= limit <= hi

    def _size(self, layers: dict) -> int:
        from mlxbun.quant import budget
        from mlxbun.quant.spec import QuantSpec

        return budget.predict(self.source, default=QuantSpec(bits=4, group_size=64), layers=layers).file_bytes


def compare(bench: Bench, label: str, baseline: dict) -> list[dict]:
    limit = baseline["file_bytes"]
    rows = [baseline | {"label": label}, bench.ours(limit, f"ours_{limit}")]
    for low, high in PAIRS:
        if not bench.reaches(limit, low, high):
            continue  # as in mlx-lm, the target must lie between all-low and all-high
        for fn in (bench.dq_threshold, bench.dq_knapsack):
            row = fn(limit, low, high)
            if row is not None:
                rows.append(row)
        rows.append(bench.ours(limit, f"ours_{low}_{high}_{limit}", tiers=(low, high)))
    return rows


# ------------------------------------------------------------------------------- report


def _header(args: argparse.Namespace, stats: dict, seconds: float) -> list[str]:
    import mlx.core as mx

    sens, dq = stats["sens"], stats["dq"]
    model = args.model.relative_to(REPO) if args.model.is_relative_to(REPO) else args.model
    return [
        "# Allocation quality at equal size (bench/allocation_quality.py)",
        "",
        f"Command: `.venv/bin/python bench/allocation_quality.py --model {model} --samples {args.samples}"
        f" --seq-len {args.seq_len}`  ",
        f"Machine: 2-core x86_64 Linux, mlx {mx.__version__} CPU, shared with other jobs (times are noisy)."
        f" Total {seconds:.0f} s.",
        "",
        "KL = KL(reference || quantized) of the next-token distributions, mean over tokens and samples;"
        f" `calib` = the {args.samples} x {args.seq_len} calibration tokens the sensitivities were measured on,"
        f" `held_out` = {args.samples} x {args.seq_len} tokens of CPython modules outside the fixture's"
        " training text. Sizes are the `.safetensors` files on disk, headers included; bpw = tensor bits /"
        " logical parameters. Every model was written by mlxbun's quantize and measured on disk.",
        "",
        "| stage | seconds | peak RSS (child) |",
        "|---|---:|---:|",
        f"| mlxbun sensitivity, exact, {sens['layers']} modules x {len(BITS)} bits | {sens['seconds']:.1f} |"
        f" {sens['peak_rss_mb']:.0f} MB |",
        f"| mlx-lm dynamic_quant estimate, {dq['pairs']} (low, high) pairs | {dq['seconds']:.1f} |"
        f" {dq['peak_rss_mb']:.0f} MB |",
        "",
    ]


def _best(rows: list[dict], word: str) -> dict | None:
    return min((r for r in rows[2:] if word in r["label"]), key=lambda r: r["held_out"], default=None)


def _summary(groups: list[tuple[str, list[dict]]]) -> list[str]:
    lines = [
        "## Summary (held-out KL; lower is better)",
        "",
        "| size of | bytes | baseline | best dynamic_quant | best mlxbun, same two tiers | mlxbun, 2-8 bits |"
        " baseline / mlxbun | best dynamic_quant / mlxbun |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for title, rows in groups:
        base, ours, dq, tiers = rows[0], rows[1], _best(rows, "dynamic_quant"), _best(rows, "only")
        dq_kl = dq["held_out"] if dq else float("nan")
        tier_kl = tiers["held_out"] if tiers else float("nan")
        lines.append(
            f"| {title} | {base['file_bytes']} | {base['held_out']:.5f} | {dq_kl:.5f} | {tier_kl:.5f} |"
            f" {ours['held_out']:.5f} | {base['held_out'] / ours['held_out']:.2f} | {dq_kl / ours['held_out']:.2f} |"
        )
    return lines + [""]


def _table(title: str, rows: list[dict]) -> list[str]:
    ours = rows[1]
    lines = [f"## At the size of {title}: {rows[0]['file_bytes']} bytes", ""]
    lines += ["| method | bytes on disk | bpw | KL calib | KL held-out | held-out KL / ours |"]
    lines += ["|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['file_bytes']} | {r['bpw']:.3f} | {r['calib']:.5f} | {r['held_out']:.5f} |"
            f" {r['held_out'] / ours['held_out']:.2f} |"
        )
    note = f"mlxbun plan: predicted summed KL {ours['predicted_kl_sum']:.5f}, exact optimum: {ours['exact']}."
    return lines + ["", note, ""]


def _verdicts(groups: list[tuple[str, list[dict]]]) -> list[str]:
    lines = ["## Is the mixed plan's KL below the alternative at the same size?", ""]
    for title, rows in groups:
        ours = rows[1]
        for name, other in (("baseline", rows[0]), ("best dynamic_quant", _best(rows, "dynamic_quant"))):
            for split in ("calib", "held_out") if other else ():
                ok = ours[split] < other[split]
                lines.append(
                    f"- {title}, {split}: mlxbun {ours[split]:.5f} {'<' if ok else '>='} {name}"
                    f" ({other['label']}) {other[split]:.5f}: {'yes' if ok else 'NO'}"
                )
    return lines + [""]


def report(
    args: argparse.Namespace, stats: dict, groups: list[tuple[str, list[dict]]], seconds: float
) -> str:
    lines = _header(args, stats, seconds) + _summary(groups)
    lines += [
        "Rows `mlxbun exact KL, a/b only` use dynamic_quant's two tiers with mlxbun's measured KLs: they"
        " separate the quality of the sensitivity estimate from the richer choice of bits.",
        "",
    ]
    for title, rows in groups:
        lines += _table(title, rows)
    return "\n".join(lines + _verdicts(groups))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=REPO / "tests" / "fixtures" / "llama-text-3m")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--work", type=Path, default=Path("/tmp/mlxbun-bench-allocate"))
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "allocate.md")
    ap.add_argument("--stage", choices=["sens", "dq"], default=None)
    ap.add_argument(
        "--reuse", action="store_true", help="reuse the sensitivities in --work from a previous run"
    )
    args = ap.parse_args()
    args.model = args.model.resolve()
    if args.stage:
        fn = stage_sensitivity if args.stage == "sens" else stage_dynamic_quant
        print(json.dumps(fn(args)))
        return
    import shutil

    t0 = time.perf_counter()
    stats_file = args.work / "stages.json"
    if args.reuse and stats_file.is_file():
        stats = json.loads(stats_file.read_text())  # sensitivities from an earlier run of this script
        shutil.rmtree(args.work / "models", ignore_errors=True)
    else:
        shutil.rmtree(args.work, ignore_errors=True)
        args.work.mkdir(parents=True)
        stats = {"sens": child("sens", args), "dq": child("dq", args)}
        stats_file.write_text(json.dumps(stats))
    print(json.dumps(stats), flush=True)
    from mlxbun import blas

    blas.load()
    bench = Bench(args)
    groups = []
    for bits in (3, 4, 5):
        groups.append(
            (
                f"uniform {bits}-bit g64",
                compare(bench, f"uniform {bits}-bit g64", bench.quantize("", bits=bits, group_size=64)),
            )
        )
        print(groups[-1][0], flush=True)
    for rule in ("mixed_3_6", "mixed_4_6"):
        groups.append(
            (
                f"mlx-lm {rule}",
                compare(bench, f"mlx-lm {rule}", bench.quantize("", mixed=rule, group_size=64)),
            )
        )
        print(groups[-1][0], flush=True)
    (args.work / "rows.json").write_text(json.dumps(groups, indent=1))
    text = report(args, stats, groups, time.perf_counter() - t0)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
