"""Plans that mix quantizers and modes per module: plan.json's ``method``, and the written model."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from test_quantize import hessians_of, make_hf_model

from mlxbun.errors import InputError
from mlxbun.quant import rounding
from mlxbun.quant.plan import Plan
from mlxbun.quant.quantize.command import quantize_model_dir
from mlxbun.quant.spec import QuantSpec

L0 = "model.layers.0"
GOLDEN = (
    b'{"version": 1, "default": {"group_size": 64, "bits": 4, "mode": "affine"}, "layers": '
    b'{"model.layers.0.mlp.up_proj": {"group_size": 32, "bits": 3, "mode": "affine", "method": "gptq"}}}'
)


def test_method_round_trips_in_plan_json_and_stays_out_of_mlx_settings():
    plan = Plan(
        default=QuantSpec(), layers={f"{L0}.mlp.up_proj": QuantSpec(bits=3, group_size=32, method="gptq")}
    )
    assert json.dumps(plan.to_dict()).encode() == GOLDEN
    again = Plan.from_dict(json.loads(GOLDEN))
    assert again == plan and again.layers[f"{L0}.mlp.up_proj"].method == "gptq"
    assert again.layers[f"{L0}.mlp.up_proj"].mlx_dict() == {"group_size": 32, "bits": 3, "mode": "affine"}
    assert QuantSpec(bits=3, method="clip") != QuantSpec(bits=3)  # distinct knapsack candidates
    assert str(QuantSpec(bits=3, method="clip")) == "affine:3:64 (clip)"


@pytest.mark.parametrize(
    "entry, match",
    [
        (
            {"bits": 4, "method": "awq2"},
            r"layers\['x'\]\.method='awq2' is not allowed; choose one of rtn, clip, gptq",
        ),
        ({"mode": "mxfp4", "method": "gptq"}, r"method='gptq' needs mode affine, got mode='mxfp4'"),
    ],
)
def test_bad_method_in_a_plan_is_refused(entry, match):
    with pytest.raises(InputError, match=match):
        Plan.from_dict({"default": {"bits": 4}, "layers": {"x": entry}})


def _plan(tmp_path, layers: dict) -> str:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"version": 1, "default": {"bits": 4, "group_size": 64}, "layers": layers}))
    return str(path)


def _module(model_dir, path: str) -> dict[str, mx.array]:
    out = {}
    for f in sorted(model_dir.glob("model*.safetensors")):
        out |= {k[len(path) + 1 :]: v for k, v in mx.load(str(f)).items() if k.startswith(path + ".")}
    return out


def test_a_plan_mixing_methods_and_modes_writes_each_module_as_its_quantizer_alone(tmp_path):
    from mlx_lm import generate, load

    src = make_hf_model(tmp_path / "src", "llama", intermediate_size=256)
    h, _ = hessians_of(src, tmp_path / "h.safetensors")
    layers = {
        f"{L0}.mlp.up_proj": {"bits": 3, "group_size": 32, "method": "gptq"},
        f"{L0}.mlp.gate_proj": {"bits": 3, "group_size": 64, "method": "clip"},
        f"{L0}.mlp.down_proj": {"mode": "mxfp4"},
        f"{L0}.self_attn.q_proj": {"mode": "nvfp4"},
        f"{L0}.self_attn.k_proj": {"mode": "mxfp8"},
        f"{L0}.self_attn.v_proj": {"bits": 6, "group_size": 128},
    }
    plan = _plan(tmp_path, layers)
    with pytest.raises(
        InputError, match=r"'model.layers.0.mlp.up_proj' method 'gptq', which needs quant.hessians"
    ):
        quantize_model_dir(src, tmp_path / "x", plan=plan)
    out = quantize_model_dir(src, tmp_path / "out", plan=plan, hessians=tmp_path / "h.safetensors").out
    again = quantize_model_dir(src, tmp_path / "again", plan=plan, hessians=tmp_path / "h.safetensors").out
    assert [p.read_bytes() for p in sorted(out.glob("*.safetensors"))] == [
        p.read_bytes() for p in sorted(again.glob("*.safetensors"))
    ]
    config = json.loads((out / "config.json").read_text())
    assert "method" not in json.dumps(config)
    assert config["quantization"][f"{L0}.mlp.down_proj"] == {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    srcw = {k: v for k, v in mx.load(str(next(src.glob("*.safetensors")))).items()}
    for path, entry in layers.items():
        w, got = srcw[path + ".weight"], _module(out, path)
        spec = QuantSpec.from_dict(entry)
        if spec.mode == "affine":
            want = rounding.quantize(
                w, bits=spec.bits, group_size=spec.group_size, method=spec.method, hessian=np.asarray(h[path])
            )
        else:
            want = mx.quantize(w, spec.group_size, spec.bits, mode=spec.mode)
        names = ("weight", "scales", "biases")[: len(want)]
        assert sorted(got) == sorted(names), path
        for name, arr in zip(names, want, strict=True):
            assert np.array_equal(
                np.asarray(got[name].astype(mx.float32)), np.asarray(arr.astype(mx.float32))
            ), (
                path,
                name,
            )
    plain = _module(out, f"{L0}.self_attn.o_proj")  # unlisted: the default, rtn
    want = mx.quantize(srcw[f"{L0}.self_attn.o_proj.weight"], 64, 4)
    assert np.array_equal(np.asarray(plain["weight"]), np.asarray(want[0]))
    m, tok = load(str(out))
    assert isinstance(generate(m, tok, prompt="w3 w4 w5 w6", max_tokens=8), str)
    assert m.model.layers[0].mlp.down_proj.mode == "mxfp4"
