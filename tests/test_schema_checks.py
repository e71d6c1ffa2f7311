"""Values the schema must refuse (one line naming key, value and what is allowed) and the units
its keys are in."""

from __future__ import annotations

import math
import re

import pytest

from mlxbun.config import checks, keys, schema
from mlxbun.errors import InputError

NON_FINITE = [math.nan, math.inf, -math.inf]


@pytest.mark.parametrize("value", NON_FINITE)
@pytest.mark.parametrize(
    ("make", "key"),
    [
        (lambda v: schema.IoCfg(shard_gb=v), "io.shard_gb"),
        (lambda v: schema.KvCfg(cap_gb=v), "kv.cap_gb"),
        (lambda v: schema.RegistryFitCfg(budget_gb=v), "registry.fit.budget_gb"),
        (lambda v: schema.RegistryFilterCfg(max_gb=v), "registry.filter.max_gb"),
        (lambda v: schema.Config(allocate=schema.AllocateCfg(budget_bpw=v)), "allocate.budget_bpw"),
        (lambda v: schema.SynthCfg(outlier_scale=v), "synth.outlier_scale"),
        (lambda v: schema.SynthCfg(norm_jitter=v), "synth.norm_jitter"),
    ],
)
def test_non_finite_numbers_are_refused(make, key: str, value: float) -> None:
    with pytest.raises(InputError, match=rf"^{key}={value!r} is out of range; it must be a finite number"):
        make(value)


def test_budget_bpw_above_the_widest_weight_is_refused() -> None:
    with pytest.raises(InputError, match=r"allocate.budget_bpw=40.0 is out of range; .* at most 32"):
        schema.Config(allocate=schema.AllocateCfg(budget_bpw=40.0))
    schema.Config(allocate=schema.AllocateCfg(budget_bpw=4.5))


def test_quant_bits_with_a_mixed_rule_is_refused() -> None:
    with pytest.raises(InputError, match=r"quant.bits=3 is ignored by quant.mixed='mixed_3_6'"):
        schema.Config(quant=schema.QuantCfg(bits=3, mixed="mixed_3_6"))
    schema.Config(quant=schema.QuantCfg(mixed="mixed_3_6"))


@pytest.mark.parametrize("key", ["seed", "fold.seed", "synth.seed", "sensitivity.calib.seed"])
def test_negative_seeds_are_refused(key: str) -> None:
    cfg = schema.Config()
    section, _, name = key.rpartition(".")
    target = cfg
    for part in filter(None, section.split(".")):
        target = getattr(target, part)
    setattr(target, name, -5)
    with pytest.raises(InputError, match=rf"^{key}=-5 is out of range; it must be >= 0"):
        schema.check_config(cfg)


def test_one_token_calibration_samples_are_refused() -> None:
    with pytest.raises(InputError, match=r"^sensitivity.calib.seq_len=1 is out of range; it must be >= 2"):
        schema.CalibCfg(seq_len=1)
    schema.CalibCfg(seq_len=2)


@pytest.mark.parametrize("root", ["/", "//", "/.."])
def test_the_filesystem_root_is_not_an_outputs_root(root: str) -> None:
    with pytest.raises(InputError, match=r"paths.outputs=.* is the filesystem root"):
        schema.PathsCfg(outputs=root)


def test_runs_limit_has_an_upper_bound() -> None:
    with pytest.raises(InputError, match=r"runs.limit=100000000000000000000 is out of range"):
        schema.RunsCfg(limit=10**20)


def test_runs_status_includes_interrupted() -> None:
    schema.RunsCfg(status="interrupted")


def test_misspelt_key_names_the_full_path_and_a_suggestion() -> None:
    with pytest.raises(InputError, match=r"unknown config key 'quant.bitz'; did you mean 'quant.bits'\?"):
        keys.check_keys({"quant": {"bitz": 4}})
    assert "did you mean 'io.shard_gb'" in keys.unknown_key_message("io.shard_gib")
    assert "did you mean 'registry.fit.budget_gb'" in keys.unknown_key_message("registry.fit.budget")


def test_every_gb_key_is_gib() -> None:
    assert schema.IoCfg().shard_bytes == 5 << 30  # mlx-lm's 5 << 30, unchanged
    assert schema.KvCfg(cap_gb=2.0).cap_bytes == 2 << 30
    assert checks.gib_bytes(16.0) == 16 << 30 and checks.gib_bytes(None) is None
    assert schema.KvCfg().cap_bytes is None


def test_key_docs_give_type_default_and_comment() -> None:
    docs = {d.key: d for d in keys.key_docs()}
    shard = docs["io.shard_gb"]
    assert shard.type == "float" and shard.default == 5.0 and "GiB" in shard.comment
    assert docs["quant.bits"].type == "int | None"
    assert "\n" not in docs["quant.out"].comment and docs["quant.out"].comment


def test_every_key_has_a_comment() -> None:
    """help=true shows each key's comment: what it does and its range."""
    assert [d.key for d in keys.key_docs() if not d.comment] == []


@pytest.mark.parametrize(
    ("make", "key", "value"),
    [
        (lambda v: schema.IoCfg(shard_gb=v), "io.shard_gb", 1e300),
        (lambda v: schema.KvCfg(cap_gb=v), "kv.cap_gb", 1e300),
        (lambda v: schema.RegistryFitCfg(budget_gb=v), "registry.fit.budget_gb", 1e300),
        (lambda v: schema.RegistryFilterCfg(max_gb=v), "registry.filter.max_gb", 1e300),
        (lambda v: schema.SensitivityCfg(ref_cache_mb=v), "sensitivity.ref_cache_mb", 1e300),
        (lambda v: schema.AllocateCfg(budget_bytes=v), "allocate.budget_bytes", 2**64),
        (lambda v: schema.KvCfg(block_kib=v), "kv.block_kib", 2**60),
        (lambda v: schema.KvCfg(max_tokens=v), "kv.max_tokens", 10**12),
        (lambda v: schema.RegistryFitCfg(context=v), "registry.fit.context", 10**12),
    ],
)
def test_sizes_and_token_counts_beyond_any_machine_are_refused(make, key: str, value: float) -> None:
    with pytest.raises(
        InputError,
        match=rf"^{re.escape(key)}={re.escape(repr(value))} is out of range; it must be at most \d+ \(",
    ):
        make(value)


def test_a_huge_size_is_one_line_and_exit_2(tmp_path) -> None:
    from cli_util import run_cli

    res = run_cli("command=registry_fit", "model.name=x", "io.shard_gb=1e300", tmp=tmp_path)
    assert res.returncode == 2 and res.stderr.startswith("error: io.shard_gb=1e+300 is out of range"), (
        res.stderr
    )
    assert res.stderr.count("\n") == 1
