"""rounding: range-searched affine quantization in mlx's own layout, checked against mx.quantize."""

from __future__ import annotations

import hashlib
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from test_quantize import hessians_of, make_hf_model

from mlxbun.errors import InputError
from mlxbun.quant import rounding, spec
from mlxbun.quant.calibrate import calibrate
from mlxbun.quant.quantize.command import quantize_model_dir

pytestmark = pytest.mark.blas

BITS = (2, 3, 4, 5, 6, 8)


def _weight(rows: int = 64, cols: int = 256, seed: int = 0) -> mx.array:
    """Gaussian weights with per-column scale spread and a few outliers, like trained linears."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)) * np.exp(0.5 * rng.standard_normal(cols))
    w[rng.integers(0, rows, 8), rng.integers(0, cols, 8)] *= 8
    return mx.array(w.astype(np.float32)).astype(mx.bfloat16)


def _codes(q, s, b, bits: int, g: int) -> np.ndarray:
    deq = mx.dequantize(q, s.astype(mx.float32), b.astype(mx.float32), group_size=g, bits=bits)
    return np.asarray(
        mx.round((deq - mx.repeat(b.astype(mx.float32), g, -1)) / mx.repeat(s.astype(mx.float32), g, -1))
    )


def _bytes(a: mx.array) -> bytes:
    return np.asarray(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a).tobytes()


def _group_err(w: mx.array, parts, bits: int, g: int, imp: np.ndarray | None = None) -> np.ndarray:
    s, b = parts[1].astype(mx.float32), parts[2].astype(mx.float32)
    deq = np.asarray(mx.dequantize(parts[0], s, b, group_size=g, bits=bits))
    e = np.square(np.asarray(w.astype(mx.float32)) - deq) * (1 if imp is None else imp)
    return e.reshape(w.shape[0], -1, g).sum(-1)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("g", [32, 64, 128])
def test_pack_is_mlx_bit_layout(bits, g):
    q, s, b = mx.quantize(_weight(), group_size=g, bits=bits)
    codes = _codes(q, s, b, bits, g).astype(np.int64)
    assert np.array_equal(rounding.pack(codes, bits), np.asarray(q))


def test_pack_golden_bytes():
    codes = np.arange(32, dtype=np.int64).reshape(1, 32) % 8
    assert rounding.pack(codes, 3).tobytes().hex() == "88c6fa88c6fa88c6fa88c6fa"
    assert rounding.pack(np.full((1, 8), 15), 4).tobytes().hex() == "ffffffff"


def test_rtn_is_mx_quantize():
    w = _weight()
    for a, b in zip(
        rounding.quantize(w, bits=4, group_size=64, method="rtn"), mx.quantize(w, 64, 4), strict=True
    ):
        assert mx.array_equal(a, b)


@pytest.mark.parametrize("bits", BITS)
def test_clip_never_worse_than_mx_quantize_per_group(bits):
    w = _weight(seed=bits)
    imp = np.exp(np.random.default_rng(1).standard_normal(256)).astype(np.float32)
    for importance in (None, imp):
        mine = rounding.quantize(w, bits=bits, group_size=64, importance=importance)
        ref = mx.quantize(w, group_size=64, bits=bits)
        assert [a.shape for a in mine] == [a.shape for a in ref]
        assert [a.dtype for a in mine] == [a.dtype for a in ref]
        e_mine, e_ref = _group_err(w, mine, bits, 64, importance), _group_err(w, ref, bits, 64, importance)
        assert (e_mine <= e_ref * (1 + 1e-6) + 1e-12).all()
        if bits <= 4:
            assert e_mine.sum() < 0.95 * e_ref.sum()  # the search finds real gains at low bits


def test_clip_is_deterministic_and_blocking_does_not_change_bytes(monkeypatch):
    w = _weight(rows=96)
    one = [_bytes(a) for a in rounding.quantize(w, bits=3, group_size=32)]
    monkeypatch.setattr(rounding, "BLOCK_ELEMENTS", 256 * 7)  # 7 rows per block
    two = [_bytes(a) for a in rounding.quantize(w, bits=3, group_size=32)]
    assert one == two


def test_clip_and_gptq_golden_bytes():
    """The range search and GPTQ write these bytes (the search over every ratio at once gives what
    the ratio-by-ratio search gave)."""
    h = hashlib.sha256()
    w = _weight(rows=48, cols=256, seed=3)
    x = np.random.default_rng(2).standard_normal((512, 256)).astype(np.float32)
    hessian = x.T @ x / 512
    for bits in (2, 3, 4, 8):
        for g in (32, 64, 128):
            for m in ("clip", "gptq"):
                for a in rounding.quantize(
                    w, bits=bits, group_size=g, method=m, hessian=hessian if m == "gptq" else None
                ):
                    h.update(_bytes(a))
    assert h.hexdigest() == "6ea42753cf7a3c9693bf8858bdb4cd6948ce8201933ef26d22b59b906159a670"


def test_bad_method_is_refused(tmp_path):
    with pytest.raises(
        InputError, match="quant.method='omq' is not allowed; choose one of rtn, clip, gptq, awq"
    ):
        spec.check_method("omq")
    with pytest.raises(InputError, match="needs mode affine"):
        spec.check_method("clip", mode="mxfp4")
    src = make_hf_model(tmp_path / "src", "llama")
    with pytest.raises(InputError, match="quant.method"):
        quantize_model_dir(src, tmp_path / "out", bits=4, group_size=64, method="nope")
    assert not (tmp_path / "out").exists()


def _digest(d: Path) -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(d.glob("model*.safetensors")))).hexdigest()


def _weight_error(src: Path, out: Path) -> float:
    """Summed squared error of every quantized Linear weight against the source."""
    from mlx_lm.utils import load

    ref, _ = load(str(src))
    cur, _ = load(str(out))
    ref_w = dict(_linears(ref))
    total = 0.0
    for path, mod in _linears(cur):
        if hasattr(mod, "scales"):
            deq = mx.dequantize(mod.weight, mod.scales, mod.biases, group_size=mod.group_size, bits=mod.bits)
            total += float(mx.sum(mx.square(deq.astype(mx.float32) - ref_w[path].weight.astype(mx.float32))))
    return total


def _linears(model):
    import mlx.nn as nn

    return [(p, m) for p, m in model.named_modules() if isinstance(m, (nn.Linear, nn.QuantizedLinear))]


def test_clip_model_loads_in_mlx_lm_generates_and_is_closer(tmp_path):
    from mlx_lm import generate, load

    src = make_hf_model(tmp_path / "src", "llama", intermediate_size=256)
    rtn = quantize_model_dir(src, tmp_path / "rtn", bits=3, group_size=64).out
    clip = quantize_model_dir(src, tmp_path / "clip", bits=3, group_size=64, method="clip").out
    again = quantize_model_dir(src, tmp_path / "again", bits=3, group_size=64, method="clip").out
    assert _digest(clip) == _digest(again) != _digest(rtn)
    assert (clip / "config.json").read_text() == (rtn / "config.json").read_text()
    model, tok = load(str(clip))
    assert isinstance(generate(model, tok, prompt="w3 w4 w5 w6", max_tokens=8), str)
    assert _weight_error(src, clip) < 0.95 * _weight_error(src, rtn)
    tokens = mx.array(np.random.default_rng(0).integers(3, 64, (4, 32)))
    ref = load(str(src))[0](tokens).astype(mx.float32)
    errs = [float(mx.mean(mx.square(load(str(d))[0](tokens).astype(mx.float32) - ref))) for d in (clip, rtn)]
    assert np.isfinite(errs).all() and errs[0] < errs[1]


def test_clip_in_row_blocks_matches_whole_modules(tmp_path, monkeypatch):
    from mlxbun.quant.quantize import convert

    src = make_hf_model(tmp_path / "src", "llama", vocab_size=100)
    whole = quantize_model_dir(src, tmp_path / "whole", bits=4, group_size=32, method="clip").out
    monkeypatch.setattr(convert, "BIG_TENSOR", 1000)
    monkeypatch.setattr(convert, "CHUNK_BYTES", 4096)
    blocked = quantize_model_dir(src, tmp_path / "blocked", bits=4, group_size=32, method="clip").out
    assert _digest(whole) == _digest(blocked)


def _correlated_hessian(cols: int, seed: int = 0) -> mx.array:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2048, 16)) @ rng.standard_normal((16, cols)) + 0.3 * rng.standard_normal(
        (2048, cols)
    )
    x *= np.exp(rng.standard_normal(cols))
    return mx.array((x.T @ x).astype(np.float32))


def _plain_order_gptq(w: mx.array, h: mx.array, bits: int, g: int) -> mx.array:
    """Textbook GPTQ in column order, each group's grid searched on the group as it stands."""
    n = (1 << bits) - 1
    W = np.array(w.astype(mx.float32))
    imp = np.maximum(np.diag(np.asarray(h)), 0)
    U = rounding.inverse_factor(np.asarray(h))
    deq = np.empty_like(W)
    for i in range(0, W.shape[1], g):
        _, s, b = rounding._search(
            mx.array(W[:, i : i + g]),
            mx.array(imp[i : i + g]),
            bits=bits,
            group_size=g,
            dtype=w.dtype,
            codes=False,
        )
        s, b = np.asarray(s)[:, 0], np.asarray(b)[:, 0]
        for k in range(i, i + g):
            deq[:, k] = s * np.clip(np.round((W[:, k] - b) / s), 0, n) + b
            W[:, k + 1 :] -= np.outer((W[:, k] - deq[:, k]) / U[k, k], U[k, k + 1 :])
    return mx.array(deq)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_gptq_rounds_in_act_order_below_the_plain_orders_error(bits):
    """The columns of largest diag(H) are rounded first: with the energetic inputs last in column
    order, the output error is well below the plain order's."""
    from mlxbun.quant.hessian import output_error

    w = _weight(rows=32)
    h = np.array(_correlated_hessian(256, seed=1))
    ramp = np.exp(np.linspace(-1.5, 1.5, 256)).astype(np.float32)  # energy grows along the columns
    h = mx.array(h * ramp[:, None] * ramp[None, :])
    order, _ = rounding.gptq_factor(h)
    assert order[0] > 128 and np.diag(np.asarray(h))[order[0]] == np.diag(np.asarray(h)).max()
    ours = mx.dequantize(*rounding.quantize(w, bits=bits, group_size=64, method="gptq", hessian=h), 64, bits)
    ref = w.astype(mx.float32)
    mine = output_error(ours.astype(mx.float32) - ref, h)
    plain = output_error(_plain_order_gptq(w, h, bits, 64) - ref, h)
    assert mine < 0.95 * plain, (mine, plain)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_gptq_lowers_the_output_error_and_keeps_mlx_layout(bits):
    from mlxbun.quant.hessian import output_error

    w, h = _weight(rows=32), _correlated_hessian(256)
    errs = {}
    for method in ("rtn", "clip", "gptq"):
        parts = rounding.quantize(w, bits=bits, group_size=64, method=method, hessian=h)
        assert [a.dtype for a in parts] == [a.dtype for a in mx.quantize(w, 64, bits)]
        deq = mx.dequantize(*parts, group_size=64, bits=bits)
        errs[method] = output_error(deq.astype(mx.float32) - w.astype(mx.float32), h)
    assert errs["gptq"] < 0.7 * errs["rtn"] and errs["clip"] <= errs["rtn"]
    again = rounding.quantize(w, bits=bits, group_size=64, method="gptq", hessian=h)
    assert [_bytes(a) for a in again] == [
        _bytes(a) for a in rounding.quantize(w, bits=bits, group_size=64, method="gptq", hessian=h)
    ]


def test_hessian_of_the_head_is_its_inputs_gram_matrix(tmp_path):
    from mlx_lm.utils import load

    from mlxbun.quant import hessian

    src = make_hf_model(tmp_path / "src", "llama")
    model, _ = load(str(src))
    model.set_dtype(mx.float32)
    tokens = np.random.default_rng(0).integers(3, 64, (3, 16))
    h = hessian.capture(model, tokens, batch_size=2)
    x = model.model(mx.array(tokens)).reshape(-1, 128)
    assert np.allclose(np.asarray(h["lm_head"]), np.asarray(x.T @ x), rtol=1e-4, atol=1e-3)
    assert "model.layers.3.mlp.down_proj" in h and "model.embed_tokens" not in h  # untied
    assert type(model.model.layers[0].self_attn.q_proj).__name__ == "Linear"  # hooks removed
    hessian.save(h, tmp_path / "h.safetensors", tokens=tokens.size)
    back = hessian.load(tmp_path / "h.safetensors")
    assert sorted(back) == sorted(h) and mx.array_equal(back["lm_head"], h["lm_head"])


def test_tied_embedding_gets_the_head_hessian(tmp_path):
    from mlx_lm.utils import load

    from mlxbun.quant import hessian

    src = make_hf_model(tmp_path / "src", "qwen3")
    model, _ = load(str(src))
    model.set_dtype(mx.float32)
    tokens = np.random.default_rng(0).integers(3, 64, (2, 16))
    h = hessian.capture(model, tokens)
    x = model.model(mx.array(tokens)).reshape(-1, 128)
    assert np.allclose(np.asarray(h["model.embed_tokens"]), np.asarray(x.T @ x), rtol=1e-4, atol=1e-3)


def test_gptq_model_loads_generates_and_is_closer_than_rtn(tmp_path):
    from mlx_lm import generate, load

    from mlxbun.quant import hessian

    src = make_hf_model(tmp_path / "src", "llama", intermediate_size=256)
    _, tokens = hessians_of(src, tmp_path / "h.safetensors", rows=8)
    model = load(str(src))[0]
    model.set_dtype(mx.float32)
    calib = tmp_path / "calib.txt"
    calib.write_text(" ".join(f"w{t}" for t in tokens.ravel()))
    captured = calibrate(model_dir=src, out_dir=tmp_path / "c", calib_path=calib, samples=2, seq_len=16)
    assert "model.layers.0.self_attn.q_proj" in hessian.load(captured.path)
    with pytest.raises(InputError, match="needs quant.hessians"):
        quantize_model_dir(src, tmp_path / "x", bits=3, group_size=64, method="gptq")
    kw = dict(bits=3, group_size=64, method="gptq", hessians=tmp_path / "h.safetensors")
    gptq = quantize_model_dir(src, tmp_path / "gptq", **kw).out
    assert _digest(gptq) == _digest(quantize_model_dir(src, tmp_path / "again", **kw).out)
    rtn = quantize_model_dir(src, tmp_path / "rtn", bits=3, group_size=64).out
    m, tok = load(str(gptq))
    assert isinstance(generate(m, tok, prompt="w3 w4 w5 w6", max_tokens=8), str)
    ref = model(mx.array(tokens))
    errs = [
        float(mx.mean(mx.square(load(str(d))[0](mx.array(tokens)).astype(mx.float32) - ref)))
        for d in (gptq, rtn)
    ]
    assert errs[0] < 0.8 * errs[1]


def test_a_file_that_is_not_hessians_is_refused(tmp_path):
    from mlxbun.quant import hessian

    mx.save_safetensors(str(tmp_path / "x.safetensors"), {"a": mx.zeros((2, 2))})
    with pytest.raises(InputError, match="is not an mlxbun hessians file"):
        hessian.load(tmp_path / "x.safetensors")
    mx.save_safetensors(
        str(tmp_path / "y.safetensors"), {"a": mx.zeros((2, 3))}, {"format": "mlxbun-hessians"}
    )
    with pytest.raises(InputError, match=r"'a' has shape \(2, 3\); expected \(n, n\)"):
        hessian.load(tmp_path / "y.safetensors")


def test_cli_quantize_with_clip_and_bad_method(tmp_path):
    from cli_util import run_cli

    src = make_hf_model(tmp_path / "src", "llama")
    common = [f"model.name={src}", "blas=off", "command=quantize", "quant.bits=3"]
    ok = run_cli(*common, "quant.method=clip", f"quant.out={tmp_path / 'clip'}", tmp=tmp_path)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert _digest(tmp_path / "clip") == _digest(
        quantize_model_dir(src, tmp_path / "lib", bits=3, group_size=64, method="clip").out
    )
    bad = run_cli(*common, "quant.method=clip", "quant.mode=mxfp4", "quant.bits=4", tmp=tmp_path)
    assert bad.returncode == 2 and "needs mode affine" in bad.stderr and "Traceback" not in bad.stderr
    no_h = run_cli(*common, "quant.method=gptq", f"quant.out={tmp_path / 'g'}", tmp=tmp_path)
    assert no_h.returncode == 2 and "needs quant.hessians" in no_h.stderr and not (tmp_path / "g").exists()


def test_stacked_experts_are_rounded_one_matrix_at_a_time():
    """A SwitchLinear weight (experts, out, in): clip works on each expert's matrix, and the
    results stack in mx.quantize's layout."""
    w = mx.stack([_weight(seed=s, rows=32) for s in range(3)])
    whole = rounding.quantize(w, bits=3, group_size=64, method="clip")
    each = [rounding.quantize(w[e], bits=3, group_size=64, method="clip") for e in range(3)]
    ref = mx.quantize(w, group_size=64, bits=3)
    assert [a.shape for a in whole] == [a.shape for a in ref]
    for k in range(3):
        assert mx.array_equal(whole[k], mx.stack([p[k] for p in each]))


def test_gptq_in_slices_of_rows_gives_the_same_bytes_with_bounded_temporaries(monkeypatch):
    """A large weight (a 150K-row embedding) is GPTQ-rounded in slices of rows, which are
    independent: the same bytes as whole, and the host's peak (numpy's float32 copies, the later
    columns' updates, the packing's bit planes) near one slice's, not several copies of the weight."""
    import tracemalloc

    w, h = _weight(rows=2048, cols=256), _correlated_hessian(256)
    peaks, out = [], []
    for chunk in (1 << 30, 64 * 256):  # whole, then slices of 2 x 64 rows: 16 slices
        monkeypatch.setattr(rounding, "CHUNK", chunk)
        tracemalloc.start()
        out.append([_bytes(a) for a in rounding.quantize(w, bits=5, group_size=64, method="gptq", hessian=h)])
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    assert out[1] == out[0]
    assert peaks[1] < 0.4 * peaks[0], peaks


def test_the_gptq_factor_holds_its_hessian_at_most_three_times_over():
    """gptq_factor's temporaries on the host stay within three float32 copies of H (numpy's
    cholesky works in float64: 4x H on its own; the former float64 route held about 5x, plus MLX's
    copies): a 21,504-wide H (Gemma-3-27B's down_proj) is 1.85 GB a copy. U is the float64
    route's to float32 rounding."""
    import tracemalloc

    h = np.array(_correlated_hessian(2048))
    order = np.argsort(-np.diag(h.astype(np.float64)), kind="stable")
    H = h.astype(np.float64)[np.ix_(order, order)]  # the float64 route
    d = np.diag(H).copy()
    H[np.diag_indices_from(H)] += rounding.DAMP * d.mean()
    want = np.linalg.inv(np.linalg.cholesky(H[::-1, ::-1]))[::-1, ::-1]
    tracemalloc.start()
    got_order, U = rounding.gptq_factor(h)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert np.array_equal(got_order, order)
    assert U.dtype == np.float32 and U.flags.c_contiguous and np.array_equal(U, np.triu(U))
    assert np.abs(U - want).max() < 1e-3 * np.abs(want).max()
    assert peak < 3.2 * h.nbytes, peak / h.nbytes
