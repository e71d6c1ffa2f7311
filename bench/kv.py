"""KV persistence: mlxbun's store vs mlx-lm's save/load_prompt_cache vs raw write+fsync, in one run.

Run: env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python bench/kv.py [--tokens 4096]
     [--layers 32] [--reps 3] [--out bench/results/kv.md]; then ``--restores-only --reps 5`` reruns
     the restores alone on the same files (more rounds where the machine is noisy) and appends them.

1. Throughput. A realistic cache — ``layers`` KVCache layers of (1, 8 KV heads, tokens, 128) fp16
   (32 x 4096: 512 MiB of valid K/V) — is saved and restored by
   * raw:       the same valid bytes written with one write+fsync per tensor / read back (the ceiling);
   * mlx-lm:    ``save_prompt_cache`` (no fsync; also timed with an fsync after) and
                ``load_prompt_cache`` (+ mx.eval);
   * mlx-lm+xxh3: ``load_prompt_cache`` followed by the check a verified snapshot restore makes
                (XXH3-128 of every tensor): mlx's own one-pass loader plus the hash, the ceiling
                for any verified restore into mlx arrays;
   * snapshot:  mlxbun single file, an mlx-lm prompt-cache file (hashes, fsync, rename, dir fsync);
                restore hashes everything; ``snapshot0``: the same with the data page-aligned
                (no header padding to the 64-byte skew), to measure what the skew buys;
   * stock-snapshot: mlx-lm's ``load_prompt_cache`` of an mlxbun snapshot file (no checks);
   * blocks:    mlxbun content-addressed 1 MiB blocks into an empty store; restore hashes every block;
   * -bg:       the same saves through ``Store.save_async``: how long the caller is blocked, and
                how long until the save is durable.
   Each save runs in its own child process (peak RSS of that child is reported), ``reps`` times;
   the median is kept. Restores run in ``reps`` rounds that interleave the methods; each round's
   child restores twice: the first restore is a fresh process's (all memory faulted in), the
   second reuses freed heap (a long-lived process). Files are in the page cache for every method.
2. A 10-turn conversation growing to ``tokens`` tokens, saved after every turn: bytes mlxbun
   writes vs unique bytes (the final turn's valid K/V), and disk used vs ten mlx-lm files.
Results go to ``--out`` (markdown) and stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

HEADS, DIM = 8, 128


def make_cache(layers: int, tokens: int, *, chunk: int | None = None) -> list:
    """KVCache layers filled through update_and_fetch (mlx-lm's own growth), seeded."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    mx.random.seed(0)
    out = []
    for _ in range(layers):
        c = KVCache()
        step = chunk or tokens
        for s in range(0, tokens, step):
            n = min(step, tokens - s)
            k = mx.random.normal((1, HEADS, n, DIM)).astype(mx.float16)
            c.update_and_fetch(k, -k)
        mx.eval(c.keys, c.values)
        out.append(c)
    return out


def valid_bytes(layers: int, tokens: int) -> int:
    return layers * 2 * HEADS * tokens * DIM * 2


# ------------------------------------------------------------------------------- child operations


def op_save(method: str, work: Path, cache: list, tokens: int) -> float | None:
    """Save once; for a background save (``-bg``), returns how long the caller was blocked."""
    import numpy as np
    from mlx_lm.models.cache import save_prompt_cache

    from mlxbun.kv.store import Store

    if method == "raw":
        with open(work / "raw.bin", "wb", buffering=0) as f:
            for c in cache:
                for a in (c.keys, c.values):
                    f.write(memoryview(np.array(a[..., :tokens, :], copy=False).view(np.uint16)).cast("B"))
            os.fsync(f.fileno())
    elif method == "mlx-lm":
        save_prompt_cache(str(work / "mlxlm.safetensors"), cache)
    elif method == "mlx-lm+fsync":  # the same file made durable, for an apples-to-apples view
        save_prompt_cache(str(work / "mlxlm-sync.safetensors"), cache)
        fd = os.open(work / "mlxlm-sync.safetensors", os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    else:
        layout, _, bg = method.partition("-")
        if layout == "snapshot0":  # the data start page-aligned instead of 64 bytes past it
            from mlxbun.kv import promptcache

            promptcache.SKEW, layout = 0, "snapshot"
        shutil.rmtree(work / f"store-{method}", ignore_errors=True)
        store = Store(work / f"store-{method}", block_kib=1024)
        kw = dict(tokens=[1] * tokens, model="bench", layout=layout)
        if not bg:
            store.save("s", cache, **kw)
            return None
        t0 = time.perf_counter()
        fut = store.save_async("s", cache, **kw)  # generation could go on from here
        blocked = time.perf_counter() - t0
        fut.result()
        return blocked
    return None


def op_load(method: str, work: Path, verify: bool) -> None:
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import load_prompt_cache

    from mlxbun.kv.format import check_digest
    from mlxbun.kv.store import Store

    if method == "raw":
        with open(work / "raw.bin", "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            buf = np.empty(size, np.uint8)
            f.readinto(memoryview(buf))  # bytes into memory only: the ceiling for a restore
    elif method in ("mlx-lm", "mlx-lm+xxh3"):
        cache = load_prompt_cache(str(work / "mlxlm.safetensors"))
        mx.eval([c.state[:2] for c in cache])
        if method == "mlx-lm+xxh3":  # two hashing threads, as a verified snapshot restore uses
            views = [memoryview(np.array(a, copy=False)).cast("B") for c in cache for a in c.state[:2]]
            with ThreadPoolExecutor(2) as pool:
                list(pool.map(check_digest, views, ["xxh3_128"] * len(views)))
    elif method == "stock-snapshot":
        cache = load_prompt_cache(str(work / "store-snapshot/snapshots/s.safetensors"))
        mx.eval([c.state[:2] for c in cache])
    else:
        cache = Store(work / f"store-{method}").load("s", model="bench", verify=verify).cache
        mx.eval([c.state[:2] for c in cache])


def child(args: argparse.Namespace) -> None:
    import mlx_lm.models.cache  # noqa: F401 - import (mlx-lm pulls in transformers) before timing

    import mlxbun.kv.store  # noqa: F401

    work = Path(args.work)
    kind, method = args.child.split(":")
    times, blocked = [], []
    cache = make_cache(args.layers, args.tokens, chunk=512) if kind == "save" else None
    for _ in range(args.reps):
        t0 = time.perf_counter()
        if kind == "save":
            blocked.append(op_save(method, work, cache, args.tokens))
        else:
            op_load(method, work, verify=kind == "load")
        times.append(time.perf_counter() - t0)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out = {"times": times, "peak_rss_mb": rss}
    if any(b is not None for b in blocked):
        out["blocked"] = blocked
    print(json.dumps(out))


def conversation(args: argparse.Namespace) -> None:
    """Child: the 10-turn growing conversation."""
    from mlx_lm.models.cache import save_prompt_cache

    from mlxbun.kv.store import Store

    work = Path(args.work) / "conv"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    full = make_cache(args.layers, args.tokens)
    store = Store(work / "store", block_kib=1024)
    from mlx_lm.models.cache import KVCache

    cache = [KVCache() for _ in range(args.layers)]
    rows, done = [], 0
    for turn in range(1, 11):
        upto = round(args.tokens * turn / 10)
        for c, f in zip(cache, full, strict=True):
            c.update_and_fetch(f.keys[..., done:upto, :], f.values[..., done:upto, :])
        done = upto
        t0 = time.perf_counter()
        info = store.save(f"turn{turn}", cache, tokens=list(range(upto)), model="bench", layout="blocks")
        ours = time.perf_counter() - t0
        t0 = time.perf_counter()
        save_prompt_cache(str(work / f"turn{turn}.safetensors"), cache)
        theirs = time.perf_counter() - t0
        rows.append(
            {
                "turn": turn,
                "tokens": upto,
                "written": info.written_bytes,
                "mlxlm_file": (work / f"turn{turn}.safetensors").stat().st_size,
                "ours_s": ours,
                "mlxlm_s": theirs,
            }
        )
    disk = sum(p.stat().st_size for p in (work / "store").rglob("*") if p.is_file())
    print(json.dumps({"rows": rows, "store_disk": disk, "unique": valid_bytes(args.layers, args.tokens)}))


# ------------------------------------------------------------------------------- parent


def run_child(args: argparse.Namespace, *extra: str, reps: int | None = None) -> dict:
    cmd = [sys.executable, __file__, "--work", str(args.work), "--tokens", str(args.tokens)]
    cmd += ["--layers", str(args.layers), "--reps", str(reps or args.reps), *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode:
        sys.stderr.write(out.stderr)
        raise SystemExit(f"child {extra} failed")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--work", type=Path, default=REPO / "outputs/bench-kv")
    ap.add_argument("--out", type=Path, default=REPO / "bench/results/kv.md")
    ap.add_argument("--child")
    ap.add_argument("--conversation", action="store_true")
    ap.add_argument(
        "--restores-only",
        action="store_true",
        help="rerun only the restores on the files of the last full run in --work; append to --out",
    )
    args = ap.parse_args()
    if args.child:
        return child(args)
    if args.conversation:
        return conversation(args)
    if args.restores_only:
        return restores_only(args)
    args.work.mkdir(parents=True, exist_ok=True)
    size = valid_bytes(args.layers, args.tokens)
    res = {}
    for op in [
        "save:raw",
        "save:mlx-lm",
        "save:mlx-lm+fsync",
        "save:snapshot",
        "save:snapshot0",
        "save:blocks",
    ]:
        res[op] = run_child(args, "--child", op)
        report_op(op, res[op], size)
    for layout in ("snapshot", "blocks"):  # Store.save_async: how long generation waits
        r = run_child(args, "--child", f"save:{layout}-bg")
        res[f"blocked:{layout}"] = {"times": r["blocked"], "peak_rss_mb": r["peak_rss_mb"]}
        res[f"bgdone:{layout}"] = r
        report_op(f"blocked:{layout}", res[f"blocked:{layout}"], size)
        report_op(f"bgdone:{layout}", r, size)
    # Restores: `reps` rounds, methods interleaved; each child restores twice, so the first restore
    # is a fresh process's (memory faulted in for the first time, as in one kv_generate run) and
    # the second reuses the heap the first one freed (a long-lived server).
    runs = restore_rounds(args, LOADS)
    for op in LOADS:
        for phase, i in (("cold", 0), ("warm", 1)):
            key = f"{op}:{phase}"
            res[key] = {
                "times": [r["times"][i] for r in runs[op]],
                "peak_rss_mb": max(r["peak_rss_mb"] for r in runs[op]),
            }
            report_op(key, res[key], size)
    conv = run_child(args, "--conversation")
    write_report(args, size, res, conv)


def restore_rounds(args: argparse.Namespace, loads: list[str]) -> dict[str, list[dict]]:
    """``reps`` rounds that interleave the restore methods; each child restores twice."""
    runs: dict[str, list[dict]] = {op: [] for op in loads}
    for _ in range(args.reps):
        for op in loads:
            runs[op].append(run_child(args, "--child", op, reps=2))
    return runs


def restores_only(args: argparse.Namespace) -> None:
    """Restores alone (the saves of a full run already in --work), as a section appended to --out."""
    size = valid_bytes(args.layers, args.tokens)
    runs = restore_rounds(args, LOADS)
    lines = [
        "",
        f"## Restores only: `bench/kv.py --restores-only --reps {args.reps}` (same files, {args.reps} interleaved rounds)",
        "",
        "| restore | method | fresh process s | vs mlx-lm | second in process s | vs mlx-lm |",
        "|---|---|---:|---:|---:|---:|",
    ]
    med = {(op, i): statistics.median(r["times"][i] for r in runs[op]) for op in LOADS for i in (0, 1)}
    for op in LOADS:
        kind, method = op.split(":")
        ratios = [med[("load:mlx-lm", i)] / med[(op, i)] for i in (0, 1)]
        lines.append(
            f"| {'verify on' if kind == 'load' else 'verify off'} | {method} | {med[(op, 0)]:.3f} | {ratios[0]:.2f}x"
            f" | {med[(op, 1)]:.3f} | {ratios[1]:.2f}x |"
        )
    lines.append(
        f"\n({size / 2**20:.0f} MiB; mlx-lm's load checks nothing, so it is listed under verify on.)"
    )
    text = "\n".join(lines) + "\n"
    with open(args.out, "a") as f:
        f.write(text)
    print(text)


LOADS = [
    "load:raw",
    "load:mlx-lm",
    "load:mlx-lm+xxh3",
    "load:snapshot",
    "load:blocks",
    "load:stock-snapshot",
    "noverify:snapshot",
    "noverify:snapshot0",
    "noverify:blocks",
]


def report_op(op: str, r: dict, size: int) -> None:
    med = statistics.median(r["times"])
    print(
        f"{op:<24} {med:7.3f} s  {size / med / 1e9:6.2f} GB/s  peak RSS {r['peak_rss_mb']:.0f} MB", flush=True
    )


def write_report(args: argparse.Namespace, size: int, res: dict, conv: dict) -> None:
    med = {k: statistics.median(v["times"]) for k, v in res.items()}
    gbs = {k: size / v / 1e9 for k, v in med.items()}
    lines = [
        "# KV persistence: mlxbun store vs mlx-lm prompt-cache files",
        "",
        f"Command: `.venv/bin/python bench/kv.py --tokens {args.tokens} --layers {args.layers} --reps {args.reps}`",
        f"Machine: 2-core x86_64 Linux (shared, noisy), Python {platform.python_version()}, mlx 0.32.4 CPU, mlx-lm 0.32.2.",
        f"Cache: {args.layers} layers x (1, {HEADS} KV heads, {args.tokens} tokens, {DIM}) fp16 K and V ="
        f" {size / 2**20:.0f} MiB of valid K/V. Median of {args.reps}; each operation in its own child process"
        " (restores: one child per round restoring twice; rounds interleave the methods).",
        "",
        "| operation | method | seconds | GB/s | vs mlx-lm | child peak RSS MB |",
        "|---|---|---:|---:|---:|---:|",
    ]
    names = {
        "raw": "raw write+fsync / read",
        "mlx-lm": "mlx-lm",
        "mlx-lm+fsync": "mlx-lm + fsync",
        "mlx-lm+xxh3": "mlx-lm + XXH3-128 of every tensor",
        "snapshot": "mlxbun snapshot",
        "snapshot0": "mlxbun snapshot, data page-aligned",
        "stock-snapshot": "mlx-lm `load_prompt_cache` of an mlxbun snapshot",
        "blocks": "mlxbun blocks",
    }
    labels = {
        "save": "save",
        "blocked": "save, caller blocked (`save_async`)",
        "bgdone": "save, `save_async` until durable",
        "load:cold": "restore, fresh process (verify on; mlx-lm: none)",
        "load:warm": "restore, second in process (verify on; mlx-lm: none)",
        "noverify:cold": "restore, fresh process (verify off)",
        "noverify:warm": "restore, second in process (verify off)",
    }
    for kind, label in labels.items():
        for m in (
            "raw",
            "mlx-lm",
            "mlx-lm+fsync",
            "mlx-lm+xxh3",
            "stock-snapshot",
            "snapshot",
            "snapshot0",
            "blocks",
        ):
            op, _, phase = kind.partition(":")
            k = f"{op}:{m}" + (f":{phase}" if phase else "")
            if k in med:
                ref = f"{'load' if op in ('load', 'noverify') else 'save'}:mlx-lm" + (
                    f":{phase}" if phase else ""
                )
                rate = "–" if op == "blocked" else f"{gbs[k]:.2f}"  # nothing is written while blocked
                lines.append(
                    f"| {label} | {names[m]} | {med[k]:.3f} | {rate} | {med[ref] / med[k]:.2f}x |"
                    f" {res[k]['peak_rss_mb']:.0f} |"
                )
    rows = conv["rows"]
    written = sum(r["written"] for r in rows)
    mlx_total = sum(r["mlxlm_file"] for r in rows)
    lines += [
        "",
        "Notes: mlx-lm's save does not fsync (its time excludes flushing to disk; ours includes fsync of",
        "every file and directory). `save_async` rows: the caller waits only while the arrays are",
        "evaluated and referenced; a worker thread writes them (mlx-lm's save blocks its caller throughout).",
        "mlx-lm's restore does not check any hash; ours re-hashes all data",
        "(2 threads; snapshot tensors XXH3-128, blocks BLAKE3) unless verify is off. Restores read from the page cache for every method;",
        "the raw restore only reads bytes into numpy (no mlx arrays): a ceiling, not a like-for-like.",
        "`mlx-lm + XXH3-128` is mlx-lm's load followed by the check a verified snapshot restore makes:",
        "mlx's one-pass loader plus the hash, the fastest verified restore into mlx arrays.",
        "Snapshots are mlx-lm prompt-cache files (format 3): `stock-snapshot` is mlx-lm's own loader",
        "reading one; `snapshot0` moves the data start from 64 bytes past a 16 KiB boundary to the",
        "boundary itself (the header is padded either way; there are no padding tensors).",
        "",
        f"## 10-turn conversation growing to {args.tokens} tokens, saved after every turn (blocks layout, 1 MiB)",
        "",
        "| turn | tokens | mlxbun bytes written | mlx-lm file bytes | mlxbun save s | mlx-lm save s |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['turn']} | {r['tokens']} | {r['written']:,} | {r['mlxlm_file']:,} | {r['ours_s']:.3f} | {r['mlxlm_s']:.3f} |"
        for r in rows
    ]
    lines += [
        "",
        f"- bytes written / unique bytes: {written:,} / {conv['unique']:,} = **{written / conv['unique']:.3f}x** (target <= 1.15x)",
        f"- disk used by the store (10 snapshots): {conv['store_disk']:,} B vs ten mlx-lm files {mlx_total:,} B"
        f" = **{conv['store_disk'] / mlx_total:.3f}x**",
        f"- save: mlxbun snapshot {med['save:mlx-lm'] / med['save:snapshot']:.2f}x, blocks"
        f" {med['save:mlx-lm'] / med['save:blocks']:.2f}x mlx-lm's speed (target >= 2x);"
        " restore with verification (target >= 1x): "
        + "; ".join(
            f"{phase} snapshot {med[f'load:mlx-lm:{phase}'] / med[f'load:snapshot:{phase}']:.2f}x, blocks"
            f" {med[f'load:mlx-lm:{phase}'] / med[f'load:blocks:{phase}']:.2f}x"
            for phase in ("cold", "warm")
        )
        + "; blocks with verify off (target >= 0.8x): "
        + ", ".join(
            f"{phase} {med[f'load:mlx-lm:{phase}'] / med[f'noverify:blocks:{phase}']:.2f}x"
            for phase in ("cold", "warm")
        ),
    ]
    text = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
