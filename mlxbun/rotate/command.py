"""TurboQuant R1 fold: rotate a checkpoint's residual stream by a seeded randomized Hadamard.

The rotated model computes the same function (up to rounding) but spreads outlier channels over
all dimensions, so it quantizes with less error (QuaRot / SpinQuant R1). In row-vector form with
``[out, in]`` weights and ``R1 = diag(s)·H/√n`` (s: seeded ±1 signs, H: see mlxbun.rotate.hadamard)::

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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mlxbun.errors import DriftError, InputError
from mlxbun.io.atomic import atomic_write_bytes, atomic_write_json
from mlxbun.io.digest import job_key
from mlxbun.io.dtypes import OUTPUT_CODES as OUT_DTYPES
from mlxbun.io.safetensors import INDEX_FILE, open_model
from mlxbun.io.shards import ShardedWriter
from mlxbun.io.staging import Stage, reached, stable_root, weights_written
from mlxbun.progress import Progress
from mlxbun.rotate.fold import (
    CHUNK_ELEMS,
    SIGNS,
    WEIGHT_DTYPES,
    FoldPlan,
    Rotation,
    check_source,
    fold_tensor,
    to_f64,
    to_stored,
)
from mlxbun.rotate.hadamard import HadamardSpec, plan
from mlxbun.rotate.verify import BASELINE_FACTOR, VerifyReport, verify_rotation
from mlxbun.runs.provenance import RunResult
from mlxbun.source.model import model_dir

log = logging.getLogger("mlxbun")

RECORD = "turboquant_fold.json"
FORMAT_VERSION = 2  # version 1 records have no final_gain
TOKENIZER_GLOBS = (
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "generation_config.json",
    "chat_template.*",
)

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
        a = rot.rows_t(to_f64(head[r0 : r0 + step]))
        b = rot.rows_t(to_f64(emb[r0 : r0 + step]))
        num += np.einsum("ij,ij->j", a, b)
        den += np.einsum("ij,ij->j", b, b)
        aa += float(np.einsum("ij,ij->", a, a))
    return num, den, aa


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


def _tensor_hash(m: Any, name: str) -> tuple[str, list[int], str]:
    info = m.info(name)
    return info.dtype, list(info.shape), hashlib.sha256(m.numpy(name)).hexdigest()


def _source_fingerprint(m: Any) -> dict[str, Any]:
    """What :func:`_stream` records of the source, for a resumed run whose shards are all written."""
    return {**_fingerprint({n: _tensor_hash(m, n) for n in m.names()}), "bytes": m.total_bytes}


def _fingerprint(hashes: dict[str, tuple[str, list[int], str]]) -> dict[str, Any]:
    lines = "".join(f"{n}\t{d}\t{s}\t{h}\n" for n, (d, s, h) in sorted(hashes.items()))
    return {"sha256": hashlib.sha256(lines.encode()).hexdigest(), "tensors": len(hashes)}


def _stream(
    m: Any, fp: FoldPlan, rot: Rotation, tmp: Path, *, dtype: str | None, shard_bytes: int
) -> dict[str, Any]:
    """Fold every tensor into shards in ``tmp`` (resuming its shards); returns the source fingerprint."""

    hashes: dict[str, tuple[str, list[int], str]] = {}
    progress = Progress(total=sum(m.info(s).nbytes for _, _, s in fp.roles.values()), unit="B", desc="rotate")
    declared = []  # the fold keeps every shape; the writer writes each tensor as it comes
    for name, (_, _, source) in fp.roles.items():
        info = m.info(source)
        declared.append((name, dtype or info.dtype, tuple(info.shape)))
    with ShardedWriter(tmp, shard_bytes=shard_bytes, resume=True, tensors=declared) as writer:
        if writer.done_names:
            log.info(
                "rotate: resuming %s, %d of %d tensors already written",
                tmp,
                len(writer.done_names),
                len(fp.roles),
            )
        for name, (role, feeder, source) in fp.roles.items():
            info = m.info(source)
            if source not in hashes:
                hashes[source] = _tensor_hash(m, source)
            if name not in writer.done_names:
                gain, out_dtype = fp.gains[feeder] if feeder else None, dtype or info.dtype
                store = fold_tensor(m.array(source), role, gain, rot, dtype=out_dtype, gemma=fp.gemma)
                writer.add(name, to_stored(store, out_dtype))
                del store
            progress.update(info.nbytes)
        writer.finish()
    progress.close()
    for name in m.names():
        if name not in hashes:  # an ignored tied lm_head still identifies the source
            hashes[name] = _tensor_hash(m, name)
    return {**_fingerprint(hashes), "bytes": m.total_bytes}


def _copy_side_files(src: Path, tmp: Path, config: dict[str, Any]) -> list[Path]:
    """config.json (as planned) and the tokenizer files, each written atomically."""

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
    _refuse_existing(out)
    if (src / RECORD).is_file():
        raise InputError(f"{src} already holds {RECORD}: it is a rotated model; rotate its source instead")


def _refuse_existing(out: Path) -> None:
    if out.exists():
        raise InputError(f"output directory {out} already exists; choose a new one (rotate never overwrites)")


def rotate_model_dir(
    src: str | Path,
    out: str | Path,
    *,
    seed: int = 0,
    dtype: str | None = None,
    shard_bytes: int = 5 << 30,
    verify: bool = True,
    verify_tokens: int = 64,
    partial_root: str | Path | None = None,
) -> RotateResult:
    """Write a rotated copy of the HF-layout checkpoint ``src`` to the new directory ``out``.

    Streams one tensor at a time; the output is built in a staging dir (see
    :mod:`mlxbun.io.staging`; resumed when a run with the same source and settings was
    interrupted) and published only when complete and, with ``verify``, checked against the
    source on random tokens.

    Args:
        src: source model directory (llama, mistral, qwen2, qwen3, gemma3_text; bf16/f16/f32).
        out: the rotated model directory to create (must not exist).
        seed: seed of R1's sign vector.
        dtype: "bfloat16", "float16" or "float32" for every tensor; None keeps each tensor's dtype.
        shard_bytes: shard size ceiling of the output.
        verify: compare logits of both models (see :func:`verify_rotation`); DriftError if they differ.
        verify_tokens: random tokens for the check.
        partial_root: where the staging dir lives (default: beside ``out``).

    Example:
        >>> res = rotate_model_dir("models/llama", "models/llama-r1", seed=0)
        >>> res.record.final_gain[:2], res.verify.rel
    """

    src, out = Path(src), Path(out).absolute()
    _check_paths(src, out, dtype)
    with open_model(src) as m:
        fp = check_source(m)
        rot = Rotation.build(seed=seed, n=fp.hidden_size)
        key = job_key("rotate", FORMAT_VERSION, _job(m, seed=seed, dtype=dtype, shard_bytes=shard_bytes))
        with Stage.locked(out, kind="rotate", key=key, root=partial_root) as stage:
            _refuse_existing(out)
            stage.claim()
            tmp = stage.dir
            if weights_written(tmp):
                source = _source_fingerprint(m)
            else:
                source = _stream(m, fp, rot, tmp, dtype=OUT_DTYPES.get(dtype), shard_bytes=shard_bytes)
            reached("weights")
            _copy_side_files(src, tmp, fp.config)
            record = _record(fp, rot, seed=seed, source=source, dtype=dtype)
            record.write(tmp / RECORD)
            try:
                report = _verify_partial(src, tmp, verify=verify, tokens=verify_tokens, seed=seed)
            except DriftError:
                stage.discard()  # a resume would publish the same wrong fold
                raise
            names, total = _written_names(tmp), _total_bytes(tmp)
            stage.publish()
    return RotateResult(out, record, [out / n for n in names], report, total)


def _written_names(d: Path) -> list[str]:
    """The files of the rotated model in ``d``: shards, index, config and tokenizer, the record."""

    weights = sorted(p.name for p in d.glob("model*.safetensors"))
    weights += [INDEX_FILE] if (d / INDEX_FILE).is_file() else []
    side = sorted(
        p.name for p in d.iterdir() if p.name not in (*weights, RECORD) and not p.name.startswith(".")
    )
    return [*weights, *side, RECORD]


def _total_bytes(d: Path) -> int:

    with open_model(d) as m:
        return m.total_bytes


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
        raise DriftError(
            f"rotated model differs from {src}: KL {report.kl:.2e} > {report.kl_tolerance:.0e} for its weight dtype "
            f"and > {BASELINE_FACTOR:g} × the KL of jittering the source by its rounding ({report.baseline_kl:.2e}); "
            f"max |Δlogit| {report.max_abs:.3g} = {report.rel:.2e} × logit std; nothing was published"
        )
    return report


# ---------------------------------------------------------------------------- command


def run(cfg: Any) -> Any:
    """command=rotate: rotate ``model.*`` into ``<run_dir>/model`` with ``fold.*`` settings."""

    src = model_dir(cfg)
    out = Path(cfg.paths.run_dir) / "model"
    start = time.monotonic()
    res = rotate_model_dir(
        src,
        out,
        seed=cfg.fold.seed,
        dtype=cfg.fold.dtype,
        shard_bytes=cfg.io.shard_bytes,
        verify=cfg.fold.verify,
        partial_root=stable_root(cfg.paths.outputs, out),  # a re-run into a new run dir resumes
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
