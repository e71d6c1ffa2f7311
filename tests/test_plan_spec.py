"""Tests for the quantization vocabulary: QuantSpec, the per-mode tables, plan.json, and the config
rules built on them (each checked once, from the tables)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pytest

from mlxbun.config.schema import AllocateCfg, QuantCfg, SensitivityCfg
from mlxbun.errors import InputError
from mlxbun.io.atomic import dumps_json
from mlxbun.quant import spec
from mlxbun.quant.plan import Plan, load_plan
from mlxbun.quant.spec import MODE_BITS, MODE_GROUPS, QuantSpec, spec_for

GOLDEN_PLAN = (
    b'{"version": 1, "default": {"group_size": 64, "bits": 4, "mode": "affine"}, "layers": '
    b'{"lm_head": false, "model.layers.0.mlp.down_proj": {"group_size": 32, "bits": 4, "mode": "mxfp4"}}}'
)


def test_the_tables_are_what_mlx_quantize_accepts():
    w = mx.random.normal((8, 128))
    for mode in spec.MODES:
        for bits in spec.ALL_BITS:
            for group in spec.ALL_GROUPS:
                try:
                    mx.eval(mx.quantize(w, group_size=group, bits=bits, mode=mode))
                    ok = True
                except (ValueError, RuntimeError):
                    ok = False
                assert ok == (bits in MODE_BITS[mode] and group in MODE_GROUPS[mode]), (mode, bits, group)


def test_defaults_per_mode_and_construction():
    assert QuantSpec() == QuantSpec(bits=4, group_size=64, mode="affine")
    assert QuantSpec(mode="mxfp4") == QuantSpec(bits=4, group_size=32, mode="mxfp4")
    assert QuantSpec(mode="nvfp4").group_size == 16
    assert QuantSpec(mode="mxfp8").bits == 8
    assert spec_for("affine", 3) == QuantSpec(bits=3)
    with pytest.raises(TypeError):
        QuantSpec(4, 64)  # keyword-only: fields can be added without breaking callers


def test_order_hash_and_text():
    specs = [QuantSpec(bits=8, group_size=32), QuantSpec(mode="mxfp4"), QuantSpec(bits=4, group_size=32)]
    assert sorted(specs) == [specs[2], specs[1], specs[0]]  # by (bits, group_size, mode)
    assert len({QuantSpec(), QuantSpec(bits=4, group_size=64)}) == 1
    assert str(QuantSpec(mode="nvfp4")) == "nvfp4:4:16"
    assert QuantSpec.parse("affine:8:32") == QuantSpec(bits=8, group_size=32)
    assert QuantSpec.parse("mxfp4") == QuantSpec(mode="mxfp4")
    assert QuantSpec.parse("affine:3") == QuantSpec(bits=3)
    assert QuantSpec.parse({"bits": 6}) == QuantSpec(bits=6)
    for bad in ("affine:x", "affine:4:64:1", "affine:7", "int4"):
        with pytest.raises(InputError, match="quant"):
            QuantSpec.parse(bad)


def test_to_dict_is_mlx_lm_order_and_from_dict_ignores_unknown_keys():
    s = QuantSpec(bits=6, group_size=32)
    assert list(s.to_dict()) == ["group_size", "bits", "mode"]
    assert QuantSpec.from_dict({**s.to_dict(), "rounding": "gptq", "note": 1}) == s
    assert QuantSpec.from_dict({"mode": "nvfp4"}) == QuantSpec(mode="nvfp4")
    assert s.matches({"bits": 6, "group_size": 32, "mode": "affine"})
    assert not s.matches({"bits": 6, "group_size": 64, "mode": "affine"}) and not s.matches(None)


@dataclass(frozen=True, kw_only=True)
class Grown(QuantSpec):
    """QuantSpec as it may grow: one more field with a default."""

    tag: str | None = None


def test_a_new_field_keeps_plan_bytes_and_old_readers_working():
    plain, grown = QuantSpec(bits=3), Grown(bits=3)
    assert grown.to_dict() == plain.to_dict()  # the default is left out: same plan.json bytes
    gptq = Grown.from_dict({"bits": 3, "tag": "gptq"})
    assert gptq.tag == "gptq" and gptq.to_dict() == {**plain.to_dict(), "tag": "gptq"}
    assert QuantSpec.from_dict(gptq.to_dict()) == plain  # an older reader ignores the new key
    assert Grown.parse(gptq) == gptq and Grown.from_dict(gptq.to_dict()) == gptq
    assert sorted([gptq, grown]) == [grown, gptq]


@pytest.mark.parametrize(
    ("mode", "bits", "group", "message"),
    [
        ("int4", None, None, r"k.mode='int4' is not allowed; choose one of affine, mxfp4, nvfp4, mxfp8"),
        ("affine", 7, None, r"k.bits=7 is not allowed for mode=affine; choose one of 2, 3, 4, 5, 6, 8"),
        ("affine", 0, None, r"k.bits=0 is not allowed for mode=affine"),
        ("affine", 4, 16, r"k.group_size=16 is not allowed for mode=affine; choose one of 32, 64, 128"),
        (
            "mxfp4",
            3,
            None,
            r"k.bits=3 is not allowed for mode=mxfp4; it supports only bits=4 with group_size=32",
        ),
        ("nvfp4", None, 32, r"k.group_size=32 is not allowed for mode=nvfp4; it supports only bits=4 with"),
        ("mxfp8", "8", None, r"k.bits='8' is not allowed for mode=mxfp8"),
    ],
)
def test_spec_for_refuses_what_mlx_refuses(mode, bits, group, message):
    with pytest.raises(InputError, match=message):
        spec_for(mode, bits, group, key="k")


def test_plan_golden_bytes_and_round_trip():
    plan = Plan(
        default=QuantSpec(),
        layers={"model.layers.0.mlp.down_proj": QuantSpec(mode="mxfp4"), "lm_head": None},
    )
    assert json.dumps(plan.to_dict()).encode() == GOLDEN_PLAN
    assert Plan.from_dict(json.loads(GOLDEN_PLAN)) == plan
    # Readers ignore what allocate writes beside the plan, and unknown keys in entries.
    report = {**json.loads(GOLDEN_PLAN), "predicted_bytes": 1, "choices": {}}
    report["layers"]["lm_head"] = False
    report["default"]["rounding"] = "nearest"
    assert Plan.from_dict(report) == plan
    assert dumps_json(Plan.from_dict(report).to_dict()) == dumps_json(plan.to_dict())


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ([], r"a plan is an object with a 'default' setting"),
        ({"layers": {}}, r"a plan is an object with a 'default' setting"),
        ({"version": 2, "default": {}}, r"plan version 2 is not supported"),
        ({"default": {}, "layers": []}, r"'layers' must map module paths"),
        (
            {"default": {}, "layers": {"a": True}},
            r"layers\['a'\]: expected \{bits, group_size, mode\} or false",
        ),
        ({"default": {}, "layers": {"a": {"bits": 7}}}, r"layers\['a'\].bits=7 is not allowed"),
        ({"default": {"group_size": 16}}, r"default.group_size=16 is not allowed for mode=affine"),
    ],
)
def test_plan_refuses_hostile_documents(tmp_path, doc, message):
    p = tmp_path / "plan.json"
    p.write_text(json.dumps(doc))
    with pytest.raises(InputError, match=message):
        load_plan(p)


def test_load_plan_names_the_file(tmp_path):
    with pytest.raises(InputError, match=r"quant.plan=.*nope.json' does not exist"):
        load_plan(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(InputError, match=r"quant.plan=.*bad.json' is not valid JSON"):
        load_plan(tmp_path / "bad.json")


def test_schema_checks_group_size_per_mode():
    """group_size=16 is nvfp4's only group size and no other mode's (it used to pass the schema)."""
    assert QuantCfg(mode="nvfp4", group_size=16).group_size == 16
    with pytest.raises(InputError, match=r"quant.group_size=16 is not allowed for mode=affine"):
        QuantCfg(group_size=16)
    with pytest.raises(InputError, match=r"sensitivity.group_size=16 is not allowed for mode=affine"):
        SensitivityCfg(group_size=16)
    # Unset, the group size is the mode's own (it defaulted to 64, which mxfp4 refuses).
    assert SensitivityCfg(mode="mxfp4", bits=[4]).group_size is None
    assert spec_for("mxfp4", 4, SensitivityCfg(mode="mxfp4", bits=[4]).group_size).group_size == 32
    assert spec_for("affine", 4, SensitivityCfg().group_size).group_size == 64
    with pytest.raises(InputError, match=r"sensitivity.bits=4 is not allowed for mode=mxfp8"):
        SensitivityCfg(mode="mxfp8", group_size=None, bits=[4, 8])
    assert SensitivityCfg(mode="nvfp4", group_size=None, bits=[4]).group_size is None
    with pytest.raises(InputError, match=r"allocate.default.group_size=16 is not allowed for mode=affine"):
        AllocateCfg(default_group_size=16)
    assert AllocateCfg(group_sizes=[16, 32], modes=["nvfp4", "mxfp4"]).group_sizes == [16, 32]


def test_schema_checks_mixed_and_budget_once():
    with pytest.raises(InputError, match=r"quant.mixed='mixed_9_9' is not allowed; choose one of mixed_2_6"):
        QuantCfg(mixed="mixed_9_9")
    with pytest.raises(InputError, match=r"needs quant.mode=affine"):
        QuantCfg(mixed="mixed_3_6", mode="mxfp4")
    with pytest.raises(InputError, match=r"quant.plan and quant.mixed are both set"):
        QuantCfg(mixed="mixed_3_6", plan="plan.json")
    with pytest.raises(InputError, match=r"both set; set exactly one"):
        AllocateCfg(budget_bpw=4.5, budget_bytes=10)
    AllocateCfg()  # no budget is fine for a config that does not run allocate
    with pytest.raises(InputError, match=r"both unset; set exactly one"):
        spec.check_budget(None, None)


def test_one_dtype_table():
    from mlxbun.io import dtypes
    from mlxbun.io.safetensors import NP_DTYPES

    assert {k: v.itemsize for k, v in NP_DTYPES.items()} == dtypes.ITEMSIZE
    assert set(dtypes.CODES.values()) <= set(dtypes.ITEMSIZE)
    for name in dtypes.CODES:
        if name != "bfloat16":  # numpy has no bfloat16
            assert dtypes.ITEMSIZE[dtypes.CODES[name]] == np.dtype(name).itemsize, name
    assert dtypes.OUTPUT_NAMES == {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
