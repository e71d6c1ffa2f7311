"""Rounded modules kept on disk (mlxbun.quant.quantize.cache): read back, a quantize writes the same bytes;
a damaged file is rounded again; a cache that cannot be written costs nothing but time."""

from __future__ import annotations

import json
import logging

import mlx.core as mx
import numpy as np
import pytest
from test_quantize import hessians_of, make_hf_model

from mlxbun.quant.quantize import cache as rounded
from mlxbun.quant.quantize.command import quantize_model_dir

L0 = "model.layers.0"


@pytest.fixture(scope="module")
def gptq_source(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rounded")
    src = make_hf_model(tmp / "src", "llama", intermediate_size=256)
    hessians_of(src, tmp / "h.safetensors")
    plan = tmp / "plan.json"
    layers = {
        f"{L0}.mlp.up_proj": {"bits": 3, "group_size": 32, "method": "gptq"},
        f"{L0}.mlp.gate_proj": {"bits": 3, "group_size": 64, "method": "clip"},
        f"{L0}.mlp.down_proj": {"bits": 4, "group_size": 64, "method": "gptq"},
    }
    plan.write_text(json.dumps({"version": 1, "default": {"bits": 4, "group_size": 64}, "layers": layers}))
    return src, plan, tmp / "h.safetensors"


def _bytes(out):
    return [p.read_bytes() for p in sorted(out.glob("*.safetensors"))]


def _quantize(gptq_source, out, cache=None):
    src, plan, h = gptq_source
    return quantize_model_dir(src, out, plan=plan, hessians=h, rounded=cache).out


def test_read_back_roundings_write_the_same_bytes(gptq_source, tmp_path, caplog):
    plain = _quantize(gptq_source, tmp_path / "plain")
    with caplog.at_level(logging.INFO, logger="mlxbun"):
        first = _quantize(gptq_source, tmp_path / "first", tmp_path / "cache")
    assert "0 rounded module(s) read back" in caplog.text and "3 rounded here" in caplog.text
    kept = sorted((tmp_path / "cache").rglob("*.safetensors"))
    assert len(kept) == 3  # the two gptq and the clip module; rtn is never kept
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mlxbun"):
        second = _quantize(gptq_source, tmp_path / "second", tmp_path / "cache")
    assert "3 rounded module(s) read back" in caplog.text and "0 rounded here" in caplog.text
    assert _bytes(plain) == _bytes(first) == _bytes(second)


def test_a_damaged_file_is_rounded_again_and_replaced(gptq_source, tmp_path, caplog):
    plain = _quantize(gptq_source, tmp_path / "plain")
    _quantize(gptq_source, tmp_path / "first", tmp_path / "cache")
    kept = sorted((tmp_path / "cache").rglob("*.safetensors"))
    data = bytearray(kept[0].read_bytes())
    data[-1] ^= 0xFF  # a tensor byte: the file still parses, its digest does not match
    kept[0].write_bytes(bytes(data))
    kept[1].write_bytes(b"not a safetensors file")
    with caplog.at_level(logging.INFO, logger="mlxbun"):
        again = _quantize(gptq_source, tmp_path / "again", tmp_path / "cache")
    assert caplog.text.count("is unusable") == 2 and "1 rounded module(s) read back" in caplog.text
    assert _bytes(again) == _bytes(plain)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mlxbun"):
        _quantize(gptq_source, tmp_path / "third", tmp_path / "cache")
    assert "3 rounded module(s) read back" in caplog.text  # the two were replaced


def test_a_cache_that_cannot_be_written_is_skipped(gptq_source, tmp_path, caplog):
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache directory would be")
    with caplog.at_level(logging.WARNING, logger="mlxbun"):
        out = _quantize(gptq_source, tmp_path / "out", blocked / "rounded")
    assert "cannot keep the rounded" in caplog.text and str(blocked) in caplog.text
    assert _bytes(out) == _bytes(_quantize(gptq_source, tmp_path / "plain"))


def test_the_key_covers_the_setting_the_weight_and_the_hessians(tmp_path):
    w = mx.array(np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)).astype(mx.bfloat16)
    a = rounded.Rounded(tmp_path, "a" * 64)
    base = a.file("m", w, bits=4, group_size=64, method="gptq")
    assert base.parent.parent.name == "a" * 16
    assert base != a.file("m", w, bits=3, group_size=64, method="gptq")
    assert base != a.file("m", w, bits=4, group_size=32, method="gptq")
    assert base != a.file("m", w, bits=4, group_size=64, method="clip")
    assert base != a.file("n", w, bits=4, group_size=64, method="gptq")
    assert base != a.file("m", w + 1, bits=4, group_size=64, method="gptq")
    assert base != a.file("m", w.astype(mx.float16), bits=4, group_size=64, method="gptq")
    assert base != rounded.Rounded(tmp_path, "b" * 64).file("m", w, bits=4, group_size=64, method="gptq")


def test_a_cache_mlx_cannot_write_is_skipped(gptq_source, tmp_path, caplog, monkeypatch):
    """mlx's own save raises RuntimeError (a full disk, a file it cannot open): logged, skipped."""

    def refuse(*args, **kwargs):
        raise RuntimeError("[save_safetensors] Failed to open file")

    monkeypatch.setattr(mx, "save_safetensors", refuse)
    with caplog.at_level(logging.WARNING, logger="mlxbun"):
        out = _quantize(gptq_source, tmp_path / "out", tmp_path / "cache")
    assert caplog.text.count("cannot keep the rounded") == 3
    monkeypatch.undo()
    assert _bytes(out) == _bytes(_quantize(gptq_source, tmp_path / "plain"))


def test_roundings_on_worker_processes_write_the_same_bytes(gptq_source, tmp_path, monkeypatch):
    """A big model's clip and GPTQ roundings run on processes (mlxbun.quant.workers): the same bytes."""
    from mlxbun.quant import workers

    src, plan, h = gptq_source
    plain = quantize_model_dir(src, tmp_path / "plain", plan=plan, hessians=h, threads=1).out
    monkeypatch.setattr(workers, "MIN_WEIGHTS", 0)
    sent = []
    real = workers.quantize
    monkeypatch.setattr(workers, "quantize", lambda *a, **k: sent.append(k["method"]) or real(*a, **k))
    pooled = quantize_model_dir(src, tmp_path / "pooled", plan=plan, hessians=h, threads=2).out
    assert sorted(sent) == ["clip", "gptq", "gptq"]
    assert _bytes(plain) == _bytes(pooled)


def _blas_of_this_process() -> dict:
    from mlxbun import blas

    return dict(blas._loaded or {})


def test_a_worker_process_loads_the_blas_before_mlx(monkeypatch):
    """The pool's initializer is mlx-free: a worker loads the BLAS it is handed before it imports
    mlxbun.quant.workers (which imports mlx.core) for its first task."""
    from mlxbun import blas
    from mlxbun.quant import workers

    library = blas.find()
    if library is None:
        pytest.skip("no optimized BLAS on this machine")
    monkeypatch.setattr(
        blas, "_loaded", {"setting": "auto", "library": library, "loaded": True, "reason": ""}
    )
    with workers.pool(threads=2, weights=workers.MIN_WEIGHTS) as pool:
        there = pool.submit(_blas_of_this_process).result()
    assert there["loaded"] and there["library"] == library, there


def test_the_probes_round_a_big_weight_in_quantizes_blocks_so_quantize_reads_them_back(
    gptq_source, tmp_path, caplog, monkeypatch
):
    """quantize rounds a big weight in blocks of rows, each kept under its own bytes' key; the
    probes rounded it whole, under another key, so quantize rounded it again (at 0.5B the tied
    embedding: most of quantize's time). Written rounds it in the same blocks, GPTQ's factor once:
    quantize reads every block back and writes the same bytes."""
    import hashlib

    from mlxbun.quant import probe
    from mlxbun.quant.hessian import Hessians
    from mlxbun.quant.quantize import convert
    from mlxbun.quant.spec import QuantSpec

    src, plan, h = gptq_source
    monkeypatch.setattr(convert, "BIG_TENSOR", 1000)
    monkeypatch.setattr(convert, "CHUNK_BYTES", 4096)
    plain = _quantize(gptq_source, tmp_path / "plain")
    sha = hashlib.file_digest(open(h, "rb"), "sha256").hexdigest()
    written = probe.Written(
        dtype="bfloat16", dtypes={}, hessians=Hessians(h), rounded=rounded.Rounded(tmp_path / "cache", sha)
    )
    weights = mx.load(str(src / "model.safetensors"))
    factors = []
    real = convert.rounding.gptq_factor
    monkeypatch.setattr(convert.rounding, "gptq_factor", lambda hh: factors.append(1) or real(hh))
    for path, spec in ((f"{L0}.mlp.up_proj", QuantSpec(bits=3, group_size=32, method="gptq")),
                       (f"{L0}.mlp.gate_proj", QuantSpec(bits=3, group_size=64, method="clip")),
                       (f"{L0}.mlp.down_proj", QuantSpec(bits=4, group_size=64, method="gptq"))):  # fmt: skip
        written(path, weights[f"{path}.weight"].astype(mx.float32), spec)
    assert len(factors) == 2  # one per GPTQ module, not one per block
    blocks = len(list((tmp_path / "cache").rglob("*.safetensors")))
    assert blocks > 3
    with caplog.at_level(logging.INFO, logger="mlxbun"):
        again = _quantize(gptq_source, tmp_path / "again", tmp_path / "cache")
    assert f"{blocks} rounded module(s) read back" in caplog.text and "0 rounded here" in caplog.text
    assert _bytes(plain) == _bytes(again)


def test_quantizes_progress_weighs_only_the_roundings_it_does(gptq_source, tmp_path, monkeypatch):
    """At 0.5B's shapes the probes had rounded every module but the tied embedding, which quantize
    rounded first: its bytes (28% of the model) took most of the minute and a half, the rest was
    read back in seconds, and the ETA read 3.6x the time left. The kept files say their setting,
    so quantize's progress counts as work only the modules it rounds itself."""
    from mlxbun.quant.quantize import command

    src, plan, h = gptq_source
    seen = []

    class Recorded(command.Progress):
        def update(self, n: float = 1, *, work: float = 0.0) -> None:
            super().update(n, work=work)
            seen.append((self.done / self.total, work, self._fraction(None)))  # before costs are fitted

    monkeypatch.setattr(command, "Progress", Recorded)
    _quantize(gptq_source, tmp_path / "first", tmp_path / "cache")
    assert sum(w > 0 for _, w, _ in seen) == 3  # no rounding kept yet: all three are work
    (d,) = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    kept = rounded.Rounded(tmp_path / "cache", d.name).kept()
    assert {(p.rsplit(".", 1)[-1], m, b, g) for p, m, b, g in kept} == {
        ("up_proj", "gptq", 3, 32), ("gate_proj", "clip", 3, 64), ("down_proj", "gptq", 4, 64)
    }  # fmt: skip
    layers = json.loads(plan.read_text())
    layers["layers"][f"{L0}.mlp.up_proj"]["bits"] = 2  # one module at a new setting: rounded here
    plan2 = tmp_path / "plan2.json"
    plan2.write_text(json.dumps(layers))
    seen.clear()
    quantize_model_dir(src, tmp_path / "second", plan=plan2, hessians=h, rounded=tmp_path / "cache")
    (at,) = [i for i, (_, w, _) in enumerate(seen) if w > 0]  # the one module rounded here
    assert seen[at][0] < 0.5 and seen[at][2] >= 0.99  # its bytes are a few, its time nearly all


def test_a_kept_file_without_its_setting_is_not_listed(tmp_path):
    """Files kept before the setting was recorded read back as before; they are only not listed."""
    cache = rounded.Rounded(tmp_path, "ab" * 32)
    w = mx.ones((4, 64))
    out = tuple(mx.quantize(w, 64, 4))
    old = cache.file("m.a", w, bits=4, group_size=64, method="clip")
    old.parent.mkdir(parents=True)
    mx.save_safetensors(
        str(old), dict(zip(rounded.NAMES, out, strict=True)), metadata={"sha256": rounded._digest(out)}
    )
    cache.put(
        cache.file("m.b", w, bits=4, group_size=64, method="gptq"),
        out,
        "m.b",
        method="gptq",
        bits=4,
        group_size=64,
    )
    assert cache.kept() == {("m.b", "gptq", 4, 64)}
    assert cache.get(old, "m.a") is not None
