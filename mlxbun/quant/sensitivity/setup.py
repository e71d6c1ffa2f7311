"""What a sensitivity sweep runs on: the model (streamed for fisher, loaded for exact and the
reference sweep), the calibration, its targets and candidates, and the settings that key its
per-group checkpoints::

    <cache>/sensitivity/<key>/          key = job_key(model, calibration, settings)
        meta.json                       settings and fingerprints of this key
        groups/0003.json                results of group 3 (atomic; a rerun skips it)
        estimate.json                   fisher: factors, measured groups, probes
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxbun import blas, device
from mlxbun.errors import InputError
from mlxbun.io.atomic import atomic_write_json
from mlxbun.io.digest import job_key
from mlxbun.io.safetensors import read_config
from mlxbun.quant.calibration import load_calibration
from mlxbun.quant.mlxlm import load_tokenizer
from mlxbun.quant.probe import Stack, Target, load_model, module_at, source_dtypes, targets
from mlxbun.quant.sensitivity import fisher
from mlxbun.quant.sensitivity.exact import group_cost
from mlxbun.quant.sensitivity.file import SCHEMA_VERSION
from mlxbun.quant.spec import QuantSpec, spec_for
from mlxbun.quant.streamed import Stream
from mlxbun.source.fingerprint import model_fingerprint

log = logging.getLogger("mlxbun.sensitivity")


def candidates(bits: list[int], *, group_size: int | None, mode: str) -> list[QuantSpec]:
    """The candidate settings, checked against what MLX's quantize supports for ``mode``."""
    return [spec_for(mode, b, group_size, key="sensitivity") for b in sorted(set(bits))]


# ---------------------------------------------------------------- sharding and checkpoints


def assign_groups(
    groups: dict[int, list[Target]], *, num_shards: int, n_blocks: int, n_cands: int
) -> list[list[int]]:
    """Groups per shard: longest-processing-time first, balanced by probe cost; deterministic."""
    order = sorted(groups, key=lambda g: (-group_cost(g, groups[g], n_blocks, n_cands), g))
    loads = [0] * num_shards
    shards: list[list[int]] = [[] for _ in range(num_shards)]
    for g in order:
        i = min(range(num_shards), key=lambda k: (loads[k], k))
        shards[i].append(g)
        loads[i] += group_cost(g, groups[g], n_blocks, n_cands)
    return [sorted(s) for s in shards]


class Checkpoints:
    """Per-group results under a work dir keyed by the model, calibration and settings."""

    def __init__(self, root: Path, settings: dict[str, Any]) -> None:
        key = job_key("sensitivity", SCHEMA_VERSION, settings)
        self.dir = root / key
        (self.dir / "groups").mkdir(parents=True, exist_ok=True)
        meta = self.dir / "meta.json"
        if not meta.exists():
            atomic_write_json(meta, settings)

    def path(self, g: int) -> Path:
        return self.dir / "groups" / f"{g:04d}.json"

    def load(self, g: int) -> dict | None:
        p = self.path(g)
        if not p.exists():
            return None
        try:
            return json.loads(p.read_text())["layers"]
        except (ValueError, KeyError):
            log.warning("ignoring unreadable checkpoint %s", p)
            return None

    def save(self, g: int, layers: dict) -> None:
        atomic_write_json(self.path(g), {"group": g, "layers": layers})


# ---------------------------------------------------------------- library entry point


@dataclass
class Setup:
    """What a sweep runs on: ``model`` is the float32 model (exact, reference) or, for fisher,
    the skeleton of ``stream``, which reads the weights a block at a time."""

    model: Any
    tokens: Any
    targets: list[Target]
    cands: list[QuantSpec]
    settings: dict[str, Any]
    stream: Stream | None = None

    @property
    def n_blocks(self) -> int:
        return self.stream.n_blocks if self.stream is not None else Stack(self.model).n

    def weight(self, path: str) -> Any:
        """A module's float32 weight (read from disk when streamed)."""
        if self.stream is not None:
            return self.stream.read(f"{path}.weight")
        return module_at(self.model, path).weight


def prepare(
    *,
    model_dir: str | Path,
    bits: list[int],
    group_size: int | None,
    mode: str,
    calib_path: str | None,
    samples: int,
    seq_len: int,
    seed: int,
    method: str,
    batch_size: int,
    refine: float = 0.0,
    refine_bits: list[int] | None = None,
) -> Setup:
    """Load the model and calibration; list targets and candidates; the settings that key results."""

    cands = candidates(bits, group_size=group_size, mode=mode)
    stream = None
    if method == "fisher":
        stream = Stream(model_dir)
        model, tokenizer, source = stream.model, load_tokenizer(Path(model_dir)), stream.source()
    else:
        model, tokenizer, source = load_model(model_dir)
    calib = load_calibration(
        tokenizer=tokenizer, path=calib_path, samples=samples, seq_len=seq_len, seed=seed
    )
    vocab = _vocab_size(model)
    if int(calib.tokens.max()) >= vocab:
        raise InputError(f"calibration token id {int(calib.tokens.max())} >= model vocab_size {vocab}")
    tgts = targets(
        model,
        group_size=cands[0].group_size,
        source=source,
        dtypes=source_dtypes(model_dir) | source["dtypes"],
        modules=None if stream is None else stream.named_modules(),
    )
    n_blocks = stream.n_blocks if stream is not None else Stack(model).n
    settings = {
        "version": SCHEMA_VERSION,
        "method": method,
        "bits": [c.bits for c in cands],
        "group_size": cands[0].group_size,
        "mode": mode,
        "batch_size": batch_size if method != "reference" else 1,
        **(_fisher_settings(refine, refine_bits) if method == "fisher" else {}),
        "runtime": runtime(),
        "model": {
            "fingerprint": model_fingerprint(model_dir, depth="sampled"),
            "model_type": getattr(model, "model_type", None) or _config(model_dir).get("model_type"),
            "num_layers": n_blocks,
            "quantized": bool(source["current"]),
        },
        "calibration": calib.to_dict(),
    }
    return Setup(
        model=model, tokens=calib.tokens, targets=tgts, cands=cands, settings=settings, stream=stream
    )


def _fisher_settings(refine: float, refine_bits: list[int] | None) -> dict[str, Any]:
    return {"refine": refine, "refine_bits": sorted(refine_bits or []), "estimator": fisher.VERSION}


def _config(model_dir: str | Path) -> dict:
    return read_config(Path(model_dir))


def _vocab_size(model: Any) -> int:
    args = getattr(model, "args", None)
    return int(getattr(args, "vocab_size", 1 << 31))


def runtime() -> dict[str, Any]:
    """What changes the numbers besides model, calibration and settings: mlx version and BLAS."""
    info = blas.load()  # what was loaded before mlx.core (cached), or the bundled BLAS
    out = {"mlx": mx.__version__, "blas": info.get("library") if info.get("loaded") else "bundled"}
    return out | ({"device": "gpu"} if device.name() == "gpu" else {})  # a CPU run keeps its cache keys
