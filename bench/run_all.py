"""Run every benchmark in bench/ one after another (``make bench``); each prints its own ratios.

Run: .venv/bin/python bench/run_all.py [name ...]   (names without .py; default: all)
Benchmarks run with OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE unset (see FINDINGS.md); results go to
stdout and, for the record, into BENCHMARKS.md by hand.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    names = sys.argv[1:] or sorted(p.stem for p in HERE.glob("*.py") if p.stem != "run_all")
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
    failed = []
    for name in names:
        print(f"\n=== bench/{name}.py ===", flush=True)
        start = time.perf_counter()
        code = subprocess.run([sys.executable, str(HERE / f"{name}.py")], env=env).returncode
        print(f"=== {name}: exit {code} in {time.perf_counter() - start:.0f} s ===", flush=True)
        if code:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
