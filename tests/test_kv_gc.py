"""kv GC: plan then execute, only unreferenced blocks, LRU cap, and the lock against racing writers."""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time

import numpy as np
import pytest
from kv_child import version_cache
from kv_util import continue_logits, filled, state_arrays, tiny_model, tokens
from test_kv_faults import _child, go

from mlxbun.kv import blocks as blk
from mlxbun.kv import format as fmt
from mlxbun.kv import gc
from mlxbun.kv.store import Store, StoreBusy


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def _blocks(store: Store) -> set[str]:
    return {p.name for p in store.blocks.iterdir()}


def test_plan_then_execute_frees_only_unreferenced_blocks(model, tmp_path):
    store = Store(tmp_path, block_kib=4)
    cache, toks = filled(model, "kv", 30)
    a = store.save("a", cache, tokens=toks, model="m", layout="blocks")
    more = tokens(10, seed=2)
    continue_logits(model, cache, more)
    b = store.save("b", cache, tokens=toks + more, model="m", layout="blocks")
    other, otoks = filled(model, "kv", 30, seed=5)
    store.save(
        "a", other, tokens=otoks, model="m", layout="blocks"
    )  # a's old blocks: shared ones stay, its tail is orphaned
    orphans = set(a.blocks) - set(b.blocks)
    assert len(orphans) == 1
    p = gc.plan(store)
    assert set(p.blocks) == orphans and p.evict == ()
    assert p.bytes_freed == sum((store.blocks / x).stat().st_size for x in orphans)
    assert orphans <= _blocks(store)  # planning deletes nothing
    done = gc.execute(store, p)
    assert set(done.blocks) == orphans and done.bytes_freed == p.bytes_freed
    assert not orphans & _blocks(store)
    for name in ("a", "b"):
        assert store.load(name, model="m").cache
    assert gc.plan(store).blocks == ()


def test_cap_evicts_least_recently_used_first(model, tmp_path):
    store = Store(tmp_path, block_kib=4)
    for i, name in enumerate(("old", "mid", "new")):
        cache, toks = filled(model, "kv", 40, seed=10 + i)
        store.save(name, cache, tokens=toks, model="m", layout="blocks")
        time.sleep(0.02)
    store.load("old", model="m")  # now "mid" is the least recently used
    sizes = {i.name: i.file_bytes for i in store.list()[0]}
    total = gc.plan(store).bytes_before
    p = gc.plan(store, cap_bytes=total - 1)
    assert [n for n, _ in p.evict] == ["mid"]
    p2 = gc.plan(store, cap_bytes=total - sizes["mid"] - 1)
    assert [n for n, _ in p2.evict] == ["mid", "new"]
    store.load("mid", model="m")  # used again after planning: execute keeps it
    done = gc.execute(store, p)
    assert done.evict == () and store.names() == ["mid", "new", "old"]
    done = gc.execute(store, gc.plan(store, cap_bytes=total - 1))
    assert [n for n, _ in done.evict] == ["new"] and store.names() == ["mid", "old"]
    assert sum(i.file_bytes for i in store.list()[0]) <= total - 1
    assert store.verify()[1] == []


def test_unreadable_manifest_blocks_all_block_deletion(model, tmp_path):
    store = Store(tmp_path, block_kib=4)
    cache, toks = filled(model, "kv", 20)
    store.save("a", cache, tokens=toks, model="m", layout="blocks")
    (store.snapshots / "a.kvm").write_bytes(b"\x89MLXBKV\nbroken")
    p = gc.plan(store)
    assert p.blocks == () and len(p.unreadable) == 1
    assert gc.execute(store, p).blocks == ()


def _paused_writer(store: Store, cache, toks, reached: threading.Event, release: threading.Event):
    def stage(name: str) -> None:
        if name == "data_written":
            reached.set()
            release.wait(30)

    return threading.Thread(
        target=store.save,
        args=("w", cache),
        kwargs=dict(tokens=toks, model="m", layout="blocks", on_stage=stage),
    )


def _race(model, tmp_path) -> tuple[Store, set[str], bool]:
    """A writer has written its blocks but not its manifest; GC plans and executes meanwhile."""
    store = Store(tmp_path, block_kib=4)
    cache, toks = filled(model, "kv", 30)
    reached, release = threading.Event(), threading.Event()
    writer = _paused_writer(store, cache, toks, reached, release)
    writer.start()
    assert reached.wait(30)
    new = _blocks(store)
    p = gc.plan(store)
    assert set(p.blocks) == new  # unpublished blocks look unreferenced: the race is real
    collector = threading.Thread(target=gc.execute, args=(Store(tmp_path), p), kwargs={"timeout": 30})
    collector.start()
    time.sleep(0.3)
    blocked = collector.is_alive()
    release.set()
    writer.join(30)
    collector.join(30)
    return store, new, blocked


def test_gc_waits_for_a_writer_holding_the_lock(model, tmp_path):
    store, new, blocked = _race(model, tmp_path)
    assert blocked  # execute waited for the writer's shared lock
    assert new <= _blocks(store)
    restored = store.load("w", model="m").cache
    assert restored and store.verify()[1] == []


def test_without_the_lock_the_race_loses_blocks(model, tmp_path, monkeypatch):
    # negative control: the test above fails when the lock does nothing
    monkeypatch.setattr(Store, "locked", lambda self, **kw: contextlib.nullcontext())
    store, new, blocked = _race(model, tmp_path)
    assert not blocked
    assert not new & _blocks(store)
    with pytest.raises(fmt.CorruptError, match="is missing"):
        store.load("w", model="m")


def _gate_held(root) -> bool:
    fd = os.open(root / ".gate", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def test_gc_is_not_starved_by_overlapping_savers(tmp_path):
    store, order = Store(tmp_path, lock_timeout=10), []
    first_in, first_out = threading.Event(), threading.Event()

    def hold(tag: str, exclusive: bool, entered=None, leave=None) -> None:
        with store.locked(exclusive=exclusive):
            order.append(tag)
            if entered:
                entered.set()
            if leave:
                leave.wait(10)

    saver = threading.Thread(target=hold, args=("saver 1", False, first_in, first_out))
    saver.start()
    assert first_in.wait(10)
    collector = threading.Thread(target=hold, args=("gc", True))
    collector.start()
    deadline = time.monotonic() + 10
    while not _gate_held(tmp_path):  # GC has passed the turnstile and now waits for saver 1
        assert time.monotonic() < deadline
        time.sleep(0.01)
    late = threading.Thread(target=hold, args=("saver 2", False))
    late.start()
    time.sleep(0.2)
    assert order == ["saver 1"]  # saver 2 queues behind the waiting GC instead of overlapping saver 1
    first_out.set()
    for t in (saver, collector, late):
        t.join(10)
    assert order == ["saver 1", "gc", "saver 2"]


def test_gc_racing_writer_processes(tmp_path):
    root, stop = tmp_path / "store", tmp_path / "stop"
    store = Store(root, block_kib=64)
    until = f"until:{stop}"  # writers keep replacing their snapshots until told to stop
    kids = [_child(root, "blocks", vs, rounds=until, name=n) for n, vs in (("x", [1, 2]), ("y", [3, 4]))]
    for k in kids:
        go(k)
    runs = freed = 0
    known = {v: version_cache(v)[0] for v in (1, 2, 3, 4)}
    deadline = time.monotonic() + 120
    while runs < 4 or freed == 0:
        assert time.monotonic() < deadline, f"GC freed nothing in {runs} runs while writers ran"
        assert all(k.poll() is None for k in kids)  # every run races live writers
        freed += gc.execute(store, gc.plan(store)).bytes_freed
        runs += 1
        for name in store.names():  # every published snapshot still loads, verified
            got = state_arrays(store.load(name, model="m").cache)
            assert any(
                all(np.array_equal(a, b) for a, b in zip(got, state_arrays(c), strict=True))
                for c in known.values()
            )
    stop.touch()
    assert all(k.wait(60) == 0 for k in kids)
    assert store.names() == ["x", "y"] and store.verify()[1] == []
    gc.execute(store, gc.plan(store))
    assert store.verify()[1] == [] and gc.plan(store).blocks == ()


def test_reader_racing_gc_keeps_its_blocks(model, tmp_path, monkeypatch):
    store = Store(tmp_path, block_kib=4)
    cache, toks = filled(model, "kv", 30)
    store.save("r", cache, tokens=toks, model="m", layout="blocks")
    other, otoks = filled(model, "kv", 30, seed=8)
    reading, release = threading.Event(), threading.Event()
    real = blk.read_blocks

    def slow_read(*a, **k):
        reading.set()
        release.wait(30)
        return real(*a, **k)

    monkeypatch.setattr(blk, "read_blocks", slow_read)
    got = {}
    reader = threading.Thread(target=lambda: got.update(c=store.load("r", model="m").cache))
    reader.start()
    assert reading.wait(30)
    store.save(
        "r", other, tokens=otoks, model="m", layout="blocks"
    )  # the reader's blocks are now unreferenced
    p = gc.plan(store)
    assert p.blocks  # ...and planned for deletion
    with pytest.raises(StoreBusy, match="is busy"):
        gc.execute(Store(tmp_path), p, timeout=0.2)  # the reader holds the lock: GC must wait
    release.set()
    reader.join(30)
    for a, b in zip(state_arrays(cache), state_arrays(got["c"]), strict=True):
        np.testing.assert_array_equal(a, b)  # the reader got the old version, complete
    assert gc.execute(store, p).blocks  # afterwards GC frees them
    assert store.load("r", model="m", verify=True).cache
