"""command=tune: learned codes, scales, biases and norms against the reference; same tensors, same bytes."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from cli_util import run_cli

from mlxbun.quant.quantize.command import quantize_model_dir

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "llama-text-3m"
SMALL = ["tune.samples=8", "tune.seq_len=32", "tune.epochs=3", "tune.batch_size=2"]
# enough windows and steps for the codes phase to move codes (64 of them) and gain (its best epoch
# the last): with SMALL's 9 steps any code moved costs more than it gains, so that phase keeps none
LEARN = ["tune.samples=64", "tune.seq_len=64", "tune.epochs=4", "tune.batch_size=4"]


@pytest.fixture(scope="module")
def q3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("q3") / "model"
    quantize_model_dir(FIXTURE, out, bits=3, group_size=64, dtype="bfloat16")
    return out


def _tensors(d: Path) -> dict[str, mx.array]:
    return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in mx.load(str(f)).items()}


def _held_out_kl(model_dir: Path) -> float:
    """KL(reference || model) on the built-in held-out text, computed here (not by tune)."""
    from mlx_lm import load

    from mlxbun.eval import encode, read_text

    ref, tok = load(str(FIXTURE))
    model, _ = load(str(model_dir))
    stream = encode(tok, read_text(None)[0])[: 4 * 64]
    x = mx.array(stream.reshape(4, 64))
    p = ref(x).astype(mx.float32)
    q = model(x).astype(mx.float32)
    lp = p - mx.logsumexp(p, -1, keepdims=True)
    lq = q - mx.logsumexp(q, -1, keepdims=True)
    return (mx.exp(lp) * (lp - lq)).sum(-1).mean().item()


def _run(tmp: Path, *args: str):
    r = run_cli("command=tune", *args, tmp=tmp)
    runs = sorted((tmp / "outputs" / "tune").glob("*")) if (tmp / "outputs" / "tune").is_dir() else []
    return r, (runs[-1] if runs else None)


@pytest.mark.slow  # 64 windows x 2 phases: about 25 s a run
def test_tune_lowers_held_out_kl_and_keeps_every_tensor_and_the_bytes(tmp_path: Path, q3: Path) -> None:
    r, run = _run(tmp_path, f"model.name={q3}", f"tune.reference={FIXTURE}", *LEARN)
    assert r.returncode == 0, r.stderr
    record = json.loads((run / "tune.json").read_text())
    assert record["status"] == "tuned" and record["chosen_epoch"] >= 1
    v = record["validation"]
    assert v[record["chosen_epoch"]] < v[0]
    before, after = _tensors(q3), _tensors(run / "model")
    assert sorted(before) == sorted(after)
    changed = set()
    for k, a in before.items():
        b = after[k]
        assert (a.dtype, a.shape) == (b.dtype, b.shape), k
        if not mx.array_equal(a, b).item():
            changed.add(k.rpartition(".")[2])
    # codes, group scales/biases and norm weights are what tuning learns
    assert changed and changed <= {"scales", "biases", "weight"}
    moved = sum(
        int(mx.sum(_codes(before[k]) != _codes(after[k])).item())
        for k in before
        if k.endswith(".weight") and before[k].dtype == mx.uint32
    )
    assert moved == record["codes_changed"] > 0
    assert record["trainable"]["codes"] == sum(
        _codes(v).size for k, v in before.items() if k.endswith(".weight") and v.dtype == mx.uint32
    )
    size = lambda d: sum(p.stat().st_size for p in d.glob("*.safetensors"))  # noqa: E731
    assert size(run / "model") == size(q3)
    assert json.loads((run / "model" / "config.json").read_text()) == json.loads(
        (q3 / "config.json").read_text()
    )
    assert _held_out_kl(run / "model") < _held_out_kl(q3)
    from mlxbun import registry  # indexed under its input's name (a directory "model": its config's type)

    registry.open_db(path=tmp_path / "registry.db")
    assert registry.resolve("llama-tuned", hub_cache=tmp_path / "hub", paths=[]) == (run / "model").resolve()
    assert "registered as llama-tuned" in r.stdout + r.stderr
    # a rerun (what a killed pipeline does on its tune step) writes the same bytes
    again, run2 = _run(tmp_path, f"model.name={q3}", f"tune.reference={FIXTURE}", *LEARN)
    assert again.returncode == 0 and run2 != run
    for f in sorted((run / "model").iterdir()):
        assert (run2 / "model" / f.name).read_bytes() == f.read_bytes(), f.name


def _codes(packed: mx.array, bits: int = 3) -> mx.array:
    """The codes of a packed 3-bit weight (q3's)."""
    ones = mx.ones((packed.shape[0], packed.shape[1] * 32 // bits // 64), mx.float32)
    return mx.dequantize(packed, ones, mx.zeros_like(ones), group_size=64, bits=bits)


@pytest.mark.slow  # 64 windows x 2 phases: about 25 s a run
def test_tune_codes_lr_0_keeps_the_codes_and_learned_codes_fit_better(tmp_path: Path, q3: Path) -> None:
    """Scales and biases alone leave every code; with the codes trained in a second phase the
    validation KL ends lower than scales alone reach in as many steps."""
    scales_only = [*LEARN[:2], "tune.epochs=8", LEARN[3], "tune.codes_lr=0"]  # 8 epochs: both phases' steps
    r, run = _run(tmp_path, f"model.name={q3}", f"tune.reference={FIXTURE}", *scales_only)
    assert r.returncode == 0, r.stderr
    kept = json.loads((run / "tune.json").read_text())
    assert kept["status"] == "tuned" and kept["codes_changed"] == 0 and kept["trainable"]["codes"] == 0
    before, after = _tensors(q3), _tensors(run / "model")
    for k in before:
        if k.endswith(".weight") and before[k].dtype == mx.uint32:
            assert mx.array_equal(before[k], after[k]).item(), k
    r, run = _run(tmp_path, f"model.name={q3}", f"tune.reference={FIXTURE}", *LEARN)
    assert r.returncode == 0, r.stderr
    learned = json.loads((run / "tune.json").read_text())
    assert learned["validation"][0] == kept["validation"][0]
    assert learned["chosen_epoch"] > 4 and learned["codes_changed"] > 0  # the codes phase's
    assert min(learned["validation"]) < min(kept["validation"])


def test_an_epoch_whose_validation_kl_is_not_finite_is_never_written(tmp_path: Path, q3: Path) -> None:
    """A step so large the scales overflow: that epoch's KL is NaN; tune.json stays strict JSON
    (the epoch's value null) and the input's values are written (it was recorded "tuned", NaN in
    the JSON, when codes_lr / lr overflowed)."""
    args = [f"model.name={q3}", f"tune.reference={FIXTURE}", *SMALL, "tune.epochs=1", "tune.lr=1e30"]
    r, run = _run(tmp_path, *args, "tune.codes_lr=0")
    assert r.returncode == 0, r.stderr
    record = json.loads(
        (run / "tune.json").read_text(), parse_constant=lambda c: pytest.fail(f"{c} in tune.json")
    )
    assert record["validation"][1] is None and record["chosen_epoch"] == 0 and record["chosen_phase"] is None
    assert record["status"] == "unchanged" and "cannot be the one written" in r.stderr
    assert "unchanged by tune" in r.stdout + r.stderr
    for f in sorted(q3.glob("*.safetensors")):
        assert (run / "model" / f.name).read_bytes() == f.read_bytes(), f.name


def test_a_model_with_nothing_to_tune_is_refused_before_anything_is_staged(tmp_path: Path) -> None:
    mx4 = tmp_path / "mxfp4"
    quantize_model_dir(FIXTURE, mx4, bits=4, group_size=32, mode="mxfp4", dtype="bfloat16")
    r, _ = _run(tmp_path, f"model.name={mx4}", f"tune.reference={FIXTURE}", *SMALL)
    assert r.returncode == 2 and "there is nothing to tune" in r.stderr and "Traceback" not in r.stderr
    assert not list((tmp_path / "outputs").rglob("*.partial*")) and not list(
        (tmp_path / "outputs").rglob("*.lock")
    )


def test_tune_epochs_0_hands_the_input_on_and_says_so(tmp_path: Path, q3: Path) -> None:
    r, run = _run(tmp_path, f"model.name={q3}", f"tune.reference={FIXTURE}", "tune.epochs=0")
    assert r.returncode == 0, r.stderr
    record = json.loads((run / "tune.json").read_text())
    assert record["status"] == "skipped" and record["reason"] == "tune.epochs=0"
    assert not (run / "model").exists()


def test_tune_hands_on_a_plan_already_within_min_kl(tmp_path: Path, q3: Path) -> None:
    r, run = _run(tmp_path, f"model.name={q3}", f"tune.reference={FIXTURE}", *SMALL, "tune.min_kl=100")
    assert r.returncode == 0, r.stderr
    record = json.loads((run / "tune.json").read_text())
    assert record["status"] == "skipped" and "is below tune.min_kl=100" in record["reason"]
    assert len(record["validation"]) == 1 and record["forward_equivalents"] < 1
    assert record["validation_windows"] == 2  # tune.samples=8: the last eighth, at least 2
    assert not (run / "model").exists() and not list(run.parent.rglob("*.safetensors"))


def test_tune_hands_on_when_training_would_outlast_max_minutes(tmp_path: Path, q3: Path) -> None:
    r, run = _run(tmp_path, f"model.name={q3}", f"tune.reference={FIXTURE}", *SMALL, "tune.max_minutes=1e-6")
    assert r.returncode == 0, r.stderr
    record = json.loads((run / "tune.json").read_text())
    assert record["status"] == "skipped" and "over 4 x tune.max_minutes=1e-06" in record["reason"]
    assert record["predicted_seconds"] > 0 and not (run / "model").exists()
    assert record["validation_windows"] == 1  # decided on the first window, not the whole pass
    assert "is handed on" in r.stdout + r.stderr


def test_tune_stops_after_patience_epochs_without_a_new_best(tmp_path: Path, q3: Path) -> None:
    # a step far too large: no epoch beats the input, so each phase's second epoch is its last
    args = [f"model.name={q3}", f"tune.reference={FIXTURE}", *SMALL, "tune.epochs=6", "tune.lr=30"]
    r, run = _run(tmp_path, *args, "tune.patience=2")
    assert r.returncode == 0, r.stderr
    record = json.loads((run / "tune.json").read_text())
    assert record["status"] == "unchanged" and record["chosen_epoch"] == 0
    assert record["phases"] == ["scales", "codes"]
    assert record["epochs_run"] == 4 and len(record["validation"]) == 5 and record["codes_changed"] == 0
    for f in sorted(q3.glob("*.safetensors")):  # the input's values, written unchanged
        assert (run / "model" / f.name).read_bytes() == f.read_bytes(), f.name


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([f"model.name={FIXTURE}", f"tune.reference={FIXTURE}"], "is not a quantized model"),
        (["tune.reference=/nonexistent/ref"], "tune.reference"),
        (["tune.samples=2"], "tune.samples=2 is out of range"),
        (["tune.lr=0"], "tune.lr"),
        (["tune.patience=-1"], "tune.patience=-1 is out of range"),
        (["tune.min_kl=nan"], "tune.min_kl=nan is out of range"),
        (["tune.max_minutes=0"], "tune.max_minutes=0"),
        # an offset multiplier of codes_lr / lr that overflowed float32 wrote scrambled codes, exit 0
        (["tune.codes_lr=1e37"], "tune.codes_lr=1e+37 is out of range; it must be at most 1.0"),
        (
            ["tune.lr=1e-42"],
            "tune.lr=1e-42 is out of range; it must be >= 6e-07 (tune.codes_lr=0.006 / 10000)",
        ),
        (["tune.codes_lr=-1"], "tune.codes_lr=-1"),
        # another model as the reference: a raw mlx broadcast error, exit 1, a staging dir left
        (
            [f"tune.reference={FIXTURE.parent / 'llama-text-12l'}"],
            "is not the model model.name was quantized from",
        ),
        (["sensitivity.calib.samples=3"], "sensitivity.calib.samples=3 is not read by command=tune"),
        (["registry.fit.budget_gb=1"], "registry.fit.budget_gb=1.0 is not read by command=tune"),
    ],
)
def test_bad_tune_input_is_one_line_and_exit_2(
    tmp_path: Path, q3: Path, args: list[str], message: str
) -> None:
    base = [f"model.name={q3}", f"tune.reference={FIXTURE}"]
    keys = {a.partition("=")[0] for a in args}
    r, _ = _run(tmp_path, *[a for a in base if a.partition("=")[0] not in keys], *args)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr
    assert not list((tmp_path / "outputs").rglob("model.safetensors"))


def test_a_reference_that_cannot_be_loaded_or_is_quantized_is_named_as_the_reference(
    tmp_path: Path, q3: Path
) -> None:
    empty = tmp_path / "noweights"
    empty.mkdir()
    (empty / "config.json").write_text((FIXTURE / "config.json").read_text())
    r, _ = _run(tmp_path, f"model.name={q3}", f"tune.reference={empty}")
    assert r.returncode == 2 and f"tune.reference={str(empty)!r} cannot be loaded" in r.stderr, r.stderr
    (empty / "config.json").unlink()  # was mlx-lm's "[Errno 2] No such file" under model.name
    r, _ = _run(tmp_path, f"model.name={q3}", f"tune.reference={empty}")
    assert r.returncode == 2 and f"tune.reference={str(empty)!r} has no config.json; pass a" in r.stderr
    r, _ = _run(tmp_path, f"model.name={q3}", f"tune.reference={q3}")
    assert r.returncode == 2 and "is a quantized model; pass the unquantized model" in r.stderr, r.stderr
    assert not (tmp_path / "outputs" / ".partial").exists() or not any(
        (tmp_path / "outputs" / ".partial").iterdir()
    )


def test_tune_without_a_reference_is_refused(tmp_path: Path, q3: Path) -> None:
    r, _ = _run(tmp_path, f"model.name={q3}")
    assert r.returncode == 2 and "tune.reference is not set" in r.stderr


def test_tuned_values_round_to_the_stored_dtype_as_trained() -> None:
    """The forward trains on what is written: scales and biases rounded to the model's dtype."""
    import mlx.nn as nn

    from mlxbun.quant.tune.command import _modules

    linear_cls, _, _ = _modules()
    layer = nn.QuantizedLinear.from_linear(nn.Linear(128, 8), group_size=64, bits=3)
    layer.scales = layer.scales.astype(mx.bfloat16)
    layer.biases = layer.biases.astype(mx.bfloat16)
    tuned = linear_cls(layer, mx.bfloat16)
    tuned.log_scale = mx.full(tuned.log_scale.shape, 1e-3)
    s, b = tuned.scales_biases()
    assert mx.array_equal(s, s.astype(mx.bfloat16).astype(mx.float32)).item()
    x = mx.random.normal((2, 128))
    untouched = linear_cls(layer, mx.bfloat16)
    ref = layer(x.astype(mx.bfloat16))  # the stored model's own forward (bias included)
    assert np.allclose(np.array(untouched(x)), np.array(ref.astype(mx.float32)), atol=0.05)


def test_a_large_5_bit_embedding_stands_in_within_a_few_bytes_a_weight() -> None:
    """The stand-in keeps one byte a code, and its codes come out in slices of rows: whole, mlx's
    dequantize of a 0.5B model's 5-bit embedding took 3.4 GB of temporaries (25 bytes a weight)
    and float32 codes 4 more, the peak of tune's run at that size."""
    import mlx.nn as nn

    from mlxbun.quant.tune.command import _modules

    _, embedding_cls, _ = _modules()
    rows, cols = 32768, 1024
    emb = nn.QuantizedEmbedding(rows, cols, group_size=128, bits=5)
    emb.scales = mx.ones_like(emb.scales).astype(mx.bfloat16)
    emb.biases = mx.zeros_like(emb.biases).astype(mx.bfloat16)
    mx.eval(emb.parameters())
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    tuned = embedding_cls(emb, mx.bfloat16)
    mx.eval(tuned._codes)
    assert tuned._codes.dtype == mx.uint8
    assert (mx.get_peak_memory() - base) / (rows * cols) < 8


def test_codes_that_do_not_fit_in_memory_stay_and_the_scales_are_still_tuned(
    tmp_path: Path, q3: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlxbun.config import schema
    from mlxbun.quant.tune import command as tune

    monkeypatch.setattr(tune, "CODE_BYTES_PER_WEIGHT", 1 << 40)  # the codes' offsets never fit
    cfg = schema.Config(model=schema.ModelCfg(name=str(q3)), tune=schema.TuneCfg(reference=str(FIXTURE)))
    for kv in SMALL:
        key, value = kv.split("=")
        setattr(cfg.tune, key.partition(".")[2], int(value))
    cfg.paths.outputs, cfg.paths.run_dir = str(tmp_path / "outputs"), str(tmp_path / "run")
    cfg.registry.path = str(tmp_path / "registry.db")
    tune.run(cfg)
    record = json.loads((tmp_path / "run" / "tune.json").read_text())
    assert record["codes"].startswith("kept: training them needs about") and "% of the" in record["codes"]
    assert record["status"] == "tuned" and record["phases"] == ["scales"] and record["codes_changed"] == 0
