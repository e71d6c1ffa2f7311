"""hessian: block-by-block capture equals a whole-model forward with hooks; the lazy file reader."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from test_quantize import make_hf_model

from mlxbun.errors import InputError
from mlxbun.quant import hessian
from mlxbun.quant.calibrate import calibrate

TOKENS = np.random.default_rng(0).integers(3, 64, (5, 24))


def _reference(model, tokens) -> dict:
    """Every Linear's (and a tied head's) input Gram matrix, hooked on one plain forward."""
    store: dict = {}

    def hook(path, m):
        def call(x, *a, **k):
            xf = x.reshape(-1, x.shape[-1]).astype(mx.float32)
            store[path] = store.get(path, 0) + xf.T @ xf
            return m(x, *a, **k)

        return call

    class Hook(nn.Module):
        def __init__(self, path, m):
            super().__init__()
            self.fn = hook(path, m)

        def __call__(self, x, *a, **k):
            return self.fn(x, *a, **k)

    leaves = tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module)
    linears = [(p, m) for p, m in leaves if isinstance(m, nn.Linear)]
    model.update_modules(tree_unflatten([(p, Hook(p, m)) for p, m in linears]))
    for p, m in leaves:
        if isinstance(m, nn.Embedding):
            m.as_linear = lambda x, p=p, m=m: (hook(p, lambda y: y)(x), nn.Embedding.as_linear(m, x))[1]
    model(mx.array(tokens))
    model.update_modules(tree_unflatten(linears))
    for _, m in leaves:
        if isinstance(m, nn.Embedding) and "as_linear" in m.__dict__:
            del m.as_linear
    return store


def _model(tmp_path, arch):
    from mlx_lm.utils import load

    model, _ = load(str(make_hf_model(tmp_path / arch, arch)))
    model.set_dtype(mx.float32)
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text"])
def test_streamed_capture_equals_one_hooked_forward(tmp_path, arch):
    model = _model(tmp_path, arch)
    ref = _reference(model, TOKENS)
    got = hessian.capture(model, TOKENS, batch_size=2)
    assert sorted(got) == sorted(ref)
    for k in ref:
        assert np.allclose(np.asarray(got[k]), np.asarray(ref[k]), rtol=1e-4, atol=1e-3), k
    logits = model(mx.array(TOKENS))  # the model is left as it was
    again = hessian.capture(model, TOKENS, batch_size=3, release=True)
    assert all(np.allclose(np.asarray(again[k]), np.asarray(ref[k]), rtol=1e-4, atol=1e-3) for k in ref)
    assert all(a.size == 0 for _, a in tree_flatten(model.model.layers[0].parameters()))  # released
    assert logits.shape[:2] == TOKENS.shape


def test_calibrate_loads_lazily_and_matches(tmp_path):
    src = make_hf_model(tmp_path / "src", "llama")
    calib = tmp_path / "calib.txt"
    calib.write_text(" ".join(f"w{t}" for t in TOKENS.ravel()))
    out = calibrate(model_dir=src, out_dir=tmp_path, calib_path=calib, samples=2, seq_len=16).path
    lazy = hessian.Hessians(out)
    eager = hessian.load(out)
    assert sorted(lazy) == sorted(eager) and len(lazy) == len(eager)
    for k in eager:
        got = lazy[k]
        assert got.dtype == np.float32 and np.array_equal(got, np.asarray(eager[k]))
    with pytest.raises(KeyError):
        lazy["nope"]


def test_lazy_reader_refuses_what_is_not_a_hessians_file(tmp_path):
    mx.save_safetensors(str(tmp_path / "x.safetensors"), {"a": mx.zeros((2, 2))})
    with pytest.raises(InputError, match="is not an mlxbun hessians file"):
        hessian.Hessians(tmp_path / "x.safetensors")
    meta = {"format": "mlxbun-hessians"}
    mx.save_safetensors(str(tmp_path / "y.safetensors"), {"a": mx.zeros((2, 3))}, meta)
    with pytest.raises(InputError, match=r"'a' has shape \(2, 3\) \(F32\); expected float32 \(n, n\)"):
        hessian.Hessians(tmp_path / "y.safetensors")
    mx.save_safetensors(str(tmp_path / "z.safetensors"), {"a": mx.zeros((2, 2), mx.float16)}, meta)
    with pytest.raises(InputError, match="F16"):
        hessian.Hessians(tmp_path / "z.safetensors")


def test_streamed_file_equals_in_memory_capture_and_golden_header(tmp_path):
    from mlx_lm.utils import load

    from mlxbun.quant.calibration import load_calibration

    src = make_hf_model(tmp_path / "src", "qwen3")
    calib = tmp_path / "calib.txt"
    calib.write_text(" ".join(f"w{t}" for t in TOKENS.ravel()))
    out = calibrate(model_dir=src, out_dir=tmp_path, calib_path=calib, samples=2, seq_len=16).path
    model, tok = load(str(src))
    model.set_dtype(mx.float32)
    tokens = load_calibration(tokenizer=tok, path=calib, samples=2, seq_len=16, seed=0).tokens
    ref = hessian.capture(model, tokens)
    got = hessian.load(out)
    assert sorted(got) == sorted(ref) and "model.embed_tokens" in got  # tied head
    assert all(np.allclose(np.asarray(got[k]), np.asarray(ref[k]), rtol=1e-5, atol=1e-4) for k in ref)
    assert not list(tmp_path.glob(".hessians.safetensors*"))  # the spool is gone
    hessian.save({"b": mx.eye(2), "a": mx.ones((1, 1))}, tmp_path / "g.safetensors", tokens=7)
    raw = (tmp_path / "g.safetensors").read_bytes()
    assert raw[:8] == (len(raw) - 8 - 20).to_bytes(8, "little")
    assert raw[8:].startswith(b'{"__metadata__":{"format":"mlxbun-hessians","tokens":"7"},"a":{"dtype":"F32"')
    assert raw[-20:] == np.float32([1, 1, 0, 0, 1]).tobytes()  # a (1x1) then b (2x2), sorted


def test_an_unfinished_writer_publishes_nothing(tmp_path):
    with pytest.raises(RuntimeError), hessian.Writer(tmp_path / "h.safetensors") as w:
        w.add("a", np.eye(3))
        raise RuntimeError("killed")
    assert list(tmp_path.iterdir()) == []


def test_a_batch_is_added_into_the_running_h_without_a_second_h() -> None:
    """A wide down_proj's H is the largest thing the capture holds: a batch's Gram matrix is added
    into its buffer (a sum then an add held two)."""
    import mlx.core as mx

    from mlxbun.quant import hessian

    n, t = 1024, 64
    store: dict = {}
    with mx.stream(mx.cpu):  # the CPU backend donates addmm's input buffer (MLX's CUDA one does not)
        x = mx.random.normal((t, n), key=mx.random.key(0))
        mx.eval(x)
        hessian._accumulate(store, "m", x)
        mx.eval(store["m"])
        mx.clear_cache()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        hessian._accumulate(store, "m", x)
        mx.eval(store["m"])
    assert mx.get_peak_memory() - base < 0.5 * n * n * 4
    assert mx.allclose(store["m"], 2 * (x.T @ x), rtol=1e-5, atol=1e-3)
