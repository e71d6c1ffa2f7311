"""The sharded writer: mlx-lm layout, determinism, staged calls, interruption and resume, loaders."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from safetensors.numpy import load_file

from mlxbun.errors import InputError
from mlxbun.io import shards as shards_mod
from mlxbun.io.parameters import count_parameters
from mlxbun.io.safetensors import open_model
from mlxbun.io.shards import JOURNAL, ShardedWriter, WriterStateError, write_sharded

REPO = Path(__file__).resolve().parent.parent


def dir_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def f32(n: int, seed: int = 0) -> mx.array:
    return mx.array(np.random.default_rng(seed).standard_normal(n).astype(np.float32))


# ---------------------------------------------------------------- layout


def test_greedy_layout_and_oversize_tensor(tmp_path: Path) -> None:
    sizes = {"t0": 10, "t1": 10, "t2": 25, "t3": 5, "t4": 5, "t5": 5}  # float32 elements -> x4 bytes
    layout = write_sharded(tmp_path, {n: f32(k, i) for i, (n, k) in enumerate(sizes.items())}, shard_bytes=80)
    assert layout.shards == {
        "model-00001-of-00003.safetensors": ["t0", "t1"],
        "model-00002-of-00003.safetensors": ["t2"],  # 100 bytes > 80: a shard of its own
        "model-00003-of-00003.safetensors": ["t3", "t4", "t5"],
    }
    assert layout.total_size == 4 * sum(sizes.values()) and layout.total_parameters == sum(sizes.values())
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index == layout.index
    assert list(index["weight_map"]) == sorted(sizes)
    assert index["metadata"] == {"total_size": 240, "total_parameters": 60}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [*layout.shards, "model.safetensors.index.json"]
    )


def test_one_shard_has_no_index(tmp_path: Path) -> None:
    layout = write_sharded(tmp_path, {"a": f32(4), "b": f32(3)})
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]
    assert not layout.index_written and layout.files == [tmp_path / "model.safetensors"]
    assert layout.index["weight_map"] == {"a": "model.safetensors", "b": "model.safetensors"}


def test_files_load_with_safetensors_and_mx(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    tensors = {
        "w": rng.standard_normal((6, 5)).astype(np.float32),
        "h": rng.standard_normal((4,)).astype(np.float16),
        "i": rng.integers(-9, 9, (3, 2)).astype(np.int64),
        "big_endian": np.arange(5, dtype=">i4"),
        "flag": np.array([True, False]),
        "t": np.asfortranarray(rng.standard_normal((3, 4)).astype(np.float32)),  # non-contiguous input
    }
    write_sharded(tmp_path, tensors, shard_bytes=64)
    for f in sorted(tmp_path.glob("model-*.safetensors")):
        for name, got in load_file(str(f)).items():
            np.testing.assert_array_equal(got, tensors[name])
        for name, got in mx.load(str(f)).items():
            np.testing.assert_array_equal(np.array(got), tensors[name])
    transposed = mx.arange(12, dtype=mx.bfloat16).reshape(3, 4).T
    write_sharded(tmp_path / "bf", {"t": transposed})
    assert mx.array_equal(mx.load(str(tmp_path / "bf/model.safetensors"))["t"], transposed).item()


def test_matches_mlx_lm_save_model(tmp_path: Path) -> None:
    """Same tensors, total_size and total_parameters as mlx_lm.utils.save_model."""
    from mlx_lm.utils import save_model

    model = tiny_llama()
    nn.quantize(model, group_size=64, bits=4)
    save_model(tmp_path / "ref", model)
    ref_index = json.loads((tmp_path / "ref/model.safetensors.index.json").read_text())
    layout = write_sharded(tmp_path / "ours", dict(tree_flatten(model.parameters())))
    assert layout.index["metadata"] == ref_index["metadata"]
    assert layout.index["weight_map"] == ref_index["weight_map"]
    ours, ref = (
        mx.load(str(tmp_path / "ours/model.safetensors")),
        mx.load(str(tmp_path / "ref/model.safetensors")),
    )
    assert ours.keys() == ref.keys() and all(mx.array_equal(ours[k], ref[k]).item() for k in ref)


# ---------------------------------------------------------------- determinism


def test_deterministic_and_overlap_gives_same_bytes(tmp_path: Path) -> None:
    tensors = {f"layer.{i}.w": f32(50 + i, i).astype(mx.bfloat16) for i in range(9)}
    write_sharded(tmp_path / "a", tensors, shard_bytes=300)
    write_sharded(tmp_path / "b", tensors, shard_bytes=300)
    with ShardedWriter(tmp_path / "c", shard_bytes=300, overlap=True) as w:
        for n, a in tensors.items():
            w.add(n, a)
        w.finish()
    assert dir_bytes(tmp_path / "a") == dir_bytes(tmp_path / "b") == dir_bytes(tmp_path / "c")
    assert len(dir_bytes(tmp_path / "a")) == 6  # 5 shards of two ~100-byte tensors + index


def test_background_error_surfaces(tmp_path: Path) -> None:
    class Boom:
        def update(self, n: int) -> None:
            raise OSError("disk full")

    w = ShardedWriter(tmp_path, shard_bytes=8, overlap=True, progress=Boom())
    w.add("a", f32(2))
    w.add("b", f32(2))  # hands shard 1 to the background thread
    with pytest.raises(OSError, match="disk full"):
        w.add("c", f32(2))
        w.finish()
    w.abort()
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- staged calls


def test_calls_out_of_order_are_refused(tmp_path: Path) -> None:
    w = ShardedWriter(tmp_path / "x")
    w.add("a", f32(2))
    with pytest.raises(InputError, match="'a' was already added"):
        w.add("a", f32(2))
    with pytest.raises(InputError, match="not allowed"):
        w.add("__metadata__", f32(2))
    with pytest.raises(InputError, match="tensor 'obj': expected an mx.array or numpy array, got list"):
        w.add("obj", [1, 2])
    with pytest.raises(InputError, match="tensor 's': numpy dtype <U1 cannot be stored"):
        w.add("s", np.array(["x"]))
    w.finish()
    with pytest.raises(WriterStateError, match="add\\(\\) on a writer that is already finished"):
        w.add("b", f32(2))
    with pytest.raises(WriterStateError, match="finish\\(\\) on a writer that is already finished"):
        w.finish()
    with pytest.raises(WriterStateError, match="abort\\(\\) after finish"):
        w.abort()
    empty = ShardedWriter(tmp_path / "y")
    with pytest.raises(InputError, match="no tensors were added"):
        empty.finish()
    aborted = ShardedWriter(tmp_path / "z")
    aborted.abort()
    with pytest.raises(WriterStateError, match="already aborted"):
        aborted.add("a", f32(2))
    with pytest.raises(InputError, match="metadata="):
        ShardedWriter(tmp_path / "m", metadata={"format": 1})
    with pytest.raises(InputError, match="shard_bytes=0"):
        ShardedWriter(tmp_path / "m", shard_bytes=0)


def test_refuses_dir_with_finished_model(tmp_path: Path) -> None:
    write_sharded(tmp_path, {"a": f32(2)})
    with pytest.raises(InputError, match="already holds a model"):
        ShardedWriter(tmp_path)


# ---------------------------------------------------------------- interruption and resume

TENSORS = 12


def tensor(i: int) -> mx.array:
    rng = np.random.default_rng(i)
    arr = mx.array(rng.standard_normal(100 + 37 * i).astype(np.float32))
    return arr.astype(mx.bfloat16) if i % 3 == 0 else arr


def declared() -> list[tuple[str, str, tuple[int, ...]]]:
    """What ``produce`` adds, told in advance (``ShardedWriter(tensors=...)``)."""
    return [(f"t.{i:02d}", "BF16" if i % 3 == 0 else "F32", (100 + 37 * i,)) for i in range(TENSORS)]


def produce(out: Path, *, resume: bool, stop_after_shards: int | None = None, **kw) -> ShardedWriter:
    w = ShardedWriter(out, shard_bytes=1500, resume=resume, **kw)
    for i in range(TENSORS):
        if f"t.{i:02d}" in w.done_names:
            continue
        w.add(f"t.{i:02d}", tensor(i))
        if stop_after_shards is not None and len(w._shards) >= stop_after_shards:
            return w
    w.finish()
    return w


def test_interrupted_writer_leaves_nothing_finished(tmp_path: Path) -> None:
    with pytest.raises(KeyboardInterrupt):
        with ShardedWriter(tmp_path, shard_bytes=1500) as w:
            for i in range(8):
                w.add(f"t.{i:02d}", tensor(i))
            raise KeyboardInterrupt
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names and all(n.startswith(".") for n in names)
    # mlx_lm.load globs model*.safetensors the way the glob module does (hidden names excluded)
    assert not glob.glob(str(tmp_path / "model*.safetensors")) and not glob.glob(str(tmp_path / "*.json"))
    with pytest.raises(InputError, match="no weights found"):
        open_model(tmp_path)
    assert JOURNAL in names  # kept for a resume


def test_resume_in_process_equals_uninterrupted(tmp_path: Path) -> None:
    produce(tmp_path / "ref", resume=False)
    w = produce(tmp_path / "run", resume=False, stop_after_shards=2)
    w._stop(keep_shards=True)  # what an exception inside `with` does
    again = ShardedWriter(tmp_path / "run", shard_bytes=1500, resume=True)
    assert len(again.done_names) > 0
    assert again.add(sorted(again.done_names)[0], f32(1)) is False  # resumed tensors are skipped
    again.abort()
    produce(tmp_path / "run2", resume=False, stop_after_shards=2)._stop(keep_shards=True)
    produce(tmp_path / "run2", resume=True)
    assert dir_bytes(tmp_path / "run2") == dir_bytes(tmp_path / "ref")


@pytest.mark.parametrize(("checksum", "where"), [("crc32", "data"), ("sha256", "data"), ("none", "header")])
def test_resume_drops_corrupt_shard(tmp_path: Path, checksum: str, where: str) -> None:
    produce(tmp_path / "ref", resume=False)
    produce(tmp_path / "run", resume=False, stop_after_shards=3, checksum=checksum)._stop(keep_shards=True)
    second = tmp_path / "run" / ".mlxbun-shard-00002.safetensors"
    data = bytearray(second.read_bytes())
    if where == "data":
        data[-1] ^= 0xFF  # caught by the digest
    else:
        data = data.replace(b'"F32"', b'"I32"', 1)  # same size: caught by the header check
    second.write_bytes(bytes(data))
    w = ShardedWriter(tmp_path / "run", shard_bytes=1500, resume=True, checksum=checksum)
    assert len(w._shards) == 1  # shard 2 does not match its journal entry, so 2 and 3 are redone
    w._stop(keep_shards=True)
    produce(tmp_path / "run", resume=True, checksum=checksum)
    assert dir_bytes(tmp_path / "run") == dir_bytes(tmp_path / "ref")


# ---------------------------------------------------------------- declared tensors: streamed at once


class Written:
    def __init__(self) -> None:
        self.total = 0

    def update(self, n: int) -> None:
        self.total += n


@pytest.mark.parametrize("resume_after", [None, 2])
def test_declared_tensors_reach_the_disk_as_added_in_the_same_bytes(tmp_path: Path, resume_after) -> None:
    produce(tmp_path / "ref", resume=False)
    added, progress = 0, Written()
    w = ShardedWriter(tmp_path / "run", shard_bytes=1500, tensors=declared(), progress=progress)
    for i in range(TENSORS):
        t = tensor(i)
        w.add(f"t.{i:02d}", t)
        added += t.nbytes
        assert progress.total == added and not w._pending  # written now, not when the shard fills
        if resume_after is not None and len(w._shards) == resume_after:
            w.add(f"t.{i + 1:02d}", tensor(i + 1))  # a shard half streamed when the run stops
            w._stop(keep_shards=True)
            assert not [p for p in (tmp_path / "run").iterdir() if ".tmp-" in p.name]
            produce(tmp_path / "run", resume=True, tensors=declared())
            break
    else:
        w.finish()
    assert dir_bytes(tmp_path / "run") == dir_bytes(tmp_path / "ref")


def test_declared_writer_refuses_what_it_was_not_told(tmp_path: Path) -> None:
    w = ShardedWriter(tmp_path / "x", shard_bytes=1500, tensors=declared()[:2])
    with pytest.raises(
        WriterStateError, match=r"add\('t.01'\): got F32 \[137\]; the declared next tensor is 't.00'"
    ):
        w.add("t.01", tensor(1))
    with pytest.raises(
        WriterStateError, match=r"got F32 \[100\]; the declared next tensor is 't.00' BF16 \[100\]"
    ):
        w.add("t.00", tensor(0).astype(mx.float32))
    with pytest.raises(WriterStateError, match=r"got BF16 \[99\]"):
        w.add("t.00", tensor(0)[:99])
    w.add("t.00", tensor(0))
    with pytest.raises(
        WriterStateError, match=r"finish\(\) before every declared tensor was added \('t.01' is next\)"
    ):
        w.finish()
    w.add("t.01", tensor(1))
    with pytest.raises(WriterStateError, match="every declared tensor was already added"):
        w.add("t.02", tensor(2))
    w.finish()
    with pytest.raises(InputError, match="tensors: 'a' is declared twice"):
        ShardedWriter(tmp_path / "y", tensors=[("a", "F32", (1,)), ("a", "F32", (1,))])
    with pytest.raises(InputError, match="tensors: 'a' has dtype 'F31'; choose one of"):
        ShardedWriter(tmp_path / "y", tensors=[("a", "F31", (1,))])


def test_resume_keeps_only_shards_that_match_the_declaration(tmp_path: Path) -> None:
    produce(tmp_path / "run", resume=False, stop_after_shards=3)._stop(keep_shards=True)
    same = ShardedWriter(tmp_path / "run", shard_bytes=1500, resume=True, tensors=declared())
    assert len(same._shards) == 3
    same._stop(keep_shards=True)
    other = [(n, d, (s[0] + 1,)) if n == "t.03" else (n, d, s) for n, d, s in declared()]
    w = ShardedWriter(tmp_path / "run", shard_bytes=1500, resume=True, tensors=other)
    assert len(w._shards) < 3 and "t.03" not in w.done_names


def test_resume_over_a_journal_of_another_version_starts_over(tmp_path: Path) -> None:
    produce(tmp_path / "ref", resume=False)
    produce(tmp_path / "run", resume=False, stop_after_shards=2)._stop(keep_shards=True)
    journal = tmp_path / "run" / JOURNAL
    journal.write_text(json.dumps({**json.loads(journal.read_text()), "version": 1}))  # data sorted by name
    w = produce(tmp_path / "run", resume=True)
    assert not w.done_names
    assert dir_bytes(tmp_path / "run") == dir_bytes(tmp_path / "ref")


def test_resume_with_other_settings_is_refused(tmp_path: Path) -> None:
    produce(tmp_path, resume=False, stop_after_shards=1)._stop(keep_shards=True)
    with pytest.raises(InputError, match="shard_bytes=1500, now shard_bytes=999"):
        ShardedWriter(tmp_path, shard_bytes=999, resume=True)


def test_interrupted_finish_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    produce(tmp_path / "ref", resume=False)
    real, calls = os.replace, []

    def flaky(src, dst):
        calls.append(dst)
        if str(dst).endswith("model-00003-of-00009.safetensors"):
            raise OSError("power cut")
        return real(src, dst)

    monkeypatch.setattr(shards_mod.os, "replace", flaky)
    with pytest.raises(OSError, match="power cut"):
        produce(tmp_path / "run", resume=False)
    monkeypatch.setattr(shards_mod.os, "replace", real)
    assert not (tmp_path / "run/model.safetensors.index.json").exists()
    produce(tmp_path / "run", resume=True)
    assert dir_bytes(tmp_path / "run") == dir_bytes(tmp_path / "ref")
    # A fresh (non-resume) writer over an interrupted finish removes the half-published shards too.
    monkeypatch.setattr(shards_mod.os, "replace", flaky)
    with pytest.raises(OSError):
        produce(tmp_path / "again", resume=False)
    monkeypatch.setattr(shards_mod.os, "replace", real)
    ShardedWriter(tmp_path / "again").abort()
    assert list((tmp_path / "again").iterdir()) == []


CHILD = """
import os, sys, time
sys.path.insert(0, {repo!r})
from pathlib import Path
from tests.test_shards import produce

class Stall:
    # Called after each tensor reaches the shard file: stall mid-write on the chosen call.
    calls = 0
    def update(self, n):
        Stall.calls += 1
        if Stall.calls == int(os.environ.get("STALL_AT", "0")):
            print("ready", flush=True)
            time.sleep(600)

from tests.test_shards import declared
kw = {{"tensors": declared()}} if os.environ.get("DECLARED") == "1" else {{}}
produce(Path(sys.argv[1]), resume=True, progress=Stall(), **kw)
print("done", flush=True)
"""


def run_child(out: Path, stall_at: int, declared: bool = False) -> subprocess.CompletedProcess | None:
    """Run the producer in a new process; SIGKILL it once it reports it stalled at call ``stall_at``."""
    code = CHILD.format(repo=str(REPO))
    env = {**os.environ, "STALL_AT": str(stall_at), "DECLARED": str(int(declared))}
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, text=True, env=env
    )
    line = proc.stdout.readline().strip()
    if line == "ready":
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        return None
    proc.wait(timeout=120)
    assert line == "done" and proc.returncode == 0
    return proc


@pytest.mark.parametrize("declared", [False, True])
def test_sigkill_mid_write_then_resume_in_new_process(tmp_path: Path, declared: bool) -> None:
    produce(tmp_path / "ref", resume=False)
    out = tmp_path / "run"
    assert run_child(out, stall_at=7, declared=declared) is None  # killed with shard 3 or so half written
    leftovers = sorted(p.name for p in out.iterdir())
    assert any(".tmp-" in n for n in leftovers) and JOURNAL in leftovers
    assert not any(n.startswith("model") for n in leftovers)
    assert run_child(out, stall_at=10**9, declared=declared) is not None
    assert dir_bytes(out) == dir_bytes(tmp_path / "ref")


# ---------------------------------------------------------------- mlx_lm.load round trips

LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": 128,
    "tie_word_embeddings": False,
}


def tiny_llama():
    from mlx_lm.models import llama

    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(LLAMA))
    model.set_dtype(mx.bfloat16)
    return model


def save_and_load(tmp_path: Path, model, config: dict, tokenizer_dir, **kw):
    import mlx_lm

    out = tmp_path / "model"
    layout = write_sharded(out, dict(tree_flatten(model.parameters())), **kw)
    (out / "config.json").write_text(json.dumps(config))
    tokenizer_dir(out, vocab_size=LLAMA["vocab_size"])
    loaded, tok = mlx_lm.load(str(out))
    tokens = mx.array([tok.encode("w5 w9 w17 w3")])
    assert mx.allclose(loaded(tokens), model(tokens)).item()
    return layout


def test_bf16_llama_loads_with_mlx_lm(tmp_path: Path, tiny_tokenizer_dir) -> None:
    from mlx_lm.utils import get_total_parameters

    model = tiny_llama()
    layout = save_and_load(tmp_path, model, LLAMA, tiny_tokenizer_dir, shard_bytes=64 << 10)
    assert len(layout.shards) > 1 and layout.total_parameters == get_total_parameters(model)


def test_mixed_quantized_llama_loads_with_mlx_lm(tmp_path: Path, tiny_tokenizer_dir) -> None:
    from mlx_lm.utils import get_total_parameters

    model = tiny_llama()
    special = {
        "model.layers.0.mlp.down_proj": {"group_size": 64, "bits": 8, "mode": "affine"},
        "model.layers.1.self_attn.q_proj": {"group_size": 32, "bits": 4, "mode": "affine"},
    }

    def predicate(path: str, module: nn.Module) -> bool | dict:
        if not hasattr(module, "to_quantized"):
            return False
        return {k: v for k, v in special[path].items() if k != "mode"} if path in special else True

    nn.quantize(model, group_size=64, bits=4, class_predicate=predicate)
    quant = {"group_size": 64, "bits": 4, "mode": "affine", **special}
    layout = save_and_load(
        tmp_path, model, {**LLAMA, "quantization": quant}, tiny_tokenizer_dir, quantization=quant
    )
    expected = get_total_parameters(model)
    assert layout.total_parameters == expected
    assert open_model(tmp_path / "model").total_parameters == expected  # reads the block from config.json
    # From shapes alone the 8-bit g64 layer is inferred right, but 4-bit g32 reads as 2-bit g64.
    weights = {n: (i.dtype, i.shape) for n, i in open_model(tmp_path / "model").infos().items()}
    q_proj = 64 * 64
    assert count_parameters(weights) == expected + q_proj


def test_mxfp4_counts_from_shapes_alone(tmp_path: Path) -> None:
    from mlx_lm.utils import get_total_parameters

    model = tiny_llama()
    nn.quantize(model, mode="mxfp4")
    layout = write_sharded(tmp_path, dict(tree_flatten(model.parameters())))
    assert layout.total_parameters == get_total_parameters(model)


COPY_CHILD = """
import sys
from mlxbun.io.safetensors import open_model
from mlxbun.io.shards import ShardedWriter

def peak():  # VmHWM restarts at exec; ru_maxrss would inherit the forking parent's peak
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))

m = open_model(sys.argv[1])
names = m.names()
if sys.argv[3] == "declared":  # a 64 MiB shard that is never held
    infos = m.infos()
    declared = [(n, infos[n].dtype, tuple(infos[n].shape)) for n in names]
    w = ShardedWriter(sys.argv[2], shard_bytes=64 << 20, tensors=declared)
else:
    w = ShardedWriter(sys.argv[2], shard_bytes=16 << 20, overlap=sys.argv[3] == "1")
w.add(names[0], m.array(names[0]))  # warm up imports and the allocator before the baseline
before = peak()
for name in names[1:]:
    w.add(name, m.array(name))
w.finish()
print(peak() - before)
"""


@pytest.mark.parametrize("overlap", ["0", "1", "declared"])
def test_streaming_copy_peak_memory_is_about_one_shard(tmp_path: Path, overlap: str) -> None:
    """Copying a 128 MiB model through the writer in 16 MiB shards stays near a shard, not the
    model; with declared tensors, near the tensors in flight, not a 64 MiB shard."""
    tensors = {
        f"t{i:02d}": mx.full((1024, 2048), float(i), dtype=mx.float32) for i in range(16)
    }  # 8 MiB each
    write_sharded(tmp_path / "src", tensors, shard_bytes=64 << 20)
    del tensors
    code = [sys.executable, "-c", COPY_CHILD, str(tmp_path / "src"), str(tmp_path / "dst"), overlap]
    grew = int(subprocess.run(code, capture_output=True, text=True, check=True).stdout.strip())
    limit = {"0": 16 << 20, "1": 32 << 20, "declared": 0}[overlap] + 2 * (8 << 20)
    assert grew < limit, f"peak RSS grew by {grew / 2**20:.0f} MiB copying a 128 MiB model"
    assert open_model(tmp_path / "dst").names() == [f"t{i:02d}" for i in range(16)]


def test_layout_digests_are_the_sha256_of_the_published_files(tmp_path: Path) -> None:
    import hashlib

    produce(tmp_path / "run", resume=False, stop_after_shards=2, checksum="sha256")._stop(keep_shards=True)
    resumed = ShardedWriter(tmp_path / "run", shard_bytes=1500, resume=True, checksum="sha256")
    for i in range(TENSORS):
        if f"t.{i:02d}" not in resumed.done_names:
            resumed.add(f"t.{i:02d}", tensor(i))
    layout = resumed.finish()
    assert len(layout.shards) > 2 and sorted(layout.digests) == sorted(layout.shards)
    for name, digest in layout.digests.items():  # resumed shards and new ones alike
        assert hashlib.sha256((tmp_path / "run" / name).read_bytes()).hexdigest() == digest
