"""A sensitivity.json is checked when read (allocate, sensitivity_merge): NaN, Inf or negative KLs
and settings MLX does not have are refused naming the file, the module and the value."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlxbun.errors import InputError
from mlxbun.quant.sensitivity.file import KIND, SCHEMA_VERSION, load_sensitivity, read_shard

PATH = "model.layers.0.mlp.down_proj"


def _doc(kl: dict, **top) -> dict:
    doc = {"version": SCHEMA_VERSION, "kind": KIND, "bits": [4, 8], "group_size": 64, "mode": "affine"}
    return doc | top | {"layers": [{"path": PATH, "params": 8, "kl": kl}]}


def _write(tmp_path: Path, doc: dict) -> Path:
    path = tmp_path / "sensitivity.json"
    path.write_text(json.dumps(doc))  # NaN and Infinity as Python's json writes them
    return path


BAD = [
    (_doc({"4": float("nan"), "8": 0.01}), f"module '{PATH}' has kl['4']=nan"),
    (_doc({"4": float("inf"), "8": 0.01}), f"module '{PATH}' has kl['4']=inf"),
    (_doc({"4": -0.5, "8": 0.01}), f"module '{PATH}' has kl['4']=-0.5"),
    (_doc({"4": "0.1", "8": 0.01}), f"module '{PATH}' has kl['4']='0.1'"),
    (_doc({"4": 0.1}, mode="evil"), "sensitivity.mode='evil' is not allowed"),
    (_doc({"4": 0.1}, group_size=48), "sensitivity.group_size=48 is not allowed"),
    (_doc({"7": 0.1}, bits=[7]), "sensitivity.bits=7 is not allowed"),
    (_doc({"x": 0.1}), "kl key 'x' is not a bit width"),
]


@pytest.mark.parametrize(("doc", "needle"), BAD)
def test_allocate_refuses_a_sensitivity_json_it_cannot_trust(tmp_path: Path, doc: dict, needle: str) -> None:
    path = _write(tmp_path, doc)
    with pytest.raises(InputError, match=f"allocate.sensitivity='{path}': .*" + needle.replace("[", r"\[")):
        load_sensitivity(path)


@pytest.mark.parametrize(("doc", "needle"), BAD)
def test_sensitivity_merge_refuses_the_same(tmp_path: Path, doc: dict, needle: str) -> None:
    path = _write(tmp_path, doc)
    with pytest.raises(InputError, match=f"sensitivity.inputs: '{path}': .*" + needle.replace("[", r"\[")):
        read_shard(path)


def test_a_kl_a_hair_below_zero_is_a_rounding_error_and_kept(tmp_path: Path) -> None:
    sens = load_sensitivity(_write(tmp_path, _doc({"4": 0.1, "8": -1e-12})))
    assert min(sens.layers[PATH].kl.values()) == -1e-12
