"""Quantizing a synthetic source in memory: the same bytes as quantizing its files, no weight files
written, and a run interrupted by SIGINT or SIGTERM that resumes to the same bytes."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxbun.quant.quantize import command as quantize
from mlxbun.quant.quantize import convert
from mlxbun.quant.quantize.command import quantize_model_dir
from mlxbun.synth import write as synth_write

REPO = Path(__file__).resolve().parent.parent
# Embeddings of 40000 x 512 rows span 5 RNG streams; row blocks of 1/8 stream cross none of them.
FIELDS = dict(arch="gemma3_text", preset="small", vocab_size=40000, outlier_channels=4, norm_jitter=0.05)


def _bits(a: mx.array) -> np.ndarray:
    return np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)


def test_rows_equal_slices_of_the_whole_tensor():
    spec = synth_write.resolve_spec(**{**FIELDS, "outlier_target": "activations"})
    src = synth_write.SyntheticSource(spec=spec, path=Path("unused"))
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.o_proj.weight", "model.norm.weight"):
        whole = _bits(src.array(name))
        rows = whole.shape[0] if whole.ndim > 1 else 1
        step = src.row_step(name)
        spans = [
            (0, rows),
            (1, min(rows, step + 3)),
            (max(0, rows - step - 1), rows),
            (step // 2, min(rows, 3 * step + 1)),
        ]
        for r0, r1 in spans:
            if r0 < r1:
                got = _bits(src.rows(name, r0, r1))
                assert np.array_equal(got.reshape(r1 - r0, -1), whole.reshape(rows, -1)[r0:r1]), (
                    name,
                    r0,
                    r1,
                )
    with pytest.raises(ValueError, match="outside"):
        src.rows("model.embed_tokens.weight", 5, 5)
    with pytest.raises(ValueError, match="outside"):
        src.rows("model.embed_tokens.weight", 0, 40001)


@pytest.mark.parametrize("bits", [4, 8])
def test_in_memory_source_gives_the_bytes_of_its_materialised_files(tmp_path, monkeypatch, bits):
    # Small thresholds: the embedding goes through the row-block path, several shards are written.
    monkeypatch.setattr(convert, "BIG_TENSOR", 16 << 20)
    monkeypatch.setattr(convert, "CHUNK_BYTES", 1 << 20)
    source = synth_write.ensure_synthetic_source(cache_dir=tmp_path / "cache", **FIELDS)
    files = synth_write.synthesize(tmp_path / "files", **FIELDS)
    kw = dict(bits=bits, group_size=64, shard_bytes=8 << 20, threads=2)
    mem = quantize_model_dir(source, tmp_path / "mem", **kw)
    disk = quantize_model_dir(files, tmp_path / "disk", **kw)
    assert mem.files == disk.files and len(mem.files) > 1
    names = [
        *mem.files,
        "config.json",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    for name in names:
        assert (mem.out / name).read_bytes() == (disk.out / name).read_bytes(), name
    # The synthetic source holds no weights on disk, before or after.
    assert not list((tmp_path / "cache").rglob("*.safetensors"))
    # Shard digests come from the writer and match the bytes on disk.
    for name, digest in mem.digests.items():
        assert hashlib.sha256((mem.out / name).read_bytes()).hexdigest() == digest


def test_another_seed_is_another_conversion(tmp_path):
    a = synth_write.ensure_synthetic_source(cache_dir=tmp_path / "cache", arch="llama", preset="tiny")
    b = synth_write.ensure_synthetic_source(cache_dir=tmp_path / "cache", arch="llama", preset="tiny", seed=1)
    ra = quantize_model_dir(a, tmp_path / "a", bits=4, threads=1)
    with pytest.raises(Exception, match="not this conversion"):
        quantize_model_dir(b, tmp_path / "a", bits=4, threads=1)
    assert quantize_model_dir(a, tmp_path / "a", bits=4, threads=1).reused
    rb = quantize_model_dir(b, tmp_path / "b", bits=4, threads=1)
    assert (ra.out / "model.safetensors").read_bytes() != (rb.out / "model.safetensors").read_bytes()


def test_default_threads_follow_the_cpu_affinity():
    assert quantize.default_threads() == len(os.sched_getaffinity(0))


# The CLI child sends itself ``sig`` right after its second shard reaches the disk. SIGINT gets
# Python's handler back, as in a terminal (a test runner started in the background ignores it).
SIGNAL_AFTER_SECOND_SHARD = """
import os, signal
signal.signal(signal.SIGINT, signal.default_int_handler)
from mlxbun.io import shards
real = shards.ShardedWriter._end_shard
def end_then_signal(self, shard):
    real(self, shard)
    if len(self._shards) == 2:
        os.kill(os.getpid(), signal.{sig})
shards.ShardedWriter._end_shard = end_then_signal
"""


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_interrupted_synthetic_cli_run_resumes_to_the_same_bytes(tmp_path, sig):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SIGNAL_AFTER_SECOND_SHARD.format(sig=sig))
    shard_gb = 0.004
    args = [
        sys.executable, "-m", "mlxbun", "command=quantize", "model.synthetic=true", "synth.arch=qwen3",
        "synth.preset=small", "quant.bits=4", f"io.shard_gb={shard_gb}", f"paths.outputs={tmp_path / 'outputs'}",
        f"paths.cache={tmp_path / 'cache'}", f"registry.path={tmp_path / 'registry.db'}", "blas=off",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": f"{hook}{os.pathsep}{REPO}"}
    stopped = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, env=env)
    assert stopped.returncode != 0 and (sig != "SIGINT" or stopped.returncode == 130), stopped.stderr[-2000:]
    (partial,) = (tmp_path / "outputs" / ".partial").glob(".model.partial-*[0-9a-f]")
    assert len(list(partial.glob(".mlxbun-shard-*.safetensors"))) == 2
    env["PYTHONPATH"] = str(REPO)
    again = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, env=env)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resuming" in again.stderr
    resumed = max((tmp_path / "outputs" / "quantize").iterdir()) / "model"
    source = synth_write.ensure_synthetic_source(
        cache_dir=tmp_path / "cache" / "synth", arch="qwen3", preset="small"
    )
    clean = quantize_model_dir(source, tmp_path / "clean", bits=4, shard_bytes=int(shard_gb * (1 << 30)))
    assert len(clean.files) > 2
    for name in [*clean.files, "config.json", "model.safetensors.index.json"]:
        assert (resumed / name).read_bytes() == (clean.out / name).read_bytes(), name
