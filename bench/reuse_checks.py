"""What the reuse checks cost: each cache's content check side by side with the check it replaced.

Run: .venv/bin/python bench/reuse_checks.py [--shard-gib 4] [--hessians-gib 1] [--kv-mib 256]
     [--reps 3] [--work outputs/bench-reuse] [--out bench/results/reuse_checks.md]

1. quantize's source identity on one ``--shard-gib`` shard: the header identity alone (what a
   reuse of quant.out checked before) against the content identity (every shard's sha256,
   remembered per file identity under ``<paths.cache>/digests``) the first time, unchanged (a
   stat), and after one byte was rewritten in place (a full read again).
2. calibrate's reuse of a cached ``--hessians-gib`` Hessians file: the hard link it made before
   against the sha256 check of the cached file plus the run's own copy (a reflink where the file
   system has them, else a kernel copy).
3. A KV blocks save of a ``--kv-mib`` cache already in the store: every stored block read and
   compared (now) against the lstat-and-size check it replaced, and against the first save
   (every block written and fsync'd).
Files are in the page cache throughout (written just before): these are the in-memory costs;
from a cold disk each read runs at the disk's speed. Times are medians of ``--reps``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def timed(fn: Any, reps: int, before: Any = None) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs (``before()`` untimed ahead of each)."""
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def random_file(path: Path, nbytes: int, head: bytes = b"") -> None:
    block = os.urandom(64 << 20)
    with open(path, "wb") as f:
        f.write(head)
        left = nbytes - len(head)
        while left > 0:
            left -= f.write(block[: min(left, len(block))])


def source_identity_rows(work: Path, gib: float, reps: int) -> list[tuple[str, float]]:
    from mlxbun.quant.quantize.outdir import source_content, source_identity

    src = work / "src"
    src.mkdir(parents=True)
    (src / "config.json").write_text(json.dumps({"model_type": "llama"}))
    n = int(gib * 2**30)
    header = json.dumps({"w": {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}}).encode()
    header += b" " * (-len(header) % 8)
    shard = src / "model.safetensors"
    random_file(shard, 8 + len(header) + n, len(header).to_bytes(8, "little") + header)
    cache = work / "digests"

    def forget() -> None:
        shutil.rmtree(cache, ignore_errors=True)

    def rewrite() -> None:
        with open(shard, "r+b") as f:
            f.seek(-1, os.SEEK_END)
            last = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last[0] ^ 1]))
        time.sleep(0.02)  # the next ctime lands on another clock tick

    content = lambda: source_content(src, cache_dir=cache)  # noqa: E731
    rows = [
        ("header identity (the check before)", timed(lambda: source_identity(src), reps)),
        ("content identity, first time", timed(content, reps, before=forget)),
    ]
    content()
    rows.append(("content identity, unchanged", timed(content, reps)))
    rows.append(("content identity, one byte rewritten", timed(content, reps, before=rewrite)))
    return rows


def calibrate_rows(work: Path, gib: float, reps: int) -> tuple[list[tuple[str, float]], bool]:
    import fcntl

    from mlxbun.io.atomic import FICLONE, publish_copy
    from mlxbun.io.digest import file_digest

    cached = work / "hessians.safetensors"
    random_file(cached, int(gib * 2**30))
    want = file_digest(cached, "sha256")
    run = work / "run"
    run.mkdir()

    def clear() -> None:
        (run / cached.name).unlink(missing_ok=True)

    def now() -> None:
        assert file_digest(cached, "sha256") == want
        publish_copy(cached, run / cached.name)

    probe = work / "reflink-probe"
    with open(cached, "rb") as a, open(probe, "wb") as b:
        try:
            fcntl.ioctl(b.fileno(), FICLONE, a.fileno())
            reflink = True
        except OSError:
            reflink = False
    probe.unlink()
    rows = [
        ("hard link (before)", timed(lambda: os.link(cached, run / cached.name), reps, before=clear)),
        ("sha256 check + own copy (now)", timed(now, reps, before=clear)),
    ]
    return rows, reflink


def kv_rows(work: Path, mib: int, reps: int) -> list[tuple[str, float]]:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from mlxbun.kv.store import Store

    heads, dim, layers = 8, 128, 16
    tokens = (mib << 20) // (layers * 2 * heads * dim * 2)
    cache = []
    for _ in range(layers):
        c = KVCache()
        k = mx.random.normal((1, heads, tokens, dim)).astype(mx.float16)
        c.update_and_fetch(k, -k)
        mx.eval(c.keys, c.values)
        cache.append(c)
    root = work / "kv"
    kw = dict(tokens=[1] * tokens, model="bench", layout="blocks")

    def empty() -> None:
        shutil.rmtree(root, ignore_errors=True)

    first = timed(lambda: Store(root, block_kib=1024).save("s", cache, **kw), reps, before=empty)
    store = Store(root, block_kib=1024)
    store.save("s", cache, **kw)
    again = timed(lambda: store.save("s", cache, **kw), reps)
    names = [p for p in (root / "blocks").iterdir() if not p.name.startswith(".")]
    stat = timed(lambda: [os.lstat(p).st_size for p in names], reps)
    return [
        (f"first save, {len(names)} blocks written and fsync'd", first),
        ("save again: every stored block read and compared (now)", again),
        ("the check it replaced: lstat and size of every block", stat),
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shard-gib", type=float, default=4)
    ap.add_argument("--hessians-gib", type=float, default=1)
    ap.add_argument("--kv-mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--work", type=Path, default=REPO / "outputs/bench-reuse")
    ap.add_argument("--out", type=Path, default=REPO / "bench/results/reuse_checks.md")
    args = ap.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    try:
        src = source_identity_rows(args.work / "q", args.shard_gib, args.reps)
        cal, reflink = calibrate_rows(args.work, args.hessians_gib, args.reps)
        kv = kv_rows(args.work, args.kv_mib, args.reps)
    finally:
        shutil.rmtree(args.work, ignore_errors=True)
    lines = [
        "# Reuse checks: what each content check costs (`bench/reuse_checks.py`)",
        "",
        "`" + " ".join(["python bench/reuse_checks.py", *sys.argv[1:]]) + "`",
        "",
        f"{platform.machine()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f};"
        f" files in the page cache; medians of {args.reps}.",
        "",
        "| check | seconds | × the check before |",
        "|---|---:|---:|",
    ]
    for title, rows in ((f"quantize source, one {args.shard_gib:g} GiB shard", src),
                        (f"calibrate reuse, {args.hessians_gib:g} GiB Hessians (reflink: {'yes' if reflink else 'no'})", cal),
                        (f"KV blocks save, {args.kv_mib} MiB cache", kv)):  # fmt: skip
        base = rows[0][1] if "calibrate" in title or "quantize" in title else rows[-1][1]
        lines.append(f"| **{title}** | | |")
        lines += [f"| {name} | {t:.4f} | {t / base:,.1f} |" for name, t in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
