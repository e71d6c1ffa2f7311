"""Synthetic checkpoint writing: mlxbun synth vs raw write+fsync of the same bytes, and peak RSS.

Run: .venv/bin/python bench/synth_bench.py [--arch gemma3_text --preset 1b] [--big-preset 4b]
         [--shard-mib 512] [--rounds 2] [--gemma27-layers 3] [--out bench/results/synth.md]

Each task runs in a fresh child process (peak RSS from wait4) in a temp dir on the work disk:
  synth        - ``mlxbun.synth.write.synthesize`` of the model (~2 GB bf16 for gemma3_text 1b), shards
                 of ``--shard-mib`` (each tensor written as it is generated).
  raw          - write+fsync of the same number of bytes into files of the same sizes (random
                 bytes prepared before the clock starts): the disk's ceiling.
  mlx-lm       - the usual way to make a random model with mlx-lm: its own model class built
                 from the same config.json (random init), cast to bf16, ``save_model`` (+ fsync).
  synth (big)  - the same synth for ``--big-preset`` (llama): peak RSS should not grow with size;
                 with ``--gemma27-layers N`` also Gemma 3 27B's tensors (N of its 62 layers, its
                 2.8 GB embedding) in mlx-lm's 5 GiB shards.
Plus in-process generator rates (table lookup vs numpy normal + bf16 cast vs mx.random.normal).
Medians of ``--rounds`` rounds. The 2-core machine is shared: numbers are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
MIB = 1 << 20


# ---------------------------------------------------------------- child tasks (fresh process)


def task_synth(out: Path, arch: str, preset: str, shard_bytes: int, layers: int = 0) -> float:
    from mlxbun.synth import write as synth_write

    start = time.perf_counter()
    dims = {"num_layers": layers} if layers else {}
    synth_write.synthesize(out, arch=arch, preset=preset, shard_bytes=shard_bytes, **dims)
    return time.perf_counter() - start


def task_raw(out: Path, sizes: list[int]) -> float:
    import numpy as np

    block = np.random.default_rng(0).integers(0, 256, size=64 * MIB, dtype=np.uint8)
    view = memoryview(block)
    out.mkdir(parents=True)
    start = time.perf_counter()
    for k, size in enumerate(sizes):
        with open(out / f"shard-{k}.bin", "wb") as f:
            for off in range(0, size, len(view)):
                f.write(view[: min(len(view), size - off)])
            f.flush()
            os.fsync(f.fileno())
    return time.perf_counter() - start


def task_mlx_lm(out: Path, config_path: Path) -> float:
    import mlx.core as mx
    from mlx_lm.utils import _get_classes, save_model

    config = json.loads(config_path.read_text())
    start = time.perf_counter()
    model_class, args_class = _get_classes(config=config)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(mx.bfloat16)
    save_model(out, model)
    for f in out.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    return time.perf_counter() - start


def child(argv: list[str]) -> None:
    task, out, *args = argv
    if task == "synth":
        seconds = task_synth(Path(out), args[0], args[1], int(args[2]), int(args[3]))
    elif task == "raw":
        seconds = task_raw(Path(out), [int(s) for s in args])
    else:
        seconds = task_mlx_lm(Path(out), Path(args[0]))
    print(json.dumps({"seconds": seconds}))


# ---------------------------------------------------------------- parent


def run_child(*args: str) -> tuple[float, int]:
    """(seconds reported by the child, peak RSS bytes of the child)."""
    proc = subprocess.Popen([sys.executable, __file__, "--child", *args], stdout=subprocess.PIPE)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise RuntimeError(f"child {args} failed with status {status}")
    return json.loads(out)["seconds"], usage.ru_maxrss * 1024


def rounds_of(n: int, target: Path, *args: str) -> tuple[float, int]:
    results = []
    for _ in range(n):
        results.append(run_child(args[0], str(target), *args[1:]))
        shutil.rmtree(target, ignore_errors=True)
    return statistics.median(r[0] for r in results), max(r[1] for r in results)


def generator_rates(n: int = 1 << 25) -> dict[str, float]:
    """Million bf16 values per second for three ways of drawing N(0, σ²) weights."""
    import mlx.core as mx
    import numpy as np

    from mlxbun.synth import arch as synth_arch
    from mlxbun.synth import values as synth_values
    from mlxbun.synth import write as synth_write

    t = synth_arch.TensorPlan("bench.weight", (n // 4096, 4096), "bfloat16", 0.02)
    spec = synth_write.resolve_spec()
    rates = {}
    for threads in (1, synth_values.THREADS):
        synth_values.THREADS = threads
        start = time.perf_counter()
        mx.eval(synth_write.tensor_array(t, spec=spec, channels=[]))
        rates[f"mlxbun table lookup, {threads} thread(s)"] = n / (time.perf_counter() - start) / 1e6
    start = time.perf_counter()
    for i in range(0, n, 1 << 22):
        x = np.random.default_rng(i).standard_normal(1 << 22, dtype=np.float32) * 0.02
        mx.eval(mx.array(x).astype(mx.bfloat16))
    rates["numpy standard_normal f32 + bf16 cast"] = n / (time.perf_counter() - start) / 1e6
    start = time.perf_counter()
    mx.eval(mx.random.normal((n,), dtype=mx.bfloat16, key=mx.random.key(0)) * 0.02)
    rates["mx.random.normal bf16"] = n / (time.perf_counter() - start) / 1e6
    return rates


def shard_sizes(model: Path) -> list[int]:
    return [f.stat().st_size for f in sorted(model.glob("model*.safetensors"))]


def bench(args: argparse.Namespace, tmp: Path) -> dict:
    shard_bytes = args.shard_mib * MIB
    ref = tmp / "reference"
    run_child("synth", str(ref), args.arch, args.preset, str(shard_bytes), "0")
    sizes, total = shard_sizes(ref), sum(shard_sizes(ref))
    print(f"model: {total / 1e9:.2f} GB in {len(sizes)} shards", flush=True)
    r = {"total": total, "shards": len(sizes)}
    r["raw"] = rounds_of(args.rounds, tmp / "raw", "raw", *map(str, sizes))
    r["synth"] = rounds_of(args.rounds, tmp / "s", "synth", args.arch, args.preset, str(shard_bytes), "0")
    r["mlx_lm"] = rounds_of(args.rounds, tmp / "m", "mlx_lm", str(ref / "config.json"))
    shutil.rmtree(ref)
    print("small model done", flush=True)
    big = tmp / "big"
    r["big"] = run_child("synth", str(big), "llama", args.big_preset, str(shard_bytes), "0")
    r["big_total"] = sum(shard_sizes(big))
    shutil.rmtree(big)
    if args.gemma27_layers:  # Gemma 3 27B tensor shapes, fewer layers, mlx-lm's 5 GiB shards
        g27 = tmp / "g27"
        r["g27"] = run_child("synth", str(g27), "gemma3_text", "27b", str(5 << 30), str(args.gemma27_layers))
        r["g27_total"] = sum(shard_sizes(g27))
        shutil.rmtree(g27)
    r["rates"] = generator_rates()
    return r


def largest_tensor(arch: str, preset: str) -> int:
    from mlxbun.synth import write as synth_write

    return max(t.nbytes for t in synth_write.plan(synth_write.resolve_spec(arch=arch, preset=preset)))


def report(args: argparse.Namespace, r: dict) -> str:
    import mlx.core as mx

    gb = r["total"] / 1e9
    raw = r["raw"][0]
    lines = [
        "# Synthetic checkpoints (bench/synth_bench.py)",
        "",
        f"Command: `.venv/bin/python bench/synth_bench.py --arch {args.arch} --preset {args.preset}"
        f" --big-preset {args.big_preset} --shard-mib {args.shard_mib} --rounds {args.rounds}"
        f" --gemma27-layers {args.gemma27_layers}`",
        f"Machine: 2-core x86_64 Linux ({platform.platform()}), mlx {mx.__version__} CPU, shared with other"
        " jobs (load average often > 2 per core): noisy; medians of rounds, each in a fresh process.",
        f"Model: {args.arch} preset {args.preset}, {gb:.2f} GB bf16 in {r['shards']} shards of"
        f" <= {args.shard_mib} MiB (largest tensor {largest_tensor(args.arch, args.preset) / MIB:,.0f} MiB).",
        "",
        "| writer | seconds | GB/s | vs raw write+fsync | peak RSS |",
        "|---|---|---|---|---|",
    ]
    names = {
        "raw": "raw write+fsync of the same bytes (random bytes ready in memory)",
        "synth": "mlxbun synth (generate + write + fsync)",
        "mlx_lm": "mlx-lm model class random init, bf16, `save_model` + fsync",
    }
    for kind, label in names.items():
        secs, rss = r[kind]
        lines.append(f"| {label} | {secs:.1f} | {gb / secs:.2f} | {raw / secs:.2f}x | {rss / MIB:,.0f} MiB |")
    big_secs, big_rss = r["big"]
    lines += [
        "",
        "## Peak RSS does not grow with model size",
        "",
        "| model | bytes | seconds | peak RSS | largest tensor |",
        "|---|---|---|---|---|",
        f"| {args.arch} {args.preset} | {gb:.2f} GB | {r['synth'][0]:.1f} | {r['synth'][1] / MIB:,.0f} MiB |"
        f" {largest_tensor(args.arch, args.preset) / MIB:,.0f} MiB |",
        f"| llama {args.big_preset} | {r['big_total'] / 1e9:.2f} GB | {big_secs:.1f} | {big_rss / MIB:,.0f} MiB |"
        f" {largest_tensor('llama', args.big_preset) / MIB:,.0f} MiB |",
    ]
    if "g27" in r:
        g27_secs, g27_rss = r["g27"]
        lines.append(
            f"| gemma3_text 27b shapes, {args.gemma27_layers} of 62 layers, 5 GiB shards |"
            f" {r['g27_total'] / 1e9:.2f} GB | {g27_secs:.1f} | {g27_rss / MIB:,.0f} MiB |"
            f" {largest_tensor('gemma3_text', '27b') / MIB:,.0f} MiB |"
        )
    lines += [
        "",
        "## Generator rates (million bf16 values per second, in process)",
        "",
        "| generator | M values/s |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v:,.0f} |" for k, v in r["rates"].items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="gemma3_text")
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--big-preset", default="4b")
    ap.add_argument("--shard-mib", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--gemma27-layers", type=int, default=0, help="also synth Gemma 3 27B shapes, N layers")
    ap.add_argument("--dir", default=str(REPO))
    ap.add_argument("--out", default=str(REPO / "bench/results/synth.md"))
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix=".synth-bench-", dir=args.dir))
    try:
        results = bench(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    text = report(args, results)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
