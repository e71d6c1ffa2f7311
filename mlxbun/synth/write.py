"""Deterministic synthetic checkpoints of real architectures (llama, mistral, qwen2, qwen3, gemma3_text).

``command=synth`` (:mod:`mlxbun.synth.command`) writes one; ``model.synthetic=true`` builds one through
:func:`ensure_synthetic` or :func:`ensure_synthetic_source`.
Random weights with real shapes and Hugging Face tensor names, written tensor by tensor through
:class:`mlxbun.io.shards.ShardedWriter`, told every tensor in advance (memory stays near the
largest tensor), plus a byte-level BPE tokenizer built offline, so ``mlx_lm.load`` and
``generate`` work on the result (or, without writing any weights, :class:`SyntheticSource`
generates each tensor when a reader such as ``command=quantize model.synthetic=true`` asks for
it, with the same bytes)::

    <out>/                                  staged by mlxbun.io.staging, renamed when complete
        synth.json                          resolved spec, planted channels, format version
        config.json                         HF config (model_type, dims, rope, eps, torch_dtype, ...)
        generation_config.json              bos / eos / pad ids
        model.safetensors                   one shard, or model-0000i-of-0000N.safetensors
        model.safetensors.index.json        + this index when there are several shards
        tokenizer.json                      byte-level BPE with exactly vocab_size tokens
        tokenizer_config.json               special tokens and a chat template

The tensors and their values are :mod:`mlxbun.synth.values`; the architectures, presets, config
files and tokenizer are :mod:`mlxbun.synth.arch`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

from mlxbun.errors import InputError
from mlxbun.host import available_memory
from mlxbun.io.atomic import atomic_write_json, file_lock, publish_dir
from mlxbun.io.dtypes import CODES
from mlxbun.io.dtypes import OUTPUT_DTYPES as DTYPES
from mlxbun.io.shards import ShardedWriter
from mlxbun.io.staging import Stage, reached, staging_dir, weights_written
from mlxbun.progress import Progress, human_bytes
from mlxbun.synth.arch import (
    ARCH_VOCAB,
    ARCHS,
    MIN_VOCAB,
    PRESETS,
    SPECIALS,
    SYNTH_DIMS,
    Shape,
    Spec,
    TensorPlan,
    build_tokenizer,
    generation_config,
    hf_config,
)
from mlxbun.synth.values import SyntheticSource, plan, planted_channels, tensor_array

log = logging.getLogger("mlxbun")

SPEC_FILE = "synth.json"
OUTLIER_TARGETS = ("weights", "activations", "both")
SAFETENSORS_METADATA = {"format": "pt"}  # what Hugging Face checkpoints carry

# ---------------------------------------------------------------------------- spec


def _check_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InputError(f"synth.{key}={value!r} is out of range; it must be an integer > 0")
    return value


def _preset_dims(arch: str, preset: str) -> dict[str, Any]:
    if preset not in PRESETS:
        raise InputError(f"synth.preset={preset!r} is not allowed; choose one of {', '.join(PRESETS)}")
    dims = {"vocab_size": ARCH_VOCAB[arch], **PRESETS[preset]["*"], **PRESETS[preset].get(arch, {})}
    return dims


def resolve_shape(arch: str, preset: str, **overrides: Any) -> tuple[Shape, dict[str, Any]]:
    """The preset's dims for ``arch`` with explicit (non-None) ``overrides`` on top.

    When hidden_size or num_heads is overridden and head_dim is not, head_dim becomes
    hidden_size // num_heads. Returns the shape and the preset's extra HF config keys.

    Example:
        >>> resolve_shape("gemma3_text", "27b")[0].hidden_size
        5376
    """
    if arch not in ARCHS:
        raise InputError(f"synth.arch={arch!r} is not allowed; choose one of {', '.join(ARCHS)}")
    dims = _preset_dims(arch, preset)
    extra = dict(dims.pop("config", {}))
    given = {k: v for k, v in overrides.items() if v is not None}
    if given.keys() & {"hidden_size", "num_heads"} and "head_dim" not in given:
        dims["head_dim"] = None
    dims.update(given)
    for key in SYNTH_DIMS:
        if dims[key] is not None:
            _check_int(key, dims[key])
    if dims["head_dim"] is None or arch == "qwen2":
        dims["head_dim"] = _derived_head_dim(arch, dims, given)
    shape = Shape(**dims)
    _check_shape(arch, shape)
    return shape, extra


def _derived_head_dim(arch: str, dims: dict[str, Any], given: dict[str, Any]) -> int:
    hidden, heads = dims["hidden_size"], dims["num_heads"]
    if hidden % heads:
        raise InputError(
            f"synth.hidden_size={hidden} is not divisible by synth.num_heads={heads}; "
            "pass synth.head_dim or a hidden_size that divides"
        )
    if arch == "qwen2" and given.get("head_dim") not in (None, hidden // heads):
        raise InputError(
            f"synth.head_dim={given['head_dim']} is not allowed for qwen2, which uses "
            f"hidden_size / num_heads = {hidden // heads}; leave synth.head_dim unset"
        )
    return hidden // heads


def _check_shape(arch: str, s: Shape) -> None:
    if s.num_heads % s.num_kv_heads:
        raise InputError(
            f"synth.num_kv_heads={s.num_kv_heads} does not divide synth.num_heads={s.num_heads}; "
            f"choose a divisor of {s.num_heads}"
        )
    if s.vocab_size < MIN_VOCAB:
        raise InputError(
            f"synth.vocab_size={s.vocab_size} is too small; it must be >= {MIN_VOCAB} "
            f"(256 byte tokens + {len(SPECIALS)} special tokens)"
        )
    if s.head_dim % 2:
        raise InputError(f"synth.head_dim={s.head_dim} must be even (rotary embeddings rotate pairs)")


def _check_knobs(shape: Shape, dtype: str, target: str, channels: Any, scale: Any, jitter: Any) -> None:
    if dtype not in DTYPES:
        raise InputError(f"synth.dtype={dtype!r} is not allowed; choose one of {', '.join(DTYPES)}")
    if target not in OUTLIER_TARGETS:
        raise InputError(
            f"synth.outlier_target={target!r} is not allowed; choose one of {', '.join(OUTLIER_TARGETS)}"
        )
    if isinstance(channels, bool) or not isinstance(channels, int) or not 0 <= channels <= shape.hidden_size:
        raise InputError(
            f"synth.outlier_channels={channels!r} is out of range; it must be in 0..{shape.hidden_size}"
        )
    if not scale > 0:
        raise InputError(f"synth.outlier_scale={scale!r} is out of range; it must be > 0")
    if not jitter >= 0:
        raise InputError(f"synth.norm_jitter={jitter!r} is out of range; it must be >= 0")


def resolve_spec(
    *,
    arch: str = "llama",
    preset: str = "tiny",
    seed: int = 0,
    dtype: str = "bfloat16",
    outlier_channels: int = 0,
    outlier_scale: float = 20.0,
    outlier_target: str = "both",
    norm_jitter: float = 0.0,
    **dims: Any,
) -> Spec:
    """Validate the synth fields (names as in ``SynthCfg``) and resolve them into a :class:`Spec`.

    Args:
        dims: hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, head_dim,
            vocab_size, tie_embeddings; None keeps the preset's value.

    Example:
        >>> resolve_spec(arch="qwen3", preset="tiny", hidden_size=128).shape.head_dim
        32
    """
    unknown = set(dims) - set(SYNTH_DIMS) - {"tie_embeddings"}
    if unknown:
        raise InputError(
            f"unknown synth field(s) {sorted(unknown)}; allowed: {', '.join(SYNTH_DIMS)}, tie_embeddings"
        )
    shape, extra = resolve_shape(arch, preset, **dims)
    _check_knobs(shape, dtype, outlier_target, outlier_channels, outlier_scale, norm_jitter)
    return Spec(
        arch=arch,
        shape=shape,
        dtype=dtype,
        seed=int(seed),
        outlier_channels=outlier_channels,
        outlier_scale=float(outlier_scale),
        outlier_target=outlier_target,
        norm_jitter=float(norm_jitter),
        config=extra,
    )


# ---------------------------------------------------------------------------- writing


def _spec_record(spec: Spec) -> dict[str, Any]:
    return {**spec.to_dict(), "planted_channels": planted_channels(spec)}


def _write_weights(spec: Spec, partial: Path, *, shard_bytes: int) -> None:
    """Generate and write every tensor, each written as it is made (no shard is held)."""
    if weights_written(partial):
        return
    tensors, channels = plan(spec), planted_channels(spec)
    progress = Progress(total=sum(t.nbytes for t in tensors), unit="B", desc=f"synth {spec.arch}")
    declared = [(t.name, CODES[t.dtype], t.shape) for t in tensors]
    with ShardedWriter(
        partial, shard_bytes=shard_bytes, metadata=SAFETENSORS_METADATA, resume=True, tensors=declared
    ) as writer:
        if writer.done_names:
            log.info(
                "synth: resuming %s, %d of %d tensors already written",
                partial,
                len(writer.done_names),
                len(tensors),
            )
        for t in tensors:
            if t.name not in writer.done_names:
                writer.add(t.name, tensor_array(t, spec=spec, channels=channels))
            progress.update(t.nbytes)  # generation is the slow part: count it, not shard writes
        writer.finish()
    progress.close()


def _write_side_files(spec: Spec, partial: Path) -> None:
    atomic_write_json(partial / "config.json", hf_config(spec))
    atomic_write_json(partial / "generation_config.json", generation_config())
    build_tokenizer(spec.shape.vocab_size).save_pretrained(str(partial))
    # transformers 5 writes its own class name; the 4.x name loads in both.
    tok_cfg = json.loads((partial / "tokenizer_config.json").read_text())
    atomic_write_json(
        partial / "tokenizer_config.json", {**tok_cfg, "tokenizer_class": "PreTrainedTokenizerFast"}
    )


def _refuse_existing(out_dir: Path) -> None:
    if out_dir.exists():
        raise InputError(f"synth.out={str(out_dir)!r} already exists; remove it or choose a new directory")


def write_spec(
    spec: Spec,
    out_dir: str | Path,
    *,
    shard_bytes: int = 5 << 30,
    partial_root: str | Path | None = None,
) -> Path:
    """Write ``spec`` into ``out_dir`` (must not exist) through a hidden partial directory.

    The staging dir ``.<name>.partial-<spec hash>`` (see :mod:`mlxbun.io.staging`) lives in
    ``partial_root`` (default: beside ``out_dir``; same filesystem) under a lock; a killed build
    of the same spec resumes from its finished shards, and the directory is renamed to
    ``out_dir`` when complete.
    """
    out_dir = Path(out_dir).expanduser().absolute()
    _refuse_existing(out_dir)
    with Stage.locked(out_dir, kind="synth", key=spec.hash, root=partial_root, setting="synth.out") as stage:
        _refuse_existing(out_dir)  # a waiter finds the first build published
        stage.claim()
        atomic_write_json(stage.dir / SPEC_FILE, _spec_record(spec))
        _write_weights(spec, stage.dir, shard_bytes=shard_bytes)
        reached("weights")
        _write_side_files(spec, stage.dir)
        stage.publish()
    return out_dir


def synthesize(
    out_dir: str | Path,
    *,
    shard_bytes: int = 5 << 30,
    **fields: Any,
) -> Path:
    """Write a random-weight checkpoint of ``arch`` at ``preset`` size into ``out_dir``.

    Args:
        out_dir: the model directory to create (must not exist; built under a hidden name).
        shard_bytes: shard ceiling (mlx-lm's default 5 GiB).
        fields: the keyword arguments of :func:`resolve_spec` (arch, preset, seed, dtype,
            outliers, norm_jitter and dims overriding the preset).

    Example:
        >>> synthesize(tmp / "m", arch="gemma3_text", preset="tiny", outlier_channels=4)
        >>> mlx_lm.load(str(tmp / "m"))
    """
    return write_spec(resolve_spec(**fields), Path(out_dir), shard_bytes=shard_bytes)


def ensure_synthetic(*, cache_dir: str | Path, shard_bytes: int = 5 << 30, **fields: Any) -> Path:
    """The cached checkpoint for these synth fields, built once into ``cache_dir/<spec hash>/``.

    Concurrent callers (sweep jobs) wait on a lock file and reuse the first build.

    Example:
        >>> ensure_synthetic(cache_dir=Path("~/.cache/mlxbun/synth").expanduser(), arch="qwen3")
    """
    fields.pop("out", None)
    spec = resolve_spec(**fields)
    cache_dir = Path(cache_dir).expanduser()
    final = cache_dir / spec.hash
    if (final / "config.json").is_file():
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    with file_lock(cache_dir / f".{spec.hash}.lock"):
        if not final.exists():
            write_spec(spec, final, shard_bytes=shard_bytes)
    return final


def sizes(spec: Spec) -> tuple[int, TensorPlan]:
    """Bytes of every tensor, and the largest tensor, from one- and two-layer plans (layers
    repeat): a billion layers are counted, not listed."""
    one, two = (plan(replace(spec, shape=replace(spec.shape, num_layers=n))) for n in (1, 2))
    per_layer = sum(t.nbytes for t in two) - sum(t.nbytes for t in one)
    total = sum(t.nbytes for t in one) + per_layer * (spec.shape.num_layers - 1)
    return total, max(two, key=lambda t: t.nbytes)


def _what(spec: Spec) -> str:
    s = spec.shape
    return f"synth {spec.arch} {s.num_layers}x{s.hidden_size} vocab {s.vocab_size} ({spec.dtype})"


def check_memory(spec: Spec, *, peak: int, why: str) -> None:
    """Refuse a spec that needs ``peak`` bytes of memory (``why`` says for what) when less is available."""
    avail = available_memory()
    if avail is not None and peak > avail:
        raise InputError(
            f"{_what(spec)} needs about {human_bytes(peak)} of memory ({why}), {human_bytes(avail)} is"
            " available; lower the synth.* dimensions"
        )


def check_room(spec: Spec, *, out: Path, partial_root: Path | None) -> None:
    """Refuse, before writing, a checkpoint that cannot fit the free disk or memory.

    Disk: every tensor, less what a killed build of the same spec already wrote. Memory: the
    largest tensor, generated whole, and its bytes on their way to the file.
    """

    total, largest = sizes(spec)
    root = partial_root or out.parent
    done = sum(f.stat().st_size for f in staging_dir(out, spec.hash, root).glob("*") if f.is_file())
    where = next(p for p in (root, *root.parents) if p.exists())
    free = shutil.disk_usage(where).free
    if total - done > free:
        raise InputError(
            f"{_what(spec)} needs {human_bytes(total - done)} of disk under {where}, which has"
            f" {human_bytes(free)} free; choose smaller synth.* dimensions or another synth.out / paths.outputs"
        )
    why = f"twice its largest tensor, {human_bytes(largest.nbytes)}"
    check_memory(spec, peak=2 * largest.nbytes, why=why)


def ensure_synthetic_source(*, cache_dir: str | Path, **fields: Any) -> SyntheticSource:
    """The :class:`SyntheticSource` for these synth fields; its small directory (config,
    tokenizer, synth.json: no weights) is built once into ``cache_dir/<spec hash>.config/``."""
    fields.pop("out", None)
    spec = resolve_spec(**fields)
    # Tensors are generated as they are read, big ones in row blocks; a quantizer still holds
    # the largest one's packed output, at least 2 bits a weight.
    largest = sizes(spec)[1]
    check_memory(spec, peak=largest.numel // 4, why=f"{largest.name} packed at 2 bits")
    cache_dir = Path(cache_dir).expanduser()
    final = cache_dir / f"{spec.hash}.config"
    if not (final / "config.json").is_file():
        cache_dir.mkdir(parents=True, exist_ok=True)
        with file_lock(cache_dir / f".{spec.hash}.config.lock"):
            if not final.exists():
                tmp = cache_dir / f".{spec.hash}.config.partial"
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
                atomic_write_json(tmp / SPEC_FILE, _spec_record(spec))
                _write_side_files(spec, tmp)
                for f in sorted(tmp.rglob("*")):
                    if f.is_file():
                        with open(f, "rb") as fh:
                            os.fsync(fh.fileno())
                publish_dir(tmp, final)
    return SyntheticSource(spec=spec, path=final)
