"""command=tune: learned rounding a block at a time; same tensors, same bytes; validated on other text."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from cli_util import other_model, run_cli

from mlxbun.quant.calibration import read_documents, split_kinds
from mlxbun.quant.quantize.command import MARKER, quantize_model_dir
from mlxbun.quant.tune import blockwise, budget, validation

pytestmark = pytest.mark.blas

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "llama-text-3m"
SMALL = ["tune.samples=8", "tune.val_samples=4", "tune.seq_len=32", "tune.steps=20", "tune.batch_size=4"]


@pytest.fixture(scope="module")
def q3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("q3") / "model"
    quantize_model_dir(FIXTURE, out, bits=3, group_size=64, dtype="bfloat16")
    return out


def _tensors(d: Path) -> dict[str, mx.array]:
    return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in mx.load(str(f)).items()}


def _run(tmp: Path, *args: str):
    r = run_cli("command=tune", *args, tmp=tmp)
    runs = sorted((tmp / "outputs" / "tune").glob("*")) if (tmp / "outputs" / "tune").is_dir() else []
    return r, (runs[-1] if runs else None)


def test_tune_keeps_every_tensor_and_the_bytes_and_is_deterministic(tmp_path: Path, q3: Path) -> None:
    r, run = _run(tmp_path, f"model.name={q3}", f"tune.reference={FIXTURE}", *SMALL)
    assert r.returncode == 0, r.stderr
    verified = run_cli("command=verify", f"runs.dir={run}", tmp=tmp_path)
    assert verified.returncode == 0, verified.stderr  # the tuned model's files are in the manifest
    record = json.loads((run / "tune.json").read_text(), parse_constant=lambda c: pytest.fail(c))
    assert record["status"] in ("tuned", "unchanged") and len(record["blocks"]) == 4
    assert record["reference_checked_by"] == "source content"
    assert record["validation"]["split"] == "kinds math, prose"
    before, after = _tensors(q3), _tensors(run / "model")
    assert sorted(before) == sorted(after)
    changed = set()
    for k, a in before.items():
        b = after[k]
        assert (a.dtype, a.shape) == (b.dtype, b.shape), k
        if not mx.array_equal(a, b).item():
            changed.add(k)
    size = lambda d: sum(p.stat().st_size for p in d.glob("*.safetensors"))  # noqa: E731
    assert size(run / "model") == size(q3)
    assert json.loads((run / "model" / "config.json").read_text()) == json.loads(
        (q3 / "config.json").read_text()
    )
    if record["status"] == "tuned":
        assert record["kl_after"] < record["kl_before"]
        kept = {b["block"] for b in record["blocks"] if b["kept"]}
        assert changed and {int(k.split(".")[2]) for k in changed} <= kept  # only kept blocks move
        assert all(k.rpartition(".")[2] in ("weight", "scales", "biases") for k in changed)
    else:
        assert not changed  # the input's values
    from mlxbun import registry

    registry.open_db(path=tmp_path / "registry.db")
    assert registry.resolve("llama-tuned", hub_cache=tmp_path / "hub", paths=[]) == (run / "model").resolve()
    again, run2 = _run(tmp_path, f"model.name={q3}", f"tune.reference={FIXTURE}", *SMALL)
    assert again.returncode == 0 and run2 != run
    for f in sorted((run / "model").iterdir()):
        assert (run2 / "model" / f.name).read_bytes() == f.read_bytes(), f.name


def test_a_tuned_linear_starts_at_the_input_exactly() -> None:
    """v starts at code - (W - b) / s: before any step the weight and the stored tensors are the input's."""
    w = mx.random.normal((8, 128), key=mx.random.key(0)).astype(mx.bfloat16).astype(mx.float32)
    wq, s, b = mx.quantize(w.astype(mx.bfloat16), group_size=64, bits=3)
    m = blockwise.TunedLinear(reference=w, weight=wq, scales=s, biases=b, bits=3, group_size=64)
    deq = mx.dequantize(wq, s.astype(mx.float32), b.astype(mx.float32), group_size=64, bits=3)
    assert mx.allclose(m.weight(), deq, atol=1e-6).item()
    stored = m.stored("x")
    assert mx.array_equal(stored["x.weight"], wq).item() and mx.array_equal(stored["x.scales"], s).item()
    assert mx.array_equal(stored["x.biases"], b).item()
    assert m.changed(m.snapshot()) == 0


def _definition(w: mx.array, v: mx.array, s: mx.array, b: mx.array, maxq: float) -> mx.array:
    """Wq by autodiff's rules: round straight through inside the grid, no gradient where clipped."""
    z = (w - b[..., None]) / s[..., None] + v
    q = mx.clip(mx.round(z), 0.0, maxq)
    inside = mx.stop_gradient((mx.round(z) == q).astype(mx.float32))
    q = inside * (z + mx.stop_gradient(q - z)) + (1.0 - inside) * mx.stop_gradient(q)
    return (q * s[..., None] + b[..., None]).reshape(w.shape[0], -1)


def test_a_tuned_linears_gradient_is_its_definitions_without_holding_its_weight() -> None:
    """The module's matmul computes its gradient by rebuilding Wq instead of keeping Wq and its
    intermediates for the backward pass; the gradients equal autodiff's of the definition. A
    bias whose group has no clipped code gets exactly none: its shift cancels through the
    rounding (before, float noise there had a sign, and signed descent moved every such bias by
    the full rate each step)."""
    w = mx.random.normal((32, 256), key=mx.random.key(1)).astype(mx.bfloat16)
    wq, s, b = mx.quantize(w, group_size=64, bits=3)
    m = blockwise.TunedLinear(reference=w, weight=wq, scales=s, biases=b, bits=3, group_size=64)
    m.v = m.v + mx.random.uniform(-0.7, 0.7, m.v.shape, key=mx.random.key(2))  # some codes clipped
    x = mx.random.normal((2, 5, 256), key=mx.random.key(3))
    y = mx.random.normal((2, 5, 32), key=mx.random.key(4))

    g = w.astype(mx.float32).reshape(32, 4, 64)

    def ours(p: dict) -> mx.array:
        m.update(p)
        return mx.sum(mx.square(m(x) - y))

    def theirs(p: dict) -> mx.array:
        m.update(p)
        sc, bi = m.scales_biases()
        return mx.sum(mx.square(x @ _definition(g, m.v, sc, bi, 7.0).T - y))

    p = dict(m.trainable_parameters())
    got, want = mx.grad(ours)(p), mx.grad(theirs)(p)
    for k in ("v", "log_scale", "shift"):
        assert mx.allclose(got[k], want[k], rtol=1e-3, atol=1e-3).item(), k
    sc, bi = m.scales_biases()
    z = mx.round((g - bi[..., None]) / sc[..., None] + m.v)
    clean = mx.all((z >= 0) & (z <= 7), axis=-1)
    assert mx.any(clean).item() and mx.all(mx.where(clean, got["shift"] == 0, True)).item()
    assert mx.any(got["shift"] != 0).item()  # clipped groups do move their bias


def test_training_and_validation_share_no_document() -> None:
    docs, _ = read_documents(None)
    train, val, how = split_kinds(docs, ("dialogue", "math"))
    assert how == "kinds dialogue, math" and {d.kind for d in val} == {"dialogue", "math"}
    assert not {id(d) for d in train} & {id(d) for d in val} and len(train) + len(val) == len(docs)
    plain = [d for d in docs if d.kind == "prose"]  # a text without those kinds: every fourth document
    train, val, how = split_kinds(plain, ("dialogue",))
    assert how == "every fourth document" and val == plain[3::4] and len(train) == len(plain) - len(val)


def _one_module_block() -> tuple[Any, dict, blockwise.Windows]:
    class Fake:
        def run(self, i, x):
            return x * lin.weight().sum()

    w = mx.ones((4, 64))
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    lin = blockwise.TunedLinear(reference=w, weight=wq, scales=s, biases=b, bits=4, group_size=64)
    data = blockwise.Windows(x_train=mx.ones((4, 2, 3)), y_train=mx.zeros((4, 2, 3)), x_val=mx.ones((1, 2, 3)),
                             y_val=mx.zeros((1, 2, 3)))  # fmt: skip
    return Fake(), {"m": lin}, data


def _ticking(monkeypatch: pytest.MonkeyPatch, tick: int) -> None:
    """Each clock reading ``tick`` seconds after the last: a step's pace in clock readings."""
    clock = iter(range(0, 10_000_000, tick))
    monkeypatch.setattr(blockwise.time, "monotonic", lambda: float(next(clock)))


def test_a_time_budget_sets_the_steps_after_a_warm_up_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first step compiles kernels and is not a step's pace; the pace of the next two sets how
    many fit (here one clock second a step: a 10-second budget runs 10 steps, not the 200 asked)."""
    _ticking(monkeypatch, 1)
    stream, tuned, data = _one_module_block()
    done, *_, pace = blockwise._train(stream, 0, tuned, data, steps=200, lr=1e-3, batch=2, seed=0, seconds=10)
    assert (done, pace) == (10, 1.0)
    assert blockwise._train(stream, 0, tuned, data, steps=5, lr=1e-3, batch=2, seed=0)[0] == 5


def test_a_step_the_time_left_cannot_hold_is_not_started(monkeypatch: pytest.MonkeyPatch) -> None:
    """At 27B's width on 2 cores a step took ~1.5 minutes: every block still ran the 3 steps that
    timed it, and tune.max_minutes=8 took 14. Now the first block stops when its next step would
    not fit, and a later block runs the steps its share holds at the first one's pace: none when
    not one fits."""
    _ticking(monkeypatch, 100)
    stream, tuned, data = _one_module_block()
    done, *_, pace = blockwise._train(
        stream, 0, tuned, data, steps=200, lr=1e-3, batch=2, seed=0, seconds=150
    )
    assert done == 1  # the compiling step took 100 of the 150 s: a second would overrun
    assert pace == 100.0  # its time bounds the next block's steps (0.5B: 24 blocks ran 1 step each)
    train = functools.partial(blockwise._train, stream, 0, tuned, data, steps=200, lr=1e-3, batch=2, seed=0)
    assert train(seconds=120, pace=150.0)[0] == 0
    done, *_, pace = train(seconds=700, pace=150.0)
    assert (done, pace) == (4, 100.0)  # the next block follows this one's pace


def test_a_blocks_step_time_leaves_room_for_what_a_block_costs_besides_steps() -> None:
    """Under tune.max_minutes each block's steps get its share of what is left less the last
    block's time outside its steps: at 0.5B's shapes a block's passes and checks took about 5 s
    besides its steps, and without this the budget ran over by that much a block."""
    assert budget.step_seconds(240.0, 24, 4.0) == pytest.approx(6.0)
    assert budget.step_seconds(240.0, 24, 0.0) == pytest.approx(10.0)
    assert budget.step_seconds(20.0, 10, 5.0) == 0.0  # over: the warm-up steps only


def test_the_best_validation_check_is_kept_not_the_last_step() -> None:
    """Validation is checked CHECKS times over the steps; the values of the best check stay (the
    input's when no check beats it)."""

    class Fake:
        def run(self, i, x):
            return x * lin.weight().sum()

    w = mx.ones((4, 64))
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    lin = blockwise.TunedLinear(reference=w, weight=wq, scales=s, biases=b, bits=4, group_size=64)
    data = blockwise.Windows(x_train=mx.ones((4, 2, 3)), y_train=mx.zeros((4, 2, 3)), x_val=mx.ones((1, 2, 3)),
                             y_val=mx.zeros((1, 2, 3)))  # fmt: skip
    seen, values = [], iter([3.0, 1.0, 2.0, 5.0])

    def validate() -> float:
        seen.append({k: np.array(v) for k, v in lin.snapshot().items()})
        return next(values)

    done, best, step, *_ = blockwise._train(
        Fake(), 0, {"m": lin}, data, steps=8, lr=1e-2, batch=2, seed=0, validate=validate, start=4.0
    )
    assert (done, best, step) == (8, 1.0, 4) and len(seen) == blockwise.CHECKS
    kept = lin.snapshot()  # the second check's codes, scales and biases, not the last step's
    assert all(np.array_equal(np.array(kept[k]), seen[1][k]) for k in kept)
    values = iter([5.0, 6.0, 7.0, 8.0])
    v0 = {k: np.array(v) for k, v in lin.snapshot().items()}
    assert (
        blockwise._train(
            Fake(),
            0,
            {"m": lin},
            data,
            steps=8,
            lr=1e-2,
            batch=2,
            seed=0,
            validate=lambda: next(values),
            start=4.0,
        )[2]
        == 0
    )
    assert all(np.array_equal(np.array(v), v0[k]) for k, v in lin.snapshot().items())  # the input's


def test_a_block_whose_validation_error_rises_keeps_the_input(tmp_path: Path, q3: Path) -> None:
    """One step far too large (half a grid step, every offset and log scale) scrambles every code:
    no block is kept and the input's bytes are written."""
    r, run = _run(
        tmp_path, f"model.name={q3}", f"tune.reference={FIXTURE}", *SMALL, "tune.lr=0.5", "tune.steps=1"
    )
    assert r.returncode == 0, r.stderr
    record = json.loads((run / "tune.json").read_text())
    assert record["status"] == "unchanged" and record["codes_changed"] == 0
    assert not any(b["kept"] for b in record["blocks"])
    assert "unchanged by tune: no block's" in r.stdout + r.stderr  # the cause, not the min_gain test
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


def test_tune_steps_0_hands_the_input_on_and_says_so(tmp_path: Path, q3: Path) -> None:
    r, run = _run(tmp_path, f"model.name={q3}", f"tune.reference={FIXTURE}", "tune.steps=0")
    assert r.returncode == 0, r.stderr
    record = json.loads((run / "tune.json").read_text())
    assert record["status"] == "skipped" and record["reason"] == "tune.steps=0"
    assert not (run / "model").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([f"model.name={FIXTURE}", f"tune.reference={FIXTURE}"], "is not a quantized model"),
        (["tune.reference=/nonexistent/ref"], "tune.reference"),
        (["tune.lr=0"], "tune.lr"),
        (["tune.lr=0.9"], "tune.lr=0.9 is out of range"),
        (["tune.steps=-1"], "tune.steps=-1 is out of range"),
        (["tune.val_samples=0"], "tune.val_samples=0"),
        (["tune.max_minutes=0"], "tune.max_minutes=0"),
        (["tune.validation_kinds=[]"], "tune.validation_kinds is empty"),
        (["tune.seq_len=60000"], "error: tune.seq_len=60000 is longer than the calibration text's training"),
        (
            [f"tune.reference={FIXTURE.parent / 'llama-text-12l'}"],
            "is not the model model.name was quantized from",
        ),
        (["sensitivity.calib.samples=3"], "sensitivity.calib.samples=3 is not read by command=tune"),
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


def test_a_reference_of_the_same_shapes_but_another_model_is_refused(tmp_path: Path, q3: Path) -> None:
    """Same config and shapes, other weights (another training run): quantize recorded its source."""
    other = other_model(FIXTURE, tmp_path / "other", metadata={"other": "1"})
    r, _ = _run(tmp_path, f"model.name={q3}", f"tune.reference={other}", *SMALL)
    assert r.returncode == 2 and "is not the model model.name was quantized from" in r.stderr, r.stderr


def test_a_tuned_model_tuned_again_is_checked_against_its_source(tmp_path: Path, q3: Path) -> None:
    """A tuned model keeps its input's source record: tuned again, its reference was checked by
    shapes only (with a warning that mlxbun had not written it) and another model passed."""
    r, run = _run(tmp_path, f"model.name={q3}", f"tune.reference={FIXTURE}", *SMALL, "tune.steps=1")
    assert r.returncode == 0, r.stderr
    again = tmp_path / "again"
    r2, run2 = _run(again, f"model.name={run / 'model'}", f"tune.reference={FIXTURE}", *SMALL, "tune.steps=1")
    assert r2.returncode == 0 and "records no source" not in r2.stderr, r2.stderr
    assert json.loads((run2 / "tune.json").read_text())["reference_checked_by"] == "source content"
    other = other_model(FIXTURE, tmp_path / "other", metadata={"other": "1"})
    r3, _ = _run(tmp_path / "other-run", f"model.name={run / 'model'}", f"tune.reference={other}", *SMALL)
    assert r3.returncode == 2 and "is not the model model.name was quantized from" in r3.stderr, r3.stderr


def test_a_reference_of_the_same_headers_but_other_tensor_bytes_is_refused(tmp_path: Path, q3: Path) -> None:
    """The source's config and safetensors header, one tensor byte changed: the header identity
    matches, the content identity quantize recorded does not."""
    ref = tmp_path / "ref"
    shutil.copytree(FIXTURE, ref)
    shard = bytearray((ref / "model.safetensors").read_bytes())
    shard[8 + int.from_bytes(shard[:8], "little") + 1001] ^= 0x01  # a low mantissa bit of a weight
    (ref / "model.safetensors").write_bytes(bytes(shard))
    r, run = _run(tmp_path, f"model.name={q3}", f"tune.reference={ref}", *SMALL)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert (
        line.startswith(f"error: tune.reference={str(ref)!r} is not the model") and "tensor bytes" in line
    ), line
    assert run is None


def test_a_reference_that_cannot_be_loaded_or_is_quantized_is_named_as_the_reference(
    tmp_path: Path, q3: Path
) -> None:
    empty = tmp_path / "noweights"
    empty.mkdir()
    r, _ = _run(tmp_path, f"model.name={q3}", f"tune.reference={empty}")
    assert r.returncode == 2 and "tune.reference" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r, _ = _run(tmp_path, f"model.name={q3}", f"tune.reference={q3}")
    assert r.returncode == 2 and "is a quantized model; pass the unquantized model" in r.stderr, r.stderr


def test_a_reference_that_is_not_finite_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    """The source quantize read, then a NaN written into one of its weights (same header, same
    identity; a record without the content identity, as an older quantize wrote it): tune stops
    at that block, naming the reference; nothing is published."""

    def copy(dst: Path, nan: bool) -> Path:
        dst.mkdir()
        for f in FIXTURE.iterdir():
            if f.suffix != ".safetensors":
                (dst / f.name).write_bytes(f.read_bytes())
        arrays, meta = mx.load(str(FIXTURE / "model.safetensors"), return_metadata=True)
        if nan:
            key = "model.layers.1.mlp.down_proj.weight"
            arrays[key] = mx.full(arrays[key].shape, np.nan, arrays[key].dtype)
        mx.save_safetensors(str(dst / "model.safetensors"), arrays, metadata=meta)
        return dst

    source, q = copy(tmp_path / "source", nan=False), tmp_path / "q3"
    quantize_model_dir(source, q, bits=3, group_size=64, dtype="bfloat16")
    record = json.loads((q / MARKER).read_text())
    del record["content"]  # else the NaN's bytes are refused before anything runs
    (q / MARKER).write_text(json.dumps(record))
    bad = copy(tmp_path / "bad", nan=True)
    (source / "model.safetensors").unlink()
    (bad / "model.safetensors").rename(source / "model.safetensors")
    r, _ = _run(tmp_path, f"model.name={q}", f"tune.reference={source}", *SMALL)
    assert (
        r.returncode == 2 and "block 1's output is not finite" in r.stderr and "Traceback" not in r.stderr
    ), r.stderr
    assert not list((tmp_path / "outputs").rglob("model.safetensors"))


def test_tune_without_a_reference_is_refused(tmp_path: Path, q3: Path) -> None:
    r, _ = _run(tmp_path, f"model.name={q3}")
    assert r.returncode == 2 and "tune.reference is not set" in r.stderr


def test_a_pipeline_ending_in_tune_writes_the_tuned_model_to_quant_out(tmp_path: Path) -> None:
    """quant.out names the run's model: the tuned one; quantize's stays in its step directory."""
    out = tmp_path / "final"
    r = run_cli(
        "command=pipeline", "pipeline.steps=[quantize,tune]", f"model.name={FIXTURE}", "quant.bits=3",
        f"quant.out={out}", f"tune.reference={FIXTURE}", *SMALL, tmp=tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    run = next((tmp_path / "outputs" / "pipeline").iterdir())
    assert (run / "quantize" / "model" / "config.json").is_file()
    assert json.loads((run / "tune" / "tune.json").read_text())["input"] == str(run / "quantize" / "model")
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    assert f"model: {out}" in r.stdout
    verified = run_cli("command=verify", f"runs.dir={run}", tmp=tmp_path)
    assert verified.returncode == 0, verified.stderr


def test_a_gain_inside_the_validation_noise_is_none() -> None:
    """The tuned model is written only when its per-token validation KL is lower than the input's
    by more than twice the standard error of the paired difference."""
    rng = np.random.default_rng(0)
    before = rng.exponential(0.2, 1024)
    noise = rng.normal(0, 0.05, 1024)
    assert not validation.significantly_lower(before + noise - 0.001, before)  # 0.5% lower: noise
    assert validation.significantly_lower(before + noise - 0.02, before)  # 10% lower: a gain
    assert not validation.significantly_lower(before + 0.01, before)


def test_the_block_loop_holds_no_embedding_or_head(q3: Path) -> None:
    """While tune trains the blocks, neither model holds its embedding or head (at a 262,144-word
    vocabulary and width 5,376: 2.8 GB in bfloat16, beside the block being trained); both are read
    again for the validation KL, and the states and logits are the same as when held throughout."""
    from mlxbun.quant.streamed import Stream

    ref, q = Stream(FIXTURE), Stream(q3, exact=True)
    tokens = np.arange(2 * 16, dtype=np.int32).reshape(2, 16) % 200
    before = (ref.head(ref.embed(tokens)), q.head(q.embed(tokens)))
    held = []

    def seen(r: blockwise.BlockResult) -> None:
        held.append([s.weight(p) for s in (ref, q) for p in {s.embedding_path, *s.head_paths}])

    blockwise.tune_streamed(ref, q, tokens, tokens[:1], steps=2, lr=1e-3, batch=2, seed=0, on_block=seen)
    assert len(held) == 4 and all(w is None or w.size == 0 for ws in held for w in ws)
    after = (ref.head(ref.embed(tokens)), q.head(q.embed(tokens)))
    assert all(mx.array_equal(a, b).item() for a, b in zip(before, after, strict=True))


def test_the_time_budget_holds_the_closing_validation_kl(monkeypatch: pytest.MonkeyPatch, q3: Path) -> None:
    """tune.max_minutes=8 at 27B's width ended the blocks on time, then the validation KL took 4
    minutes more. Its time is now taken from the budget before the blocks share it: a KL expected
    to fill the budget leaves each block only the step that times it."""
    from mlxbun.quant.streamed import Stream

    ref, q = Stream(FIXTURE), Stream(q3, exact=True)
    tokens = np.arange(4 * 16, dtype=np.int32).reshape(4, 16) % 200
    monkeypatch.setattr(blockwise, "kl_seconds", lambda *a: 59.9)
    given = []
    out = blockwise.tune_streamed(
        ref, q, tokens, tokens[:2], steps=20, lr=1e-3, batch=2, seed=0, max_minutes=1.0, on_budget=given.append
    )  # fmt: skip
    # 20 each when the KL was not counted; now the first block's warm-up step, and its time says
    # no later block can hold one: those are carried through on the validation windows only
    assert [r.steps for r in out.blocks] == [1, 0, 0, 0]
    assert [r.val_before is None for r in out.blocks] == [False, True, True, True]
    assert out.kl_seconds_expected == 59.9 and len(given) == 1 and given[0] <= 0.1
    assert out.kl_seconds > 0
    free = blockwise.tune_streamed(ref, q, tokens, tokens[:2], steps=1, lr=1e-3, batch=2, seed=0)
    assert out.kl_before == pytest.approx(free.kl_before, rel=1e-5)  # the carried blocks are the input's


def test_the_first_blocks_share_leaves_room_for_its_passes(monkeypatch: pytest.MonkeyPatch, q3: Path) -> None:
    """The first block had no block before it to say what its passes and checks cost, so its steps
    took its whole share and those took the next block's (at 27B's width block 1 got no step).
    Its reference and input passes, timed before its steps, stand in for them."""
    from mlxbun.quant.streamed import Stream

    ref, q = Stream(FIXTURE), Stream(q3, exact=True)
    tokens = np.arange(4 * 16, dtype=np.int32).reshape(4, 16) % 200
    outside = []
    real = budget.step_seconds
    monkeypatch.setattr(budget, "step_seconds", lambda left, n, o: outside.append(o) or real(left, n, o))
    blockwise.tune_streamed(ref, q, tokens, tokens[:2], steps=2, lr=1e-3, batch=2, seed=0, max_minutes=1.0)
    assert outside[0] > 0  # block 0's share (0 before: its passes and checks took block 1's)


def test_a_tight_budget_trains_the_first_blocks_it_holds_and_carries_the_rest() -> None:
    """At 0.5B's shapes under tune.max_minutes=5 a block's passes took about 10 s and a step 0.9 s:
    the 220 s left after the KL's could not take 23 blocks through their passes and a step each,
    and every block after the first was carried through untrained, 124 s used of 300. Carried
    blocks cost a few seconds, so the first ones that fit beside them train."""
    assert budget.blocks_to_train(195.0, 23, 10.0, 1.5, 0.9) == 17  # 17 x (10 + 0.9) + 6 x 1.5 <= 195
    assert budget.blocks_to_train(1000.0, 23, 10.0, 1.5, 0.9) == 23  # all of them, as without a budget
    assert budget.blocks_to_train(20.0, 23, 10.0, 1.5, 0.9) == 0  # not one: all carried
    assert budget.blocks_to_train(0.0, 1, 0.0, 0.0, 0.9) == 0


def test_a_validation_kl_over_half_the_budget_reads_fewer_tokens(
    monkeypatch: pytest.MonkeyPatch, q3: Path
) -> None:
    """At 27B's width on 2 cores the closing KL over all validation tokens took 6.5 of
    tune.max_minutes=8: the blocks got 1.5 minutes, and their one warm-up step ran the budget over.
    The KL now takes at most half the budget, over the whole slices that fit."""
    assert budget.kl_tokens(1024, 64, 100.0, 480.0) == 1024  # fits half: all of them
    assert budget.kl_tokens(1088, 64, 390.0, 480.0) == 640  # 17 slices, 10 of them fit 240 s
    assert budget.kl_tokens(1024, 64, 9999.0, 1.0) == 64  # one slice at least
    from mlxbun.quant.streamed import Stream

    ref, q = Stream(FIXTURE), Stream(q3, exact=True)
    tokens = np.arange(4 * 16, dtype=np.int32).reshape(4, 16) % 200
    monkeypatch.setattr(blockwise, "kl_seconds", lambda *a: 120.0)
    monkeypatch.setattr(blockwise, "kl_step", lambda *a: 8)
    out = blockwise.tune_streamed(
        ref, q, tokens, tokens[:2], steps=2, lr=1e-3, batch=2, seed=0, max_minutes=1.0
    )
    assert out.kl_tokens == 8 and out.kl_seconds_expected == pytest.approx(30.0)  # 1 of 4 slices


def test_one_timed_slice_gives_the_validation_kls_seconds(monkeypatch: pytest.MonkeyPatch, q3: Path) -> None:
    """:func:`kl_seconds` runs one slice of the KL and counts the slices the whole will take."""
    from mlxbun.quant.streamed import Stream

    ref, q = Stream(FIXTURE), Stream(q3, exact=True)
    h = ref.embed(np.arange(3 * 16, dtype=np.int32).reshape(3, 16) % 200)
    monkeypatch.setattr(validation, "kl_step", lambda *a: 10)
    _ticking(monkeypatch, 2)
    assert validation.kl_seconds(ref, h, q, h) == 2 * 5  # 48 tokens in slices of 10: 5 of 2 s


def test_a_significant_gain_below_min_gain_is_none() -> None:
    """Validation gains of 2.5% and 4% passed the significance test and came with held-out KL
    1% and 7% worse (tokens of a window are not independent): the tuned model is written only
    when its validation KL is also tune.min_gain below the input's."""
    rng = np.random.default_rng(0)
    before = rng.exponential(0.2, 4096)
    after = before * 0.97 + rng.normal(0, 0.002, 4096)  # 3% lower, far beyond twice the error
    assert validation.significantly_lower(after, before)
    assert not validation.gained(after, before, 0.05) and validation.gained(after, before, 0.0)
    assert validation.gained(before * 0.9, before, 0.05)


def test_min_gain_out_of_range_is_refused(tmp_path: Path, q3: Path) -> None:
    r, _ = _run(tmp_path, f"model.name={q3}", f"tune.reference={FIXTURE}", *SMALL, "tune.min_gain=1.5")
    assert (
        r.returncode == 2 and "tune.min_gain=1.5 is out of range" in r.stderr and "Traceback" not in r.stderr
    )
