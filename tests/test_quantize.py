"""quantize: bit-identical to ``mlx_lm convert`` on tiny models of four architectures, plans,
mixed rules, resume after SIGKILL, and bad input refused before anything is written."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import xxhash
from cli_util import KILL_AFTER_SECOND_SHARD
from conftest import make_tokenizer_dir
from mlx.utils import tree_flatten

from mlxbun.errors import InputError
from mlxbun.quant import skeleton as qplan
from mlxbun.quant.quantize.command import MARKER, quantize_model_dir

REPO = Path(__file__).resolve().parent.parent
BASE = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
# intermediate_size 96 is not a multiple of 64: down_proj stays unquantized at group size 64/128.
CONFIGS = {
    "llama": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], intermediate_size=96, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=False, torch_dtype="bfloat16",
    ),
    "mistral": dict(
        model_type="mistral", architectures=["MistralForCausalLM"], intermediate_size=256, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=False, torch_dtype="bfloat16",
    ),
    "qwen3": dict(
        model_type="qwen3", architectures=["Qwen3ForCausalLM"], intermediate_size=256, rms_norm_eps=1e-6,
        head_dim=32, max_position_embeddings=512, rope_theta=1e6, tie_word_embeddings=True,
        torch_dtype="bfloat16",
    ),
    "gemma3_text": dict(
        model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], intermediate_size=96, head_dim=32,
        rms_norm_eps=1e-6, sliding_window=16, sliding_window_pattern=2, query_pre_attn_scalar=32,
        torch_dtype="bfloat16",
    ),
}  # fmt: skip


def make_hf_model(path: Path, arch: str, *, seed: int = 0, files: int = 1, **over) -> Path:
    """A tiny HF-layout checkpoint: mlx-lm's own model class, random bf16 weights, extra tensors
    that mlx-lm's sanitize drops (rotary inv_freq; a tied lm_head), a tokenizer."""
    from mlx_lm.utils import _get_classes

    cfg = {**BASE, **CONFIGS[arch], **over}
    model_class, args_class = _get_classes(cfg)
    mx.random.seed(seed)
    weights = {
        k: v.astype(mx.bfloat16) for k, v in tree_flatten(model_class(args_class.from_dict(cfg)).parameters())
    }
    if arch == "llama":
        weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = mx.arange(16, dtype=mx.float32)
    if cfg.get("tie_word_embeddings"):
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    path.mkdir(parents=True)
    names = sorted(weights)
    parts = [names[i::files] for i in range(files)]
    index = {}
    for i, part in enumerate(parts, start=1):
        fname = "model.safetensors" if files == 1 else f"model-{i:05d}-of-{files:05d}.safetensors"
        mx.save_safetensors(str(path / fname), {n: weights[n] for n in part}, metadata={"format": "pt"})
        index.update(dict.fromkeys(part, fname))
    if files > 1:
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    make_tokenizer_dir(path, vocab_size=cfg["vocab_size"])
    return path


def hessians_of(src: Path, out: Path, *, rows: int = 4) -> tuple[dict, np.ndarray]:
    """The input Hessians of the tiny model ``src`` (float32) on ``rows`` x 32 random tokens,
    saved to ``out``; (the Hessians, the tokens)."""
    from mlx_lm import load

    from mlxbun.quant import hessian

    model, _ = load(str(src))
    model.set_dtype(mx.float32)
    tokens = np.random.default_rng(0).integers(3, 64, (rows, 32))
    h = hessian.capture(model, tokens)
    hessian.save(h, out, tokens=tokens.size)
    return h, tokens


def make_mixtral(path: Path) -> Path:
    """A tiny Mixtral in HF layout: one tensor per expert, which mlx-lm's sanitize stacks."""
    import re

    from mlx_lm.utils import _get_classes

    cfg = dict(
        BASE, model_type="mixtral", architectures=["MixtralForCausalLM"], intermediate_size=128,
        num_local_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-5, rope_theta=1e6, torch_dtype="bfloat16",
    )  # fmt: skip
    model_class, args_class = _get_classes(cfg)
    mx.random.seed(1)
    hf, names = {}, {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
    for k, v in tree_flatten(model_class(args_class.from_dict(cfg)).parameters()):
        m = re.match(r"(model\.layers\.\d+)\.block_sparse_moe\.switch_mlp\.(\w+)\.weight", k)
        for e in range(v.shape[0] if m else 0):
            hf[f"{m.group(1)}.block_sparse_moe.experts.{e}.{names[m.group(2)]}.weight"] = v[e].astype(
                mx.bfloat16
            )
        if not m:
            hf[k] = v.astype(mx.bfloat16)
    path.mkdir(parents=True)
    mx.save_safetensors(str(path / "model.safetensors"), hf, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg))
    make_tokenizer_dir(path, vocab_size=cfg["vocab_size"])
    return path


def mlx_lm_convert(src: Path, dst: Path, **kw) -> Path:
    from mlx_lm.convert import convert

    convert(hf_path=str(src), mlx_path=str(dst), quantize=True, **kw)
    return dst


def tensors(d: Path) -> dict[str, mx.array]:
    out = {}
    for f in sorted(d.glob("model*.safetensors")):
        out.update(mx.load(str(f)))
    return out


def assert_same_tensors(ref: Path, mine: Path) -> None:
    a, b = tensors(ref), tensors(mine)
    assert sorted(a) == sorted(b)
    for k in a:
        assert (a[k].dtype, a[k].shape) == (b[k].dtype, b[k].shape), k
        assert bytes(memoryview(a[k])) == bytes(memoryview(b[k])), f"{k} differs"


def index(d: Path) -> dict:
    return json.loads((d / "model.safetensors.index.json").read_text())


CASES = [
    ("llama", dict(q_bits=4, q_group_size=64), {}),
    ("qwen3", dict(q_bits=3, q_group_size=32), {}),
    ("mistral", dict(q_mode="mxfp4"), {}),
    ("gemma3_text", dict(q_bits=8, q_group_size=128), {}),
    ("qwen3", dict(q_mode="nvfp4", dtype="float16"), {"dtype": "float16"}),
    ("llama", dict(q_bits=3, q_group_size=64, quant_predicate="mixed_3_6"), {"mixed": "mixed_3_6"}),
]


@pytest.mark.parametrize(
    ("arch", "ref_kw", "extra"), CASES, ids=[f"{a}-{i}" for i, (a, _, _) in enumerate(CASES)]
)
def test_bit_identical_to_mlx_lm_convert(tmp_path, arch, ref_kw, extra):
    src = make_hf_model(tmp_path / "src", arch, files=2 if arch == "gemma3_text" else 1)
    ref = mlx_lm_convert(src, tmp_path / "ref", **ref_kw)
    res = quantize_model_dir(
        src,
        tmp_path / "mine",
        mode=ref_kw.get("q_mode", "affine"),
        bits=ref_kw.get("q_bits"),
        group_size=ref_kw.get("q_group_size"),
        **extra,
    )
    assert_same_tensors(ref, res.out)
    assert (res.out / "config.json").read_text() == (ref / "config.json").read_text()
    assert index(res.out) == index(ref)
    assert (res.out / "generation_config.json").is_file() and (res.out / "tokenizer.json").is_file()


def test_shard_packing_and_order_match_mlx_lm(tmp_path, monkeypatch):
    """With a small shard ceiling on both sides, the same tensors land in the same shards."""
    import mlx_lm.utils as mu

    limit = 60_000

    def small_shards(weights, max_file_size_gb=5):
        shards, size = [], 0
        for k, v in weights.items():
            if not shards or size + v.nbytes > limit:
                shards.append({})
                size = 0
            shards[-1][k] = v
            size += v.nbytes
        return shards

    monkeypatch.setattr(mu, "make_shards", small_shards)
    src = make_hf_model(tmp_path / "src", "llama")
    ref = mlx_lm_convert(src, tmp_path / "ref", q_bits=4, q_group_size=64)
    mine = quantize_model_dir(src, tmp_path / "mine", bits=4, group_size=64, shard_bytes=limit, threads=2)
    assert len(mine.files) > 2 and mine.files == sorted(p.name for p in ref.glob("model*.safetensors"))
    assert index(mine.out) == index(ref)
    assert_same_tensors(ref, mine.out)


def test_plan_file_matches_mlx_lm_with_the_same_predicate(tmp_path):
    src = make_hf_model(tmp_path / "src", "qwen3")
    layers = {
        "model.layers.0.mlp.down_proj": {"bits": 8, "group_size": 64, "mode": "affine"},
        "model.layers.1.self_attn.v_proj": {"bits": 4, "group_size": 32, "mode": "mxfp4"},
        "model.layers.3.mlp.up_proj": False,
    }
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(
        json.dumps({"version": 1, "default": {"bits": 3, "group_size": 64}, "layers": layers})
    )

    def predicate(path, module):  # what the plan means, as an mlx-lm quant_predicate
        entry = layers.get(path, True)
        return {k: entry[k] for k in ("group_size", "bits", "mode")} if isinstance(entry, dict) else entry

    ref = mlx_lm_convert(src, tmp_path / "ref", q_bits=3, q_group_size=64, quant_predicate=predicate)
    res = quantize_model_dir(src, tmp_path / "mine", plan=plan_path)
    assert_same_tensors(ref, res.out)
    mine_q = json.loads((res.out / "config.json").read_text())["quantization"]
    ref_q = json.loads((ref / "config.json").read_text())["quantization"]
    assert mine_q == {**ref_q, "model.layers.3.mlp.up_proj": False}
    # The layout the allocator predicts from is what was written.
    written = tensors(res.out)
    sk, _ = qplan.prepare(src, plan=plan_path)
    for path, m in sk.originals.items():
        if not hasattr(m, "to_quantized") or "weight" not in m:
            continue
        d = sk.decisions.get(path)
        assert (f"{path}.scales" in written) == (d is not None), path
        if d is not None:
            assert written[f"{path}.weight"].shape[-1] * 32 // d["bits"] == m.weight.shape[-1]


def test_mlx_lm_generates_the_same_tokens(tmp_path):
    from mlx_lm import generate, load

    src = make_hf_model(tmp_path / "src", "llama")
    ref = mlx_lm_convert(src, tmp_path / "ref", q_bits=4, q_group_size=32)
    mine = quantize_model_dir(src, tmp_path / "mine", bits=4, group_size=32).out
    outs = []
    for d in (ref, mine):
        model, tok = load(str(d))
        outs.append(generate(model, tok, prompt="w3 w4 w5 w6", max_tokens=12))
    assert outs[0] == outs[1] and outs[0]


KILL_SCRIPT = """
import os, signal, sys
sys.path.insert(0, {repo!r})
from mlxbun.io import shards
from mlxbun.quant.quantize.command import quantize_model_dir
real = shards.ShardedWriter._end_shard
def end_then_die(self, shard):
    real(self, shard)
    if len(self._shards) == 3:
        os.kill(os.getpid(), signal.SIGKILL)
shards.ShardedWriter._end_shard = end_then_die
quantize_model_dir({src!r}, {out!r}, bits=4, group_size=64, shard_bytes=40000)
"""


def _killed_after_three_shards(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(source, out, staging dir) of a conversion SIGKILLed after its third shard."""
    src = make_hf_model(tmp_path / "src", "llama", files=2)
    out = tmp_path / "killed" / "model"
    script = KILL_SCRIPT.format(repo=str(REPO), src=str(src), out=str(out))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert not out.exists()  # nothing that looks finished
    (partial,) = [p for p in out.parent.iterdir() if p.is_dir() and p.name.startswith(".model.partial-")]
    assert len(list(partial.glob(".mlxbun-shard-*.safetensors"))) == 3
    return src, out, partial


def test_resume_after_sigkill_gives_identical_bytes(tmp_path):
    src, out, partial = _killed_after_three_shards(tmp_path)
    resumed = quantize_model_dir(src, out, bits=4, group_size=64, shard_bytes=40000)
    clean = quantize_model_dir(src, tmp_path / "clean" / "model", bits=4, group_size=64, shard_bytes=40000)
    assert resumed.files == clean.files and len(clean.files) > 3
    for name in [*clean.files, "config.json", "model.safetensors.index.json"]:
        assert (out / name).read_bytes() == (clean.out / name).read_bytes(), name
    assert not partial.exists()
    again = quantize_model_dir(src, out, bits=4, group_size=64, shard_bytes=40000)
    assert again.reused


def test_resume_trusts_the_journal_and_reads_no_kept_shard(tmp_path, monkeypatch):
    from mlxbun.io import shards, staging

    src, out, partial = _killed_after_three_shards(tmp_path)
    kept = sorted(p.name for p in partial.glob(".mlxbun-shard-*"))
    read = []
    for mod in (shards, staging):
        real = mod.file_digest
        monkeypatch.setattr(
            mod, "file_digest", lambda p, *a, real=real, **k: read.append(p.name) or real(p, *a, **k)
        )
    resumed = quantize_model_dir(src, out, bits=4, group_size=64, shard_bytes=40000)
    assert not [n for n in read if n in kept or n.endswith(".safetensors")], read  # only small side files
    record = json.loads((out / MARKER).read_text())["files"]
    for name in resumed.files:  # kept shards' digests come from the journal, new ones from the writer
        assert resumed.digests[name] == hashlib.sha256((out / name).read_bytes()).hexdigest()
        assert record[name]["xxh3_128"] == xxhash.xxh3_128((out / name).read_bytes()).hexdigest()


def test_resume_redoes_a_kept_shard_changed_since_its_journal_entry(tmp_path):
    src, out, partial = _killed_after_three_shards(tmp_path)
    second = partial / ".mlxbun-shard-00002.safetensors"
    data = bytearray(second.read_bytes())
    data[-1] ^= 0xFF  # same size, same header: the mtime shows the change
    second.write_bytes(bytes(data))
    quantize_model_dir(src, out, bits=4, group_size=64, shard_bytes=40000)
    clean = quantize_model_dir(src, tmp_path / "clean" / "model", bits=4, group_size=64, shard_bytes=40000)
    for name in clean.files:
        assert (out / name).read_bytes() == (clean.out / name).read_bytes(), name


def test_progress_after_a_resume_counts_only_this_runs_bytes(tmp_path, monkeypatch):
    from mlxbun.quant.quantize import command as quantize

    src, out, _ = _killed_after_three_shards(tmp_path)
    bars = []
    real = quantize.Progress
    monkeypatch.setattr(quantize, "Progress", lambda **kw: bars.append(real(**kw)) or bars[-1])
    res = quantize_model_dir(src, out, bits=4, group_size=64, shard_bytes=40000)
    (bar,) = bars
    assert 0 < bar.done == bar.total < res.source_bytes  # the kept shards' bytes are not in the rate


def test_stale_partial_of_another_conversion_is_removed(tmp_path):
    import fcntl

    src = make_hf_model(tmp_path / "src", "llama", files=2)
    out = tmp_path / "killed" / "model"
    script = KILL_SCRIPT.format(repo=str(REPO), src=str(src), out=str(out))
    assert subprocess.run([sys.executable, "-c", script], capture_output=True).returncode == -9
    (stale,) = out.parent.glob(".model.partial-*[!k]")
    busy = out.parent / ".model.partial-0123456789abcdef"  # another run holds this one's lock
    busy.mkdir()
    (busy / ".mlxbun-stage.json").write_text((stale / ".mlxbun-stage.json").read_text())
    mine = out.parent / ".model.partial-notmine"  # not a quantize partial name: never touched
    mine.mkdir()
    with open(busy.with_name(busy.name + ".lock"), "a") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        with pytest.raises(InputError, match=r"quant.out=.* is being built by another quantize job"):
            quantize_model_dir(src, out, bits=8, group_size=64, shard_bytes=40000)  # other settings
    assert stale.is_dir() and busy.is_dir()  # refused before any work: nothing removed
    # the killed job can still resume until another job publishes into the same out
    quantize_model_dir(src, out, bits=8, group_size=64, shard_bytes=40000)  # other settings
    assert not stale.exists() and not busy.exists() and mine.is_dir()
    assert (out / "config.json").is_file()


def _nothing_written(root: Path, before: set[str]) -> None:
    assert {p.name for p in root.iterdir()} == before


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"mode": "int3"}, r"quant.mode='int3' is not allowed; choose one of affine"),
        ({"mode": "mxfp4", "bits": 3}, r"quant.bits=3 is not allowed for mode=mxfp4"),
        ({"bits": 7}, r"quant.bits=7 is not allowed for mode=affine; choose one of 2, 3, 4, 5, 6, 8"),
        ({"group_size": 128}, r"quant.group_size=128 divides the input width of no quantizable layer"),
        ({"mixed": "mixed_9_9"}, r"quant.mixed='mixed_9_9' is not allowed"),
        ({"dtype": "int8"}, r"quant.dtype='int8' is not allowed"),
    ],
)
def test_bad_settings_are_refused_before_writing(tmp_path, kw, match):
    src = make_hf_model(
        tmp_path / "src", "llama", hidden_size=96, num_attention_heads=3, num_key_value_heads=1
    )
    before = {p.name for p in tmp_path.iterdir()}
    with pytest.raises(InputError, match=match):
        quantize_model_dir(src, tmp_path / "out", **kw)
    _nothing_written(tmp_path, before)


def test_bad_sources_and_outputs_are_refused(tmp_path):
    src = make_hf_model(tmp_path / "src", "llama")
    (tmp_path / "noconfig").mkdir()
    with pytest.raises(InputError, match=r"has no config.json"):
        quantize_model_dir(tmp_path / "noconfig", tmp_path / "out")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.raises(InputError, match=r"quant.out=.*taken.* already exists and is not this conversion"):
        quantize_model_dir(src, tmp_path / "taken")
    assert sorted(p.name for p in (tmp_path / "taken").iterdir()) == ["notes.txt"]
    plan = tmp_path / "plan.json"
    plan.write_text(
        json.dumps({"default": {"bits": 4}, "layers": {"model.layers.0.mlp.down_proj": {"bits": 4}}})
    )
    with pytest.raises(
        InputError, match=r"group_size=64 does not divide in_features=96 of 'model.layers.0.mlp.down_proj'"
    ):
        quantize_model_dir(src, tmp_path / "out", plan=plan)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))
    plan.write_text(json.dumps({"default": {"bits": 4}, "layers": {"model.layers.0.mlp.dwn_proj": False}}))
    with pytest.raises(InputError, match=r"quant.plan names 1 module.*'model.layers.0.mlp.dwn_proj'"):
        quantize_model_dir(src, tmp_path / "out", plan=plan)
    quantized = quantize_model_dir(src, tmp_path / "q", bits=4).out
    with pytest.raises(InputError, match=r"already quantized"):
        quantize_model_dir(quantized, tmp_path / "qq")


def test_a_different_conversion_does_not_reuse_an_output(tmp_path):
    src = make_hf_model(tmp_path / "src", "llama")
    first = quantize_model_dir(src, tmp_path / "out", bits=4)
    assert "model.safetensors" in json.loads((first.out / MARKER).read_text())["files"]
    with pytest.raises(InputError, match=r"already exists and is not this conversion"):
        quantize_model_dir(src, tmp_path / "out", bits=8)


def test_cli_quantize_writes_a_model_and_exits_2_on_bad_input(tmp_path):
    src = make_hf_model(tmp_path / "src", "qwen3")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    common = [
        f"model.name={src}",
        f"paths.outputs={tmp_path / 'outputs'}",
        f"paths.cache={tmp_path / 'cache'}",
        "blas=off",
    ]
    ok = subprocess.run(
        [sys.executable, "-m", "mlxbun", "command=quantize", "quant.bits=4", *common],
        capture_output=True, text=True, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr[-2000:]
    (run_dir,) = (tmp_path / "outputs" / "quantize").iterdir()
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "ok" and "model/model.safetensors" in manifest["outputs"]
    assert json.loads((run_dir / "model" / "config.json").read_text())["quantization"]["bits"] == 4
    from mlxbun import registry

    registry.open_db(path=tmp_path / "cache" / "registry.db")
    found = registry.resolve("src-4bit-g64", hub_cache=tmp_path / "hub", paths=[])
    assert found == (run_dir / "model").resolve()
    bad = subprocess.run(
        [sys.executable, "-m", "mlxbun", "command=quantize", "quant.mode=mxfp4", "quant.bits=3", *common],
        capture_output=True, text=True, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert bad.returncode == 2 and "quant.bits=3" in bad.stderr and "Traceback" not in bad.stderr


def test_big_weights_quantized_in_row_blocks_are_bit_identical(tmp_path, monkeypatch):
    from mlxbun.quant.quantize import convert

    monkeypatch.setattr(convert, "BIG_TENSOR", 1000)
    monkeypatch.setattr(convert, "CHUNK_BYTES", 4096)  # 8 rows of 128 f32 per block
    blocked = []
    real = convert.Converter.quantize_rows
    monkeypatch.setattr(
        convert.Converter, "quantize_rows", lambda self, u: blocked.append(u.path) or real(self, u)
    )
    src = make_hf_model(tmp_path / "src", "llama", vocab_size=100)
    ref = mlx_lm_convert(src, tmp_path / "ref", q_bits=5, q_group_size=32, dtype="float32")
    mine = quantize_model_dir(src, tmp_path / "mine", bits=5, group_size=32, dtype="float32")
    assert "model.embed_tokens" in blocked and "model.layers.0.mlp.up_proj" in blocked
    assert_same_tensors(ref, mine.out)


def test_quantize_skips_transformers_and_mlx_lm_still_imports_normally(tmp_path):
    src = make_hf_model(tmp_path / "src", "qwen3")
    script = (
        "import sys\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "from mlxbun.quant.quantize.command import quantize_model_dir\n"
        f"out = quantize_model_dir({str(src)!r}, {str(tmp_path / 'q')!r}, bits=4).out\n"
        "assert 'transformers' not in sys.modules\n"
        "import mlx_lm\n"
        "from mlx_lm import generate, load\n"
        "model, tok = load(str(out))\n"
        "print('OK', mlx_lm.__version__, len(generate(model, tok, prompt='w3 w4', max_tokens=4)) > 0)\n"
    )
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert res.returncode == 0 and "OK" in res.stdout and res.stdout.strip().endswith("True"), res.stderr[
        -2000:
    ]


def test_moe_experts_stacked_by_sanitize_match_mlx_lm(tmp_path):
    src = make_mixtral(tmp_path / "src")
    ref = mlx_lm_convert(src, tmp_path / "ref", q_bits=4, q_group_size=64)
    mine = quantize_model_dir(src, tmp_path / "mine", bits=4, group_size=64, threads=2)
    assert "model.layers.1.block_sparse_moe.switch_mlp.down_proj.scales" in tensors(mine.out)
    assert_same_tensors(ref, mine.out)
    assert (mine.out / "config.json").read_text() == (ref / "config.json").read_text()


def test_moe_experts_take_a_rounding_method(tmp_path):
    """clip on stacked experts (3-D SwitchLinear weights): each expert rounded on its own, in
    mlx-lm's layout."""
    src = make_mixtral(tmp_path / "src")
    rtn = quantize_model_dir(src, tmp_path / "rtn", bits=3, group_size=64, threads=2)
    clip = quantize_model_dir(src, tmp_path / "clip", bits=3, group_size=64, threads=2, method="clip")
    a, b = tensors(rtn.out), tensors(clip.out)
    name = "model.layers.1.block_sparse_moe.switch_mlp.down_proj.weight"
    assert {k: (v.shape, v.dtype) for k, v in a.items()} == {k: (v.shape, v.dtype) for k, v in b.items()}
    assert not mx.array_equal(a[name], b[name])


@pytest.mark.slow
def test_cli_rerun_after_sigkill_resumes_into_the_new_run_dir(tmp_path):
    src = make_hf_model(tmp_path / "src", "llama")
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(KILL_AFTER_SECOND_SHARD)
    args = [
        sys.executable, "-m", "mlxbun", "command=quantize", f"model.name={src}", "quant.bits=4",
        "io.shard_gb=0.00004", f"paths.outputs={tmp_path / 'outputs'}", f"paths.cache={tmp_path / 'cache'}",
        "blas=off",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": f"{hook}{os.pathsep}{REPO}"}
    killed = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, env=env)
    assert killed.returncode == -9, killed.stderr[-2000:]
    env["PYTHONPATH"] = str(REPO)
    again = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, env=env)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resuming" in again.stderr
    runs = sorted((tmp_path / "outputs" / "quantize").iterdir())
    assert len(runs) == 2 and not (runs[0] / "model").exists()
    clean = quantize_model_dir(src, tmp_path / "clean", bits=4, shard_bytes=int(0.00004 * (1 << 30)))
    assert len(clean.files) > 2
    for name in [*clean.files, "config.json", "model.safetensors.index.json"]:
        assert (runs[1] / "model" / name).read_bytes() == (clean.out / name).read_bytes(), name
