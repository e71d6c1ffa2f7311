"""allocate.check's corrections: per-quantizer factors from whole-model probes, and the re-solve."""

from __future__ import annotations

import pytest

from mlxbun.errors import InputError
from mlxbun.quant.check import FACTOR_RANGE, correction_factors, correction_key, reference_of, rescaled
from mlxbun.quant.sensitivity_file import LayerSensitivity, Sensitivity
from mlxbun.quant.spec import QuantSpec

RTN3, RTN4 = QuantSpec(bits=3), QuantSpec(bits=4)
GPTQ3, CLIP4 = QuantSpec(bits=3, method="gptq"), QuantSpec(bits=4, method="clip")
MX4 = QuantSpec(mode="mxfp4")
PREDICTED = {RTN3: 1.0, RTN4: 0.25, GPTQ3: 0.2, CLIP4: 0.2, MX4: 0.3}
TRUE_FACTOR = {"rtn": 1.0, "gptq": 3.0, "clip": 1.5, "mxfp4": 0.5}  # how wrong each estimate is
INTERACTION = 1.3  # the whole model's KL over the sum of its modules' KLs


def _measure(layers, calls):
    """A model whose KL is INTERACTION x the sum of each module's true KL ("g": a module the
    objective does not score, and that costs nothing)."""
    calls.append(dict(layers))
    return INTERACTION * sum(
        PREDICTED[s] * TRUE_FACTOR[correction_key(s)] for p, s in layers.items() if s and p != "g"
    )


def test_keys_and_references():
    assert [correction_key(s) for s in (RTN3, GPTQ3, CLIP4, MX4)] == ["rtn", "gptq", "clip", "mxfp4"]
    assert reference_of(GPTQ3) == RTN3 and reference_of(MX4) == RTN4
    assert reference_of(QuantSpec(bits=4, group_size=32, method="clip")) == QuantSpec(bits=4, group_size=32)


def test_factors_recover_each_quantizers_error_with_one_probe_each():
    layers = {"a": GPTQ3, "b": GPTQ3, "c": CLIP4, "d": MX4, "e": RTN4, "f": None, "g": RTN3}
    calls: list = []
    probes = correction_factors(
        layers, lambda p, s: None if p == "g" else PREDICTED[s], lambda x: _measure(x, calls)
    )
    assert [p.key for p in probes] == ["rtn", "clip", "gptq", "mxfp4"]
    assert len(calls) == 4  # the reference plan, then one probe per quantizer other than RTN
    assert calls[0] == {"a": RTN3, "b": RTN3, "c": RTN4, "d": RTN4, "e": RTN4, "f": None, "g": RTN3}
    assert calls[2]["a"] == GPTQ3 and calls[2]["c"] == RTN4
    for p in probes:
        assert p.factor == pytest.approx(TRUE_FACTOR[p.key])
    assert probes[2].modules == 2 and probes[0].modules == 5


def test_a_factor_is_clipped_and_a_missing_reference_is_named():
    probes = correction_factors({"a": GPTQ3, "b": RTN4}, lambda p, s: PREDICTED[s],
                                lambda x: 1000.0 if x["a"] == GPTQ3 else 1.0)  # fmt: skip
    assert probes[1].factor == FACTOR_RANGE[1]
    with pytest.raises(InputError, match=r"no KL for 'a' at affine:3:64; probe its RTN reference"):
        correction_factors({"a": GPTQ3}, lambda p, s: PREDICTED[s] if s != RTN3 else None, lambda x: 1.0)


def test_rescaled_multiplies_each_candidate_by_its_quantizers_factor():
    sens = Sensitivity({"a": LayerSensitivity("a", 10, dict(PREDICTED))}, "m", "c")
    out = rescaled(sens, {"gptq": 3.0, "mxfp4": 0.5})
    assert out.layers["a"].kl == {RTN3: 1.0, RTN4: 0.25, GPTQ3: pytest.approx(0.6), CLIP4: 0.2, MX4: 0.15}
    assert (out.model_fingerprint, out.calibration_fingerprint) == ("m", "c")


def test_a_quantizer_with_too_small_a_share_of_the_kl_is_not_probed():
    """One clip module among many: its factor would be the whole model's measurement noise."""
    layers = {f"m{i}": GPTQ3 for i in range(40)} | {"c": CLIP4}
    calls: list = []
    probes = correction_factors(layers, lambda p, s: PREDICTED[s], lambda x: _measure(x, calls))
    assert [(p.key, p.measured, p.factor) for p in probes][1] == ("clip", None, 1.0)
    assert len(calls) == 2  # the reference plan and gptq's: clip is 0.2 of 40 x 1.0 + 0.2
    assert probes[2].factor == pytest.approx(TRUE_FACTOR["gptq"])
