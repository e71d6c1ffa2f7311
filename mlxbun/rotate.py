"""TurboQuant R1 fold: rotate a checkpoint's residual stream by a seeded randomized Hadamard.

The rotated model computes the same function (up to rounding) but spreads outlier channels over
all dimensions, so it quantizes with less error (QuaRot / SpinQuant R1). In row-vector form with
``[out, in]`` weights and ``R1 = diag(s)·H/√n`` (s: seeded ±1 signs, H: see mlxbun.hadamard)::

    RMSNorm gain g folded into the linears it feeds, norm set to unit gain (gemma: 1 + w, w = 0)
    embedding rows, q/k/v, gate/up, lm_head    W  ->  W · diag(g) · R1       (input side)
    o_proj, down_proj (and their biases)       W  ->  R1ᵀ · W,  b -> b · R1   (output side)
    tied head                                  lm_head = embedding · diag(g_final) · R1 (untied)

A tied head whose final gain is exactly 1 stays tied (the rotated embedding is the head). Gemma 3
applies post-attention/post-feedforward norms to o_proj/down_proj outputs before the residual
add, where no linear follows to absorb a gain: they commute with R1 only when uniform, so rotate
folds gemma3_text models whose post-norms are uniform and refuses the others (naming the
tensor). Per-head q_norm/k_norm act on head_dim after q/k_proj and are untouched.

All arithmetic is float64. The output directory is built under a hidden partial name and
published by rename when complete and verified::

    <out>/
        config.json                  copied; tie_word_embeddings=false when the head was untied
        tokenizer.json ...           tokenizer files copied
        model.safetensors            (or model-0000i-of-0000N.safetensors + index), same names
        turboquant_fold.json         FoldRecord: version, seed, hadamard, hidden_size,
                                     final_gain, source fingerprint

Run: ``python -m mlxbun command=rotate model.name=<dir> fold.seed=0``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from mlxbun.errors import DriftError, InputError
from mlxbun.hadamard import HadamardSpec, apply_rows, plan
from mlxbun.io.atomic import atomic_write_json, fsync_dir, publish_dir
from mlxbun.io.dtypes import OUTPUT_CODES as OUT_DTYPES
from mlxbun.kl import kl as _kl

log = logging.getLogger("mlxbun")

RECORD = "turboquant_fold.json"
FORMAT_VERSION = 2  # version 1 records have no final_gain
SIGNS = "shake256(b'mlxbun-r1:<seed>'), bit i (LSB first) -> s_i = 1 - 2*bit"
WEIGHT_DTYPES = ("BF16", "F16", "F32")
CHUNK_ELEMS = 1 << 22  # float64 elements per transform chunk (32 MiB)
TOKENIZER_GLOBS = (
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "generation_config.json",
    "chat_template.*",
)
# Per-layer tensors (after "model.layers.<i>."): (role, norm feeding it). Roles: "in" (input
# side, gain folded), "out"/"out_bias" (output side), "norm" (folded, set to unit), "uniform"
# (gemma post-norms: must be uniform), "keep" (not on the residual stream: q/k/v and gate/up
# biases, per-head q/k norms on head_dim, rope tables).
_COMMON = {
    "self_attn.o_proj.weight": ("out", None),
    "self_attn.o_proj.bias": ("out_bias", None),
    "mlp.down_proj.weight": ("out", None),
    "mlp.down_proj.bias": ("out_bias", None),
    "input_layernorm.weight": ("norm", None),
    **{f"self_attn.{p}_proj.weight": ("in", "input_layernorm") for p in "qkv"},
    **{f"self_attn.{p}_proj.bias": ("keep", None) for p in "qkv"},
    **{f"mlp.{p}_proj.bias": ("keep", None) for p in ("gate", "up")},
    "self_attn.q_norm.weight": ("keep", None),
    "self_attn.k_norm.weight": ("keep", None),
    "self_attn.rotary_emb.inv_freq": ("keep", None),
}
_LLAMA = {
    **_COMMON,
    "post_attention_layernorm.weight": ("norm", None),
    **{f"mlp.{p}_proj.weight": ("in", "post_attention_layernorm") for p in ("gate", "up")},
}
_GEMMA3 = {
    **_COMMON,
    "pre_feedforward_layernorm.weight": ("norm", None),
    **{f"mlp.{p}_proj.weight": ("in", "pre_feedforward_layernorm") for p in ("gate", "up")},
    "post_attention_layernorm.weight": ("uniform", None),
    "post_feedforward_layernorm.weight": ("uniform", None),
}
FAMILIES = {"llama": _LLAMA, "mistral": _LLAMA, "qwen2": _LLAMA, "qwen3": _LLAMA, "gemma3_text": _GEMMA3}
TOP = {
    "model.embed_tokens.weight": ("embed", None),
    "model.norm.weight": ("norm", None),
    "lm_head.weight": ("in", "model.norm"),
}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


# ---------------------------------------------------------------------------- the rotation


def signs(seed: int, n: int) -> np.ndarray:
    """The ±1 sign vector s of R1 (float64), from SHAKE-256 so it never depends on numpy's RNG."""
    raw = hashlib.shake_256(f"mlxbun-r1:{seed}".encode()).digest((n + 7) // 8)
    bits = np.unpackbits(np.frombuffer(raw, dtype=np.uint8), bitorder="little")[:n]
    return 1.0 - 2.0 * bits.astype(np.float64)


@dataclass(frozen=True, eq=False)
class Rotation:
    """R1 = diag(s)·H/√n applied to row vectors.

    Example:
        >>> r = Rotation.build(seed=0, n=64)
        >>> np.allclose(r.rows_t(r.rows(np.eye(64))), np.eye(64))
        True
    """

    seed: int
    spec: HadamardSpec
    s: np.ndarray

    @classmethod
    def build(cls, *, seed: int, n: int, spec: HadamardSpec | None = None) -> Rotation:
        return cls(seed=seed, spec=spec or plan(n), s=signs(seed, n))

    def rows(self, x: np.ndarray) -> np.ndarray:
        """x @ R1 for float64 rows x [r, n]."""
        return apply_rows(x * self.s, self.spec) / math.sqrt(self.spec.n)

    def rows_t(self, x: np.ndarray) -> np.ndarray:
        """x @ R1ᵀ for float64 rows x [r, n]."""
        return apply_rows(x, self.spec, transpose=True) * self.s / math.sqrt(self.spec.n)


# ---------------------------------------------------------------------------- the record


@dataclass(frozen=True)
class FoldRecord:
    """``turboquant_fold.json``: how a rotated checkpoint was made, enough to rebuild R1.

    Args:
        seed: seed of the sign vector s (see SIGNS).
        hidden_size: n, the order of R1.
        hadamard: the construction of H (``HadamardSpec.to_dict``).
        final_gain: the final norm's gain that the fold moved into lm_head (None only while
            reading a version-1 record that has not been recovered yet).
        model_type: config.json ``model_type`` of the source.
        untied: whether the fold wrote lm_head for a source with tied embeddings.
        source: fingerprint of the source: {"sha256", "tensors", "bytes"}.
        dtype: dtype of the rotated weights ("source" when each kept its own).
        version: format version (1: no final_gain; 2: current).
    """

    seed: int
    hidden_size: int
    hadamard: dict[str, Any]
    final_gain: tuple[float, ...] | None
    model_type: str = ""
    untied: bool = False
    source: dict[str, Any] = field(default_factory=dict)
    dtype: str = "source"
    norm: str = "rmsnorm"
    version: int = FORMAT_VERSION

    def to_dict(self) -> dict[str, Any]:
        gain = None if self.final_gain is None else [float(g) for g in self.final_gain]
        return {
            "version": self.version,
            "seed": self.seed,
            "hidden_size": self.hidden_size,
            "hadamard": dict(self.hadamard),
            "signs": SIGNS,
            "rotation": "R1 = diag(s) @ H / sqrt(n), applied to row vectors: h -> h @ R1",
            "final_gain": gain,
            "model_type": self.model_type,
            "untied": self.untied,
            "source": dict(self.source),
            "dtype": self.dtype,
            "norm": self.norm,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FoldRecord:
        """Parse a record of any known version; unknown keys are ignored."""
        version = int(d.get("version", 1))
        if version not in (1, FORMAT_VERSION):
            raise InputError(
                f"{RECORD} version={version} is unknown; this version reads 1 and {FORMAT_VERSION}"
            )
        n = int(d["hidden_size"])
        hadamard = d.get("hadamard") or plan(n).to_dict()  # version 1 used the default plan
        gain = d.get("final_gain")
        if gain is not None and len(gain) != n:
            raise InputError(f"{RECORD}: final_gain has {len(gain)} entries, hidden_size is {n}")
        return cls(
            seed=int(d["seed"]),
            hidden_size=n,
            hadamard=hadamard,
            final_gain=None if gain is None else tuple(float(g) for g in gain),
            model_type=d.get("model_type", ""),
            untied=bool(d.get("untied", False)),
            source=d.get("source", {}),
            dtype=d.get("dtype", "source"),
            norm=d.get("norm", "rmsnorm"),
            version=version,
        )

    def rotation(self) -> Rotation:
        """The R1 this record describes."""
        return Rotation.build(seed=self.seed, n=self.hidden_size, spec=HadamardSpec.from_dict(self.hadamard))

    def write(self, path: str | Path) -> None:
        atomic_write_json(path, self.to_dict())

    @classmethod
    def read(cls, path: str | Path) -> FoldRecord:
        """Read a record as stored (a version-1 record keeps final_gain=None)."""
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise InputError(f"{path}: not a readable {RECORD} ({type(e).__name__}: {e})") from None


def read_fold_record(path: str | Path, *, model_dir: str | Path | None = None) -> FoldRecord:
    """Read ``turboquant_fold.json`` (or the one in directory ``path``), recovering final_gain.

    A version-1 record has no final_gain. It is recovered from the rotated weights when the
    source had a tied head (then ``lm_head·R1ᵀ = embedding·diag(g)``, so g is a per-column
    ratio); otherwise the gain is not in the weights and an InputError says so.

    Args:
        path: the record file or the rotated model directory holding it.
        model_dir: the rotated model to recover from (default: the record's directory).

    Example:
        >>> rec = read_fold_record("outputs/rotate/<run>/model")
        >>> len(rec.final_gain) == rec.hidden_size
        True
    """
    path = Path(path)
    file = path / RECORD if path.is_dir() else path
    if not file.is_file():
        raise InputError(f"{file} does not exist; pass a rotated model directory or its {RECORD}")
    record = FoldRecord.read(file)
    if record.final_gain is not None:
        return record
    gain = recover_final_gain(Path(model_dir) if model_dir else file.parent, record)
    return FoldRecord.from_dict({**record.to_dict(), "final_gain": gain.tolist(), "version": FORMAT_VERSION})


def recover_final_gain(model_dir: Path, record: FoldRecord, *, max_residual: float = 0.02) -> np.ndarray:
    """g with ``lm_head·R1ᵀ ≈ (embedding·R1ᵀ)·diag(g)`` by per-column least squares, or refuse."""
    from mlxbun.io.safetensors import open_model

    head, emb = "lm_head.weight", "model.embed_tokens.weight"
    why = f"{RECORD} in {model_dir} is version {record.version} without final_gain, and"
    with open_model(model_dir) as m:
        if head not in m or emb not in m:
            raise InputError(
                f"{why} the model has no separate {head}: a tied head keeps no trace of the final norm's "
                "gain; re-run rotate on the source model to write a current record"
            )
        for name in (head, emb):
            if m.info(name).dtype not in WEIGHT_DTYPES:
                raise InputError(
                    f"{why} {name} is {m.info(name).dtype}; recover from the unquantized rotated model"
                )
        num, den, aa = _column_fit(m.array(head), m.array(emb), record.rotation())
    gain = num / np.where(den > 0, den, 1.0)
    residual = math.sqrt(max(aa - float(np.sum(num * gain)), 0.0) / max(aa, 1e-300))
    if residual > max_residual:
        raise InputError(
            f"{why} {head} is not embedding·diag(g) (relative residual {residual:.3f} > {max_residual}): the "
            "source had its own head, so final_gain is not recoverable; re-run rotate on the source model"
        )
    return gain


def _column_fit(head: Any, emb: Any, rot: Rotation) -> tuple[np.ndarray, np.ndarray, float]:
    """Per-column sums Σ a·b, Σ b·b and the total Σ a·a of a = head·R1ᵀ, b = emb·R1ᵀ."""
    n = rot.spec.n
    num, den, aa = np.zeros(n), np.zeros(n), 0.0
    step = max(1, CHUNK_ELEMS // n)
    for r0 in range(0, head.shape[0], step):
        a = rot.rows_t(_f64(head[r0 : r0 + step]))
        b = rot.rows_t(_f64(emb[r0 : r0 + step]))
        num += np.einsum("ij,ij->j", a, b)
        den += np.einsum("ij,ij->j", b, b)
        aa += float(np.einsum("ij,ij->", a, a))
    return num, den, aa


# ---------------------------------------------------------------------------- dtype helpers


def _f64(a: Any) -> np.ndarray:
    """An mx.array (any float dtype) as a float64 numpy array."""
    import mlx.core as mx

    return np.asarray(a.astype(mx.float32), dtype=np.float64)


def _store(x: np.ndarray, dtype: str) -> np.ndarray:
    """float64 -> the storage array of safetensors ``dtype`` (BF16 as uint16 bits, round to nearest even)."""
    if dtype == "F32":
        return x.astype(np.float32)
    if dtype == "F16":
        return x.astype(np.float16)
    u = x.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _wrap(x: np.ndarray, dtype: str) -> Any:
    """A storage array as something ShardedWriter stores with the right dtype."""
    import mlx.core as mx

    return mx.array(x).view(mx.bfloat16) if dtype == "BF16" else x


_STORE_NP = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


# ---------------------------------------------------------------------------- checking the source


@dataclass(frozen=True, eq=False)
class FoldPlan:
    """Everything checked about a source before anything is written.

    Args:
        model_type: the family (a key of FAMILIES).
        hidden_size: n.
        roles: output tensor name -> (role, norm feeding it, source tensor name), sorted by name.
        gains: norm prefix (e.g. "model.layers.0.input_layernorm") -> float64 gain.
        untie: the source head is the embedding and the fold writes a separate lm_head.
        config: the config.json to write.
    """

    model_type: str
    hidden_size: int
    roles: dict[str, tuple[str, str | None, str]]
    gains: dict[str, np.ndarray]
    untie: bool
    config: dict[str, Any]

    @property
    def gemma(self) -> bool:
        return self.model_type.startswith("gemma")

    @property
    def final_gain(self) -> np.ndarray:
        return self.gains["model.norm"]


def _role(name: str, table: dict[str, tuple[str, str | None]]) -> tuple[str, str | None] | None:
    if name in TOP:
        return TOP[name]
    match = _LAYER.fullmatch(name)
    if match is None or match.group(2) not in table:
        return None
    role, feeder = table[match.group(2)]
    return role, None if feeder is None else f"model.layers.{match.group(1)}.{feeder}"


def _check_family(m: Any) -> tuple[str, int]:
    model_type = m.config.get("model_type")
    if model_type not in FAMILIES:
        raise InputError(
            f"{m.path}: model_type={model_type!r} is not supported by rotate; choose one of {', '.join(FAMILIES)}"
        )
    if "quantization" in m.config or any(n.endswith(".scales") for n in m.names()):
        raise InputError(f"{m.path} is quantized; rotate needs an unquantized (bf16/f16/f32) checkpoint")
    hidden = int(m.config.get("hidden_size", 0))
    try:
        plan(hidden)
    except InputError as e:
        raise InputError(f"{m.path}: {e}") from None
    return model_type, hidden


def _check_tensors(m: Any, table: dict[str, tuple[str, str | None]], hidden: int) -> None:
    for name in m.names():
        info, role = m.info(name), _role(name, table)
        if role is None:
            raise InputError(
                f"{m.path}: tensor {name!r} is not part of a {m.config['model_type']} checkpoint as rotate knows it;"
                " rotating around it would change the model's function"
            )
        if info.dtype not in WEIGHT_DTYPES:
            raise InputError(
                f"{m.path}: tensor {name!r} is {info.dtype}; rotate reads {', '.join(WEIGHT_DTYPES)}"
            )
        axis = {"embed": -1, "in": -1, "out": 0, "out_bias": 0, "norm": 0, "uniform": 0}.get(role[0])
        if axis is not None and info.shape[axis] != hidden:
            raise InputError(
                f"{m.path}: tensor {name!r} has shape {list(info.shape)}; expected hidden_size={hidden} on axis {axis}"
            )


def _gains(m: Any, table: dict[str, tuple[str, str | None]], gemma: bool) -> dict[str, np.ndarray]:
    """float64 gain of every folded norm (gemma stores w and applies 1 + w)."""
    gains = {}
    for name in m.names():
        role = _role(name, table)[0]
        if role in ("norm", "uniform"):
            w = _f64(m.array(name))
            gain = 1.0 + w if gemma else w
            if role == "uniform" and not np.all(gain == gain[0]):
                raise InputError(_post_norm_reason(m.path, name, gain))
            gains[name.removesuffix(".weight")] = gain
    if "model.norm" not in gains:
        raise InputError(f"{m.path}: no model.norm.weight; rotate needs the final norm to fold into lm_head")
    return gains


def _post_norm_reason(path: Path, name: str, gain: np.ndarray) -> str:
    return (
        f"{path}: {name} has a non-uniform gain (min {gain.min():.4g}, max {gain.max():.4g}); gemma3_text applies "
        "this norm to the attention/MLP output before the residual add, where no linear layer follows to absorb "
        "it, and an RMSNorm commutes with R1 only when its gain is uniform; rotate refuses this model rather "
        "than change its function"
    )


def _is_tied(m: Any, model_type: str) -> bool:
    """Whether the head mlx-lm uses is the embedding (mlx-lm's own rule per family)."""
    if "lm_head.weight" not in m:
        return True
    return model_type != "gemma3_text" and bool(m.config.get("tie_word_embeddings", True))


def check_source(m: Any) -> FoldPlan:
    """Validate an open source model (``mlxbun.io.safetensors.ModelDir``) and plan the fold."""
    model_type, hidden = _check_family(m)
    table = FAMILIES[model_type]
    _check_tensors(m, table, hidden)
    gains = _gains(m, table, model_type.startswith("gemma"))
    tied = _is_tied(m, model_type)
    # A tied head with unit final gain stays tied: lm_head = embedding·R1 exactly.
    untie = tied and not np.all(gains["model.norm"] == 1.0)
    names = [n for n in m.names() if not (tied and n == "lm_head.weight")]
    roles = {n: (*_role(n, table), n) for n in names}
    if untie:
        roles["lm_head.weight"] = ("in", "model.norm", "model.embed_tokens.weight")
    config = dict(m.config)
    if untie:
        config["tie_word_embeddings"] = False
    return FoldPlan(model_type, hidden, dict(sorted(roles.items())), gains, untie, config)


# ---------------------------------------------------------------------------- folding tensors


def _rotate_rows(a: Any, fn: Any, gain: np.ndarray | None, dtype: str) -> np.ndarray:
    """fn(a · diag(gain)) row chunk by row chunk, for a [rows, n] tensor."""
    rows, n = a.shape
    out = np.empty((rows, n), dtype=_STORE_NP[dtype])
    step = max(1, CHUNK_ELEMS // n)
    for r0 in range(0, rows, step):
        x = _f64(a[r0 : r0 + step])
        out[r0 : r0 + step] = _store(fn(x if gain is None else x * gain), dtype)
    return out


def _rotate_cols(a: Any, rot: Rotation, dtype: str) -> np.ndarray:
    """R1ᵀ · a for an [n, cols] tensor, column chunk by column chunk: (R1ᵀ a)ᵀ = aᵀ R1."""
    n, cols = a.shape
    out = np.empty((n, cols), dtype=_STORE_NP[dtype])
    step = max(1, CHUNK_ELEMS // n)
    for c0 in range(0, cols, step):
        out[:, c0 : c0 + step] = _store(rot.rows(_f64(a[:, c0 : c0 + step]).T).T, dtype)
    return out


def fold_tensor(
    a: Any, role: str, gain: np.ndarray | None, rot: Rotation, *, dtype: str, gemma: bool
) -> np.ndarray:
    """One tensor of the rotated model from its source tensor ``a`` (an mx.array).

    Returns the storage array (float32/float16, or the uint16 bits of bfloat16); wrap it with
    ``_wrap`` after dropping ``a`` so that at most two tensors are alive at once.

    Args:
        a: the source tensor.
        role: "embed", "in", "out", "out_bias", "norm", "uniform" or "keep" (see FAMILIES).
        gain: the gain of the norm feeding an "in" tensor (None otherwise).
        rot: R1.
        dtype: safetensors dtype of the result ("BF16", "F16", "F32").
        gemma: norms store w and apply 1 + w (a unit gain is then w = 0).
    """
    if role == "norm":
        return _store(np.full(a.shape, 0.0 if gemma else 1.0), dtype)
    if role in ("uniform", "keep"):
        return _store(_f64(a), dtype)
    if role == "out":
        return _rotate_cols(a, rot, dtype)
    if role == "out_bias":
        return _store(rot.rows(_f64(a)[None, :])[0], dtype)
    return _rotate_rows(a, rot.rows, gain, dtype)


# ---------------------------------------------------------------------------- the model directory


@dataclass(frozen=True)
class RotateResult:
    """What :func:`rotate_model_dir` produced."""

    out: Path
    record: FoldRecord
    files: list[Path]
    verify: VerifyReport | None
    total_bytes: int


def _job(m: Any, *, seed: int, dtype: str | None, shard_bytes: int) -> dict[str, Any]:
    """What a partial output must match to be resumed: settings and the source's layout."""
    layout = [(n, i.dtype, list(i.shape), i.file.name, i.start, i.end) for n, i in m.infos().items()]
    stats = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in m.files]
    blob = json.dumps([layout, stats, m.config], sort_keys=True, default=str).encode()
    return {
        "seed": seed,
        "dtype": dtype,
        "shard_bytes": shard_bytes,
        "source": hashlib.sha256(blob).hexdigest(),
    }


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # torn or unreadable: treated as another job


def _prepare_partial(tmp: Path, job: dict[str, Any]) -> bool:
    """Reuse ``tmp`` when it holds a partial run of the same job (returns True), else start it afresh."""
    marker = tmp / ".rotate-job.json"
    finished = any(tmp.glob("model*.safetensors"))  # failed after the shards: redo it all
    if marker.is_file() and not finished and _read_json(marker) == job:
        return True
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    atomic_write_json(marker, job)
    return False


def _fingerprint(hashes: dict[str, tuple[str, list[int], str]]) -> dict[str, Any]:
    lines = "".join(f"{n}\t{d}\t{s}\t{h}\n" for n, (d, s, h) in sorted(hashes.items()))
    return {"sha256": hashlib.sha256(lines.encode()).hexdigest(), "tensors": len(hashes)}


def _stream(
    m: Any, fp: FoldPlan, rot: Rotation, tmp: Path, *, dtype: str | None, shard_bytes: int, resume: bool
):
    """Fold every tensor into shards in ``tmp``; returns the layout and the source fingerprint."""
    from mlxbun.io.shards import ShardedWriter
    from mlxbun.progress import Progress

    hashes: dict[str, tuple[str, list[int], str]] = {}
    progress = Progress(total=sum(m.info(s).nbytes for _, _, s in fp.roles.values()), unit="B", desc="rotate")
    with ShardedWriter(tmp, shard_bytes=shard_bytes, resume=resume) as writer:
        for name, (role, feeder, source) in fp.roles.items():
            info = m.info(source)
            if source not in hashes:
                hashes[source] = (info.dtype, list(info.shape), hashlib.sha256(m.numpy(source)).hexdigest())
            if name not in writer.done_names:
                gain, out_dtype = fp.gains[feeder] if feeder else None, dtype or info.dtype
                store = fold_tensor(m.array(source), role, gain, rot, dtype=out_dtype, gemma=fp.gemma)
                writer.add(name, _wrap(store, out_dtype))
                del store
            progress.update(info.nbytes)
        layout = writer.finish()
    progress.close()
    for name in m.names():
        if name not in hashes:  # an ignored tied lm_head still identifies the source
            info = m.info(name)
            hashes[name] = (info.dtype, list(info.shape), hashlib.sha256(m.numpy(name)).hexdigest())
    return layout, {**_fingerprint(hashes), "bytes": m.total_bytes}


def _copy_side_files(src: Path, tmp: Path, config: dict[str, Any]) -> list[Path]:
    """config.json (as planned) and the tokenizer files, each written atomically."""
    from mlxbun.io.atomic import atomic_write_bytes

    atomic_write_json(tmp / "config.json", config)
    copied = [tmp / "config.json"]
    for pattern in TOKENIZER_GLOBS:
        for f in sorted(src.glob(pattern)):
            if f.is_file() and not (tmp / f.name).exists():
                atomic_write_bytes(tmp / f.name, f.read_bytes())
                copied.append(tmp / f.name)
    return copied


def _check_paths(src: Path, out: Path, dtype: str | None) -> None:
    if dtype is not None and dtype not in OUT_DTYPES:
        raise InputError(f"fold.dtype={dtype!r} is not allowed; choose one of {', '.join(OUT_DTYPES)}")
    if out.exists():
        raise InputError(f"output directory {out} already exists; choose a new one (rotate never overwrites)")
    if (src / RECORD).is_file():
        raise InputError(f"{src} already holds {RECORD}: it is a rotated model; rotate its source instead")


def rotate_model_dir(
    src: str | Path,
    out: str | Path,
    *,
    seed: int = 0,
    dtype: str | None = None,
    shard_bytes: int = 5 << 30,
    verify: bool = True,
    verify_tokens: int = 64,
) -> RotateResult:
    """Write a rotated copy of the HF-layout checkpoint ``src`` to the new directory ``out``.

    Streams one tensor at a time; the output is built in ``.<out>.partial`` beside ``out``
    (resumed when a run with the same settings was interrupted) and published only when complete
    and, with ``verify``, checked against the source on random tokens.

    Args:
        src: source model directory (llama, mistral, qwen2, qwen3, gemma3_text; bf16/f16/f32).
        out: the rotated model directory to create (must not exist).
        seed: seed of R1's sign vector.
        dtype: "bfloat16", "float16" or "float32" for every tensor; None keeps each tensor's dtype.
        shard_bytes: shard size ceiling of the output.
        verify: compare logits of both models (see :func:`verify_rotation`); DriftError if they differ.
        verify_tokens: random tokens for the check.

    Example:
        >>> res = rotate_model_dir("models/llama", "models/llama-r1", seed=0)
        >>> res.record.final_gain[:2], res.verify.rel
    """
    from mlxbun.io.safetensors import open_model

    src, out = Path(src), Path(out)
    _check_paths(src, out, dtype)
    with open_model(src) as m:
        fp = check_source(m)
        rot = Rotation.build(seed=seed, n=fp.hidden_size)
        tmp = out.parent / f".{out.name}.partial"
        resume = _prepare_partial(tmp, _job(m, seed=seed, dtype=dtype, shard_bytes=shard_bytes))
        layout, source = _stream(
            m, fp, rot, tmp, dtype=OUT_DTYPES.get(dtype), shard_bytes=shard_bytes, resume=resume
        )
    names = [p.name for p in layout.files] + (
        ["model.safetensors.index.json"] if layout.index_written else []
    )
    names += [p.name for p in _copy_side_files(src, tmp, fp.config)] + [RECORD]
    record = _record(fp, rot, seed=seed, source=source, dtype=dtype)
    record.write(tmp / RECORD)
    report = _verify_partial(src, tmp, verify=verify, tokens=verify_tokens, seed=seed)
    (tmp / ".rotate-job.json").unlink()
    fsync_dir(tmp)
    publish_dir(tmp, out)
    return RotateResult(out, record, [out / n for n in names], report, layout.total_size)


def _record(
    fp: FoldPlan, rot: Rotation, *, seed: int, source: dict[str, Any], dtype: str | None
) -> FoldRecord:
    return FoldRecord(
        seed=seed,
        hidden_size=fp.hidden_size,
        hadamard=rot.spec.to_dict(),
        final_gain=tuple(float(g) for g in fp.final_gain),
        model_type=fp.model_type,
        untied=fp.untie,
        source=source,
        dtype=dtype or "source",
        norm="rmsnorm(1+w)" if fp.gemma else "rmsnorm",
    )


def _verify_partial(src: Path, tmp: Path, *, verify: bool, tokens: int, seed: int) -> VerifyReport | None:
    if not verify:
        return None
    report = verify_rotation(src, tmp, n_tokens=tokens, seed=seed)
    if report is not None and not report.ok:
        shutil.rmtree(tmp)
        raise DriftError(
            f"rotated model differs from {src}: KL {report.kl:.2e} > {report.kl_tolerance:.0e} for its weight dtype "
            f"and > {BASELINE_FACTOR:g} × the KL of jittering the source by its rounding ({report.baseline_kl:.2e}); "
            f"max |Δlogit| {report.max_abs:.3g} = {report.rel:.2e} × logit std; nothing was published"
        )
    return report


# ---------------------------------------------------------------------------- verification

# Allowed mean KL(source ‖ rotated) by the rotated weights' dtype. Storing rotated weights
# re-rounds them: ~1e-12 in float32, ~1e-4..3e-3 in bfloat16 on tiny random models; a fold
# mistake in one layer gives KL ~ 1 or more. Models whose function is very sensitive to rounding
# (large planted outliers) are judged against the source with its own weights jittered by the
# dtype's unit roundoff instead: KL within BASELINE_FACTOR of that is rounding, not a bad fold.
KL_TOLERANCE = {"F32": 1e-6, "F16": 1e-3, "BF16": 1e-2}
UNIT_ROUNDOFF = {"F32": 2.0**-24, "F16": 2.0**-11, "BF16": 2.0**-8}
BASELINE_FACTOR = 10.0


@dataclass(frozen=True)
class VerifyReport:
    """Logits of a rotated model against its source on the same random tokens.

    Args:
        max_abs: max |Δlogit| over tokens and vocabulary.
        logit_scale: std of the source logits.
        kl: mean over tokens of KL(source ‖ rotated).
        tokens: number of random tokens.
        kl_tolerance: the KL allowed for the rotated weights' dtype.
        forward: dtype of both forwards ("float64" when it fits in memory, else "float32").
        baseline_kl: KL(source ‖ source with weights jittered by the unit roundoff), computed
            only when ``kl`` exceeds ``kl_tolerance``.
    """

    max_abs: float
    logit_scale: float
    kl: float
    tokens: int
    kl_tolerance: float
    forward: str
    baseline_kl: float | None = None

    @property
    def rel(self) -> float:
        return self.max_abs / max(self.logit_scale, 1e-30)

    @property
    def ok(self) -> bool:
        if self.kl <= self.kl_tolerance:
            return True
        return self.baseline_kl is not None and self.kl <= BASELINE_FACTOR * self.baseline_kl

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_abs_dlogit": self.max_abs,
            "logit_scale": self.logit_scale,
            "rel": self.rel,
            "kl": self.kl,
            "kl_tolerance": self.kl_tolerance,
            "tokens": self.tokens,
            "forward": self.forward,
            "baseline_kl": self.baseline_kl,
            "ok": self.ok,
        }


def _logits(path: Path, tokens: np.ndarray, forward: str, *, jitter: float = 0.0) -> np.ndarray:
    """Logits of the model in ``path`` (loaded by mlx-lm, cast to ``forward``) on the CPU.

    ``jitter`` > 0 first multiplies every matrix by (1 + δ), δ ~ U(-jitter, jitter), seeded.
    """
    import mlx.core as mx
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(path), lazy=True)
    model.set_dtype(getattr(mx, forward))
    with mx.stream(mx.cpu):  # float64 runs on the CPU only
        if jitter:
            _jitter(model, jitter)
        logits = model(mx.array(tokens)[None])[0].astype(mx.float64)
        mx.eval(logits)
    return np.asarray(logits)


def _jitter(model: Any, jitter: float) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    mx.random.seed(0)  # parameters come in a fixed order, so the noise is reproducible
    params = []
    for name, v in tree_flatten(model.parameters()):
        if v.ndim > 1:
            v = v * (1 + mx.random.uniform(-jitter, jitter, v.shape).astype(v.dtype))
        params.append((name, v))
    model.update(tree_unflatten(params))


def _forward_dtype(params: int) -> str | None:
    """float64 when a copy fits in 25% of memory, float32 within 40%, else None (skip)."""
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if 8 * params <= 0.25 * physical:
        return "float64"
    return "float32" if 4 * params <= 0.4 * physical else None


def verify_rotation(
    src: str | Path, rotated: str | Path, *, n_tokens: int = 64, seed: int = 0
) -> VerifyReport | None:
    """Compare the logits of ``rotated`` and ``src`` on ``n_tokens`` seeded random tokens.

    Both load through mlx-lm's own loader (no custom code) and run one at a time in float64
    (float32 for models too large for that), so the difference is what storing the rotated
    weights cost. Returns None (and logs why) when even a float32 copy would not fit in memory.

    Example:
        >>> rep = verify_rotation("models/llama", "models/llama-r1", n_tokens=64)
        >>> rep.ok, rep.rel, rep.kl
    """
    from mlxbun.io.safetensors import open_model

    src, rotated = Path(src), Path(rotated)
    with open_model(rotated) as m:
        params = sum(math.prod(i.shape) for i in m.infos().values())
        dtypes = {i.dtype for i in m.infos().values()} & set(KL_TOLERANCE)
        vocab = int(m.config["vocab_size"])
    forward = _forward_dtype(params)
    if forward is None:
        log.warning("rotate: verification skipped: a float32 copy of %s would not fit in memory", src)
        return None
    tokens = np.random.default_rng(seed).integers(0, vocab, size=n_tokens)
    ref, cur = _logits(src, tokens, forward), _logits(rotated, tokens, forward)
    worst = max(dtypes, key=KL_TOLERANCE.__getitem__)
    report = VerifyReport(
        float(np.max(np.abs(ref - cur))),
        float(np.std(ref)),
        _kl(ref, cur),
        n_tokens,
        KL_TOLERANCE[worst],
        forward,
    )
    if report.kl <= report.kl_tolerance:
        return report
    baseline = _kl(ref, _logits(src, tokens, forward, jitter=UNIT_ROUNDOFF[worst]))
    return replace(report, baseline_kl=baseline)


# ---------------------------------------------------------------------------- command


def run(cfg: Any) -> Any:
    """command=rotate: rotate ``model.*`` into ``<run_dir>/model`` with ``fold.*`` settings."""
    from mlxbun.provenance import RunResult
    from mlxbun.source import model_dir

    src = model_dir(cfg)
    out = Path(cfg.paths.run_dir) / "model"
    start = time.monotonic()
    res = rotate_model_dir(
        src,
        out,
        seed=cfg.fold.seed,
        dtype=cfg.fold.dtype,
        shard_bytes=int(cfg.io.shard_gb * (1 << 30)),
        verify=cfg.fold.verify,
    )
    rec, spec = res.record, HadamardSpec.from_dict(res.record.hadamard)
    check = (
        "skipped" if res.verify is None else f"max|Δlogit| {res.verify.rel:.1e}×scale, KL {res.verify.kl:.1e}"
    )
    metrics = {
        "seed": rec.seed,
        "hidden_size": rec.hidden_size,
        "hadamard": spec.describe(),
        "untied": rec.untied,
        "bytes": res.total_bytes,
        "seconds": round(time.monotonic() - start, 3),
        "verify": None if res.verify is None else res.verify.to_dict(),
    }
    return RunResult(
        outputs=[out],
        inputs=[src],
        metrics=metrics,
        message=f"rotated {rec.model_type} n={rec.hidden_size} (H = {spec.describe()}, seed {rec.seed}) -> {out}; "
        f"verify: {check}",
        provides={"model.name": str(out), "model.synthetic": False},
    )
