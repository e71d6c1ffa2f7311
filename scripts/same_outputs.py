"""Do two commits produce the same artifacts? Runs the same commands on both and compares sha256s.

    python scripts/same_outputs.py e0873e9 HEAD            # base, head (any git revisions)
    python scripts/same_outputs.py e0873e9 HEAD --only quantize_plan rotate

Each commit is checked out with ``git worktree add --detach`` into a temporary directory and
every scenario runs there (``python -m mlxbun`` with that tree first on PYTHONPATH) with its own
outputs, cache and registry, so the two sides share nothing but the Python environment::

    <tmp>/<side>/tree/                 the checkout (removed at the end)
    <tmp>/<side>/runs/<scenario>/      the scenario's run directory (hydra.run.dir)
    <tmp>/<side>/{outputs,cache,registry.db,hub}

A scenario's digest set is the sha256 of every file under its run directory except
``manifest.json`` (timestamps, the git commit), ``*.log`` and a KV store's ``models/``
(where each model lives on this machine), keyed by the path relative to the
run directory. quantize's resume marker (``.mlxbun-quantize.json``) names the source's absolute
path and a fingerprint of its files' mtimes, which differ between the two sides by construction:
it is hashed as canonical JSON without those two keys (its settings, plan and quantization
block stay in). Exit 0 when every scenario has the same files with the same digests, else 1.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SKIP = {"manifest.json"}
# File name -> key paths that depend on where and when the source was written.
VOLATILE = {".mlxbun-quantize.json": (("fingerprint",), ("settings", "source"))}

# A hand-written plan for the tiny synthetic llama (hidden 64, intermediate 128, 2 blocks).
PLAN = {
    "version": 1,
    "default": {"bits": 4, "group_size": 64, "mode": "affine"},
    "layers": {
        "model.layers.0.self_attn.v_proj": {"bits": 8, "group_size": 32, "mode": "affine"},
        "model.layers.1.mlp.down_proj": {"bits": 4, "group_size": 32, "mode": "mxfp4"},
        "model.layers.1.mlp.up_proj": False,
    },
}
SYNTH = ["model.synthetic=true", "synth.preset=tiny", "synth.outlier_channels=4"]
SENS = ["command=sensitivity", *SYNTH, "sensitivity.bits=[2,4,8]", "sensitivity.calib.samples=4",
        "sensitivity.calib.seq_len=64"]  # fmt: skip
SCENARIOS: dict[str, list[str]] = {
    "quickstart": ["+recipe=quickstart"],
    "synth": ["command=synth", "synth.preset=tiny", "synth.outlier_channels=4"],
    "quantize_uniform": ["command=quantize", *SYNTH, "quant.bits=4", "quant.group_size=64"],
    "quantize_mxfp4": ["command=quantize", *SYNTH, "quant.mode=mxfp4"],
    "quantize_mixed": ["command=quantize", *SYNTH, "quant.mixed=mixed_3_6"],
    "quantize_plan": ["command=quantize", *SYNTH, "quant.plan={plan}"],
    "rotate": ["command=rotate", *SYNTH],
    "sensitivity_exact": [*SENS, "sensitivity.method=exact"],
    "sensitivity_reference": [*SENS, "sensitivity.method=reference"],
}


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True, text=True).stdout.strip()


def content(p: Path) -> bytes:
    """The bytes compared for ``p``: the file, or canonical JSON without its volatile keys."""
    if p.name not in VOLATILE:
        return p.read_bytes()
    doc = json.loads(p.read_text())
    for *parents, last in VOLATILE[p.name]:
        node = doc
        for k in parents:
            node = node.get(k, {})
        node.pop(last, None)
    return json.dumps(doc, sort_keys=True).encode()


def digests(run_dir: Path) -> dict[str, str]:
    """Relative path -> sha256 of every artifact under ``run_dir``."""
    out = {}
    for p in sorted(run_dir.rglob("*")):
        # kv/models/<fingerprint> holds the model's path on this machine, which differs by side
        if p.is_file() and p.name not in SKIP and p.suffix != ".log" and p.parent.name != "models":
            out[str(p.relative_to(run_dir))] = hashlib.sha256(content(p)).hexdigest()
    return out


def run_side(rev: str, side: Path, names: list[str]) -> dict[str, dict[str, str]]:
    """Check out ``rev`` under ``side`` and run each scenario; scenario -> digests."""
    tree = side / "tree"
    git("worktree", "add", "--detach", str(tree), rev)
    try:
        (side / "plan.json").write_text(json.dumps(PLAN))
        env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1"}
        results = {}
        for name in names:
            run_dir = side / "runs" / name
            args = [a.format(plan=side / "plan.json") for a in SCENARIOS[name]]
            isolate = [
                f"hydra.run.dir={run_dir}",
                f"paths.outputs={side / 'outputs'}",
                f"paths.cache={side / 'cache'}",
                f"registry.path={side / 'registry.db'}",
                f"registry.hub_cache={side / 'hub'}",
            ]
            res = subprocess.run(
                [sys.executable, "-m", "mlxbun", *args, *isolate],
                cwd=tree,
                env=env,
                capture_output=True,
                text=True,
            )
            if res.returncode != 0:
                raise SystemExit(f"{rev} {name}: exit {res.returncode}\n{res.stderr[-2000:]}")
            results[name] = digests(run_dir)
            print(f"  {rev[:10]} {name}: {len(results[name])} files", flush=True)
        return results
    finally:
        git("worktree", "remove", "--force", str(tree))


def compare(a: dict[str, str], b: dict[str, str]) -> list[str]:
    """Lines naming each file that is missing on one side or differs."""
    lines = []
    for path in sorted(set(a) | set(b)):
        if path not in a or path not in b:
            lines.append(f"    {path}: only in {'head' if path not in a else 'base'}")
        elif a[path] != b[path]:
            lines.append(f"    {path}: {a[path][:12]} != {b[path][:12]}")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base")
    ap.add_argument("head")
    ap.add_argument("--only", nargs="*", choices=sorted(SCENARIOS), default=None)
    ap.add_argument("--keep", action="store_true", help="keep the temporary run directories")
    args = ap.parse_args()
    names = args.only or list(SCENARIOS)
    revs = {"base": git("rev-parse", args.base), "head": git("rev-parse", args.head)}
    tmp = Path(tempfile.mkdtemp(prefix="same_outputs-"))
    try:
        got = {side: run_side(rev, tmp / side, names) for side, rev in revs.items()}
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"base {revs['base'][:10]}  head {revs['head'][:10]}")
    same = True
    for name in names:
        diff = compare(got["base"][name], got["head"][name])
        n = len(got["base"][name])
        print(f"{name:18s} {'same' if not diff else 'DIFFERENT'} ({n} files)")
        for line in diff:
            print(line)
        same = same and not diff
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
