"""Safetensors I/O vs the anchors: read and write throughput, and peak RSS of streaming a model.

Run: .venv/bin/python bench/io_bench.py [--tensors 40] [--shard-mib 256] [--rounds 3] [--out bench/results/io.md]

Builds a float16 model of ``--tensors`` 4096x4096 tensors (32 MiB each; default 1.25 GiB in
5 shards of 256 MiB) with mlxbun's writer in a temp dir on the work disk, then times, each in
its own child process (peak RSS from wait4):
  read   - every tensor of the model: mlxbun ``array()`` (mx.array) vs ``mx.load`` per shard;
           mlxbun ``numpy()`` + copy vs ``safetensors.safe_open(framework="numpy")``; cold
           (pages evicted with posix_fadvise) and warm (page cache) runs.
  write  - the same tensors: mlxbun ShardedWriter (+ overlap) vs raw write+fsync of the same
           bytes in the same files vs ``mx.save_safetensors`` per shard (+ fsync).
  stream - copy the model tensor by tensor into a new sharded dir (ShardedWriter; peak ≈ one
           shard) and read-only streaming (peak ≈ one tensor) vs loading it whole (mx.load).
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
SIDE = 4096  # tensors are SIDE x SIDE float16 = 32 MiB


# ---------------------------------------------------------------- child tasks (run in a fresh process)


def make_tensors(n: int):
    import mlx.core as mx

    mx.random.seed(0)
    out = {f"model.layers.{i}.w": mx.random.normal((SIDE, SIDE)).astype(mx.float16) for i in range(n)}
    mx.eval(list(out.values()))
    return out


def shard_groups(tensors: dict, shard_bytes: int) -> list[list[str]]:
    groups, size = [], 0
    for name, a in tensors.items():
        if not groups or size + a.nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += a.nbytes
    return groups


def task_write(kind: str, out: Path, n: int, shard_bytes: int) -> float:
    import mlx.core as mx
    import numpy as np

    from mlxbun.io.shards import ShardedWriter

    tensors = make_tensors(n)
    start = time.perf_counter()
    if kind.startswith("ours"):
        checksum = "none" if kind.endswith("nosum") else "crc32"
        w = ShardedWriter(out, shard_bytes=shard_bytes, overlap="overlap" in kind, checksum=checksum)
        for name, a in tensors.items():
            w.add(name, a)
        w.finish()
    else:
        out.mkdir(parents=True)
        for k, names in enumerate(shard_groups(tensors, shard_bytes)):
            path = out / f"shard-{k}.safetensors"
            if kind == "raw":
                with open(path, "wb") as f:
                    for name in names:
                        f.write(memoryview(np.asarray(tensors[name])).cast("B"))
                    f.flush()
                    os.fsync(f.fileno())
            else:  # mx.save_safetensors, as mlx_lm.utils.save_model does, plus the fsync it lacks
                mx.save_safetensors(str(path), {m: tensors[m] for m in names}, metadata={"format": "mlx"})
                fd = os.open(path, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
    return time.perf_counter() - start


def read_ours_mx(model: Path) -> None:
    from mlxbun.io.safetensors import open_model

    with open_model(model) as m:
        for name in m.names():
            a = m.array(name)
            del a


def read_ours_np(model: Path) -> None:
    import numpy as np

    from mlxbun.io.safetensors import open_model

    with open_model(model) as m:
        for name in m.names():
            a = np.array(m.numpy(name))  # a private copy, as safe_open's get_tensor returns
            m.release(name)
            del a


def read_safe_open(model: Path) -> None:
    from safetensors import safe_open

    for f in sorted(model.glob("model*.safetensors")):
        with safe_open(str(f), framework="numpy") as st:
            for k in st.keys():
                a = st.get_tensor(k)
                del a


def read_mx_load(model: Path) -> None:
    import mlx.core as mx

    for f in sorted(model.glob("model*.safetensors")):
        d = mx.load(str(f))
        mx.eval(list(d.values()))
        del d


def stream_copy(model: Path, out: Path, shard_bytes: int, overlap: bool) -> None:
    from mlxbun.io.safetensors import open_model
    from mlxbun.io.shards import ShardedWriter

    with open_model(model) as m:
        w = ShardedWriter(out, shard_bytes=shard_bytes, overlap=overlap)
        for name in m.names():
            w.add(name, m.array(name))
        w.finish()


def load_whole(model: Path) -> None:
    import mlx.core as mx

    weights = {}
    for f in sorted(model.glob("model*.safetensors")):
        weights.update(mx.load(str(f)))
    mx.eval(list(weights.values()))


def child(argv: list[str]) -> None:
    task, *args = argv
    if task == "baseline":
        import mlx.core  # noqa: F401

        import mlxbun.io.shards  # noqa: F401

        seconds = 0.0
    elif task == "write":
        seconds = task_write(args[0], Path(args[1]), int(args[2]), int(args[3]))
    else:
        fn = {
            "ours_mx": read_ours_mx,
            "ours_np": read_ours_np,
            "safe_open": read_safe_open,
            "mx_load": read_mx_load,
        }
        start = time.perf_counter()
        if task == "read":
            fn[args[0]](Path(args[1]))
        elif task == "stream_copy":
            stream_copy(Path(args[0]), Path(args[1]), int(args[2]), args[3] == "1")
        elif task == "stream_read":
            read_ours_mx(Path(args[0]))
        elif task == "load_whole":
            load_whole(Path(args[0]))
        seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "peak": peak_rss()}))


def peak_rss() -> int:
    """VmHWM: peak RSS of this process image (ru_maxrss would include the forking parent's)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


# ---------------------------------------------------------------- parent


def run_child(*args: str) -> tuple[float, int]:
    """(seconds reported by the child, its peak RSS in bytes: VmHWM, checked against wait4)."""
    proc = subprocess.Popen([sys.executable, __file__, "--child", *args], stdout=subprocess.PIPE)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise RuntimeError(f"child {args} failed with status {status}")
    res = json.loads(out)
    assert res["peak"] <= usage.ru_maxrss * 1024 + (1 << 20)
    return res["seconds"], res["peak"]


def evict(path: Path) -> None:
    """Drop our own files from the page cache (no global drop_caches on a shared machine)."""
    for f in path.rglob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def median_run(rounds: int, *args: str, before=None) -> tuple[float, int]:
    results = []
    for _ in range(rounds):
        if before:
            before()
        results.append(run_child(*args))
    return statistics.median(r[0] for r in results), max(r[1] for r in results)


def bench_writes(
    tmp: Path, n: int, shard_bytes: int, rounds: int, total: int
) -> dict[str, tuple[float, int]]:
    out = {}
    for kind in ("ours", "ours_overlap", "ours_nosum", "ours_overlap_nosum", "raw", "mx_save"):
        times = []
        for r in range(rounds):
            target = tmp / f"w-{kind}-{r}"
            times.append(run_child("write", kind, str(target), str(n), str(shard_bytes))[0])
            shutil.rmtree(target)
        out[kind] = (statistics.median(times), total)
    return out


def bench_reads(model: Path, rounds: int) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for warmth in ("cold", "warm"):
        before = (lambda: evict(model)) if warmth == "cold" else None
        for kind in ("ours_mx", "mx_load", "ours_np", "safe_open"):
            secs, rss = median_run(rounds, "read", kind, str(model), before=before)
            out.setdefault(kind, {})[warmth] = secs
            out[kind]["rss"] = max(out[kind].get("rss", 0), rss)
    return out


def bench_stream(model: Path, tmp: Path, shard_bytes: int) -> dict[str, tuple[float, int]]:
    out = {"baseline": run_child("baseline")}
    for overlap in ("0", "1"):
        target = tmp / f"copy-{overlap}"
        out[f"stream_copy{'_overlap' if overlap == '1' else ''}"] = run_child(
            "stream_copy", str(model), str(target), str(shard_bytes), overlap
        )
        shutil.rmtree(target)
    out["stream_read"] = run_child("stream_read", str(model))
    out["load_whole"] = run_child("load_whole", str(model))
    return out


def report(args, total: int, writes, reads, stream) -> str:
    gb = total / 1e9
    base = stream["baseline"][1]
    lines = [
        "# Safetensors I/O (bench/io_bench.py)",
        "",
        f"Command: `.venv/bin/python bench/io_bench.py --tensors {args.tensors} --shard-mib {args.shard_mib}"
        f" --rounds {args.rounds}`",
        f"Machine: 2-core x86_64 Linux ({platform.platform()}), mlx {_mlx_version()} CPU, shared with other"
        " jobs: numbers are noisy (medians of rounds).",
        f"Model: {args.tensors} float16 tensors of {SIDE}x{SIDE} (32 MiB) = {gb:.2f} GB in"
        f" {-(-total // (args.shard_mib * MIB))} shards of {args.shard_mib} MiB.",
        "",
        "## Read every tensor (GB/s; cold = our files evicted from the page cache first)",
        "",
        "| reader | cold GB/s | warm GB/s | peak RSS | vs anchor (cold / warm) |",
        "|---|---|---|---|---|",
    ]
    pairs = {"ours_mx": "mx_load", "ours_np": "safe_open"}
    names = {
        "ours_mx": "mlxbun `array()` -> mx.array",
        "mx_load": "`mx.load` per shard",
        "ours_np": "mlxbun `numpy()` + copy",
        "safe_open": "`safe_open(framework='numpy')`",
    }
    for kind in ("ours_mx", "mx_load", "ours_np", "safe_open"):
        r = reads[kind]
        ratio = ""
        if kind in pairs:
            a = reads[pairs[kind]]
            ratio = f"{a['cold'] / r['cold']:.2f}x / {a['warm'] / r['warm']:.2f}x"
        lines.append(
            f"| {names[kind]} | {gb / r['cold']:.2f} | {gb / r['warm']:.2f} | {r['rss'] / 1e6:,.0f} MB | {ratio} |"
        )
    lines += [
        "",
        "## Write the same tensors (GB/s, fsync'd)",
        "",
        "| writer | GB/s | vs raw write+fsync |",
        "|---|---|---|",
    ]
    wnames = {
        "ours": "mlxbun ShardedWriter (crc32 journal digest)",
        "ours_overlap": "mlxbun ShardedWriter overlap=True (crc32)",
        "ours_nosum": "mlxbun ShardedWriter checksum='none'",
        "ours_overlap_nosum": "mlxbun ShardedWriter overlap=True checksum='none'",
        "raw": "raw write+fsync of the same bytes",
        "mx_save": "`mx.save_safetensors` per shard + fsync",
    }
    for kind, (secs, _) in writes.items():
        lines.append(f"| {wnames[kind]} | {gb / secs:.2f} | {writes['raw'][0] / secs:.2f}x |")
    lines += [
        "",
        "## Peak RSS while streaming the model (child process, VmHWM)",
        "",
        f"Largest tensor: 32 MiB; one shard: {args.shard_mib} MiB; whole model: {total / MIB:,.0f} MiB;"
        f" baseline (python + mlx + mlxbun imported): {base / MIB:,.0f} MiB.",
        "",
        "| task | seconds | peak RSS | above baseline |",
        "|---|---|---|---|",
    ]
    snames = {
        "stream_read": "read every tensor (`array()`), one at a time",
        "stream_copy": "copy tensor by tensor into ShardedWriter",
        "stream_copy_overlap": "copy into ShardedWriter overlap=True",
        "load_whole": "anchor: `mx.load` every shard, hold the model",
    }
    for kind in ("stream_read", "stream_copy", "stream_copy_overlap", "load_whole"):
        secs, rss = stream[kind]
        lines.append(
            f"| {snames[kind]} | {secs:.1f} | {rss / MIB:,.0f} MiB | {(rss - base) / MIB:,.0f} MiB |"
        )
    return "\n".join(lines) + "\n"


def _mlx_version() -> str:
    import mlx.core as mx

    return mx.__version__


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=40)
    ap.add_argument("--shard-mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=str(REPO))
    ap.add_argument("--out", default=str(REPO / "bench/results/io.md"))
    args = ap.parse_args()
    shard_bytes = args.shard_mib * MIB
    total = args.tensors * SIDE * SIDE * 2
    tmp = Path(tempfile.mkdtemp(prefix=".io-bench-", dir=args.dir))
    try:
        model = tmp / "model"
        run_child("write", "ours", str(model), str(args.tensors), str(shard_bytes))
        print(f"model: {total / 1e9:.2f} GB in {len(list(model.glob('*.safetensors')))} shards", flush=True)
        reads = bench_reads(model, args.rounds)
        print("reads done", flush=True)
        writes = bench_writes(tmp, args.tensors, shard_bytes, args.rounds, total)
        print("writes done", flush=True)
        stream = bench_stream(model, tmp, shard_bytes)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    text = report(args, total, writes, reads, stream)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
