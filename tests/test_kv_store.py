"""kv store: round trips per cache class and layout, golden bytes, dedup, lookup, refusals, async."""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import Future
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import xxhash
from kv_util import continue_logits, filled, make_cache, state_arrays, tiny_model, tokens
from mlx_lm.models import cache as C

from mlxbun.errors import InputError
from mlxbun.kv import format as fmt
from mlxbun.kv import promptcache as pc
from mlxbun.kv.store import MismatchError, Store

KINDS = ["kv", "rotating", "quantized", "list"]
LAYOUTS = ["snapshot", "blocks"]


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", KINDS)
def test_roundtrip_continues_bit_exactly(model, tmp_path, kind, layout):
    # 70 prefill + 30 decode steps: the rotating caches (max 48) have wrapped their ring
    cache, toks = filled(model, kind, 70, decode=30)
    store = Store(tmp_path, block_kib=4)
    store.save("s", cache, tokens=toks, model="m", layout=layout)
    restored = store.load("s", model="m", tokens=toks).cache
    assert [type(c).__name__ for c in restored] == [type(c).__name__ for c in cache]
    for a, b in zip(state_arrays(cache), state_arrays(restored), strict=True):
        np.testing.assert_array_equal(a, b)
    more = tokens(20, seed=9)
    ref, got = (
        continue_logits(model, cache, more, kind=kind),
        continue_logits(model, restored, more, kind=kind),
    )
    np.testing.assert_array_equal(ref, got)
    for a, b in zip(state_arrays(cache), state_arrays(restored), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_matches_mlx_lm_reference_and_stores_only_valid_tokens(model, tmp_path, layout):
    cache, toks = filled(model, "kv", 37)
    C.save_prompt_cache(str(tmp_path / "ref.safetensors"), cache)
    ref = C.load_prompt_cache(str(tmp_path / "ref.safetensors"))
    info = Store(tmp_path / "s", block_kib=4).save("s", cache, tokens=toks, model="m", layout=layout)
    got = Store(tmp_path / "s").load("s", model="m").cache
    for r, g in zip(ref, got, strict=True):
        np.testing.assert_array_equal(np.array(r.keys[..., : r.offset, :]), np.array(g.keys))
        np.testing.assert_array_equal(np.array(r.values[..., : r.offset, :]), np.array(g.values))
        assert g.offset == r.offset == 37
    # valid bytes: 2 layers x K/V x (1, 2 heads, 37 tokens, 32) float32; mlx-lm keeps 256 slots
    assert info.data_bytes == 2 * 2 * 2 * 37 * 32 * 4
    assert (tmp_path / "ref.safetensors").stat().st_size > 6 * info.data_bytes


def _fixed_cache() -> list:
    c = C.KVCache()
    k = mx.arange(1 * 2 * 3 * 4, dtype=mx.float16).reshape(1, 2, 3, 4)
    c.update_and_fetch(k, -k)
    return [c]


def test_golden_bytes_and_determinism(tmp_path):
    kw = dict(tokens=[5, 6, 7], model="m", tokenizer="t", model_name="org/model")
    a, b = Store(tmp_path / "a"), Store(tmp_path / "b")
    a.save("g", _fixed_cache(), **kw)
    b.save("g", _fixed_cache(), **kw)
    path = tmp_path / "a/snapshots/g.safetensors"
    raw = path.read_bytes()
    assert raw == (tmp_path / "b/snapshots/g.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    # the header is padded so the data starts 64 bytes past a 16 KiB page (fmt.SKEW)
    assert 8 + n == 16384 + 64 and raw[8:43] == b'{"__metadata__":{"0.mlxbun_kvs":"3"'
    assert len(raw) == 16448 + 48 + 48 + 4  # keys, values back to back, then the offset scalar
    keys = raw[16448 : 16448 + 48]
    np.testing.assert_array_equal(np.frombuffer(keys, np.float16), np.arange(24, dtype=np.float16))
    assert raw[16448 + 96 :] == np.int32(3).tobytes()
    table = json.loads(raw[8:16448])
    meta = table.pop("__metadata__")
    assert list(meta) == [
        "0.mlxbun_kvs", "0.mlxbun_sha256", "0.mlxbun_header", "0.model", "0.tokenizer_config",
        "1.0", "2.0", "2.1.0", "2.1.1",
    ]  # fmt: skip
    assert raw[pc.HASH_AT : pc.HASH_AT + 64].decode() == meta["0.mlxbun_sha256"]
    zeroed = raw[: pc.HASH_AT] + b"0" * 64 + raw[pc.HASH_AT + 64 : 16448]
    assert meta["0.mlxbun_sha256"] == hashlib.sha256(zeroed).hexdigest()
    header = json.loads(meta["0.mlxbun_header"])
    assert header["hash"] == "xxh3_128" and header["data_start"] == 16448
    assert header["layers"][0]["tensors"]["keys"]["hash"] == xxhash.xxh3_128_hexdigest(keys)
    assert {k: meta[k] for k in list(meta)[3:]} == {
        "0.model": "org/model", "0.tokenizer_config": "{}", "1.0": "KVCache",
        "2.0": "", "2.1.0": "0.2", "2.1.1": "scalar",
    }  # fmt: skip
    assert table == {
        "0.0": {"dtype": "F16", "shape": [1, 2, 3, 4], "data_offsets": [0, 48]},
        "0.1": {"dtype": "F16", "shape": [1, 2, 3, 4], "data_offsets": [48, 96]},
        "0.2": {"dtype": "I32", "shape": [], "data_offsets": [96, 100]},
    }
    assert hashlib.sha256(raw).hexdigest() == GOLDEN


def test_snapshots_open_in_safetensors_readers(tmp_path):
    from safetensors.numpy import load_file

    store = Store(tmp_path)
    store.save("g", _fixed_cache(), tokens=[5, 6, 7], model="m", tokenizer="t")
    want = np.arange(24, dtype=np.float16).reshape(1, 2, 3, 4)
    path = str(tmp_path / "snapshots/g.safetensors")
    strict = load_file(path)  # checks the data is contiguous and fully covered
    np.testing.assert_array_equal(strict["0.0"], want)
    np.testing.assert_array_equal(strict["0.1"], -want)
    assert sorted(strict) == ["0.0", "0.1", "0.2"]  # no tensors beyond mlx-lm's own
    loaded = mx.load(path)
    np.testing.assert_array_equal(np.array(loaded["0.1"]), -want)


GOLDEN = "d19d06662218c57220398a241036dd686beaaf5cef22ec4cf2df7fc5bbfe004e"
# written by earlier versions: framed header with BLAKE3 then XXH3-128 tensor hashes (version 1),
# a safetensors .kvs with __pad__ tensors (version 2)
OLD_KVS = {
    "blake3-v1.kvs": ("blake3", "73271bd4ece81ab3c973e6476409e3b35ef8d4d2d33077d0679bd5df6fb0a355"),
    "xxh3-v1.kvs": ("xxh3_128", "889aa5ea25c7783f59b098700b3a50b97b51069e9bdeebf6191bac70edfad307"),
}
V2_KVS = ("xxh3-v2.kvs", "7513df385cfae2e9449bdefb93e3174677532ea04fbbdff95d96ef5d496b6f3b")


def test_snapshots_of_format_version_2_still_load(tmp_path):
    fixture, sha = V2_KVS
    raw = (Path(__file__).parent / "fixtures/kv" / fixture).read_bytes()
    assert hashlib.sha256(raw).hexdigest() == sha
    assert raw[8:40] == b'{"__metadata__":{"mlxbun.kvs":"2'
    store = Store(tmp_path)
    (tmp_path / "snapshots").mkdir()
    (tmp_path / "snapshots/g.kvs").write_bytes(raw)
    (layer,) = store.load("g", model="m", tokenizer="t").cache
    np.testing.assert_array_equal(
        np.array(layer.values), -np.arange(24, dtype=np.float16).reshape(1, 2, 3, 4)
    )
    assert store.verify() == (len(raw), [])
    assert [s.name for s in store.list()[0]] == ["g"]
    flipped = bytearray(raw)
    flipped[16384 + 64 + 5] ^= 0x10
    (tmp_path / "snapshots/g.kvs").write_bytes(bytes(flipped))
    with pytest.raises(fmt.CorruptError, match="tensor '0.keys' hash mismatch"):
        store.load("g", model="m", tokenizer="t")


@pytest.mark.parametrize("fixture", sorted(OLD_KVS))
def test_snapshots_of_format_version_1_still_load(tmp_path, fixture):
    algo, sha = OLD_KVS[fixture]
    raw = (Path(__file__).parent / "fixtures/kv" / fixture).read_bytes()
    assert hashlib.sha256(raw).hexdigest() == sha
    assert raw[:8] == b"\x89MLXBKV\n" and raw[8:12] == (1).to_bytes(4, "little")
    header = json.loads(raw[56 : 56 + int.from_bytes(raw[16:24], "little")])
    assert header["hash"] == algo
    assert header["layers"][0]["tensors"]["keys"]["hash"] == fmt.check_digest(raw[16384 : 16384 + 48], algo)
    store = Store(tmp_path)
    (tmp_path / "snapshots").mkdir()
    (tmp_path / "snapshots/g.kvs").write_bytes(raw)
    (layer,) = store.load("g", model="m", tokenizer="t").cache
    np.testing.assert_array_equal(np.array(layer.keys), np.arange(24, dtype=np.float16).reshape(1, 2, 3, 4))
    assert store.verify() == (len(raw), [])
    flipped = bytearray(raw)
    flipped[16384 + 5] ^= 0x10
    (tmp_path / "snapshots/g.kvs").write_bytes(bytes(flipped))
    with pytest.raises(fmt.CorruptError, match="tensor '0.keys' hash mismatch"):
        store.load("g", model="m", tokenizer="t")


def test_tensor_hash_must_match_the_named_algorithm(tmp_path):
    store = Store(tmp_path)
    store.save("g", _fixed_cache(), tokens=[5, 6, 7], model="m", tokenizer="t", layout="snapshot")
    path = tmp_path / "snapshots/g.safetensors"
    raw = path.read_bytes()
    header = store.header("g")[1]
    for algo, msg in (("blake3", "not 64 lower-case hex digits"), ("sha1", "hash 'sha1' is not supported")):
        lie = dict(header, hash=algo)  # 32-digit XXH3 values under another algorithm's name
        path.write_bytes(pc.encode(lie) + raw[header["data_start"] :])
        with pytest.raises((fmt.CorruptError, fmt.UnsupportedError), match=msg):
            store.load("g", model="m", tokenizer="t")


def test_appending_tokens_keeps_earlier_blocks_identical(model, tmp_path):
    store = Store(tmp_path, block_kib=4)  # 1 KiB of K/V per token: 4 tokens per block
    cache, toks = filled(model, "kv", 30)
    first = store.save("t1", cache, tokens=toks, model="m", layout="blocks")
    assert store.header("t1")[1]["block_tokens"] == 4
    more = tokens(10, seed=3)
    continue_logits(model, cache, more)
    second = store.save("t2", cache, tokens=toks + more, model="m", layout="blocks")
    full = len(toks) // 4  # blocks of t1 that were full
    assert first.blocks[:full] == second.blocks[:full]
    assert first.blocks[full] != second.blocks[full]  # the partial block was rewritten
    assert second.written_bytes < second.data_bytes * 0.5
    assert len(set(first.blocks) | set(second.blocks)) == len(second.blocks) + 1


def test_longest_prefix_lookup(model, tmp_path):
    store = Store(tmp_path, block_kib=4)
    cache, toks = filled(model, "kv", 40)
    short, _ = filled(model, "kv", 20)
    store.save("long", cache, tokens=toks, model="m")
    store.save("short", short, tokens=toks[:20], model="m")
    store.save("other", short, tokens=toks[:20], model="other-model")
    assert store.lookup(toks + [1, 2], model="m").name == "long"
    assert store.lookup(toks[:30], model="m").name == "short"
    assert store.lookup(toks[:30], model="m").tokens == 20
    assert store.lookup([99] + toks, model="m") is None
    assert store.lookup(toks, model="nobody") is None


def test_refuses_other_model_tokenizer_or_prompt(model, tmp_path):
    store = Store(tmp_path, block_kib=4)
    cache, toks = filled(model, "kv", 20)
    store.save("s", cache, tokens=toks, model="m", tokenizer="tok")
    with pytest.raises(MismatchError, match="model"):
        store.load("s", model="another")
    with pytest.raises(MismatchError, match="tokenizer"):
        store.load("s", model="m", tokenizer="tok2")
    with pytest.raises(MismatchError, match="not a prefix"):
        store.load("s", model="m", tokens=[7] + toks)
    with pytest.raises(MismatchError, match="not a prefix"):
        store.load("s", model="m", tokens=toks[:10])
    assert len(store.load("s", model="m", tokenizer="tok", tokens=toks + [3]).tokens) == 20


def test_refuses_unsupported_cache_classes_and_bad_input(model, tmp_path):
    store = Store(tmp_path)
    with pytest.raises(InputError, match="ArraysCache.*choose one of KVCache"):
        store.save("s", [C.ArraysCache(2)], tokens=[], model="m")
    with pytest.raises(InputError, match="ChunkedKVCache"):
        store.save("s", [C.ChunkedKVCache(8)], tokens=[], model="m")
    cache, toks = filled(model, "kv", 5)
    with pytest.raises(InputError, match="offset"):
        store.save("s", cache, tokens=toks[:4], model="m")
    for bad in ("../x", "a/b", "", ".hidden", "x" * 200):
        with pytest.raises(InputError, match="kv.name"):
            store.save(bad, cache, tokens=toks, model="m")
    assert not (tmp_path / "snapshots").exists() or not list((tmp_path / "snapshots").iterdir())


def test_empty_and_bfloat16_caches(tmp_path):
    c = C.KVCache()
    k = mx.random.normal((1, 2, 5, 8)).astype(mx.bfloat16)
    c.update_and_fetch(k, k * 2)
    store = Store(tmp_path, block_kib=1)
    store.save("b", [c, C.KVCache()], tokens=[1, 2, 3, 4, 5], model="m")
    got = store.load("b", model="m").cache
    assert got[0].keys.dtype == mx.bfloat16 and got[1].keys is None and got[1].offset == 0
    assert mx.array_equal(got[0].keys, k).item() and mx.array_equal(got[0].values, k * 2).item()


def test_save_async_owns_buffers_until_acknowledged(model, tmp_path):
    store = Store(tmp_path, block_kib=4)
    cache, toks = filled(model, "kv", 30)
    before = state_arrays(cache)
    fut = store.save_async("bg", cache, tokens=toks, model="m", layout="snapshot")
    assert isinstance(fut, Future)
    continue_logits(model, cache, tokens(40, seed=5))  # keep generating into the same cache
    info = fut.result(timeout=60)
    store.close()
    assert info.tokens == 30
    for a, b in zip(before, state_arrays(store.load("bg", model="m").cache), strict=True):
        np.testing.assert_array_equal(a, b)


def test_layout_switch_replaces_the_other_file(model, tmp_path):
    store = Store(tmp_path, block_kib=4)
    cache, toks = filled(model, "kv", 12)
    store.save("s", cache, tokens=toks, model="m", layout="blocks")
    store.save("s", cache, tokens=toks, model="m", layout="snapshot")
    assert sorted(p.name for p in (tmp_path / "snapshots").iterdir()) == ["s.safetensors"]
    assert store.names() == ["s"]
    assert store.info("s").layout == "snapshot"


def test_header_versions_and_unknown_classes_refused(model, tmp_path):
    store = Store(tmp_path, block_kib=4)
    cache, toks = filled(model, "kv", 8)
    store.save("s", cache, tokens=toks, model="m", layout="blocks")
    path = tmp_path / "snapshots/s.kvm"
    header, _ = fmt.read_header(path, what="x")
    raw = bytearray(path.read_bytes())
    raw[8:12] = (2).to_bytes(4, "little")
    path.write_bytes(bytes(raw))
    with pytest.raises(fmt.UnsupportedError, match="format version 2"):
        store.load("s", model="m")
    header["layers"][0]["class"] = "ArraysCache"
    path.write_bytes(fmt.encode(header))
    with pytest.raises(fmt.UnsupportedError, match="'ArraysCache' is not supported"):
        store.load("s", model="m")


def test_caller_cache_untouched_when_restore_fails(model, tmp_path):
    store = Store(tmp_path, block_kib=4)
    cache, toks = filled(model, "kv", 20)
    store.save("s", cache, tokens=toks, model="m", layout="blocks")
    mine, _ = filled(model, "kv", 10, seed=4)
    before = state_arrays(mine)
    block = next((tmp_path / "blocks").iterdir())
    block.write_bytes(b"\0" + block.read_bytes()[1:])
    with pytest.raises(fmt.CorruptError):
        mine = store.load("s", model="m").cache
    for a, b in zip(before, state_arrays(mine), strict=True):
        np.testing.assert_array_equal(a, b)
    assert make_cache("kv")  # the helper still builds fresh caches


@pytest.mark.parametrize("kind", ["kv", "quantized"])
def test_blocks_restore_stacks_like_tensors_into_capped_pieces(model, tmp_path, monkeypatch, kind):
    from mlxbun.kv import blocks as blk

    cache, toks = filled(model, kind, 40)
    store = Store(tmp_path, block_kib=4)
    store.save("s", cache, tokens=toks, model="m", layout="blocks")
    _, h = store.header("s")
    geo = blk.check_manifest(h, what="t")
    one = max(rows * t * rb for _, rows, t, rb in geo.tensors)
    monkeypatch.setattr(blk, "PIECE_BYTES", 2 * one)
    parts = blk.pieces(h, geo)
    specs = fmt.tensors_of(h)
    assert [p.first for p in parts] == list(np.cumsum([0] + [p.count for p in parts[:-1]]))
    assert sum(p.count for p in parts) == len(specs) and len(parts) < len(specs)
    for p in parts:
        members = specs[p.first : p.first + p.count]
        keys = {(t["dtype"], t["shape"][2], t["shape"][3]) for _, t in members}
        assert keys == {(p.dtype, p.tokens, p.width)}
        assert p.rows * p.tokens * p.row_bytes <= 2 * one or p.count == 1
    for a, b in zip(parts, parts[1:], strict=False):  # maximal: a piece only ends where it must
        same = (a.dtype, a.tokens, a.width) == (b.dtype, b.tokens, b.width)
        assert not same or (a.rows + b.rows // b.count) * a.tokens * a.row_bytes > 2 * one
    restored = store.load("s", model="m", tokens=toks).cache
    for x, y in zip(state_arrays(cache), state_arrays(restored), strict=True):
        np.testing.assert_array_equal(x, y)
