"""command=eval through the CLI: mlx-lm q3/q4/q6 and an mlxbun plan on both fixtures, its time per token
against ``python -m mlx_lm perplexity`` on the same tokens, the reference-cache speed-up, and peak RSS at
a 150k vocabulary (a Qwen2-0.5B-shaped synthetic model). ``--throughput REV``: instead, eval's scoring
rate (tokens/s) of this tree against git revision REV's, side by side in one run (``throughput``).

Run: nice -n 10 .venv/bin/python bench/eval.py [--work W] [--tokens 4096] [--seq-len 256]
         [--big-tokens 512] [--out bench/results/eval.md]
     nice -n 10 .venv/bin/python bench/eval.py --throughput main [--work W] [--out bench/results/eval_throughput.md]
     nice -n 10 .venv/bin/python bench/eval.py --precision [--tokens 2048]   (float32 against float64)

Per fixture: ``python -m mlx_lm convert -q --q-bits {3,4,6}``; ``command=sensitivity`` then
``+recipe=allocate_4p5bpw`` (plan + quantized model); ``command=eval`` of the four against the fixture
twice (the second reads the cached reference). ``mlx_lm perplexity`` needs the ``datasets`` package
and a hub dataset to load text; the bench runs its ``main()`` unchanged with ``load_data`` replaced by
the token windows eval scored (same windows, same B x (L-1) tokens), and reads its reported time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIXTURES = ("llama-text-3m", "llama-text-12l")
BITS = (3, 4, 6)
# Qwen2.5-0.5B's shape (hidden, intermediate, layers, heads, kv heads, head dim, vocabulary).
BIG = {"hidden_size": 896, "intermediate_size": 4864, "num_layers": 24, "num_heads": 14, "num_kv_heads": 2,
       "head_dim": 64, "vocab_size": 151936}  # fmt: skip

PPL_SHIM = """
import sys, numpy as np, mlx.core as mx, mlx_lm.perplexity as p
w = np.load(sys.argv[1])
p.load_data = lambda tokenizer, data_path, num_samples, sequence_length: mx.array(w)
sys.argv = ["mlx_lm.perplexity", "--model", sys.argv[2], "--batch-size", sys.argv[3],
            "--sequence-length", str(w.shape[1]), "--num-samples", str(w.shape[0])]
p.main()
"""


def run(argv: list[str], *, log: Path, tree: Path = REPO) -> tuple[str, float, int]:
    """Run a command in ``tree`` (its mlxbun first on the path); (stdout, wall seconds, peak RSS of the child)."""
    t0 = time.perf_counter()
    with open(log, "a") as err:
        err.write(f"\n$ {' '.join(argv)}\n")
        err.flush()
        path = os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": path}
        proc = subprocess.Popen(argv, cwd=tree, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed ({os.waitstatus_to_exitcode(status)}): {' '.join(argv)}; see {log}")
    return out, time.perf_counter() - t0, usage.ru_maxrss * 1024


def mlxbun(work: Path, *args: str, tree: Path = REPO) -> tuple[dict, float, int]:
    iso = [
        f"paths.outputs={work / 'outputs'}",
        f"paths.cache={work / 'cache'}",
        f"registry.path={work / 'registry.db'}",
    ]
    argv = [sys.executable, "-m", "mlxbun", *args, *iso, "json=true"]
    out, secs, rss = run(argv, log=work / "log.txt", tree=tree)
    return json.loads(out), secs, rss


def convert(src: Path, dst: Path, bits: int, log: Path) -> Path:
    if not (dst / "config.json").is_file():
        run([sys.executable, "-m", "mlx_lm", "convert", "--hf-path", str(src), "--mlx-path", str(dst), "-q",
             "--q-bits", str(bits), "--q-group-size", "64"], log=log)  # fmt: skip
    return dst


def plan(work: Path, src: Path) -> Path:
    calib = ["sensitivity.calib.samples=8", "sensitivity.calib.seq_len=256"]
    sens, _, _ = mlxbun(
        work, "command=sensitivity", f"model.name={src}", "sensitivity.bits=[3,4,6,8]", *calib
    )
    alloc, _, _ = mlxbun(work, "+recipe=allocate_4p5bpw", f"model.name={src}",
                         f"allocate.sensitivity={sens['run_dir']}", *calib)  # fmt: skip
    return Path(alloc["run_dir"]) / "model"


def windows(src: Path, tokens: int, seq_len: int, out: Path) -> Path:
    """The token windows command=eval scores (same function, same defaults), for mlx_lm perplexity."""
    import numpy as np
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    sys.path.insert(0, str(REPO))
    from mlxbun import eval as ev

    text = ev.windows(ev.encode(load_tokenizer(src), ev.HELDOUT.read_text()), source="", tokens=tokens,
                      seq_len=seq_len, seed=0)  # fmt: skip
    np.save(out, text.tokens)
    return out


def mlx_lm_ppl(model: Path, npy: Path, log: Path, batch: int) -> dict:
    out, secs, rss = run([sys.executable, "-c", PPL_SHIM, str(npy), str(model), str(batch)], log=log)
    get = {
        line.split(":")[0].strip(): line.split(":", 1)[1].strip() for line in out.splitlines() if ":" in line
    }
    return {"ppl": get["Perplexity"], "seconds": float(get["Evaluation time"].split()[0]),
            "tok_s": float(get["Tokens per second"]), "wall": secs, "rss": rss}  # fmt: skip


def fixture(args: argparse.Namespace, name: str) -> dict:
    src = REPO / "tests" / "fixtures" / name
    work = args.work / name
    work.mkdir(parents=True, exist_ok=True)
    cands = [convert(src, work / f"q{b}", b, work / "log.txt") for b in BITS] + [plan(work, src)]
    ev = ["command=eval", f"model.name={src}", f"eval.candidates=[{','.join(map(str, cands))}]",
          f"eval.tokens={args.tokens}", f"eval.seq_len={args.seq_len}", f"eval.batch_size={args.batch}"]  # fmt: skip
    first, wall1, rss1 = mlxbun(work, *ev)
    second, wall2, rss2 = mlxbun(work, *ev)
    topk, _, _ = mlxbun(work, *ev, "eval.top_k=1024")  # half the vocabulary: a tail, its bound
    npy = windows(src, args.tokens, args.seq_len, work / "windows.npy")
    ppl = mlx_lm_ppl(work / "q4", npy, work / "log.txt", args.batch)
    return {"first": first["result"], "second": second["result"], "wall": [wall1, wall2], "rss": [rss1, rss2],
            "mlx_lm_q4": ppl, "top1024": topk["result"], "command": " ".join(["python -m mlxbun", *ev])}  # fmt: skip


def big(args: argparse.Namespace) -> dict:
    work = args.work / "qwen2-0.5b"
    work.mkdir(parents=True, exist_ok=True)
    dims = [f"synth.{k}={v}" for k, v in BIG.items()]
    syn, _, _ = mlxbun(work, "command=synth", "synth.arch=qwen2", "synth.preset=1b", *dims,
                       f"synth.out={work / 'bf16'}")  # fmt: skip
    src = work / "bf16"
    q4 = convert(src, work / "q4", 4, work / "log.txt")
    ev = ["command=eval", f"model.name={src}", f"eval.candidates=[{q4}]", f"eval.tokens={args.big_tokens}",
          f"eval.seq_len={args.seq_len}", "eval.batch_size=1"]  # fmt: skip
    first, wall, rss = mlxbun(work, *ev)
    second, wall2, rss2 = mlxbun(work, *ev)
    return {
        "result": first["result"],
        "wall": [wall, wall2],
        "rss": [rss, rss2],
        "command": " ".join(["python -m mlxbun", *ev]),
    }


def report(fx: dict[str, dict], bigr: dict, args: argparse.Namespace) -> str:
    lines = ["# eval: KLD of mlx-lm q3/q4/q6 and an mlxbun 4.5-bpw plan against the fixture (bench/eval.py)", "",
             f"Held-out text: mlxbun/data/heldout.txt, {args.tokens} tokens requested in windows of {args.seq_len}.", ""]  # fmt: skip
    for name, r in fx.items():
        d = r["first"]
        lines += [f"## {name}", "", f"`{r['command']}`", "", "| candidate | size | bpw | KLD mean | 99.9% | max | same top p | RMS Δp | PPL ratio |",
                  "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for c, label in zip(
            d["candidates"], ["mlx-lm q3", "mlx-lm q4", "mlx-lm q6", "mlxbun plan 4.5 bpw"], strict=True
        ):
            lines.append(
                f"| {label} | {c['bytes'] / 2**20:.2f} MiB | {c['bpw']:.3f} | {c['kld_mean']:.5f} ± {c['kld_mean_err']:.5f}"
                f" | {c['kld_p99_9']:.4f} | {c['kld_max']:.4f} | {c['same_top']:.4f} ± {c['same_top_err']:.4f}"
                f" | {c['rms_dp']:.4f} | {c['ppl_ratio']:.4f} ± {c['ppl_ratio_err']:.4f} |"
            )
        gaps = [f"{c['kld_mean'] - t['kld_mean']:.2e} of {c['kld_mean']:.2e} (bound {t['kld_bound']:.2e})"
                for c, t in zip(d["candidates"], r["top1024"]["candidates"], strict=True)]  # fmt: skip
        q4 = d["candidates"][1]
        ours = q4["seconds"] / q4["tokens"]
        theirs = r["mlx_lm_q4"]["seconds"] / q4["tokens"]
        lines += ["", f"- scored tokens {q4['tokens']}; PPL ref {q4['ppl_ref']:.3f}, q4 {q4['ppl']:.3f} (mlx_lm perplexity on the same windows: {r['mlx_lm_q4']['ppl']})",
                  f"- time per token, q4: eval {1e3 * ours:.3f} ms (load, dequantize, forward, all statistics) vs mlx_lm perplexity {1e3 * theirs:.3f} ms (its evaluation time) = {ours / theirs:.2f}×",
                  f"- reference: {d['reference']['seconds']:.2f} s computed, {r['second']['reference']['seconds']:.3f} s from the cache"
                  f" ({d['reference']['seconds'] / max(r['second']['reference']['seconds'], 1e-9):.0f}×); whole run {r['wall'][0]:.1f} s → {r['wall'][1]:.1f} s",
                  f"- the reference keeps all {d['top_k']} log-probs (the default up to 2048: exact); with eval.top_k=1024 the mean KLD missed per candidate: {', '.join(gaps)}",
                  f"- peak RSS of the eval process {r['rss'][0] / 2**30:.2f} GiB", ""]  # fmt: skip
    b = bigr["result"]
    c = b["candidates"][0]
    lines += ["## 150k vocabulary: Qwen2.5-0.5B shape (synthetic, vocab 151936), mlx-lm q4", "", f"`{bigr['command']}`", "",
              f"- scored tokens {c['tokens']}; KLD mean {c['kld_mean']:.5f} ± {c['kld_mean_err']:.5f}, top-{b['top_k']} bound {c['kld_bound']:.2e}",
              f"- peak RSS {bigr['rss'][0] / 2**30:.2f} GiB (first run, reference computed), {bigr['rss'][1] / 2**30:.2f} GiB (cache hit);"
              f" wall {bigr['wall'][0]:.1f} s → {bigr['wall'][1]:.1f} s",
              f"- reference cache on disk: {b['text']['scored_tokens']} tokens × top-{b['top_k']} instead of × 151936 float32"
              f" ({b['text']['scored_tokens'] * b['top_k'] * 8 / 2**20:.1f} MiB vs {b['text']['scored_tokens'] * 151936 * 4 / 2**20:.0f} MiB)", ""]  # fmt: skip
    return "\n".join(lines)


# ------------------------------------------------------------------------------- --throughput REV

# A 151,936 vocabulary (Qwen2's) on a tiny body: the per-token math dominates the forward.
NARROW = {"hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
          "vocab_size": 151936}  # fmt: skip


def export(rev: str, dest: Path) -> Path:
    """The tree of git revision ``rev`` (mlxbun, conf, recipes) in ``dest``; ``rev`` may be such a tree."""
    if (Path(rev) / "mlxbun").is_dir():
        return Path(rev).resolve()
    if not (dest / "mlxbun").is_dir():
        dest.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", rev, "mlxbun", "conf", "recipes"], cwd=REPO, check=True,
                                 capture_output=True).stdout  # fmt: skip
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def throughput_models(args: argparse.Namespace) -> dict[str, tuple[Path, list[Path]]]:
    """``args.models`` of: llama-text-12l, a narrow model with Qwen2's vocabulary, a synthetic model of
    Qwen2.5-0.5B's shape; each with mlx-lm q4 and q8."""
    work = args.work / "models"
    work.mkdir(parents=True, exist_ok=True)
    srcs = {"llama-text-12l": REPO / "tests" / "fixtures" / "llama-text-12l"}
    for name, arch, dims in (("narrow-152k", "llama", NARROW), ("qwen2-0.5b", "qwen2", BIG)):
        srcs[name] = work / name
        if name in args.models and not (work / name / "config.json").is_file():
            mlxbun(work, "command=synth", f"synth.arch={arch}", *(f"synth.{k}={v}" for k, v in dims.items()),
                   f"synth.out={work / name}")  # fmt: skip
    return {name: (srcs[name], [convert(srcs[name], work / f"{name}-q{b}", b, work / "log.txt") for b in (4, 8)])
            for name in args.models}  # fmt: skip


def throughput(args: argparse.Namespace) -> dict:
    """Each tree's eval of both models twice (reference computed, then cached), eval.top_k=1024 in both."""
    trees = {"before": export(args.throughput, args.work / f"tree-{args.throughput}"), "after": REPO}
    out: dict = {}
    for name, (src, cands) in throughput_models(args).items():
        ev = ["command=eval", f"model.name={src}", f"eval.candidates=[{','.join(map(str, cands))}]",
              f"eval.tokens={args.tokens}", f"eval.seq_len={args.seq_len}", f"eval.batch_size={args.batch}",
              "eval.top_k=1024"]  # fmt: skip
        for side, tree in trees.items():
            work = args.work / f"{side}-{name}"
            work.mkdir(parents=True, exist_ok=True)
            first, wall, rss = mlxbun(work, *ev, tree=tree)
            second, wall2, _ = mlxbun(work, *ev, tree=tree)
            out.setdefault(name, {})[side] = {"first": first["result"], "second": second["result"],
                                              "wall": [wall, wall2], "rss": rss}  # fmt: skip
        out[name]["command"] = " ".join(["python -m mlxbun", *ev])
    return out


def throughput_report(res: dict, args: argparse.Namespace) -> str:
    lines = [f"# eval throughput: this tree against {args.throughput} (bench/eval.py --throughput)", "",
             f"{args.tokens} held-out tokens in windows of {args.seq_len}, batch {args.batch}, eval.top_k=1024 in both;"
             " tokens/s of a candidate counts its load, forward and every statistic.", "",
             "| model | vocab | step | before tok/s | after tok/s | after / before |", "|---|---|---|---|---|---|"]  # fmt: skip
    for name, r in res.items():
        b, a = r["before"], r["after"]
        vocab = a["first"]["reference"]["vocab"]
        for i, c in enumerate(a["second"]["candidates"]):
            tb = b["second"]["candidates"][i]["tokens"] / b["second"]["candidates"][i]["seconds"]
            ta = c["tokens"] / c["seconds"]
            lines.append(
                f"| {name} | {vocab} | candidate {c['label']} | {tb:,.0f} | {ta:,.0f} | {ta / tb:.2f}× |"
            )
        n = a["first"]["text"]["scored_tokens"]
        rb, ra = n / b["first"]["reference"]["seconds"], n / a["first"]["reference"]["seconds"]
        lines.append(f"| {name} | {vocab} | reference record | {rb:,.0f} | {ra:,.0f} | {ra / rb:.2f}× |")
    lines += [""] + [f"- {name}: `{r['command']}`; peak RSS before {r['before']['rss'] / 2**30:.2f} GiB, after"
                     f" {r['after']['rss'] / 2**30:.2f} GiB; mean KLD of q4 before"
                     f" {r['before']['second']['candidates'][0]['kld_mean']:.6f}, after"
                     f" {r['after']['second']['candidates'][0]['kld_mean']:.6f}" for name, r in res.items()]  # fmt: skip
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------- --precision


def precision(args: argparse.Namespace) -> str:
    """The device's float32 per-token math against the former float64 numpy path (tests/test_eval.py's
    reference implementation) on the same float32 logits: both fixtures, mlx-lm q3/q4/q6/q8 (g64),
    every log-prob kept and top 1024 / 512 (the KLD top-K missed and its bound)."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    sys.path[:0] = [str(REPO), str(REPO / "tests")]
    import test_eval as t  # noqa: PLC0415 - the float64 reference lives with the tests

    from mlxbun import eval as ev
    from mlxbun.quant.probe import load_model

    args.work.mkdir(parents=True, exist_ok=True)
    lines = ["| fixture | candidate | K | mean KLD float64 | float32 − float64 | relative | max per-token diff |"
             " KLD missed (whole vocabulary − top-K) | mean bound |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name in FIXTURES:
        src = REPO / "tests" / "fixtures" / name
        text = ev.windows(ev.encode(load_tokenizer(src), ev.HELDOUT.read_text()), source="", tokens=args.tokens,
                          seq_len=args.seq_len, seed=0)  # fmt: skip
        w, targets = text.tokens, text.tokens[:, 1:].reshape(-1)

        def logits(d: Path, w: np.ndarray = w) -> np.ndarray:
            model = load_model(d)[0]
            out = [
                np.array(model(mx.array(w[i : i + args.batch]))[:, :-1]) for i in range(0, len(w), args.batch)
            ]
            return np.concatenate(out).reshape(-1, out[0].shape[-1])

        ref = logits(src)
        vocab = ref.shape[1]
        for bits in (3, 4, 6, 8):
            cur = logits(convert(src, args.work / f"{name}-q{bits}", bits, args.work / "log.txt"))
            full = t.f64_stats(ref, cur, targets, vocab)["kld"].mean()
            for k in (vocab, 1024, 512):
                old, new = t.f64_stats(ref, cur, targets, k), t.device_stats(ref, cur, targets, k)
                diff = new["kld"].mean() - old["kld"].mean()
                lines.append(f"| {name} | q{bits} | {k} | {old['kld'].mean():.6e} | {diff:+.1e} |"
                             f" {diff / old['kld'].mean():+.1e} | {np.abs(new['kld'] - old['kld']).max():.1e} |"
                             f" {full - new['kld'].mean():.2e} | {new['bound'].mean():.2e} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--work", type=Path, default=None, help="scratch directory (default: a new temporary one)"
    )
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--big-tokens", type=int, default=512)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--throughput",
        metavar="REV",
        default=None,
        help="compare eval's rate with git revision (or tree) REV",
    )
    ap.add_argument("--models", default="llama-text-12l,narrow-152k", help="--throughput: models to evaluate")
    ap.add_argument("--precision", action="store_true", help="float32 device math against float64 instead")
    args = ap.parse_args()
    args.work = (args.work or Path(tempfile.mkdtemp(prefix="mlxbun-eval-"))).resolve()
    args.models = args.models.split(",")
    if args.precision:
        out = args.out or REPO / "bench" / "results" / "eval_precision.md"
        out.write_text(precision(args))
        print(out.read_text())
        return
    if args.throughput:
        out = args.out or REPO / "bench" / "results" / "eval_throughput.md"
        res = throughput(args)
        out.with_suffix(".json").write_text(json.dumps(res, indent=2, sort_keys=True))
        out.write_text(throughput_report(res, args))
        print(out.read_text())
        return
    args.out = args.out or REPO / "bench" / "results" / "eval.md"
    fx = {name: fixture(args, name) for name in FIXTURES}
    bigr = big(args)
    (args.out.with_suffix(".json")).write_text(
        json.dumps({"fixtures": fx, "big": bigr}, indent=2, sort_keys=True)
    )
    args.out.write_text(report(fx, bigr, args))
    print(args.out.read_text())


if __name__ == "__main__":
    main()
