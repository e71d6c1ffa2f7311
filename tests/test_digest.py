"""Job keys (mlxbun.io.digest.job_key): one way to name cached and resumable work by its inputs."""

from __future__ import annotations

import pytest

from mlxbun.io.digest import JOB_KEY_CHARS, job_key


def test_a_job_key_is_pinned_and_ignores_the_order_of_mapping_keys() -> None:
    a = job_key("calibrate", 1, {"model": "ab12", "calibration": {"samples": 8, "seq_len": 16}})
    b = job_key("calibrate", 1, {"calibration": {"seq_len": 16, "samples": 8}, "model": "ab12"})
    assert a == b
    assert job_key("calibrate", 1, {"model": "ab12", "calibration": {"samples": 8}}) == "bfd63aa68956854bea70"
    assert len(a) == JOB_KEY_CHARS and int(a, 16) >= 0


@pytest.mark.parametrize(
    "other",
    [
        ("sensitivity", 1, "model", 3),  # another kind
        ("calibrate", 2, "model", 3),  # another version of the producer
        ("calibrate", 1, "model", 4),  # another input
        ("calibrate", 1, "model", 3, None),  # one more input
        ("calibrate", 1, ["model", 3]),  # the same values grouped otherwise
    ],
)
def test_any_change_of_kind_version_or_inputs_gives_another_key(other: tuple) -> None:
    assert job_key(*other) != job_key("calibrate", 1, "model", 3)


def test_inputs_that_are_not_json_are_refused_not_stringified() -> None:
    with pytest.raises(TypeError):
        job_key("rotate", 2, {"path": object()})
