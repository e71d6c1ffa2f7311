"""allocate.check's corrections: per-quantizer factors from whole-model probes, and the re-solve."""

from __future__ import annotations

import pytest

from mlxbun.errors import InputError
from mlxbun.quant.allocate.check import (
    FACTOR_RANGE,
    correction_factors,
    correction_key,
    reference_of,
    rescaled,
)
from mlxbun.quant.sensitivity.file import LayerSensitivity, Sensitivity
from mlxbun.quant.spec import QuantSpec

RTN3, RTN4 = QuantSpec(bits=3), QuantSpec(bits=4)
GPTQ3, CLIP4 = QuantSpec(bits=3, method="gptq"), QuantSpec(bits=4, method="clip")
MX4 = QuantSpec(mode="mxfp4")
PREDICTED = {RTN3: 1.0, RTN4: 0.25, GPTQ3: 0.2, CLIP4: 0.2, MX4: 0.3}
TRUE_FACTOR = {"rtn": 1.0, "gptq": 3.0, "clip": 1.5, "mxfp4": 0.5}  # how wrong each estimate is
INTERACTION = 1.3  # the whole model's KL over the sum of its modules' KLs


def _each(measure):
    """correction_factors measures its probes all at once: one call, a list of settings."""
    return lambda settings: [measure(x) for x in settings]


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
        layers, lambda p, s: None if p == "g" else PREDICTED.get(s), _each(lambda x: _measure(x, calls))
    )
    assert [p.key for p in probes] == ["rtn", "clip", "gptq", "mxfp4"]
    assert len(calls) == 4  # the reference plan, then one probe per quantizer other than RTN
    assert calls[0] == {"a": RTN3, "b": RTN3, "c": RTN4, "d": RTN4, "e": RTN4, "f": None, "g": RTN3}
    assert calls[2]["a"] == GPTQ3 and calls[2]["c"] == RTN4  # no 4-bit gptq setting to add
    for p in probes:
        assert p.factor == pytest.approx(TRUE_FACTOR[p.key])
    assert (probes[2].modules, probes[2].planned) == (2, 2) and probes[0].modules == 5
    # clip's one module carried 0.2 of 2.7: the 4-bit modules were added at clip (3-bit: no setting)
    assert (probes[1].modules, probes[1].planned) == (3, 1)
    assert [calls[1][p] for p in "abcde"] == [RTN3, RTN3, CLIP4, CLIP4, CLIP4]
    assert [calls[3][p] for p in "abcde"] == [RTN3, RTN3, MX4, MX4, MX4]


def test_a_factor_is_clipped_and_a_missing_reference_is_named():
    probes = correction_factors({"a": GPTQ3, "b": RTN4}, lambda p, s: PREDICTED.get(s),
                                _each(lambda x: 1000.0 if x["a"] == GPTQ3 else 1.0))  # fmt: skip
    assert probes[1].factor == FACTOR_RANGE[1]
    with pytest.raises(InputError, match=r"no KL for 'a' at affine:3:64; probe its RTN reference"):
        correction_factors(
            {"a": GPTQ3}, lambda p, s: PREDICTED[s] if s != RTN3 else None, _each(lambda x: 1.0)
        )


def test_a_tied_embeddings_gptq_is_probed_apart_from_the_blocks():
    """A tied embedding's GPTQ estimate is the head's error alone (its Hessian is the head's
    inputs'): with one key its misprediction is charged to every module's GPTQ. Keyed apart, the
    blocks' GPTQ keeps its own factor."""
    assert correction_key(GPTQ3, tied=True) == "gptq (tied embedding)"
    assert correction_key(CLIP4, tied=True) == "clip"  # the range search weighs no Hessian
    layers = {"emb": GPTQ3, "a": GPTQ3, "b": GPTQ3, "c": RTN4}
    truth = {"emb": 6.0, "a": 1.2, "b": 1.2}  # the embedding's GPTQ estimate is 6x low

    def measure(settings):
        return sum(PREDICTED[s] * (truth.get(p, 1.0) if s == GPTQ3 else 1.0) for p, s in settings.items())

    kl = lambda p, s: PREDICTED.get(s)  # noqa: E731
    probes = {p.key: p for p in correction_factors(layers, kl, _each(measure), tied={"emb"})}
    assert probes["gptq"].factor == pytest.approx(1.2) and probes["gptq"].modules == 2
    assert probes["gptq (tied embedding)"].factor == pytest.approx(6.0)
    mixed = correction_factors(layers, kl, _each(measure))[1]  # one key: the blocks pay for it
    assert mixed.key == "gptq" and mixed.factor == pytest.approx(2.8)
    sens = Sensitivity({p: LayerSensitivity(p, 10, dict(PREDICTED)) for p in ("emb", "a")}, "m", "c")
    out = rescaled(sens, {k: p.factor for k, p in probes.items()}, tied={"emb"})
    assert out.layers["emb"].kl[GPTQ3] == pytest.approx(1.2) and out.layers["a"].kl[GPTQ3] == pytest.approx(
        0.24
    )


def test_rescaled_multiplies_each_candidate_by_its_quantizers_factor():
    sens = Sensitivity({"a": LayerSensitivity("a", 10, dict(PREDICTED))}, "m", "c")
    out = rescaled(sens, {"gptq": 3.0, "mxfp4": 0.5})
    assert out.layers["a"].kl == {RTN3: 1.0, RTN4: 0.25, GPTQ3: pytest.approx(0.6), CLIP4: 0.2, MX4: 0.15}
    assert (out.model_fingerprint, out.calibration_fingerprint) == ("m", "c")


def test_a_quantizer_with_too_small_a_share_of_the_kl_is_not_probed():
    """One clip module among many, and no other module with a clip setting: its factor would be
    the whole model's measurement noise."""
    layers = {f"m{i}": GPTQ3 for i in range(40)} | {"c": CLIP4}
    calls: list = []
    probes = correction_factors(layers, lambda p, s: PREDICTED.get(s), _each(lambda x: _measure(x, calls)))
    assert [(p.key, p.measured, p.factor) for p in probes][1] == ("clip", None, 1.0)
    assert len(calls) == 2  # the reference plan and gptq's: clip is 0.2 of 40 x 1.0 + 0.2
    assert probes[2].factor == pytest.approx(TRUE_FACTOR["gptq"])


def test_a_small_quantizer_is_probed_on_the_largest_other_modules_until_half_the_kl():
    """One planned clip module of 41 (the 8-layer fixture's case): measured alone, the whole
    model's measurement noise over its share is its factor; the largest others at clip fix that."""
    layers = {f"m{i}": RTN3 for i in range(40)} | {"c": CLIP4}
    clip3 = QuantSpec(bits=3, method="clip")
    kls = {f"m{i}": {RTN3: 0.06, clip3: 0.03 + i / 2000} for i in range(40)} | {"c": {RTN4: 0.25, CLIP4: 0.2}}
    truth = {"rtn": 1.0, "clip": 1.5}

    def probed(kl):
        calls: list = []

        def measure(settings):  # exact for the reference plan, 3% high for a probe
            calls.append(settings)
            exact = sum(kls[p][s] * truth[correction_key(s)] for p, s in settings.items())
            return exact * (1.0 if len(calls) == 1 else 1.03)

        return correction_factors(layers, kl, _each(measure))[1], calls

    alone, _ = probed(lambda p, s: kls[p].get(s) if s != clip3 else None)  # no other clip setting
    assert alone.modules == 1 and abs(alone.factor - 1.5) > 0.35
    clip, calls = probed(lambda p, s: kls[p].get(s))
    assert clip.planned == 1 and clip.factor == pytest.approx(1.5, rel=0.06)
    added = [p for p, s in calls[1].items() if s == clip3]
    assert set(added) == {f"m{i}" for i in range(39, 39 - len(added), -1)}  # the largest first
    assert sum(kls[p][clip3] for p in added) + 0.2 >= 0.5 * sum(kls[p][calls[1][p]] for p in layers)
    assert clip.modules == 1 + len(added) < 41
