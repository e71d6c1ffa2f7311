"""Synthetic sizes are checked against disk and memory before anything is allocated: from the
shapes, without listing a billion layers' tensors, for `synth` and for `model.synthetic=true`."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_util import run_cli

from mlxbun.errors import InputError
from mlxbun.synth import write as synth_write
from mlxbun.synth.values import plan


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"num_layers": 1},
        {"arch": "gemma3_text", "num_layers": 7},
        {"arch": "qwen3", "tie_embeddings": False},
    ],
)
def test_sizes_are_the_plans_totals(fields: dict) -> None:
    spec = synth_write.resolve_spec(**fields)
    tensors = plan(spec)
    total, largest = synth_write.sizes(spec)
    assert (total, largest.nbytes) == (sum(t.nbytes for t in tensors), max(t.nbytes for t in tensors))


def test_a_billion_layers_are_refused_without_listing_them(tmp_path: Path, monkeypatch) -> None:
    listed = []

    def spy(spec):
        listed.append(spec.shape.num_layers)
        assert spec.shape.num_layers <= 2, "the whole model's tensors were listed"
        return plan(spec)

    monkeypatch.setattr(synth_write, "plan", spy)
    spec = synth_write.resolve_spec(num_layers=10**9)
    with pytest.raises(InputError, match=r"synth llama 1000000000x\d+ .* of disk"):
        synth_write.check_room(spec, out=tmp_path / "model", partial_root=None)
    assert listed


def test_a_synthetic_source_larger_than_memory_is_refused(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(synth_write, "available_memory", lambda: 1 << 20)
    with pytest.raises(InputError, match="of memory .* packed at 2 bits.*lower the synth"):
        synth_write.ensure_synthetic_source(cache_dir=tmp_path, hidden_size=4096)
    assert not any(tmp_path.iterdir())
    synth_write.ensure_synthetic_source(cache_dir=tmp_path, hidden_size=512)  # 512 x 512 x 2 bits fits


def test_cli_synthetic_quantize_of_a_huge_width_is_refused_at_once(tmp_path: Path) -> None:
    res = run_cli(
        "command=quantize", "model.synthetic=true", "synth.hidden_size=10000000", tmp=tmp_path, timeout=60
    )
    assert res.returncode == 2, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "of memory" in res.stderr
