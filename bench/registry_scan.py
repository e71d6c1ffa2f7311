"""Registry scan vs huggingface_hub.scan_cache_dir on one synthetic hub of 1,000 repos, side by side.

Run: .venv/bin/python bench/registry_scan.py [--repos 1000] [--rounds 5] [--layouts mlx,minimal]
     [--out bench/results/registry.md]

Builds ``models--org--m<i>`` repos like huggingface_hub does (blobs, refs/main, snapshots of
relative symlinks; every 10th repo has a second revision, every 7th goes through the cache-wide
shared blob store) in two layouts: the 9 files of an mlx-community repo, and a minimal 5-file
one. Then times, each in its own child process (peak RSS from wait4):
  first scan  - mlxbun.registry.scan into an empty sqlite db (reads config.json, the index, the
                safetensors headers, README front matter, tokenizer config) vs scan_cache_dir;
  rescan      - mlxbun.registry.scan over the same db (incremental) vs scan_cache_dir again
                (it has no incremental mode).
Times are medians of ``--rounds`` rounds; speedups the median of per-round ratios, in wall
and in CPU time (the machine is shared: wall time is noisy).
Targets: first scan >= 3x faster, rescan >= 10x faster.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _safetensors(i: int) -> bytes:
    from safetensors.numpy import save

    t = {f"model.layers.{k}.mlp.up_proj.weight": np.zeros((4, 4), np.float16) for k in range(8)}
    t["model.embed_tokens.weight"] = np.zeros((8 + i % 5, 4), np.float16)
    return save(t, metadata={"format": "mlx"})


def _minimal_files(i: int, rev: int) -> dict[str, bytes]:
    """Five files: config, one shard without an index, README, tokenizer and generation configs."""
    full = _files(i, rev)
    keep = (
        "config.json",
        "model.safetensors",
        "README.md",
        "tokenizer_config.json",
        "generation_config.json",
    )
    return {k: full[k] for k in keep}


def _files(i: int, rev: int) -> dict[str, bytes]:
    """The files of an mlx-community style repo (mlx-lm writes the index even for one shard)."""
    cfg = {"model_type": "llama", "num_hidden_layers": 8, "hidden_size": 4, "num_attention_heads": 1,
           "vocab_size": 8 + i % 5, "revision": rev}  # fmt: skip
    tok = {"chat_template": "{% if tools %}{{ tools }}{% endif %}" if i % 3 == 0 else "{{ messages }}",
           "bos_token": "<s>", "eos_token": "</s>", "model_max_length": 4096}  # fmt: skip
    weights = _safetensors(i)
    names = [f"model.layers.{k}.mlp.up_proj.weight" for k in range(8)] + ["model.embed_tokens.weight"]
    index = {"metadata": {"total_size": len(weights), "total_parameters": 8 * 16 + (8 + i % 5) * 4},
             "weight_map": {n: "model.safetensors" for n in sorted(names)}}  # fmt: skip
    vocab = {f"w{k}": k for k in range(8 + i % 5)}
    return {
        ".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n",
        "README.md": f"---\nlicense: {'mit' if i % 2 else 'apache-2.0'}\ntags:\n- mlx\n---\n# m{i}\n".encode(),
        "config.json": json.dumps(cfg).encode(),
        "generation_config.json": b'{"do_sample": false}',
        "model.safetensors": weights,
        "model.safetensors.index.json": json.dumps(index).encode(),
        "special_tokens_map.json": b'{"bos_token": "<s>", "eos_token": "</s>"}',
        "tokenizer.json": json.dumps({"model": {"type": "WordLevel", "vocab": vocab}}).encode(),
        "tokenizer_config.json": json.dumps(tok).encode(),
    }


def _add(hub: Path, repo: Path, rev: str, files: dict[str, bytes], shared: bool) -> None:
    snap = repo / "snapshots" / rev
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for name, data in files.items():
        etag = hashlib.sha256(data).hexdigest()
        blob = repo / "blobs" / etag
        if not os.path.lexists(blob):
            if shared:
                store = hub / "blobs" / etag[:2] / etag
                store.parent.mkdir(parents=True, exist_ok=True)
                store.write_bytes(data)
                os.symlink(f"../../blobs/{etag[:2]}/{etag}", blob)
            else:
                blob.write_bytes(data)
        os.symlink(f"../../blobs/{etag}", snap / name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(rev)


LAYOUTS = {"mlx": _files, "minimal": _minimal_files}


def build_hub(hub: Path, n: int, layout: str = "mlx") -> int:
    """Write ``n`` repos; return the number of snapshots."""
    (hub / "blobs").mkdir(parents=True)
    (hub / "blobs" / ".huggingface-shared-blobs").write_text("1\n")
    snaps = 0
    for i in range(n):
        repo = hub / f"models--org--m{i:04d}"
        for rev in range(2 if i % 10 == 0 else 1):
            _add(hub, repo, f"{rev:040x}", LAYOUTS[layout](i, rev), shared=i % 7 == 0)
            snaps += 1
    old = time.time() - 3600  # a cache downloaded an hour ago (fresh mtimes are re-read as "racy")
    for d, _, _ in os.walk(hub):
        os.utime(d, (old, old))
    return snaps


def child(kind: str, hub: str, db: str) -> None:
    """One measurement in this process; prints {"seconds", "models"} as JSON."""
    if kind == "hf":
        from huggingface_hub import scan_cache_dir

        t, c = time.perf_counter(), time.process_time()
        info = scan_cache_dir(hub)
        n = sum(len(r.revisions) for r in info.repos)
    else:
        from mlxbun import registry

        registry.open_db(path=db)
        t, c = time.perf_counter(), time.process_time()
        n = registry.scan(hub_cache=hub, registered=False).models
    print(json.dumps({"seconds": time.perf_counter() - t, "cpu": time.process_time() - c, "models": n}))


def warm(hub: Path) -> None:
    """Stat and read every entry once, so neither side pays for a cold dentry or page cache."""
    for d, _, files in os.walk(hub):
        for f in files:
            with open(os.path.join(d, f), "rb") as fh:
                fh.read()


def measure(kind: str, hub: Path, db: Path) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, "--hub", str(hub), "--db", str(db)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    out = p.stdout.read()
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode:
        raise SystemExit(f"child {kind} failed ({p.returncode})")
    res = json.loads(out)
    res["rss_mb"] = usage.ru_maxrss / 1024  # Linux: KiB
    return res


def run(repos: int, rounds: int, layout: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="mlxbun-bench-hub-") as tmp:
        hub = Path(tmp) / "hub"
        t = time.perf_counter()
        snaps = build_hub(hub, repos, layout)
        print(f"built {repos} repos / {snaps} snapshots in {time.perf_counter() - t:.1f}s: {hub}", flush=True)
        rows: dict[str, list[dict]] = {"hf_first": [], "ours_first": [], "hf_rescan": [], "ours_rescan": []}
        for r in range(rounds):
            db = Path(tmp) / f"registry-{r}.db"
            warm(hub)
            rows["hf_first"].append(measure("hf", hub, db))
            rows["ours_first"].append(measure("ours", hub, db))
            rows["hf_rescan"].append(measure("hf", hub, db))
            rows["ours_rescan"].append(measure("ours", hub, db))
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]['seconds']:.3f}s/{v[-1]['cpu']:.3f}s cpu"
                                                 for k, v in rows.items()), flush=True)  # fmt: skip
        assert {x["models"] for v in rows.values() for x in v} == {snaps}, (
            "both sides must see every snapshot"
        )

    def med(kind: str, metric: str) -> float:
        return statistics.median(x[metric] for x in rows[kind])

    def ratio(phase: str, metric: str) -> float:  # per round (same load on both sides), then median
        pairs = zip(rows[f"hf_{phase}"], rows[f"ours_{phase}"], strict=True)
        return statistics.median(h[metric] / o[metric] for h, o in pairs)

    return {
        "repos": repos, "snapshots": snaps, "rounds": rounds, "layout": layout,
        "wall": {k: med(k, "seconds") for k in rows}, "cpu": {k: med(k, "cpu") for k in rows},
        "ratio": {f"{p}_{m}": ratio(p, m) for p in ("first", "rescan") for m in ("seconds", "cpu")},
        "peak_rss_mb": {k: max(x["rss_mb"] for x in v) for k, v in rows.items()},
    }  # fmt: skip


LAYOUT_TEXT = {
    "mlx": "the 9 files of an mlx-community repo (.gitattributes, README, config, generation config, one "
    "shard + index, tokenizer, tokenizer config, special tokens)",
    "minimal": "5 files (config, one shard without index, README, tokenizer and generation configs)",
}


def _rows(res: dict) -> list[str]:
    w, c, q, rss = res["wall"], res["cpu"], res["ratio"], res["peak_rss_mb"]

    def met(x: float, target: float) -> str:
        return f">= {target:g}x: {'met' if x >= target else 'NOT met'}"

    name = res["layout"]
    return [
        f"| {name}: first scan | {w['hf_first']:.3f} s / {c['hf_first']:.3f} s | {w['ours_first']:.3f} s / "
        f"{c['ours_first']:.3f} s | {q['first_seconds']:.1f}x | {q['first_cpu']:.1f}x | {met(q['first_seconds'], 3)} |",
        f"| {name}: rescan | {w['hf_rescan']:.3f} s / {c['hf_rescan']:.3f} s | {w['ours_rescan']:.3f} s / "
        f"{c['ours_rescan']:.3f} s | {q['rescan_seconds']:.1f}x | {q['rescan_cpu']:.1f}x | {met(q['rescan_seconds'], 10)} |",
        f"| {name}: peak RSS (child) | {max(rss['hf_first'], rss['hf_rescan']):.0f} MB | "
        f"{max(rss['ours_first'], rss['ours_rescan']):.0f} MB | | | |",
    ]  # fmt: skip


def report(results: list[dict]) -> str:
    r0 = results[0]
    trees = [f"- {r['layout']}: {r['snapshots']} snapshots of {LAYOUT_TEXT[r['layout']]}" for r in results]
    return "\n".join([
        "# Registry scan vs huggingface_hub.scan_cache_dir",
        "",
        "Command: `.venv/bin/python bench/registry_scan.py` (one run, both sides on the same trees)",
        f"Machine: 2-core x86_64 Linux, shared with other jobs (load average ~10 during the run), "
        f"Python {platform.python_version()}, mlx 0.32.4 CPU.",
        f"Trees: {r0['repos']} synthetic repos each, symlinked blobs, every 10th repo two revisions, every 7th "
        "through the cache-wide shared blob store:",
        *trees,
        f"{r0['rounds']} rounds per tree; each measurement in a fresh child process, timing the scan call only,",
        "caches warmed before each round. Times are medians; speedups are the median of per-round",
        "ratios (both sides of a round ran under the same load). CPU = user+sys time of the call,",
        "which the machine's contention inflates far less than wall time (wall was 3-5x CPU here).",
        "",
        "| tree: phase | scan_cache_dir wall / CPU | registry.scan wall / CPU | speedup wall | speedup CPU | target |",
        "|---|---|---|---|---|---|",
        *[line for r in results for line in _rows(r)],
        "",
        "The registry's first scan does more than scan_cache_dir: it reads config.json, the index,",
        "every safetensors header, README front matter and the tokenizer config, and writes one row",
        "per snapshot to sqlite; its cost grows with the files it reads, scan_cache_dir's with every",
        "file in the snapshot (hence the larger ratio on the realistic tree). Its rescan stats each",
        "repo and snapshot directory and re-reads nothing unchanged; scan_cache_dir has no",
        "incremental mode, so its rescan is a full scan again.",
        "",
    ])  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repos", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layouts", default="mlx,minimal", help="comma-separated: mlx, minimal")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "registry.md"))
    ap.add_argument("--child")
    ap.add_argument("--hub")
    ap.add_argument("--db")
    a = ap.parse_args()
    if a.child:
        return child(a.child, a.hub, a.db)
    text = report([run(a.repos, a.rounds, layout) for layout in a.layouts.split(",")])
    print(text)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
