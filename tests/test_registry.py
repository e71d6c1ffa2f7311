"""Registry tests on synthetic HF hub trees built here; every test runs on sqlite and PostgreSQL.

PostgreSQL params run when MLXBUN_TEST_PG_URL is set (``eval "$(bash .ci/postgres.sh)"``); they
are skipped without it, except under CI=true, where a missing server is a failure.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import peewee as pw
import pytest
from safetensors import safe_open
from safetensors.numpy import save

from mlxbun import registry
from mlxbun.errors import EnvironmentFailure, InputError
from mlxbun.registry import commands
from mlxbun.source import hub

PG_URL = os.environ.get("MLXBUN_TEST_PG_URL")
TOOLS_TEMPLATE = (
    "{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"
)


# --------------------------------------------------------------------------- databases


def _drop_all(database: pw.Database) -> None:
    cascade = " CASCADE" if isinstance(database, pw.PostgresqlDatabase) else ""
    for t in ("model_record", "runrecord", "schema_version"):
        database.execute_sql(f'DROP TABLE IF EXISTS "{t}"{cascade}')


@pytest.fixture(
    params=[
        "sqlite",
        pytest.param("postgres", marks=pytest.mark.postgres),
    ]
)
def dburl(request, tmp_path):
    """A fresh, empty registry database URL: sqlite in tmp_path, or the test PostgreSQL database,
    held by one test at a time across xdist workers (each starts by dropping its tables, so two
    at once failed on each other's: xdist_group marks did not keep them on one worker)."""
    lock = None
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'registry.db'}"
    else:
        if not PG_URL and os.environ.get("CI") == "true":  # CI must prove the PostgreSQL path
            pytest.fail("CI=true but MLXBUN_TEST_PG_URL is not set: .ci/postgres.sh did not run or failed")
        if not PG_URL:
            pytest.skip('MLXBUN_TEST_PG_URL is not set (eval "$(bash .ci/postgres.sh)")')
        url = PG_URL
        lock = open(Path(tempfile.gettempdir()) / "mlxbun-test-postgres.lock", "w")  # noqa: SIM115
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if the test dies
        from playhouse.db_url import connect

        d = connect(url)
        _drop_all(d)
        d.close()
    registry.database._target = None
    try:
        yield url
    finally:
        if registry.db.obj is not None:
            registry.db.obj.close()
        registry.database._target = None
        if lock is not None:
            lock.close()


@pytest.fixture
def reg(dburl):
    registry.open_db(url=dburl)
    return registry


# --------------------------------------------------------------------------- synthetic hub trees


def st(tensors: dict[str, tuple[str, tuple[int, ...]]]) -> bytes:
    """A real safetensors file (written by the safetensors library) of zero tensors."""
    return save(
        {n: np.zeros(shape, dtype=dt) for n, (dt, shape) in tensors.items()}, metadata={"format": "mlx"}
    )


def llama_config(**kw) -> dict:
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2,
           "hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 32,
           "torch_dtype": "bfloat16"}  # fmt: skip
    cfg.update(kw)
    return cfg


def dense_weights(layers: int = 2, hidden: int = 16, vocab: int = 32) -> dict[str, bytes]:
    t = {"model.embed_tokens.weight": ("float16", (vocab, hidden))}
    for i in range(layers):
        t[f"model.layers.{i}.self_attn.q_proj.weight"] = ("float16", (hidden, hidden))
        t[f"model.layers.{i}.mlp.down_proj.weight"] = ("float16", (hidden, 2 * hidden))
    return {"model.safetensors": st(t)}


def model_files(
    config: dict | bytes, weights: dict[str, bytes] | None = None, **extra: bytes
) -> dict[str, bytes]:
    cfg = config if isinstance(config, bytes) else json.dumps(config).encode()
    return {"config.json": cfg, **(dense_weights() if weights is None else weights), **extra}


class Hub:
    """Builds ``models--org--name/{blobs, refs, snapshots}`` trees like huggingface_hub does."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def repo_dir(self, repo_id: str, kind: str = "models") -> Path:
        return self.root / f"{kind}--{repo_id.replace('/', '--')}"

    def _blob(self, repo: Path, data: bytes, shared: bool) -> str:
        etag = hashlib.sha256(data).hexdigest()
        blob = repo / "blobs" / etag
        blob.parent.mkdir(parents=True, exist_ok=True)
        if blob.exists() or blob.is_symlink():
            return etag
        if shared:  # hf_hub 2.x: repo blob -> cache-wide store, two hops from the snapshot
            store = self.root / "blobs" / etag[:2] / etag
            store.parent.mkdir(parents=True, exist_ok=True)
            (self.root / "blobs" / ".huggingface-shared-blobs").write_text("1\n")
            store.write_bytes(data)
            os.symlink(f"../../blobs/{etag[:2]}/{etag}", blob)
        else:
            blob.write_bytes(data)
        return etag

    def add(self, repo_id: str, rev: str, files: dict[str, bytes], *, main: bool = True, shared: bool = False,
            kind: str = "models") -> Path:  # fmt: skip
        repo = self.repo_dir(repo_id, kind)
        snap = repo / "snapshots" / rev
        snap.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            os.symlink(f"../../blobs/{self._blob(repo, data, shared)}", snap / name)
        if main:
            (repo / "refs").mkdir(exist_ok=True)
            (repo / "refs" / "main").write_text(rev)
        return snap

    def age(self, seconds: float = 3600) -> None:
        """Date every directory back, as in a cache downloaded earlier (mtimes this fresh are "racy")."""
        t = time.time() - seconds
        for d, _dirs, _files in os.walk(self.root):
            os.utime(d, (t, t))

    def break_link(self, snap: Path, name: str) -> None:
        """Delete the blob behind ``snap/name`` (as an interrupted download or a manual rm would)."""
        os.unlink(os.path.realpath(snap / name))


@pytest.fixture
def hubtree(tmp_path) -> Hub:
    return Hub(tmp_path / "hub")


def row(path: Path) -> dict:
    return registry.ModelRecord.get(registry.ModelRecord.path == str(path)).to_dict()


def shapes_elements(path: Path) -> int:
    with safe_open(str(path), framework="numpy") as f:
        return sum(int(np.prod(f.get_slice(n).get_shape())) for n in f.keys())


# --------------------------------------------------------------------------- fields


def test_dense_snapshot_fields(reg, hubtree):
    files = model_files(llama_config())
    files["README.md"] = b"---\nlanguage: en\nlicense: apache-2.0\ntags: [x]\n---\n# card\n"
    files["tokenizer_config.json"] = json.dumps({"chat_template": TOOLS_TEMPLATE}).encode()
    files["kv_config.json"] = json.dumps({"layers": {"0": {"bits": 4}}}).encode()
    snap = hubtree.add("org/dense", "r1", files)
    report = reg.scan(hub_cache=hubtree.root)
    assert (report.read, report.unchanged, report.warnings) == (1, 0, ())
    r = row(snap)
    weights = snap / "model.safetensors"
    assert r["weight_bytes"] == os.stat(weights).st_size == len(files["model.safetensors"])
    assert r["total_bytes"] == r["weight_bytes"] and r["vision_bytes"] == 0 and r["expert_bytes"] == 0
    assert r["param_count"] == shapes_elements(weights) == 32 * 16 + 2 * (16 * 16 + 16 * 32)
    assert (r["repo_id"], r["name"], r["revision"], r["refs"], r["source"]) == (
        "org/dense",
        "org/dense",
        "r1",
        "main",
        "hub",
    )
    assert (r["model_type"], r["text_model_type"], r["architectures"]) == (
        "llama",
        "llama",
        "LlamaForCausalLM",
    )
    assert (r["num_layers"], r["hidden_size"], r["vocab_size"], r["num_kv_heads"], r["head_dim"]) == (
        2,
        16,
        32,
        2,
        4,
    )
    assert (r["license"], r["has_tools"], r["has_kv_config"], r["has_vision"]) == (
        "apache-2.0",
        True,
        True,
        False,
    )
    assert r["quant_bits"] is None and r["quant_mode"] is None and r["is_drafter"] is False
    assert r["warning"] is None and r["scanned_at"]


def test_index_total_parameters_wins_and_shards_are_summed(reg, hubtree):
    a = st({"model.embed_tokens.weight": ("float32", (32, 16))})
    b = st({"lm_head.weight": ("float32", (32, 16))})
    index = {"metadata": {"total_size": 4096, "total_parameters": 1024},
             "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                            "lm_head.weight": "model-00002-of-00002.safetensors"}}  # fmt: skip
    weights = {"model-00001-of-00002.safetensors": a, "model-00002-of-00002.safetensors": b,
               "model.safetensors.index.json": json.dumps(index).encode()}  # fmt: skip
    snap = hubtree.add("org/sharded", "r1", model_files(llama_config(), weights))
    reg.scan(hub_cache=hubtree.root)
    r = row(snap)
    assert r["param_count"] == 1024
    assert r["weight_bytes"] == len(a) + len(b)


def test_vision_model_text_config_and_sidecar(reg, hubtree):
    cfg = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
           "text_config": {"model_type": "gemma3_text", "num_hidden_layers": 6, "hidden_size": 32,
                           "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 8, "vocab_size": 64,
                           "sliding_window": 4, "sliding_window_pattern": 3},
           "vision_config": {"model_type": "siglip_vision_model"}}  # fmt: skip
    sidecar = st({"vision_tower.patch_embed.weight": ("float16", (8, 8))})
    files = model_files(cfg, **{"optiq_vision.safetensors": sidecar})
    snap = hubtree.add("org/vlm", "r1", files)
    reg.scan(hub_cache=hubtree.root)
    r = row(snap)
    assert r["has_vision"] is True and r["vision_bytes"] == len(sidecar)
    assert r["weight_bytes"] == len(files["model.safetensors"])
    assert r["total_bytes"] == r["weight_bytes"] + r["vision_bytes"]
    assert (r["model_type"], r["text_model_type"]) == ("gemma3", "gemma3_text")
    assert (r["num_layers"], r["hidden_size"], r["vocab_size"], r["head_dim"], r["num_kv_heads"]) == (
        6,
        32,
        64,
        8,
        1,
    )
    assert (r["sliding_window"], r["num_sliding_layers"]) == (4, 4)  # 6 layers, every 3rd global


def moe_files() -> tuple[dict[str, bytes], int]:
    t = {"model.embed_tokens.weight": ("float16", (32, 16))}
    expert_bytes = 0
    for i in range(2):
        t[f"model.layers.{i}.mlp.gate.weight"] = ("float16", (4, 16))
        t[f"model.layers.{i}.mlp.shared_experts.up_proj.weight"] = ("float16", (16, 16))
        for e in range(4):
            t[f"model.layers.{i}.mlp.experts.{e}.up_proj.weight"] = ("float16", (8, 16))
            expert_bytes += 8 * 16 * 2
    cfg = llama_config(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=1)
    return model_files(cfg, {"model.safetensors": st(t)}), expert_bytes


def test_moe_expert_bytes_from_headers_and_active_share(reg, hubtree):
    files, expert_bytes = moe_files()
    snap = hubtree.add("org/moe", "r1", files)
    reg.scan(hub_cache=hubtree.root)
    r = row(snap)
    assert r["expert_bytes"] == expert_bytes  # shared_experts are not routed experts
    assert (r["num_experts"], r["experts_per_tok"]) == (4, 1)
    f = reg.fit("org/moe", hub_cache=hubtree.root, budget_gb=1, context=10)
    assert f.active_expert_bytes == expert_bytes // 4
    assert f.active_weight_bytes == r["weight_bytes"] - expert_bytes + expert_bytes // 4


def test_quantized_model_fields_and_logical_params(reg, hubtree):
    t = {"model.embed_tokens.weight": ("uint32", (32, 2)), "model.embed_tokens.scales": ("float16", (32, 1)),
         "model.embed_tokens.biases": ("float16", (32, 1)), "model.norm.weight": ("float16", (16,))}  # fmt: skip
    cfg = llama_config(quantization={"group_size": 16, "bits": 4, "mode": "affine"})
    snap = hubtree.add("org/q4", "r1", model_files(cfg, {"model.safetensors": st(t)}))
    reg.scan(hub_cache=hubtree.root)
    r = row(snap)
    assert (r["quant_bits"], r["quant_group_size"], r["quant_mode"]) == (4, 16, "affine")
    assert r["param_count"] == 32 * 16 + 16  # packed uint32 -> 8 four-bit values each; scales/biases 0
    hf_style = llama_config(quantization_config={"quant_method": "gptq", "bits": 8, "group_size": 128})
    snap2 = hubtree.add("org/gptq", "r1", model_files(hf_style))
    reg.scan(hub_cache=hubtree.root)
    assert (row(snap2)["quant_bits"], row(snap2)["quant_mode"]) == (8, "gptq")


def test_mixed_quantization_params_follow_each_module_bits(tmp_path):
    """Per-module bits in the quantization block count, as mlx-lm's get_total_parameters does."""
    t = {"a.weight": ("uint32", (32, 2)), "a.scales": ("float16", (32, 1)), "a.biases": ("float16", (32, 1)),
         "b.weight": ("uint32", (32, 4)), "b.scales": ("float16", (32, 1)), "b.biases": ("float16", (32, 1))}  # fmt: skip
    cfg = llama_config(quantization={"group_size": 16, "bits": 4, "b": {"bits": 8, "group_size": 16}})
    for name, data in model_files(cfg, {"model.safetensors": st(t)}).items():
        (tmp_path / name).write_bytes(data)
    info = hub.read_model_dir(tmp_path, hub.list_files(tmp_path))
    assert info.param_count == 32 * 16 + 32 * 16  # a: 2 words x 8 four-bit values; b: 4 words x 4 eight-bit


def test_license_front_matter_forms(reg, hubtree):
    cases = {
        "org/l1": b"---\nlicense: mit\n---\n",
        "org/l2": b"---\ntags:\n- a\nlicense:\n  - 'llama3.1'\n---\ntext\n",
        "org/l3": b'---\nlicense: "other" # custom\nlicense_name: foo\n---\n',
        "org/l4": b"# no front matter\nlicense: mit\n",
    }
    snaps = {rid: hubtree.add(rid, "r1", model_files(llama_config(), **{"README.md": b""})) for rid in cases}
    for rid, text in cases.items():
        os.unlink(snaps[rid] / "README.md")
        (snaps[rid] / "README.md").write_bytes(text)
    reg.scan(hub_cache=hubtree.root)
    got = {rid: row(s)["license"] for rid, s in snaps.items()}
    assert got == {"org/l1": "mit", "org/l2": "llama3.1", "org/l3": "other", "org/l4": None}


def test_tool_template_forms(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(llama_config()))
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": [{"name": "default", "template": "x"},
                                                                         {"name": "tool_use", "template": TOOLS_TEMPLATE}]}))  # fmt: skip
    assert hub.read_model_dir(d, hub.list_files(d)).has_tools is True
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    assert hub.read_model_dir(d, hub.list_files(d)).has_tools is False
    (d / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    assert hub.read_model_dir(d, hub.list_files(d)).has_tools is True


def test_shared_blob_store_two_hops(reg, hubtree):
    files = model_files(llama_config())
    snap = hubtree.add("org/shared", "r1", files, shared=True)
    assert os.path.islink(os.readlink(snap / "model.safetensors").replace("../..", str(snap.parent.parent)))
    reg.scan(hub_cache=hubtree.root)
    r = row(snap)
    assert r["weight_bytes"] == len(files["model.safetensors"]) and r["warning"] is None
    assert r["param_count"] == shapes_elements(snap / "model.safetensors")


# --------------------------------------------------------------------------- robustness


def test_broken_partial_empty_dataset_and_bad_json_are_warnings(reg, hubtree, caplog):
    good = hubtree.add("org/good", "r1", model_files(llama_config()))
    broken = hubtree.add("org/broken", "r1", model_files(llama_config()))
    hubtree.break_link(broken, "model.safetensors")
    (hubtree.repo_dir("org/broken") / "blobs" / "deadbeef.incomplete").write_bytes(b"partial")
    empty = hubtree.repo_dir("org/empty") / "snapshots" / "r1"
    empty.mkdir(parents=True)
    badjson = hubtree.add("org/badjson", "r1", model_files(b"{not json"))
    hubtree.add("org/data", "r1", model_files(llama_config()), kind="datasets")
    (hubtree.repo_dir("org/nosnaps")).mkdir()
    (hubtree.root / "version.txt").write_text("1")
    report = reg.scan(hub_cache=hubtree.root)
    text = " | ".join(report.warnings)
    assert "broken link: model.safetensors" in text and "empty directory" in text
    assert "config.json: unreadable" in text and "no snapshots/" in text
    assert "registry:" in caplog.text  # logged, not raised
    assert [m["name"] for m in reg.ls()] == ["org/good"]
    listed = {m["name"]: m for m in reg.ls(broken=True)}
    assert set(listed) == {"org/good", "org/broken", "org/empty", "org/badjson"}  # no dataset
    assert listed["org/broken"]["warning"] and listed["org/broken"]["weight_bytes"] == 0
    assert row(good)["warning"] is None and row(badjson)["model_type"] is None
    with pytest.raises(
        EnvironmentFailure, match="org/broken.*cannot be used: broken link: model.safetensors"
    ):
        reg.resolve("org/broken", hub_cache=hubtree.root)


def test_hostile_safetensors_header_is_a_warning(reg, hubtree):
    bad = (2**40).to_bytes(8, "little") + b"{}"
    snap = hubtree.add("org/hostile", "r1", model_files(llama_config(), {"model.safetensors": bad}))
    report = reg.scan(hub_cache=hubtree.root)
    assert any("unreadable header" in w for w in report.warnings)
    assert row(snap)["warning"]


# --------------------------------------------------------------------------- incremental


def test_rescan_reads_only_changes_and_prunes(reg, hubtree, monkeypatch):
    snaps = [hubtree.add(f"org/m{i}", "r1", model_files(llama_config(vocab_size=32 + i))) for i in range(4)]
    assert reg.scan(hub_cache=hubtree.root).read == 4
    assert reg.scan(hub_cache=hubtree.root).read == 4  # mtimes too fresh to trust: read again
    hubtree.age()
    assert reg.scan(hub_cache=hubtree.root).read == 4  # stores the now-trusted keys
    calls = []
    real = hub.read_model_dir
    monkeypatch.setattr(hub, "read_model_dir", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    again = reg.scan(hub_cache=hubtree.root)
    assert (again.read, again.unchanged, again.pruned, calls) == (0, 4, 0, [])
    (snaps[1] / "kv_config.json").write_text("{}")  # a new file: that snapshot changes
    assert reg.scan(hub_cache=hubtree.root).read == 1 and calls == [str(snaps[1])]
    assert row(snaps[1])["has_kv_config"] is True
    shutil.rmtree(hubtree.repo_dir("org/m2"))
    assert [m["name"] for m in reg.ls()] == ["org/m0", "org/m1", "org/m3"]  # gone before any rescan
    assert reg.scan(hub_cache=hubtree.root).pruned == 1
    assert registry.ModelRecord.select().count() == 3


def test_refs_move_without_reread(reg, hubtree):
    hubtree.add("org/m", "r1", model_files(llama_config()))
    new = hubtree.add("org/m", "r2", model_files(llama_config(vocab_size=40)))
    hubtree.age()
    reg.scan(hub_cache=hubtree.root)
    assert reg.resolve("org/m", hub_cache=hubtree.root) == new
    (hubtree.repo_dir("org/m") / "refs" / "main").write_text("r1")
    r = reg.scan(hub_cache=hubtree.root)
    assert r.read == 0
    assert reg.resolve("org/m", hub_cache=hubtree.root).name == "r1"


# --------------------------------------------------------------------------- resolve


def test_resolve_revisions_collapse_to_canonical(reg, hubtree):
    old = hubtree.add("org/rev", "aaa", model_files(llama_config()), main=False)
    hubtree.add("org/rev", "bbb", model_files(llama_config(vocab_size=48)), main=False)
    # No refs/main: same scan time, so ties go by path.
    assert reg.resolve("org/rev", hub_cache=hubtree.root) == old
    hubtree.age()
    reg.scan(hub_cache=hubtree.root)
    time.sleep(0.01)
    late = hubtree.add("org/rev", "zzz", model_files(llama_config(vocab_size=64)), main=False)
    assert reg.resolve("rev", hub_cache=hubtree.root) == late  # most recently scanned wins
    hubtree.add("org/rev", "bbb", {}, main=True)  # refs/main -> bbb
    assert reg.resolve("org/rev", hub_cache=hubtree.root).name == "bbb"
    assert len(reg.ls()) == 1 and len(reg.ls(all_revisions=True)) == 3


def test_resolve_exact_fuzzy_ambiguous_missing(reg, hubtree, tmp_path):
    a = hubtree.add("Qwen/Qwen3-0.6B", "r1", model_files(llama_config(model_type="qwen3")))
    hubtree.add("Qwen/Qwen3-4B", "r1", model_files(llama_config(model_type="qwen3")))
    hubtree.add("Qwen/Qwen3-4B-Instruct", "r1", model_files(llama_config(model_type="qwen3")))
    root = hubtree.root
    assert reg.resolve("Qwen/Qwen3-0.6B", hub_cache=root) == a  # exact repo id, on an empty db
    assert reg.resolve("qwen/qwen3-0.6b", hub_cache=root) == a
    assert reg.resolve("0.6b", hub_cache=root) == a  # fuzzy, unique
    assert reg.resolve("Qwen/Qwen3-4B", hub_cache=root).parent.parent.name == "models--Qwen--Qwen3-4B"
    assert reg.resolve(str(a), hub_cache=root) == a.resolve()  # a path
    with pytest.raises(
        InputError, match=r"matches 3 models: Qwen/Qwen3-0.6B, Qwen/Qwen3-4B, Qwen/Qwen3-4B-Instruct"
    ):
        reg.resolve("qwen3", hub_cache=root)
    with pytest.raises(InputError) as e:
        reg.resolve("meta-llama/Llama-3.2-1B", hub_cache=root)
    msg = str(e.value)
    assert "not in the local HF cache" in msg and "hf download meta-llama/Llama-3.2-1B" in msg
    assert "huggingface-cli download meta-llama/Llama-3.2-1B" in msg and str(root) in msg
    with pytest.raises(InputError, match="matches no indexed model"):
        reg.resolve("nothing-like-this", hub_cache=root)


def test_drafters_are_never_candidates(reg, hubtree):
    target = hubtree.add("org/Llama-8B", "r1", model_files(llama_config()))
    eagle = hubtree.add("yuhuili/EAGLE3-Llama-8B", "r1", model_files(llama_config()))
    hubtree.add("org/Llama-8B-mtp", "r1", model_files(llama_config(model_type="llama_mtp")))
    hubtree.add("org/Llama-8B-heads", "r1", model_files(llama_config(medusa_num_heads=4)))
    hubtree.add(
        "org/Llama-8B-tiny", "r1", model_files(llama_config(architectures=["LlamaDrafterForCausalLM"]))
    )
    reg.scan(hub_cache=hubtree.root)
    flags = {m["name"]: m["is_drafter"] for m in reg.ls()}
    assert flags == {"org/Llama-8B": False, "yuhuili/EAGLE3-Llama-8B": True, "org/Llama-8B-mtp": True,
                     "org/Llama-8B-heads": True, "org/Llama-8B-tiny": True}  # fmt: skip
    assert reg.resolve("llama-8b", hub_cache=hubtree.root) == target
    assert reg.resolve("yuhuili/EAGLE3-Llama-8B", hub_cache=hubtree.root) == eagle  # explicit still works


# --------------------------------------------------------------------------- other sources


def test_local_paths_run_outputs_and_registered(reg, hubtree, tmp_path):
    models = tmp_path / "models"
    for name in ("alpha", "beta"):
        (models / name).mkdir(parents=True)
        for fname, data in model_files(llama_config()).items():
            (models / name / fname).write_bytes(data)
    (models / "notes").mkdir()
    run = tmp_path / "outputs" / "quantize" / "2026-01-01_00-00-00_000000"
    (run / "model").mkdir(parents=True)
    (run / "manifest.json").write_text("{}")
    for fname, data in model_files(llama_config(quantization={"bits": 4, "group_size": 64})).items():
        (run / "model" / fname).write_bytes(data)
    (run / ".model.partial").mkdir()
    (run / ".model.partial" / "config.json").write_text("{}")
    stray = tmp_path / "outputs" / "stray"  # no manifest: not an mlxbun output
    stray.mkdir()
    (stray / "config.json").write_text("{}")
    r = reg.scan(hub_cache=hubtree.root, paths=[models], runs_root=tmp_path / "outputs")
    assert r.read == 3
    got = {m["name"]: m["source"] for m in reg.ls()}
    assert got == {"alpha": "local", "beta": "local", "quantize/2026-01-01_00-00-00_000000/model": "run"}
    assert reg.ls(quantized=True)[0]["source"] == "run"
    # A single model dir is a path too; registered models keep their given name.
    own = tmp_path / "fresh-4bit"
    own.mkdir()
    for fname, data in model_files(llama_config()).items():
        (own / fname).write_bytes(data)
    rec = reg.register_model(own, name="my-fresh-4bit")
    assert rec["source"] == "registered" and rec["param_count"]
    assert reg.resolve("my-fresh-4bit", hub_cache=hubtree.root) == own
    assert reg.scan(hub_cache=hubtree.root, paths=[models], runs_root=tmp_path / "outputs").read == 0
    with pytest.raises(InputError, match="is not a directory"):
        reg.register_model(tmp_path / "missing")
    # The latest registration of a name wins; two local dirs of one name are ambiguous, with paths.
    newer = tmp_path / "fresh-4bit-v2"
    shutil.copytree(own, newer)
    (newer / "kv_config.json").write_text("{}")
    time.sleep(0.01)
    reg.register_model(newer, name="my-fresh-4bit")
    assert reg.resolve("my-fresh-4bit", hub_cache=hubtree.root) == newer
    shutil.rmtree(newer)
    assert reg.resolve("my-fresh-4bit", hub_cache=hubtree.root) == own
    other = tmp_path / "more" / "alpha"
    shutil.copytree(models / "alpha", other)
    with pytest.raises(InputError, match=r"matches 2 models: alpha \(.*alpha\), alpha \("):
        reg.resolve("alpha", hub_cache=hubtree.root, paths=[models, other])
    # A registered dir under a scanned path keeps its name; a vanished one is dropped by the next scan.
    reg.register_model(models / "beta", name="beta-tuned")
    reg.scan(hub_cache=hubtree.root, paths=[models])
    assert reg.resolve("beta-tuned", hub_cache=hubtree.root, paths=[models]) == models / "beta"
    assert row(models / "beta")["source"] == "registered"
    shutil.rmtree(own)
    assert reg.scan(hub_cache=hubtree.root).pruned == 1
    assert registry.ModelRecord.get_or_none(registry.ModelRecord.path == str(own)) is None


# --------------------------------------------------------------------------- ls


def test_ls_filters_and_sorting(reg, hubtree):
    hubtree.add(
        "org/small-text", "r1", model_files(llama_config(), **{"README.md": b"---\nlicense: mit\n---\n"})
    )
    vlm_cfg = llama_config(model_type="llava", vision_config={"hidden_size": 8})
    big = {"model.safetensors": st({"w": ("float32", (256, 64))})}
    hubtree.add("org/big-vision", "r1", model_files(vlm_cfg, big))
    hubtree.add("org/q-text", "r1", model_files(llama_config(quantization={"bits": 4, "group_size": 64})))
    reg.scan(hub_cache=hubtree.root)

    def names(**kw):
        return [m["name"] for m in reg.ls(**kw)]

    sizes = {m["name"]: m["total_bytes"] for m in reg.ls()}
    assert names() == sorted(sizes, key=lambda n: (sizes[n], n)) and names()[-1] == "org/big-vision"
    assert names(vision=True) == ["org/big-vision"]
    assert "org/big-vision" not in names(vision=False)
    assert names(max_gb=60_000 / 2**30) == names(vision=False)
    assert names(query="SMALL") == ["org/small-text"]
    assert names(query="llava") == ["org/big-vision"]  # model type
    assert names(license="MIT") == ["org/small-text"]
    assert names(model_type="LLaVA") == ["org/big-vision"]
    assert names(quantized=True) == ["org/q-text"]
    assert set(names(quantized=False)) == {"org/small-text", "org/big-vision"}
    assert names(vision=True, max_gb=1e-9) == []


# --------------------------------------------------------------------------- fit


def test_fit_kv_cache_and_verdict(reg, hubtree):
    cfg = llama_config(num_hidden_layers=4, num_key_value_heads=2, head_dim=8)
    snap = hubtree.add("org/fitme", "r1", model_files(cfg))
    reg.scan(hub_cache=hubtree.root)
    w = row(snap)["weight_bytes"]
    kv = 4 * 2 * 8 * 2 * 2 * 1000  # layers x kv_heads x head_dim x (K,V) x bf16 x tokens
    f = reg.fit("org/fitme", hub_cache=hubtree.root, budget_gb=(w + kv) / 2**30, context=1000)
    assert (f.kv_bytes, f.total_bytes, f.fits) == (kv, w + kv, True)
    f = reg.fit("org/fitme", hub_cache=hubtree.root, budget_gb=(w + kv - 1) / 2**30, context=1000)
    assert f.fits is False
    local = hubtree.root.parent / "plain-dir"  # a directory never scanned: read on the spot
    local.mkdir()
    for name, data in model_files(cfg).items():
        (local / name).write_bytes(data)
    assert reg.fit(str(local), hub_cache=hubtree.root, context=1000).kv_bytes == kv
    assert "does NOT fit" in registry.format_fit(f) and "KV cache" in registry.format_fit(f)


def test_fit_sliding_window_and_vision(reg, hubtree):
    cfg = {"model_type": "gemma3", "vision_config": {},
           "text_config": {"model_type": "gemma3_text", "num_hidden_layers": 6, "hidden_size": 32,
                           "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 8,
                           "sliding_window": 100, "sliding_window_pattern": 6, "torch_dtype": "float32"}}  # fmt: skip
    sidecar = st({"vision_tower.w": ("float16", (8, 8))})
    hubtree.add("org/g3", "r1", model_files(cfg, **{"optiq_vision.safetensors": sidecar}))
    f = reg.fit("org/g3", hub_cache=hubtree.root, context=1000, vision=True)
    per = 1 * 8 * 2 * 4
    assert f.kv_bytes == per * (1 * 1000 + 5 * 100)  # 5 sliding layers keep 100 tokens
    assert f.vision_bytes == len(sidecar)
    assert reg.fit("org/g3", hub_cache=hubtree.root, context=1000).vision_bytes == 0
    no_shape = registry.fit_record(
        type("R", (), dict(row(next(hubtree.repo_dir("org/g3").glob("snapshots/*"))), num_kv_heads=None))(),
        budget_bytes=10**9,
        context=10,
    )
    assert no_shape.kv_bytes is None and any("KV cache unknown" in n for n in no_shape.notes)


# --------------------------------------------------------------------------- schema, runs


class RunRecordV1(pw.Model):
    """The first released layout of `runrecord` (no host column, no schema_version table)."""

    command = pw.CharField(index=True)
    recipe = pw.CharField(null=True, index=True)
    overrides = pw.TextField(default="[]")
    config_hash = pw.CharField(index=True)
    status = pw.CharField(index=True, default="running")
    output_dir = pw.TextField()
    metrics = pw.TextField(default="{}")
    error = pw.TextField(null=True)
    started_at = pw.DateTimeField()
    finished_at = pw.DateTimeField(null=True)
    duration_s = pw.FloatField(null=True)

    class Meta:
        table_name = "runrecord"


def test_migrates_a_v1_database_and_keeps_rows(dburl):
    from playhouse.db_url import connect

    old = connect(dburl)
    with old.bind_ctx([RunRecordV1]):
        old.create_tables([RunRecordV1])
        for i in range(3):
            RunRecordV1.create(
                command=f"c{i}", config_hash="h", output_dir=f"/o/{i}", started_at=registry.utcnow()
            )
    assert registry.schema_version(old) == 1
    old.close()
    database = registry.open_db(url=dburl)
    assert registry.schema_version(database) == registry.SCHEMA_VERSION
    cols = {c.name for c in database.get_columns("runrecord")}
    assert "host" in cols and "model_record" in database.get_tables()
    assert [r["command"] for r in registry.list_runs()] == ["c2", "c1", "c0"]
    rid = registry.record_run_start(
        command="new", recipe=None, overrides=[], config_hash="h", output_dir="/o"
    )
    registry.record_run_end(rid, status="ok", metrics={"x": 1})
    assert registry.list_runs(limit=1)[0]["host"]
    registry.database._target = None
    assert registry.upgrade_schema(registry.open_db(url=dburl)) == registry.SCHEMA_VERSION  # idempotent
    registry.SchemaVersion.update(version=registry.SCHEMA_VERSION + 1).execute()
    registry.database._target = None
    with pytest.raises(InputError, match="newer than this mlxbun"):
        registry.open_db(url=dburl)  # never "migrate" a newer schema backwards


def _insert_runs(args: tuple[str, int, int]) -> int:
    url, worker, n = args
    registry.database._target = None
    registry.open_db(url=url)
    for i in range(n):
        rid = registry.record_run_start(command="sweep", recipe=None, overrides=[f"w={worker}", f"i={i}"],
                                        config_hash="h", output_dir=f"/o/{worker}/{i}")  # fmt: skip
        registry.record_run_end(rid, status="ok", metrics={"i": i})
    return n


def test_parallel_processes_lose_no_run_records(dburl):
    n = 25
    with mp.get_context("fork").Pool(8) as pool:  # each worker opens its own connection
        assert sum(pool.map(_insert_runs, [(dburl, w, n) for w in range(8)])) == 8 * n
    registry.open_db(url=dburl)
    rows = registry.list_runs(limit=10_000)
    assert len(rows) == 8 * n and all(r["status"] == "ok" for r in rows)


# --------------------------------------------------------------------------- commands


def _cfg(dburl: str, hub_root: Path, **registry_kw):
    from mlxbun.config import schema

    cfg = schema.Config()
    cfg.registry.url, cfg.registry.hub_cache, cfg.registry.runs_root = dburl, str(hub_root), None
    for k, v in registry_kw.items():
        setattr(cfg.registry, k, v)
    return cfg


def test_commands_scan_ls_resolve_fit(dburl, hubtree):
    snap = hubtree.add(
        "org/cmd", "r1", model_files(llama_config(), **{"README.md": b"---\nlicense: mit\n---\n"})
    )
    cfg = _cfg(dburl, hubtree.root)
    res = commands.scan(cfg)
    assert res.metrics["models"] == 1 and "1 read" in res.message
    table = commands.ls(cfg).message
    assert "org/cmd" in table and "mit" in table and "1 model(s)" in table
    hubtree.add("org/cmd-later", "r1", model_files(llama_config()))
    assert "2 model(s)" in commands.ls(cfg).message  # ls refreshes the index itself
    shutil.rmtree(hubtree.repo_dir("org/cmd-later"))
    cfg.json = True
    rows = json.loads(commands.ls(cfg).message)
    assert rows[0]["path"] == str(snap) and rows[0]["license"] == "mit"
    cfg.json, cfg.model.name = False, "cmd"
    assert commands.resolve(cfg).message == str(snap)
    cfg.registry.fit.budget_gb, cfg.registry.fit.context = 1.0, 128
    assert commands.fit(cfg).message.startswith("org/cmd: fits in 1.00 GiB")
    cfg.model.name = None
    with pytest.raises(InputError, match="model.name is not set"):
        commands.fit(cfg)


def test_cli_scan_ls_json_and_missing_repo(tmp_path):
    from cli_util import run_cli

    Hub(tmp_path / "hub").add(
        "org/clitest", "r1", model_files(llama_config(), **{"README.md": b"---\nlicense: mit\n---\n"})
    )
    scan = run_cli("command=registry_scan", "registry.runs_root=null", tmp=tmp_path)
    assert scan.returncode == 0, scan.stderr
    assert "1 read" in scan.stdout and "manifest:" in scan.stdout
    ls = run_cli("command=registry_ls", "json=true", "registry.filter.license=mit", tmp=tmp_path)
    assert ls.returncode == 0, ls.stderr
    assert [r["repo_id"] for r in json.loads(ls.stdout)] == ["org/clitest"]
    missing = run_cli("command=registry_resolve", "model.name=org/not-here", tmp=tmp_path)
    assert missing.returncode == 2
    assert missing.stderr.strip().startswith("error: model.name='org/not-here' is not in the local HF cache")
    assert "Traceback" not in missing.stderr


def test_large_headers_and_json_are_read_whole(tmp_path):
    d = tmp_path / "big"
    d.mkdir()
    tensors = {
        f"model.layers.{i}.mlp.experts.{e}.w.weight": ("float16", (2, 2))
        for i in range(40)
        for e in range(64)
    }
    (d / "model.safetensors").write_bytes(st(tensors))
    assert int.from_bytes((d / "model.safetensors").read_bytes()[:8], "little") > 2 * (
        64 << 10
    )  # past a first 64 KiB read
    tok = {
        "added_tokens_decoder": {str(i): {"content": f"<t{i}>"} for i in range(8000)},
        "chat_template": TOOLS_TEMPLATE,
    }
    (d / "tokenizer_config.json").write_text(json.dumps(tok))
    assert (d / "tokenizer_config.json").stat().st_size > 2 * (64 << 10)  # past the first read
    (d / "config.json").write_text(json.dumps(llama_config()))
    info = hub.read_model_dir(d, hub.list_files(d))
    assert info.param_count == shapes_elements(d / "model.safetensors") == 40 * 64 * 4
    assert info.expert_bytes == 40 * 64 * 8 and info.has_tools is True and info.warnings == ()
    data = os.urandom(300_000)
    (d / "blob").write_bytes(data)
    assert hub.read_bytes(d / "blob") == data and hub.read_bytes(d / "blob", 70_000) == data[:70_000]


def test_hostile_metadata_types_never_fail_a_scan(reg, hubtree):
    cfg = llama_config(num_hidden_layers="many", quantization={"bits": "4", "mode": {"x": 1}}, layer_types=3,
                       sliding_window=8, sliding_window_pattern=0, text_config=[1], architectures="Llama")  # fmt: skip
    index = {"metadata": ["not", "a", "dict"], "weight_map": {"w": "model.safetensors"}}
    bad_offsets = b'{"w": {"dtype": "F16", "shape": ["x"], "data_offsets": [0, 2]}}'
    weights = {"model.safetensors": len(bad_offsets).to_bytes(8, "little") + bad_offsets + b"\0\0",
               "model.safetensors.index.json": json.dumps(index).encode()}  # fmt: skip
    snap = hubtree.add("org/hostile-types", "r1", model_files(cfg, weights))
    good = hubtree.add("org/fine", "r1", model_files(llama_config()))
    report = reg.scan(hub_cache=hubtree.root)
    assert report.models == 2 and any("malformed header entry" in w for w in report.warnings)
    r = row(snap)
    assert r["num_layers"] is None and r["quant_mode"] is None and r["architectures"] is None
    assert row(good)["warning"] is None


def test_hub_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_HOME", raising=False)
    assert hub.hub_cache_dir() == Path.home() / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub.hub_cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    assert hub.hub_cache_dir() == tmp_path / "cache"
    assert hub.hub_cache_dir(tmp_path / "override") == tmp_path / "override"


def test_fit_verdict_is_the_exit_code_and_json_is_honoured(dburl, hubtree):
    hubtree.add("org/fitme", "r1", model_files(llama_config()))
    cfg = _cfg(dburl, hubtree.root)
    cfg.model.name = "org/fitme"
    cfg.registry.fit.budget_gb, cfg.registry.fit.context = 1e-6, 128
    no = commands.fit(cfg)
    assert no.exit_code == 1 and no.message.startswith("org/fitme: does NOT fit")
    cfg.registry.fit.budget_gb = 1.0
    assert commands.fit(cfg).exit_code == 0
    cfg.json, cfg.registry.fit.budget_gb = True, 1e-6
    no = commands.fit(cfg)
    assert no.exit_code == 1 and json.loads(no.message)["fits"] is False
    assert json.loads(commands.scan(cfg).message)["models"] == 1
    got = json.loads(commands.resolve(cfg).message)
    assert got["path"].endswith("/snapshots/r1") and commands.resolve(cfg).provides == {
        "model.name": got["path"]
    }


def test_ls_vision_column_says_whether_a_model_sees(reg, hubtree):
    vlm = {"model_type": "gemma3", "vision_config": {"model_type": "siglip_vision_model"}}
    sidecar = st({"vision_tower.patch_embed.weight": ("float16", (8, 8))})
    hubtree.add("org/with-sidecar", "r1", model_files(vlm, **{"optiq_vision.safetensors": sidecar}))
    tower = dense_weights()
    tower["model.safetensors"] = st(
        {"vision_tower.w.weight": ("float16", (4, 4)), "lm_head.weight": ("float16", (4, 4))}
    )
    hubtree.add("org/tower-inside", "r1", model_files(vlm, tower))
    hubtree.add("org/text-only", "r1", model_files(llama_config()))
    reg.scan(hub_cache=hubtree.root)
    lines = reg.format_table(reg.ls()).splitlines()
    col = lines[0].index("vision") + len("vision")  # the column is right-aligned under its head
    cells = {ln.rsplit(" ", 1)[1]: ln[:col].split()[-1] for ln in lines[1:-1]}
    assert cells == {"org/with-sidecar": registry.table._human(len(sidecar)).split()[-1],
                     "org/tower-inside": "yes", "org/text-only": "-"}  # fmt: skip


def test_cli_fit_that_does_not_fit_exits_1(tmp_path):
    from cli_util import run_cli

    Hub(tmp_path / "hub").add("org/fitcli", "r1", model_files(llama_config()))
    res = run_cli(
        "command=registry_fit", "model.name=org/fitcli", "registry.fit.budget_gb=0.000001", tmp=tmp_path
    )
    assert res.returncode == 1, res.stderr
    assert "does NOT fit" in res.stdout and "Traceback" not in res.stderr


def test_ls_size_filter_beyond_the_database_lists_everything(reg, hubtree):
    hubtree.add("org/any", "r1", model_files(llama_config()))
    reg.scan(hub_cache=hubtree.root)
    assert [m["name"] for m in reg.ls(max_gb=1e30)] == ["org/any"]
