"""command=tune: learned rounding, a decoder block at a time (:mod:`mlxbun.quant.blockwise`).

Each block's affine quantized modules below 8 bits learn their codes' rounding and their group
scales and biases so that the block's output on the quantized model's own inputs matches the
reference block's; every tensor keeps its name, dtype and shape, so the bytes on disk are the
input's. Both models are read from disk a block at a time: memory is one block of each, whatever
the depth.

Training and validation never share text: the training windows come from the calibration
documents of other kinds than ``tune.validation_kinds``, the validation windows from those kinds.
A block keeps the best of four validation checks over its steps (or the input's values); the
tuned model is written only when its validation KL against the reference is at least
``tune.min_gain`` below the input's and by more than twice the standard error of their per-token
difference, otherwise the input's values are (``tune.json`` says which). ``tune.max_minutes``
holds the blocks and the closing validation KL (timed on one of its slices first; over fewer
tokens when it would take more than half the budget): it sets how many steps each block gets,
at the pace timed after a warm-up step (the blocks the minutes left cannot train are carried
through with their input's values); it never skips the step.

    <run_dir>/
        model/          the tuned model (config.json and tokenizer files copied; mlx_lm.load reads it;
                        .mlxbun-source.json: its input's source record, for a later tune's check)
        tune.json       {"status", "reference", "calibration", "validation", "kl_before", "kl_after",
                         "blocks": [per block: steps, validation error before/after, kept],
                         "validation_kl_tokens", "validation_kl_seconds": {"measured", "expected"},
                         ...}

Example:
    python -m mlxbun command=tune model.name=<quantized dir> tune.reference=<its source>
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from mlxbun import registry
from mlxbun.errors import InputError
from mlxbun.io.atomic import atomic_write_bytes, atomic_write_json
from mlxbun.io.digest import job_key
from mlxbun.io.safetensors import INDEX_FILE, open_model, read_config
from mlxbun.io.shards import ShardedWriter
from mlxbun.io.staging import Stage, read_json_object, stable_root
from mlxbun.progress import Progress
from mlxbun.quant.calibration import WindowKeys, load_calibration, read_documents, split_kinds
from mlxbun.quant.mlxlm import load_tokenizer
from mlxbun.quant.quantize.command import source_name
from mlxbun.quant.quantize.outdir import MARKER, copy_side_files, source_identity
from mlxbun.quant.streamed import Stream
from mlxbun.quant.tune.blockwise import tunable_modules, tune_streamed
from mlxbun.runs.provenance import RunResult
from mlxbun.source.fingerprint import model_fingerprint
from mlxbun.source.model import model_dir, named_dir

log = logging.getLogger("mlxbun")

TUNE_FILE = "tune.json"
SOURCE_RECORD = ".mlxbun-source.json"  # in a tuned model: its input's source, for a later tune's check
NOTHING_TO_TUNE = "model.name has no affine quantized module below 8 bits; there is nothing to tune"
VERSION = 3  # of the method: part of the job key (3: block by block, validated on held-out kinds)


# ----------------------------------------------------------------------------- writing


def write_tuned(src: Path, tmp: Path, tensors: dict[str, Any], *, shard_bytes: int) -> None:
    """Every tensor of ``src`` into shards in ``tmp`` in its order, with its metadata, tuned ones
    replaced (same names, dtypes and shapes); then the index, config.json and tokenizer files."""
    config = json.loads((src / "config.json").read_text())
    with open_model(src) as m:
        infos, order = m.infos(), m.stored_order()
        declared = [(n, infos[n].dtype, tuple(infos[n].shape)) for n in order]
        writer = ShardedWriter(
            tmp,
            shard_bytes=shard_bytes,
            metadata=m.metadata,
            quantization=config.get("quantization"),
            tensors=declared,
        )
        with writer:
            for name in order:
                new = tensors.get(name)
                if new is None:
                    writer.add(name, m.array(name))
                    continue
                old = infos[name]
                if tuple(new.shape) != tuple(old.shape):
                    raise RuntimeError(f"tune changed the shape of {name}: {old.shape} -> {new.shape}")
                writer.add(name, new)
            layout = writer.finish()
    if not layout.index_written:  # mlx-lm writes the index for a single shard too
        atomic_write_json(tmp / INDEX_FILE, layout.index)
    atomic_write_bytes(tmp / "config.json", (src / "config.json").read_bytes())
    copy_side_files(src, tmp)


def record_source(src: Path, out: Path) -> None:
    """The input's source (quantize's identity and content digests) kept in the tuned model: not
    quantize's whole record, whose file digests a later quantize to that directory would check."""
    record = source_record(src)[1]
    kept = {k: record[k] for k in ("source", "content") if k in record}
    if kept:
        atomic_write_json(out / SOURCE_RECORD, kept)


# ----------------------------------------------------------------------------- inputs


def _reference_dir(cfg: Any) -> Path:
    if not cfg.tune.reference:
        raise InputError(
            "tune.reference is not set; pass the unquantized model the quantized one was made from"
        )
    ref = named_dir(cfg.tune.reference, reg=cfg.registry, key="tune.reference")
    if read_config(ref).get("quantization"):
        raise InputError(
            f"tune.reference={str(ref)!r} is a quantized model; pass the unquantized model"
            " the quantized one was made from"
        )
    return ref


def _quantized_dir(cfg: Any) -> Path:
    src = model_dir(cfg)
    config = (src / "config.json").read_text() if (src / "config.json").is_file() else ""
    if '"quantization"' not in config:
        raise InputError(
            f"model.name={str(src)!r} is not a quantized model (its config.json has no quantization)"
        )
    return src


def check_reference(q: Any, ref: Any, ref_dir: Path, q_dir: Path, *, digests: Path | None = None) -> str:
    """Refuse a reference that is not the quantized model's source: a tuned module missing there
    or of another shape, or (when quantize recorded its source) another source's identity: its
    config and weight headers, and (when recorded) every byte of it (``digests``: where its
    shards' sha256 are remembered). Returns how the reference was checked."""
    for i in range(q.n_blocks):
        for path in tunable_modules(q, i):
            want = tuple(q.module(path).weight.shape)
            try:
                got = tuple(ref.module(path).weight.shape)
            except (AttributeError, IndexError, KeyError):
                got = None
            if got != want:
                there = "missing" if got is None else f"{got[0]} x {got[1]}"
                raise InputError(
                    f"tune.reference={str(ref_dir)!r} is not the model model.name was quantized from:"
                    f" its {path} is {there}, model.name's is {want[0]} x {want[1]}"
                )
    where, record = source_record(q_dir)
    if "source" not in record:
        log.warning(
            "tune: %s records no source (not written by mlxbun quantize or tune); tune.reference=%s"
            " is checked by shapes only",
            q_dir, ref_dir,
        )  # fmt: skip
        return "shapes"
    if record["source"] != source_identity(ref_dir):
        raise InputError(
            f"tune.reference={str(ref_dir)!r} is not the model model.name was quantized from: its"
            " config.json or weight headers differ from the source quantize recorded"
            f" in {where}"
        )
    if "content" in record and record["content"] != model_fingerprint(
        ref_dir, depth="content", cache_dir=digests
    ):
        raise InputError(
            f"tune.reference={str(ref_dir)!r} is not the model model.name was quantized from: its"
            " config.json and weight headers match, its tensor bytes differ from the source quantize"
            f" recorded in {where}"
        )
    return "source content" if "content" in record else "source identity"


def source_record(q_dir: Path) -> tuple[Path, dict[str, Any]]:
    """(where, what) a quantized model records of its source: quantize's record, or tune's copy
    of it in a tuned model (so a tuned model tuned again is checked as its input was)."""
    for name in (MARKER, SOURCE_RECORD):
        record = read_json_object(q_dir / name)
        if record is not None:
            return q_dir / name, record
    return q_dir / MARKER, {}


def _windows(cfg: Any, tokenizer: Any) -> tuple[Any, Any, str]:
    """(training windows, validation windows, how the documents were split)."""
    t, c = cfg.tune, cfg.sensitivity.calib
    kinds = tuple(t.validation_kinds)
    how = split_kinds(read_documents(c.path)[0], kinds)[2]
    common = {"tokenizer": tokenizer, "path": c.path, "seq_len": t.seq_len, "seed": c.seed}
    train = load_calibration(
        **common, samples=t.samples, documents=lambda d: split_kinds(d, kinds)[0], label="training",
        keys=WindowKeys(samples="tune.samples", seq_len="tune.seq_len"),
    )  # fmt: skip
    val = load_calibration(
        **common, samples=t.val_samples, documents=lambda d: split_kinds(d, kinds)[1], label="validation",
        keys=WindowKeys(samples="tune.val_samples", seq_len="tune.seq_len"),
    )  # fmt: skip
    return train, val, how


# ----------------------------------------------------------------------------- command


def run(cfg: Any) -> Any:
    """command=tune: tune ``model.name`` (quantized) against ``tune.reference`` into ``<run_dir>/model``."""
    t = cfg.tune
    src, ref_dir = _quantized_dir(cfg), _reference_dir(cfg)
    run_dir = Path(cfg.paths.run_dir)
    out = Path(t.out).expanduser() if t.out else run_dir / "model"
    q, ref = Stream(src, exact=True), Stream(ref_dir, key="tune.reference")
    if not any(tunable_modules(q, i) for i in range(q.n_blocks)):  # refused before anything is staged
        raise InputError(NOTHING_TO_TUNE)
    checked = check_reference(q, ref, ref_dir, src, digests=Path(cfg.paths.cache).expanduser() / "digests")
    train, val, split = _windows(cfg, load_tokenizer(src))
    record: dict[str, Any] = {
        "version": VERSION,
        "input": str(src),
        "reference": str(ref_dir),
        "reference_checked_by": checked,
        "calibration": train.to_dict(),
        "validation": val.to_dict() | {"split": split},
        "settings": {
            "steps": t.steps, "lr": t.lr, "batch_size": t.batch_size, "max_minutes": t.max_minutes,
            "validation_kinds": list(t.validation_kinds), "min_gain": t.min_gain,
        },
    }  # fmt: skip
    if t.steps == 0:
        return _handed_on(run_dir, src, record, "tune.steps=0")
    key = job_key(
        "tune", VERSION, model_fingerprint(src, depth="header"), str(ref_dir), record["settings"],
        train.fingerprint, val.fingerprint, cfg.seed,
    )  # fmt: skip
    progress = Progress(total=q.n_blocks, unit="blocks", desc="tune", heartbeat=True)
    if t.max_minutes is not None:  # the budget sets each block's steps: the blocks end with it
        progress.deadline(60.0 * t.max_minutes)
    with Stage.locked(out, kind="tune", key=key, root=stable_root(cfg.paths.outputs, out)) as stage:
        stage.claim(resume=False)
        phases = [progress]

        def validation(slices: int, expected: float | None) -> Any:  # the blocks are done
            progress.close()
            phases.append(Progress(total=slices, unit="slices", desc="tune (validation KL)", heartbeat=True))
            if expected is not None:
                phases[-1].hint(expected)
            return phases[-1].update

        outcome = tune_streamed(
            ref, q, train.tokens, val.tokens, steps=t.steps, lr=t.lr, batch=t.batch_size, seed=cfg.seed,
            max_minutes=t.max_minutes, min_gain=t.min_gain, on_block=lambda r: _block_done(progress, r),
            on_kl=validation, on_budget=progress.deadline,
        )  # fmt: skip
        phases[-1].close()
        write_tuned(src, stage.dir, outcome.tensors, shard_bytes=cfg.io.shard_bytes)
        record_source(src, stage.dir)
        stage.publish()
    return _finish(cfg, run_dir, src, ref_dir, out, record, outcome)


def _block_done(progress: Progress, r: Any) -> None:
    if r.val_before is None:
        log.info("tune: block %d carried through untrained (tune.max_minutes holds no more steps)", r.block)
        progress.update(1)
        return
    log.info(
        "tune: block %d, %d steps, validation error %.6g -> %.6g (%s)",
        r.block, r.steps, r.val_before, r.val_after, "kept" if r.kept else "the input's kept",
    )  # fmt: skip
    progress.update(1)


def _finish(
    cfg: Any, run_dir: Path, src: Path, ref_dir: Path, out: Path, record: dict, outcome: Any
) -> RunResult:
    tuned = outcome.improved
    changed = sum(b.codes_changed for b in outcome.blocks if b.kept) if tuned else 0
    record |= {
        "status": "tuned" if tuned else "unchanged",
        "kl_before": round(outcome.kl_before, 8),
        "kl_after": round(outcome.kl_after, 8),
        "blocks_kept": sum(b.kept for b in outcome.blocks) if tuned else 0,
        "codes_changed": changed,
        "blocks": [b.to_json() for b in outcome.blocks],
        "seconds": round(outcome.seconds, 3),
        "validation_kl_tokens": outcome.kl_tokens,
        "validation_kl_seconds": {
            "measured": round(outcome.kl_seconds, 3),
            "expected": None
            if outcome.kl_seconds_expected is None
            else round(outcome.kl_seconds_expected, 3),
        },
    }
    atomic_write_json(run_dir / TUNE_FILE, record)
    name = _register(cfg, out, src)
    before, after = outcome.kl_before, outcome.kl_after
    steps = sum(b.steps for b in outcome.blocks)
    if tuned:
        message = (
            f"tuned {src.name}: validation KL {before:.4g} -> {after:.4g} ({record['blocks_kept']} of"
            f" {len(outcome.blocks)} blocks, {changed} codes moved, {outcome.seconds:.0f} s) -> {out}"
        )
    elif not any(b.kept for b in outcome.blocks):
        message = (
            f"{src.name} unchanged by tune: no block's {steps} steps in all lowered its validation"
            f" error ({outcome.seconds:.0f} s); the input's values are written to {out}"
        )
    else:
        message = (
            f"{src.name} unchanged by tune: the tuned model's validation KL {after:.4g} against the"
            f" input's {before:.4g} is not both {record['settings']['min_gain']:.0%} lower (tune.min_gain)"
            f" and significantly lower ({outcome.seconds:.0f} s); the input's values are written to {out}"
        )
    message += f" (registered as {name})"
    return RunResult(
        outputs=[out, run_dir / TUNE_FILE],
        inputs=[src, ref_dir],
        metrics={
            "validation_kl_before": round(before, 8),
            "validation_kl_after": round(after if tuned else before, 8),
            "blocks_kept": record["blocks_kept"],
            "codes_changed": changed,
            "seconds": record["seconds"],
        },
        message=message,
        provides={"model.name": str(out)},  # out is what this run published: every file in it is an output
    )


def _handed_on(run_dir: Path, src: Path, record: dict, why: str) -> RunResult:
    log.warning("tune: skipped (%s); the input model is handed on unchanged", why)
    atomic_write_json(run_dir / TUNE_FILE, {**record, "status": "skipped", "reason": why})
    return RunResult(
        outputs=[run_dir / TUNE_FILE],
        metrics={"skipped": why},
        message=f"tune skipped ({why}); {src} is handed on",
        provides={"model.name": str(src)},
    )


def _register(cfg: Any, out: Path, src: Path) -> str:
    """Index the tuned model as its input's registry name + ``-tuned`` (e.g.
    ``Qwen3-4B-mixed-3.50bpw-tuned``), so later recipes can name it; returns the name."""
    registry.open_db(url=cfg.registry.url, path=cfg.registry.path)
    name = f"{source_name(str(src))}-tuned"
    registry.register_model(out, name=name)
    return name
