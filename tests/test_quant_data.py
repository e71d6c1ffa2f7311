"""Data and I/O defects of quantize: broken config.json, hostile Hessians, read-only outputs,
missing tokenizers, stale fisher spills, and two jobs sharing one ``quant.out``."""

from __future__ import annotations

import shutil
from pathlib import Path

from cli_util import run_cli


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_broken_config_json_is_one_line_as_inspect_says_it(tmp_path, tiny_model):
    src = _copy(tiny_model(), tmp_path / "src")
    (src / "config.json").write_text('{"model_type": "llama",')
    seen = run_cli("command=inspect", f"model.name={src}", tmp=tmp_path)
    q = run_cli("command=quantize", f"model.name={src}", "blas=off", tmp=tmp_path)
    assert seen.returncode == 2 and q.returncode == 2, q.stderr[-2000:]
    line = f"{src / 'config.json'}: not valid JSON"
    assert line in seen.stderr and line in q.stderr
    assert "JSONDecodeError" not in q.stderr and "Traceback" not in q.stderr
    assert not (tmp_path / "outputs" / "quantize").exists()
