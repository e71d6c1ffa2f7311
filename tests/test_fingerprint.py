"""One model fingerprint at three depths: each depth's digest of a committed fixture is pinned,
because each is persisted (KV snapshots and eval results; sensitivity.json and plan.json;
quantize's record) and a reader compares it with a fresh one."""

from pathlib import Path

import pytest

from mlxbun.quant.quantize.outdir import source_identity
from mlxbun.source.fingerprint import model_fingerprint

FIXTURE = Path(__file__).parent / "fixtures" / "llama-text-3m"


@pytest.mark.parametrize(
    ("depth", "digest"),
    [
        ("content", "d249359ff4eb8151489dfcb74c68261e425b8add73f13d4252710c610deb6434"),
        ("sampled", "4b439876a902c10381cd618fca364ad19596979d680b632e0cdc29066119f662"),
        ("header", "994abb8ac60b1a056902373b7efa4aca902a441ba28ba1bfcc5f46b29e7a21db"),
    ],
)
def test_each_depth_hashes_the_bytes_it_always_has(depth, digest):
    assert model_fingerprint(FIXTURE, depth=depth) == digest


def test_quantize_source_identity_is_the_header_depth_or_the_synthetic_spec():
    assert source_identity(FIXTURE) == model_fingerprint(FIXTURE, depth="header")
    assert source_identity(FIXTURE, "synthetic-spec") == (
        "8f7a9e1a123c53c8392196de03b6b10a1857cfc45ca8a79cfe7f767eb090e251"
    )


def test_every_depth_sees_a_changed_config(tmp_path):
    import shutil

    copy = tmp_path / "m"
    shutil.copytree(FIXTURE, copy)
    (copy / "config.json").write_text((copy / "config.json").read_text() + " ")
    for depth in ("content", "sampled", "header"):
        assert model_fingerprint(copy, depth=depth) != model_fingerprint(FIXTURE, depth=depth)


def test_an_unknown_depth_names_the_choices():
    with pytest.raises(ValueError, match="content, sampled, header"):
        model_fingerprint(FIXTURE, depth="full")
