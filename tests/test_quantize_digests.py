"""The manifest's digests of a conversion: outputs hashed while written, inputs free in the HF cache;
and the source's content identity, without which an output is not reused."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import xxhash
from cli_util import run_cli
from test_quantize import assert_same_tensors, make_hf_model

from mlxbun.io import staging
from mlxbun.quant.quantize.command import quantize_model_dir
from mlxbun.quant.quantize.outdir import MARKER
from mlxbun.runs import provenance
from mlxbun.runs.provenance import Manifest, RunResult, hash_paths, named_sha256
from mlxbun.source.fingerprint import model_fingerprint


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def hf_cache_snapshot(root: Path, files: dict[str, bytes]) -> Path:
    """``models--o--m/{blobs/<sha256>, snapshots/<rev>/<file> -> ../../blobs/<sha256>}``."""
    repo = root / "models--o--m"
    snap = repo / "snapshots" / ("a" * 40)
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for name, data in files.items():
        digest = hashlib.sha256(data).hexdigest()
        if name == "config.json":
            digest = hashlib.sha1(data).hexdigest()  # git files are named by a 40-hex blob hash
        (repo / "blobs" / digest).write_bytes(data)
        (snap / name).symlink_to(Path("../../blobs") / digest)
    return snap


def test_hf_cache_blob_names_are_the_input_digests(tmp_path, monkeypatch):
    snap = hf_cache_snapshot(tmp_path, {"model.safetensors": b"w" * 1000, "config.json": b"{}"})
    assert named_sha256(snap / "model.safetensors") == _sha(snap / "model.safetensors")
    assert named_sha256(snap / "config.json") is None  # a sha1 name is no sha256
    assert named_sha256(snap.parent.parent / "blobs" / _sha(snap / "model.safetensors")) is None  # not a link
    read = []
    real = provenance.file_digest
    monkeypatch.setattr(provenance, "file_digest", lambda p, kind: read.append(Path(p).name) or real(p, kind))
    got = hash_paths([snap], base=tmp_path)
    assert read == ["config.json"]
    for name in ("model.safetensors", "config.json"):
        key = str((snap / name).resolve().relative_to(tmp_path.resolve()))  # keys name the blobs
        assert got[key]["sha256"] == _sha(snap / name)


def test_a_link_to_a_misnamed_file_is_hashed(tmp_path):
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    (blobs / ("0" * 64)).write_bytes(b"not what the name says")
    (tmp_path / "w").symlink_to(blobs / ("0" * 64))
    # Only links into a cache's blobs/ are trusted; this one is, by name: the HF convention.
    assert named_sha256(tmp_path / "w") == "0" * 64
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / ("1" * 64)).write_bytes(b"x")
    (tmp_path / "v").symlink_to(tmp_path / "store" / ("1" * 64))
    assert named_sha256(tmp_path / "v") is None


def test_manifest_takes_the_writers_shard_digests_without_reading_them(tmp_path, tiny_model, monkeypatch):
    src = tiny_model("llama")
    run_dir = tmp_path / "run"
    res = quantize_model_dir(src, run_dir / "model", bits=4, shard_bytes=20000, threads=2)
    assert len(res.digests) == len(res.files) > 1
    real = provenance.file_digest

    def no_shards(path, kind):
        if Path(path).name.startswith("model-") and Path(path).suffix == ".safetensors":
            pytest.fail(f"{path} was read again to hash it")
        return real(path, kind)

    monkeypatch.setattr(provenance, "file_digest", no_shards)
    manifest = Manifest(run_dir, "quantize", {}, [], None, 0, {})
    digests = {res.out / f: d for f, d in res.digests.items()}
    manifest.finish(status="ok", result=RunResult(outputs=[res.out], digests=digests))
    for name in res.files:
        assert manifest.outputs[f"model/{name}"]["sha256"] == _sha(res.out / name)


def test_prehash_fills_the_digest_cache(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.bin").write_bytes(b"a" * 5000)
    got = provenance.prehash([tmp_path / "src"], cache_dir=tmp_path / "cache").result(timeout=30)
    assert got == {tmp_path / "src" / "a.bin": _sha(tmp_path / "src" / "a.bin")}
    assert list((tmp_path / "cache").rglob("*")) != []


def test_record_takes_the_writers_xxh3_without_reading_the_shards(tmp_path, tiny_model, monkeypatch):
    src = tiny_model("llama")
    real = staging.file_digest

    def no_shards(path, kind):
        if Path(path).name.startswith((".mlxbun-shard-", "model")) and Path(path).suffix == ".safetensors":
            pytest.fail(f"{path} was read again to hash it")
        return real(path, kind)

    monkeypatch.setattr(staging, "file_digest", no_shards)
    res = quantize_model_dir(src, tmp_path / "model", bits=4, shard_bytes=20000, threads=2)
    record = json.loads((res.out / MARKER).read_text())["files"]
    assert len(res.files) > 1 and "config.json" in record
    for name, entry in record.items():
        data = (res.out / name).read_bytes()
        assert entry == {"xxh3_128": xxhash.xxh3_128(data).hexdigest(), "size": len(data)}, name
    monkeypatch.setattr(staging, "file_digest", real)
    assert quantize_model_dir(src, tmp_path / "model", bits=4, shard_bytes=20000, threads=2).reused


def _rewrite_keeping_header(shard: Path, data: bytes, *, keep_mtime: bool) -> None:
    """``data`` (a file with the same safetensors header) written over ``shard`` in place: the same
    inode and size; with ``keep_mtime`` its mtime set back, as ``cp -p`` or ``touch -d`` would."""
    before = shard.stat()
    with open(shard, "r+b") as f:
        n = int.from_bytes(data[:8], "little")
        assert f.read(8 + n) == data[: 8 + n]  # the same header: only tensor bytes differ
        f.write(data[8 + n :])
    if keep_mtime:
        os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))


def test_an_output_of_other_source_bytes_under_the_same_header_is_converted_again(tmp_path):
    """Same config, shapes and safetensors header, other tensor bytes: the record's content
    identity differs, so quant.out is converted again, not reused."""
    src = make_hf_model(tmp_path / "src", "llama")
    other = make_hf_model(tmp_path / "other", "llama", seed=1)
    first = quantize_model_dir(src, tmp_path / "out", bits=4)
    assert json.loads((first.out / MARKER).read_text())["content"] == model_fingerprint(src, depth="content")
    _rewrite_keeping_header(
        src / "model.safetensors", (other / "model.safetensors").read_bytes(), keep_mtime=True
    )
    again = quantize_model_dir(src, tmp_path / "out", bits=4)
    assert not again.reused
    assert_same_tensors(quantize_model_dir(other, tmp_path / "fresh", bits=4).out, again.out)
    assert json.loads((again.out / MARKER).read_text())["content"] == model_fingerprint(
        other, depth="content"
    )
    assert quantize_model_dir(src, tmp_path / "out", bits=4).reused  # the same content: reused


def test_cli_quantize_after_the_weights_changed_writes_and_describes_the_new_output(tmp_path):
    """Through the digest cache: a shard rewritten with its mtime set back is hashed again (its
    ctime moved), the output converted again and the manifest's digests are the new files'."""
    src = make_hf_model(tmp_path / "src", "llama")
    other = make_hf_model(tmp_path / "other", "llama", seed=1)
    out = tmp_path / "q"
    args = ("command=quantize", f"model.name={src}", "quant.bits=4", f"quant.out={out}", "blas=off")
    assert run_cli(*args, tmp=tmp_path).returncode == 0
    _rewrite_keeping_header(
        src / "model.safetensors", (other / "model.safetensors").read_bytes(), keep_mtime=True
    )
    r = run_cli(*args, "json=true", tmp=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)
    assert doc["metrics"]["reused"] is False
    assert_same_tensors(quantize_model_dir(other, tmp_path / "fresh", bits=4).out, out)
    manifest = json.loads((Path(doc["run_dir"]) / "manifest.json").read_text())
    shard = str((src / "model.safetensors").resolve())
    assert manifest["inputs"][shard]["sha256"] == _sha(src / "model.safetensors")
    assert manifest["outputs"][str(out / "model.safetensors")]["sha256"] == _sha(out / "model.safetensors")
