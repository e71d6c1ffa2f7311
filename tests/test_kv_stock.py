"""kv snapshots are mlx-lm prompt-cache files: stock loaders open them and continue identically."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from kv_util import continue_logits, filled, tiny_model, tokens
from mlx_lm.models import cache as C

from mlxbun.kv.store import Store

KINDS = ["kv", "rotating", "quantized", "list"]


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.mark.parametrize("kind", KINDS)
def test_stock_load_prompt_cache_continues_like_the_original(model, tmp_path, kind):
    cache, toks = filled(model, kind, 70, decode=30)  # rotating rings (max 48) have wrapped
    info = Store(tmp_path).save("s", cache, tokens=toks, model="m", model_name="org/tiny")
    stock, meta = C.load_prompt_cache(str(info.path), return_metadata=True)
    assert meta["model"] == "org/tiny" and meta["tokenizer_config"] == "{}"
    assert [type(c).__name__ for c in stock] == [type(c).__name__ for c in cache]
    more = tokens(20, seed=9)
    want = continue_logits(model, cache, more, kind=kind)
    np.testing.assert_array_equal(continue_logits(model, stock, more, kind=kind), want)


@pytest.mark.parametrize("kind", KINDS)
def test_names_and_metadata_are_mlx_lms_own(model, tmp_path, kind):
    cache, toks = filled(model, kind, 30)
    ref = tmp_path / "ref.safetensors"
    C.save_prompt_cache(str(ref), cache, {"model": "org/tiny", "tokenizer_config": "{}"})
    info = Store(tmp_path / "s").save("s", cache, tokens=toks, model="m", model_name="org/tiny")
    want_arrays, want_meta = mx.load(str(ref), return_metadata=True)
    got_arrays, got_meta = mx.load(str(info.path), return_metadata=True)
    ours = {k for k in got_meta if k.startswith("0.mlxbun_")}
    assert ours == {"0.mlxbun_kvs", "0.mlxbun_sha256", "0.mlxbun_header"}
    assert {k: v for k, v in got_meta.items() if k not in ours} == want_meta
    assert sorted(got_arrays) == sorted(want_arrays)  # no extra tensors
    for name, a in got_arrays.items():
        b = want_arrays[name]
        assert a.dtype == b.dtype and a.ndim == b.ndim
        if a.ndim == 4:  # mlx-lm keeps the padded buffer; a snapshot keeps the valid slots
            np.testing.assert_array_equal(np.array(a), np.array(b[..., : a.shape[2], :]))
        else:
            np.testing.assert_array_equal(np.array(a), np.array(b))


def test_stock_greedy_generation_matches_a_run_from_scratch(model, tmp_path):
    from mlx_lm.generate import generate_step

    prompt = tokens(60, seed=3)
    cache = C.make_prompt_cache(model)
    model(mx.array(prompt[:-1])[None], cache=cache)
    mx.eval([c.state for c in cache])
    info = Store(tmp_path).save("s", cache, tokens=prompt[:-1], model="m")

    def greedy(c, rest):
        return [int(t) for t, _ in generate_step(mx.array(rest), model, max_tokens=16, prompt_cache=c)]

    scratch = greedy(C.make_prompt_cache(model), prompt)
    assert greedy(C.load_prompt_cache(str(info.path)), prompt[-1:]) == scratch
