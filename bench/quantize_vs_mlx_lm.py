"""Streaming quantize vs ``mlx_lm convert``: wall time, CPU time and peak RSS on the same models.

Run: .venv/bin/python bench/quantize_vs_mlx_lm.py [--work DIR] [--keep] [--quick] [--reps N]
     (or --profile DIR: each phase alone on one thread; --thread-profile DIR: each step of a
     real conversion, wall and CPU of the thread that ran it)
Builds two synthetic bf16 llama checkpoints (1.7B, then 3.6B; --quick: 0.2B and 0.4B) in child
processes and lays each out as a Hugging Face cache entry (``blobs/<sha256>`` hard links,
``snapshots/<rev>/`` symlinks), then runs as child processes on a warm page cache, interleaved
--reps times (best wall time kept, the machine is shared), all with mlx-lm's 5 GiB shards:

- ``mlx_lm.convert -q`` (4-bit, g64) on the snapshot directory;
- mlxbun's ``quantize_model_dir`` with the same settings (the library call);
- ``python -m mlxbun command=quantize`` on the snapshot, a first run (empty digest cache,
  registry and outputs: Hydra start-up, registry, manifest with sha256 of every input and output);
- the same command again (a new conversion into a new run directory; input digests cached);

then once: the first CLI run on the plain directory (inputs hashed while the conversion runs) and
the library call with 1 GiB shards (peak RSS near one shard, whatever the model size). Every
mlxbun output is checked tensor by tensor against mlx-lm's. Peak RSS is each child's
``ru_maxrss`` from ``os.wait4``. Models and outputs are deleted afterwards unless --keep. Results
are appended to bench/results/quantize.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODELS = {  # name -> synth overrides (llama dims; preset 1b = Llama 3.2 1B, 4b = Llama 3.2 3B)
    "full": [("llama-1.7b", dict(preset="1b", num_layers=24)), ("llama-3.6b", dict(preset="4b", num_layers=32))],
    "quick": [("llama-0.2b", dict(preset="small", num_layers=16, hidden_size=1024, intermediate_size=2816)),
              ("llama-0.4b", dict(preset="small", num_layers=32, hidden_size=1024, intermediate_size=2816))],
}  # fmt: skip


def run_child(cmd: list[str], *, cwd: Path) -> dict:
    """Run ``cmd``; wall seconds, user+sys CPU seconds and peak RSS (GB) of that child alone."""
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
    env["PYTHONPATH"] = str(REPO)
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = proc.stdout.read().decode(errors="replace")
    _, status, ru = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{out[-3000:]}")
    return {"wall": wall, "cpu": ru.ru_utime + ru.ru_stime, "rss_gb": ru.ru_maxrss * 1024 / 1e9, "log": out}


def warm(src: Path) -> None:
    for f in src.glob("*.safetensors"):
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass


def same_tensors(a: Path, b: Path) -> bool:
    code = (
        "import sys, mlx.core as mx; from pathlib import Path\n"
        "def load(d):\n  o={}\n  [o.update(mx.load(str(f))) for f in sorted(Path(d).glob('model*.safetensors'))]\n  return o\n"
        "x, y = load(sys.argv[1]), load(sys.argv[2])\n"
        "ok = sorted(x) == sorted(y) and all(bytes(memoryview(x[k])) == bytes(memoryview(y[k])) for k in x)\n"
        "print('SAME' if ok else 'DIFFERENT')\n"
    )
    res = subprocess.run([sys.executable, "-c", code, str(a), str(b)], capture_output=True, text=True)
    return res.stdout.strip().endswith("SAME")


LIB = (
    "import sys; from mlxbun.quant.quantize.command import quantize_model_dir\n"
    "r = quantize_model_dir(sys.argv[1], sys.argv[2], bits=4, group_size=64, shard_bytes=int(sys.argv[3]) << 30)\n"
    "print('seconds', r.seconds)\n"
)


def mlx_lm_run(src: Path, work: Path, name: str) -> dict:
    ref = work / f"{name}-mlx_lm"
    shutil.rmtree(ref, ignore_errors=True)
    warm(src)
    return run_child(
        [str(Path(sys.executable).parent / "mlx_lm.convert"), "--hf-path", str(src), "--mlx-path", str(ref), "-q",
         "--q-bits", "4", "--q-group-size", "64"],
        cwd=work,
    )  # fmt: skip


def lib_run(src: Path, work: Path, name: str, shard_gb: int) -> dict:
    out = work / f"{name}-mlxbun-{shard_gb}"
    shutil.rmtree(out, ignore_errors=True)
    warm(src)
    r = run_child([sys.executable, "-c", LIB, str(src), str(out), str(shard_gb)], cwd=work)
    r["identical"] = same_tensors(work / f"{name}-mlx_lm", out)
    shutil.rmtree(out)
    return r


def cli_runs(src: Path, work: Path, name: str, *, repeat: bool) -> list[dict]:
    """A first ``python -m mlxbun command=quantize`` run with empty caches, and (``repeat``) the
    same command again; both outputs compared with mlx-lm's."""
    root = work / f"{name}-mlxbun-cli"
    shutil.rmtree(root, ignore_errors=True)
    args = [sys.executable, "-m", "mlxbun", "command=quantize", f"model.name={src}", "quant.bits=4",
            "quant.group_size=64", "io.shard_gb=5", f"paths.outputs={root / 'outputs'}",
            f"paths.cache={root / 'cache'}", f"registry.path={root / 'registry.db'}"]  # fmt: skip
    runs = []
    for _ in range(2 if repeat else 1):
        warm(src)
        runs.append(run_child(args, cwd=work))
    outs = sorted((root / "outputs" / "quantize").iterdir())
    for r, run_dir in zip(runs, outs, strict=True):
        r["identical"] = same_tensors(work / f"{name}-mlx_lm", run_dir / "model")
    shutil.rmtree(root)
    return runs


def best(runs: list[dict]) -> dict:
    """Shortest wall time (least disturbed by other jobs), lowest CPU, highest peak RSS of n runs."""
    out = dict(min(runs, key=lambda r: r["wall"]))
    out.update(cpu=min(r["cpu"] for r in runs), rss_gb=max(r["rss_gb"] for r in runs), n=len(runs))
    if any("identical" in r for r in runs):
        out["identical"] = all(r.get("identical") for r in runs)
    return out


def bench_model(name: str, plain: Path, snap: Path, work: Path, reps: int) -> list[dict]:
    """mlx-lm, the library call and the CLI (first run, repeat) interleaved ``reps`` times; then
    the first CLI run from a plain directory and the library call with 1 GiB shards."""
    ref, lib5, first, again = [], [], [], []
    for _ in range(reps):
        ref.append(mlx_lm_run(snap, work, name))
        lib5.append(lib_run(snap, work, name, 5))
        r1, r2 = cli_runs(snap, work, name, repeat=True)
        first.append(r1)
        again.append(r2)
    rows = [
        {"model": name, "tool": "mlx_lm convert", "shard_gb": 5, **best(ref)},
        {"model": name, "tool": "mlxbun (library call)", "shard_gb": 5, **best(lib5)},
        {"model": name, "tool": "mlxbun CLI, first run (HF cache)", "shard_gb": 5, **best(first)},
        {"model": name, "tool": "mlxbun CLI, repeat run (HF cache)", "shard_gb": 5, **best(again)},
        {
            "model": name,
            "tool": "mlxbun CLI, first run (plain dir)",
            "shard_gb": 5,
            **best(cli_runs(plain, work, name, repeat=False)),
        },
        {
            "model": name,
            "tool": "mlxbun (library call)",
            "shard_gb": 1,
            **best([lib_run(snap, work, name, 1)]),
        },
    ]
    shutil.rmtree(work / f"{name}-mlx_lm")
    return rows


def hf_cache_entry(plain: Path, hub: Path, name: str) -> Path:
    """Lay ``plain`` out as an HF cache entry (hard links, no extra disk); return the snapshot."""
    repo = hub / f"models--bench--{name}"
    snap = repo / "snapshots" / ("0" * 40)
    if snap.is_dir():
        return snap
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True)
    for f in sorted(plain.iterdir()):
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            while block := fh.read(16 << 20):
                h.update(block)
        blob = repo / "blobs" / h.hexdigest()
        if not blob.exists():
            os.link(f, blob)
        (snap / f.name).symlink_to(Path("../../blobs") / blob.name)
    return snap


def synthesize(src: Path, dims: dict) -> None:
    """Build the source in a child: this process stays small, and children inherit its peak RSS."""
    code = "import sys, json; from mlxbun.synth.write import synthesize; synthesize(sys.argv[1], arch='llama', **json.loads(sys.argv[2]))"
    run_child([sys.executable, "-c", code, str(src), json.dumps(dims)], cwd=src.parent)


def report(rows: list[dict], sizes: dict[str, float], load: tuple[str, str]) -> str:
    lines = [
        f"## quantize vs mlx_lm convert ({time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC)",
        "",
        f"Machine: {os.cpu_count()}-core {platform.machine()} Linux, mlx {_ver('mlx')} CPU, mlx-lm {_ver('mlx-lm')};"
        f" load average before/after: {load[0]} / {load[1]} (on a shared machine wall times are noisy:"
        " the best of the interleaved runs is shown; CPU seconds are steadier). 4-bit affine g64, bf16 synthetic llama sources on a warm page cache.",
        "",
        "| model | source GB | run | shards | runs | wall s (best) | CPU s | peak RSS GB | tensors identical to mlx-lm |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ident = {True: "yes", False: "NO", None: "-"}[r.get("identical")]
        lines.append(
            f"| {r['model']} | {sizes[r['model']]:.2f} | {r['tool']} | {r['shard_gb']} GiB | {r['n']} | {r['wall']:.1f}"
            f" | {r['cpu']:.1f} | {r['rss_gb']:.2f} | {ident} |"
        )
    lines += ["", *ratios(rows), ""]
    return "\n".join(lines)


def ratios(rows: list[dict]) -> list[str]:
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        ref = next(r for r in rows if r["model"] == model and r["tool"] == "mlx_lm convert")
        for r in rows:
            if r["model"] == model and r["tool"].startswith("mlxbun"):
                out.append(
                    f"- {model}, {r['tool']}, {r['shard_gb']} GiB shards: {ref['wall'] / r['wall']:.2f}x mlx-lm's"
                    f" speed (wall), {ref['cpu'] / r['cpu']:.2f}x (CPU s); peak RSS {r['rss_gb']:.2f} GB vs"
                    f" {ref['rss_gb']:.2f} GB"
                )
    return out


PROFILE = """
import hashlib, os, sys, tempfile, time
import mlx.core as mx
from mlxbun.source.model import FileTensors
from mlxbun.io.layout import tensor_bytes
src = sys.argv[1]
def clock():
    return time.perf_counter(), time.process_time()
def row(name, t, nbytes):
    wall, cpu = time.perf_counter() - t[0], time.process_time() - t[1]
    print(f"| {name} | {nbytes / 1e9:.2f} | {wall:.2f} | {cpu:.2f} | {nbytes / 1e9 / max(cpu, 1e-9):.2f} |", flush=True)
with FileTensors(__import__('pathlib').Path(src)) as f:
    names = [n for n in f.model.names() if n.endswith("proj.weight") or n.endswith("embed_tokens.weight")]
    t, total, arrays = clock(), 0, []
    for n in names:
        a = f.array(n); mx.eval(a); total += a.nbytes
        arrays.append(a) if len(arrays) < 0 else None
    row("read every weight (pread into mx buffers)", t, total)
    t, out = clock(), []
    for n in names:
        w, s, b = mx.quantize(f.array(n), 64, 4); mx.eval(w, s, b); out.append((w, s, b))
    row("read + mx.quantize 4-bit g64, one thread", t, total)
    size = sum(x.nbytes for o in out for x in o)
    t = clock()
    with tempfile.NamedTemporaryFile(dir=os.path.dirname(src.rstrip('/')) or '.') as tmp:
        for o in out:
            for x in o:
                tmp.write(tensor_bytes(x)[2])
        tmp.flush(); os.fsync(tmp.fileno())
    row("write + fsync the quantized bytes", t, size)
    t, h = clock(), hashlib.sha256()
    for o in out:
        for x in o:
            h.update(tensor_bytes(x)[2])
    row("sha256 of the quantized bytes", t, size)
    t, h = clock(), hashlib.sha256()
    for p in sorted(f.model.files):
        with open(p, "rb") as fh:
            while block := fh.read(16 << 20):
                h.update(block)
    row("sha256 of the source files", t, sum(os.path.getsize(p) for p in f.model.files))
"""


# The library call with each step timed on the thread that runs it.
THREADS = """
import collections, resource, sys, threading, time
t_start = time.perf_counter()
from mlxbun.quant.quantize import command as Q
from mlxbun.io import shards
t_import = time.perf_counter() - t_start
stats, lock = collections.defaultdict(lambda: [0.0, 0.0, 0]), threading.Lock()
def wrap(obj, name, label):
    real = getattr(obj, name)
    def timed(*a, **k):
        w, c = time.perf_counter(), time.thread_time()
        try:
            return real(*a, **k)
        finally:
            with lock:
                s = stats[label]; s[0] += time.perf_counter() - w; s[1] += time.thread_time() - c; s[2] += 1
    setattr(obj, name, timed)
wrap(Q.Converter, "read", "worker: read a source tensor (pread)")
wrap(Q.Converter, "quantize_rows", "worker: a big tensor, read and quantized in row blocks")
wrap(Q.Converter, "finish", "worker: mx.eval of a unit (waits for mx.quantize)")
wrap(shards.ShardedWriter, "add", "main: writer.add")
wrap(shards.ShardedWriter, "_write_data", "main: write a tensor (O_DIRECT)")
wrap(shards.ShardedWriter, "_end_shard", "main: close a shard (fsync, rename, journal)")
wrap(shards._Hashes, "update", "hash thread: sha256 + xxh3 of the shard")
wrap(Q, "prepare", "main: plan the skeleton")
wrap(Q, "write_side_files", "main: config and side files")
wrap(Q, "write_record", "main: record")
wrap(Q.Stage, "publish", "main: publish (fsync, rename)")
t0, c0 = time.perf_counter(), time.process_time()
Q.quantize_model_dir(sys.argv[1], sys.argv[2], bits=4, group_size=64, shard_bytes=int(sys.argv[3]) << 30)
wall, cpu = time.perf_counter() - t0, time.process_time() - c0
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
print(f"import {t_import:.2f} s; call: wall {wall:.2f} s, process CPU {cpu:.2f} s, peak RSS {rss:.2f} GB")
for k, (w, c, n) in sorted(stats.items(), key=lambda kv: -kv[1][1]):
    print(f"| {k} | {n} | {w:.2f} | {c:.2f} |")
"""


def thread_profile(src: Path, work: Path) -> str:
    """Wall and thread CPU of each step of a real 4-bit conversion (2 workers, 5 GiB shards); the
    remainder of the process CPU is mx.quantize, run on MLX's per-thread stream threads."""
    out = work / "thread-profile"
    shutil.rmtree(out, ignore_errors=True)
    warm(src)
    r = run_child([sys.executable, "-c", THREADS, str(src), str(out), "5"], cwd=work)
    shutil.rmtree(out, ignore_errors=True)
    lines = r["log"].splitlines()
    head = ["| step | calls | wall s | thread CPU s |", "|---|---|---|---|"]
    return "\n".join(
        [*[x for x in lines if x.startswith("import")], "", *head, *[x for x in lines if x.startswith("| ")]]
    )


def profile(src: Path) -> str:
    """Where a 4-bit conversion's time goes: each phase alone, one thread, in a child."""
    warm(src)
    r = run_child([sys.executable, "-c", PROFILE, str(src)], cwd=src.parent)
    head = ["| phase (one thread) | GB | wall s | CPU s | GB per CPU s |", "|---|---|---|---|---|"]
    return "\n".join(head + [line for line in r["log"].splitlines() if line.startswith("| ")])


def _ver(pkg: str) -> str:
    from importlib import metadata

    return metadata.version(pkg)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/mlxbun-bench-quantize"))
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--quick", action="store_true", help="small models (a smoke run, not the result)")
    ap.add_argument(
        "--reps", type=int, default=2, help="interleaved runs of mlx-lm and mlxbun (best is kept)"
    )
    ap.add_argument("--profile", type=Path, help="only time the phases of a conversion of this model dir")
    ap.add_argument(
        "--thread-profile", type=Path, help="only time each step of a conversion of this model dir"
    )
    args = ap.parse_args()
    if args.profile:
        print(profile(args.profile))
        return
    if args.thread_profile:
        args.work.mkdir(parents=True, exist_ok=True)
        print(thread_profile(args.thread_profile, args.work))
        return
    args.work.mkdir(parents=True, exist_ok=True)
    load0 = open("/proc/loadavg").read().split()[0]
    rows, sizes = [], {}
    try:
        for name, dims in MODELS["quick" if args.quick else "full"]:
            src = args.work / name
            if not src.exists():
                synthesize(src, dims)
            snap = hf_cache_entry(src, args.work / "hub", name)
            sizes[name] = sum(f.stat().st_size for f in src.glob("*.safetensors")) / 1e9
            rows += bench_model(name, src, snap, args.work, args.reps)
            print("\n".join(ratios(rows)), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(args.work, ignore_errors=True)
    text = report(rows, sizes, (load0, open("/proc/loadavg").read().split()[0]))
    print(text)
    if not args.quick:
        results = REPO / "bench" / "results" / "quantize.md"
        results.parent.mkdir(parents=True, exist_ok=True)
        with open(results, "a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
