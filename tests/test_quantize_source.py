"""The file-backed tensor reader quantize streams from: pread into mx buffers, same bytes as the
validating mmap reader, and a file that shrinks under it is named, not read past."""

from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxbun.errors import InputError
from mlxbun.io.safetensors import open_model
from mlxbun.io.shards import write_sharded
from mlxbun.source.model import FileTensors, identity, lazy_weights, source_dir


def _bits(a: mx.array) -> np.ndarray:
    return np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)


@pytest.fixture
def model_dir(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        "a.bf16": mx.array(rng.standard_normal((37, 24)).astype(np.float32)).astype(mx.bfloat16),
        "b.f32": mx.array(rng.standard_normal((5, 3, 4)).astype(np.float32)),
        "c.i32": mx.array(np.arange(11, dtype=np.int32)),
        "d.f16": mx.array(rng.standard_normal((8,)).astype(np.float16)),
    }
    write_sharded(tmp_path / "m", tensors, shard_bytes=1500)
    return tmp_path / "m"


def test_arrays_and_rows_match_the_mmap_reader(model_dir):
    with FileTensors(model_dir) as f, open_model(model_dir) as ref:
        for name in ref.names():
            want = ref.array(name)
            got = f.array(name)
            assert got.dtype == want.dtype and got.shape == want.shape
            assert np.array_equal(_bits(got), _bits(want)), name
        rows = f.rows("a.bf16", 5, 29)
        assert np.array_equal(_bits(rows), _bits(ref.array("a.bf16"))[5:29])
        assert f.row_step("a.bf16") == 1


def test_a_file_truncated_after_opening_is_named(model_dir):
    with FileTensors(model_dir) as f:
        info = f.model.info("a.bf16")
        os.truncate(info.file, info.start + 10)
        with pytest.raises(InputError, match="truncated") as e:
            f.rows("a.bf16", 0, 37)
        assert str(info.file) in str(e.value)


def test_directory_sources_describe_their_files(model_dir):
    assert lazy_weights(model_dir) is None and source_dir(str(model_dir)) == model_dir.resolve()
    before = identity(model_dir)
    assert "model-00001-of-" in before
    shard = sorted(model_dir.glob("model-*.safetensors"))[0]
    os.utime(shard, ns=(1, 1))
    assert identity(model_dir) != before


def test_registry_names_of_pipeline_outputs_are_readable(tmp_path: Path) -> None:
    import json

    from mlxbun import registry
    from mlxbun.config import schema
    from mlxbun.quant.quantize.command import registry_name

    registry.open_db(path=tmp_path / "registry.db")
    model = tmp_path / "run" / "synth" / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    plan = tmp_path / "run" / "allocate" / "plan.json"
    plan.parent.mkdir(parents=True)
    plan.write_text(json.dumps({"default": {"bits": 4}, "predicted_bpw": 4.4987}))
    cfg = schema.Config()
    cfg.model.name, cfg.quant.plan = str(model), str(plan)
    assert registry_name(cfg, {}) == "llama-mixed-4.50bpw"  # was model-plan-plan
    snapshot = tmp_path / "hub" / "models--acme--tiny-llm" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    cfg.model.name, cfg.quant.plan = str(snapshot), None
    assert registry_name(cfg, {"bits": 4, "group_size": 64}) == "tiny-llm-4bit-g64"
