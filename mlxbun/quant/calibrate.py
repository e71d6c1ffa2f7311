"""command=calibrate: the input Hessians of every quantizable module on calibration text, cached.

Capture is streamed block by block with the weights loaded lazily and released
(:func:`mlxbun.quant.hessian.write`): memory holds one block's weights and Hessians and the
calibration set's hidden states, never the whole model's activations. The result is keyed like
sensitivity's checkpoints, by the model's fingerprint and the calibration record, so a rerun
with the same model and calibration (``sensitivity.calib.*``) reuses the file and says so::

    <cache>/hessians/<key>/             key = job_key(version, model fingerprint, calibration)
        meta.json                       what the key was made of, and the file's sha256
        hessians.safetensors            (format: mlxbun.quant.hessian)
    <run_dir>/
        hessians.safetensors            a copy of the cached file (a reflink where the file system
                                        has them): never the same file, so damage to either is not
                                        damage to the other

A cached file is reused only when it still has the sha256 recorded when it was written (one read
of it); otherwise it is captured again.

``quant.hessians`` of quantize and allocate may name the run directory or the file.

Example:
    >>> r = calibrate(model_dir="tests/fixtures/llama-text-3m", out_dir="out", work_dir="work")
    >>> r.path, r.reused
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxbun.io.atomic import atomic_write_json, file_lock, publish_copy
from mlxbun.io.digest import file_digest, job_key
from mlxbun.io.staging import read_json_object
from mlxbun.progress import Progress
from mlxbun.quant import hessian
from mlxbun.quant.calibration import load_calibration
from mlxbun.quant.plan import HESSIANS_NAME
from mlxbun.runs.provenance import RunResult
from mlxbun.source.fingerprint import model_fingerprint
from mlxbun.source.model import expand
from mlxbun.source.model import model_dir as source_dir

log = logging.getLogger("mlxbun.calibrate")

VERSION = 1  # of the cache key: bump when the captured numbers change for the same inputs


@dataclass(frozen=True)
class Calibrated:
    """A calibrate run's result: the run's file, its cache key, whether the cache had it."""

    path: Path
    key: str
    reused: bool
    seconds: float
    calibration: dict[str, Any]
    sha256: str  # of the file, computed as it was written


def calibrate(
    *,
    model_dir: str | Path,
    out_dir: str | Path,
    work_dir: str | Path | None = None,
    calib_path: str | Path | None = None,
    samples: int = 24,
    seq_len: int = 512,
    seed: int = 0,
    batch_size: int = 8,
) -> Calibrated:
    """Hessians of ``model_dir`` on its calibration into ``out_dir/hessians.safetensors``.

    Args:
        model_dir: a bf16/f16/f32 checkpoint or an mlx-lm quantized model directory.
        out_dir: the run directory (created if missing).
        work_dir: root of the cache (one directory per key); None captures without one.
        calib_path, samples, seq_len, seed: calibration (see :mod:`mlxbun.quant.calibration`); the same
            keys as sensitivity's, so both measure on the same tokens.
        batch_size: samples per block forward.
    """
    t0 = time.monotonic()
    model, tokenizer = hessian.load_lazy(model_dir)
    calib = load_calibration(
        tokenizer=tokenizer, path=calib_path, samples=samples, seq_len=seq_len, seed=seed
    )
    settings = {
        "version": VERSION,
        "model": model_fingerprint(model_dir, depth="sampled"),
        "calibration": calib.to_dict(),
    }
    key = job_key("calibrate", VERSION, settings)
    out = Path(out_dir) / HESSIANS_NAME
    out.parent.mkdir(parents=True, exist_ok=True)
    if work_dir is None:
        sha256 = _capture(model, calib.tokens, settings, out, batch_size=batch_size)
        reused = False
    else:
        entry = Path(work_dir) / key
        cached = entry / HESSIANS_NAME
        with file_lock(entry / ".lock"):
            sha256 = _intact(entry)
            reused = sha256 is not None
            if sha256 is None:
                sha256 = _capture(model, calib.tokens, settings, cached, batch_size=batch_size)
                atomic_write_json(entry / "meta.json", {**settings, "sha256": sha256})
            publish_copy(cached, out)
    seconds = time.monotonic() - t0
    return Calibrated(
        path=out, key=key, reused=reused, seconds=seconds, calibration=settings["calibration"], sha256=sha256
    )


def _capture(model: Any, tokens: Any, settings: dict[str, Any], out: Path, *, batch_size: int) -> str:
    """Stream the capture into ``out`` with progress in blocks; the file records model and
    calibration. Returns its sha256."""
    meta = {"model": settings["model"], "calibration": json.dumps(settings["calibration"], sort_keys=True)}
    progress = Progress(total=hessian.n_blocks(model) + 1, unit="blocks", desc="calibrate", heartbeat=True)
    try:
        return hessian.write(model, tokens, out, batch_size=batch_size, meta=meta, on_block=progress.update)
    finally:
        progress.close()


def _intact(entry: Path) -> str | None:
    """The sha256 recorded for the cache entry's file when the file still has it; None when it is
    missing, has none recorded, or has other bytes (a damaged one is captured again)."""
    cached = entry / HESSIANS_NAME
    if not cached.exists():
        return None
    want = (read_json_object(entry / "meta.json") or {}).get("sha256")
    if want is not None and file_digest(cached, "sha256") == want:
        return str(want)
    why = "its sha256 is not the one recorded when it was written" if want else "no sha256 was recorded"
    log.warning("calibrate: %s is damaged (%s); capturing again", cached, why)
    return None


def run(cfg: Any) -> RunResult:
    """command=calibrate: unpack the config and call :func:`calibrate`."""
    c = cfg.sensitivity.calib
    mdir = source_dir(cfg)
    work = expand(cfg.calibrate.work_dir) if cfg.calibrate.work_dir else expand(cfg.paths.cache) / "hessians"
    r = calibrate(
        model_dir=mdir, out_dir=Path(cfg.paths.run_dir), work_dir=work, calib_path=c.path,
        samples=c.samples, seq_len=c.seq_len, seed=c.seed, batch_size=cfg.sensitivity.batch_size,
    )  # fmt: skip
    how = f"reused the cached capture {work / r.key}" if r.reused else "captured"
    msg = (
        f"calibrate: Hessians on {r.calibration['samples']} x {r.calibration['seq_len']} tokens {how}"
        f" in {r.seconds:.1f}s -> {r.path}"
    )
    return RunResult(
        outputs=[r.path],
        inputs=[mdir] + ([expand(c.path)] if c.path else []),
        metrics={"seconds": round(r.seconds, 3), "reused": r.reused, "key": r.key},
        message=msg,
        provides={"quant.hessians": str(r.path)},
        digests={r.path: r.sha256},
    )
