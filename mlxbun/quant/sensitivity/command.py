"""command=sensitivity: per-layer KL(reference || one layer quantized) at candidate bit widths.

``method`` chooses the estimator that makes the numbers:

- ``fisher`` (default, ``fisher.py``): a second-order estimate from one forward + backward per
  calibration batch, scaled per candidate by one whole-model forward: about 3 + candidates
  forward passes in all, linear in depth;
- ``exact`` (``exact.py``): every (module, candidate) measured from the stored hidden state;
- ``reference`` (``sensitivity_ref.py``): the same numbers as ``exact``, the slow way.

This module loads the model and calibration (``prepare``), shards the work, keeps per-group
checkpoints and writes the reports. Work is grouped by the first block a module changes
("group" = block index; 0 also holds the embedding, L is the head). Groups are the unit of
sharding and of checkpoints::

    <cache>/sensitivity/<key>/          key = job_key(model, calibration, settings)
        meta.json                       settings and fingerprints of this key
        groups/0003.json                results of group 3 (atomic; a rerun skips it)
        estimate.json                   fisher: factors, measured groups, probes
    <run_dir>/
        sensitivity.json, .csv, .png    the results (format: ``sensitivity_file.py``)

Example:
    >>> doc = sensitivity(model_dir="tests/fixtures/llama-text-3m", out_dir="out", work_dir="work")
    >>> doc["layers"][0]["path"], doc["layers"][0]["kl"]["4"]
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxbun import blas, device
from mlxbun.errors import InputError
from mlxbun.io.atomic import atomic_write_json
from mlxbun.io.digest import job_key
from mlxbun.io.safetensors import read_config
from mlxbun.progress import Progress
from mlxbun.quant import calibrate, hessian
from mlxbun.quant.allocate import allocation
from mlxbun.quant.calibration import load_calibration
from mlxbun.quant.mlxlm import load_tokenizer
from mlxbun.quant.plan import hessians_file
from mlxbun.quant.probe import Stack, Target, load_model, module_at, source_dtypes, targets, timed_forward
from mlxbun.quant.quantize import command as quantize
from mlxbun.quant.sensitivity import candidates as rich_candidates
from mlxbun.quant.sensitivity import fisher
from mlxbun.quant.sensitivity.exact import Sweep, group_cost
from mlxbun.quant.sensitivity.file import SCHEMA_VERSION, document, write_reports
from mlxbun.quant.sensitivity.reference import reference_sweep
from mlxbun.quant.spec import QuantSpec, spec_for
from mlxbun.quant.streamed import Stream
from mlxbun.runs.provenance import RunResult
from mlxbun.source.fingerprint import model_fingerprint, shard_sha256
from mlxbun.source.model import expand
from mlxbun.source.model import model_dir as source_dir

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


def sensitivity(
    *,
    model_dir: str | Path,
    out_dir: str | Path,
    work_dir: str | Path,
    bits: list[int] = (4, 8),
    group_size: int | None = 64,
    mode: str = "affine",
    calib_path: str | None = None,
    samples: int = 24,
    seq_len: int = 512,
    seed: int = 0,
    method: str = "fisher",
    batch_size: int = 8,
    refine: float = 0.0,
    refine_bits: list[int] | None = None,
    shard: int = 0,
    num_shards: int = 1,
    ref_cache_mb: float = 1024,
    stop_after_groups: int | None = None,
    candidate_group_sizes: Sequence[int] = (),
    candidate_methods: Sequence[str] = (),
    candidate_modes: Sequence[str] = (),
    hessians: str | Path | None = None,
    probe_bpw: float | None = None,
    probe_bytes: int | None = None,
    out_dtype: str | None = "bfloat16",
    threads: int | None = None,
    rounded: str | Path | None = None,
) -> dict[str, Any]:
    """Per-layer KL sensitivities of ``model_dir``; writes sensitivity.json/.csv/.png to ``out_dir``.

    Args:
        model_dir: a bf16/f16/f32 checkpoint or an mlx-lm quantized model directory.
        out_dir: where the reports go (the run directory).
        work_dir: root of per-group checkpoints (keyed by model, calibration and settings).
        bits, group_size, mode: the candidates (``mode`` as in ``mx.quantize``).
        calib_path, samples, seq_len, seed: calibration (see ``mlxbun.quant.calibration``).
        method: "fisher" (``fisher.py``: estimated from one backward pass, the default),
            "exact" (``exact.py``) or "reference" (``sensitivity_ref``: one full forward per
            sample and probe; slow, for checking).
        batch_size: samples per forward (fisher, exact).
        refine, refine_bits: fisher only: the fraction of modules (largest first) probed exactly on
            the calibration subset at ``refine_bits`` (default: the middle candidate), each
            module's estimate then scaled to its probe (``fisher.refine_kl``); 0 turns it off.
        shard, num_shards: compute only this shard's groups (merge with ``sensitivity_merge``).
        ref_cache_mb: keep reference log-probs for all samples when they fit in this budget.
        stop_after_groups: stop (raising KeyboardInterrupt) after this many new groups (tests).
        candidate_group_sizes, candidate_methods, candidate_modes: more candidates, each module's
            KL scored from its input Hessian (``hessians``; None: captured on the calibration)
            and the measured RTN KL (``mlxbun.quant.sensitivity.candidates``); probe_bpw / probe_bytes: the
            budget of the plan whose whole-model probes correct them (None: uncorrected);
            out_dtype: the dtype those probes are quantized with; threads: modules scored at
            once (None: one per core this process may use, as quantize); rounded: where the
            probes keep their clip and GPTQ roundings (``mlxbun.quant.quantize.cache``) for quantize.

    Returns:
        The sensitivity.json document (also written) plus ``_stats`` (not written).
    """
    log.info(  # before the first progress line: a 27B model takes minutes to load and hash
        "sensitivity (%s): loading and fingerprinting %s, tokenizing %d x %d calibration tokens",
        method, model_dir, samples, seq_len,
    )  # fmt: skip
    s = prepare(
        model_dir=model_dir, bits=list(bits), group_size=group_size, mode=mode, calib_path=calib_path,
        samples=samples, seq_len=seq_len, seed=seed, method=method, batch_size=batch_size,
        refine=refine, refine_bits=refine_bits,
    )  # fmt: skip
    n_blocks = s.n_blocks
    groups: dict[int, list[Target]] = {}
    for t in s.targets:
        groups.setdefault(t.group, []).append(t)
    mine = assign_groups(groups, num_shards=num_shards, n_blocks=n_blocks, n_cands=len(s.cands))[shard]
    ckpt = Checkpoints(Path(work_dir), s.settings)
    kls, todo = {}, {}
    for g in mine:
        done = ckpt.load(g)
        if done is not None and all(t.path in done for t in groups[g]):
            kls.update(done)
        else:
            todo[g] = groups[g]
    first = {"fisher": "one backward pass for the estimate", "exact": "timing one forward for the ETA"}
    log.info(
        "sensitivity (%s): %d of %d groups to compute (%d resumed), %d candidates each; %s",
        method, len(todo), len(mine), len(mine) - len(todo), len(s.cands),
        first.get(method, "one forward per sample and probe"),
    )  # fmt: skip
    t0 = time.monotonic()
    _compute(
        s, todo, ckpt, kls, batch_size=batch_size, ref_cache_mb=ref_cache_mb, stop_after=stop_after_groups
    )
    shard_info = None if num_shards == 1 else {"index": shard, "count": num_shards, "groups": mine}
    record = None
    if candidate_group_sizes or candidate_methods or candidate_modes:
        if num_shards != 1:
            raise InputError("sensitivity.candidates needs the whole model: set sensitivity.num_shards=1")
        rich = {"group_sizes": sorted(candidate_group_sizes), "methods": sorted(candidate_methods),
                "modes": sorted(candidate_modes), "hessians": None if hessians is None else shard_sha256(Path(hessians), cache_dir=None),
                "version": rich_candidates.VERSION}  # fmt: skip
        kls, record = rich_candidates.extend(
            weight=s.weight, stream=s.stream or Stream(model_dir), targets=s.targets, kls=kls, model_dir=model_dir, tokens=s.tokens,
            work_dir=ckpt.dir / "candidates" / job_key("candidates", rich_candidates.VERSION, rich),
            group_size=s.cands[0].group_size, mode=mode, group_sizes=candidate_group_sizes,
            methods=candidate_methods, modes=candidate_modes, hessians=hessians,
            calib=s.settings["calibration"] | {"path": calib_path, "seed": seed},
            budget_bpw=probe_bpw, budget_bytes=probe_bytes, out_dtype=out_dtype, steps=_candidate_steps(rounded),
            threads=quantize.default_threads() if threads is None else threads,
        )  # fmt: skip
    doc = document(tgts=s.targets, kls=kls, settings=s.settings, shard=shard_info)
    if record is not None:
        doc["candidates"] = record
    if s.settings["method"] == "fisher" and (ckpt.dir / "estimate.json").is_file():
        doc["estimate"] = json.loads((ckpt.dir / "estimate.json").read_text())
    write_reports(doc, Path(out_dir))
    stats = {
        "seconds": round(time.monotonic() - t0, 3),
        **({"candidates_seconds": record["seconds"]} if record else {}),
        "groups_computed": len(todo),
        "groups_resumed": len(mine) - len(todo),
        "layers": len(doc["layers"]),
        "checkpoints": str(ckpt.dir),
    }
    return doc | {"_stats": stats}


def runtime() -> dict[str, Any]:
    """What changes the numbers besides model, calibration and settings: mlx version and BLAS."""
    info = blas.load()  # what was loaded before mlx.core (cached), or the bundled BLAS
    out = {"mlx": mx.__version__, "blas": info.get("library") if info.get("loaded") else "bundled"}
    return out | ({"device": "gpu"} if device.name() == "gpu" else {})  # a CPU run keeps its cache keys


def _compute(
    s: Setup, todo: dict, ckpt: Checkpoints, kls: dict, *, batch_size, ref_cache_mb, stop_after
) -> dict[str, Any] | None:
    """Fill ``kls`` for the groups in ``todo`` (each saved as it completes); the fisher extras."""
    if not todo:
        return None
    method = s.settings["method"]
    n_blocks = s.n_blocks
    total = sum(len(v) for v in todo.values())
    work = {"exact": sum(group_cost(g, todo[g], n_blocks, len(s.cands)) for g in todo), "fisher": 1.0}.get(
        method
    )
    progress = Progress(
        total=total, unit="modules", desc=f"sensitivity ({method})", work_total=work, heartbeat=True
    )
    count = [0]

    def on_group(g: int, results: dict) -> None:
        ckpt.save(g, results)
        kls.update(results)
        count[0] += 1
        if stop_after is not None and count[0] >= stop_after:
            raise KeyboardInterrupt(f"stopped after {count[0]} groups")

    try:
        if method == "fisher":
            return _fisher(s, todo, on_group, progress, batch_size=batch_size, ckpt_dir=ckpt.dir)
        if method == "reference":
            reference_sweep(s.model, s.tokens, todo, s.cands, on_group=on_group, progress=progress)
        else:
            # work is counted in blocks run per module and candidate: (n_blocks + 1) make one forward
            per_batch = timed_forward(s.model, s.tokens, batch_size)
            n_batches = -(-len(s.tokens) // batch_size)
            progress.hint(per_batch * n_batches * (1 + work / (n_blocks + 1)))
            sweep = Sweep(s.model, s.tokens, batch_size=batch_size, ref_cache_mb=ref_cache_mb)
            sweep.run(todo, s.cands, on_group=on_group, progress=progress)
        return None
    finally:
        progress.close()


def _fisher(s: Setup, todo: dict, on_group, progress, *, batch_size: int, ckpt_dir: Path) -> dict[str, Any]:
    """The fisher estimate over all targets (its calibration is whole-model); todo's groups saved."""

    def at(fraction: float) -> None:
        progress.update(fraction * progress.total - progress.done, work=fraction - progress.work)

    est = fisher.estimate(
        s.stream, s.tokens, s.targets, s.cands, seed=s.settings["calibration"]["seed"],
        refine=s.settings["refine"], refine_bits=s.settings["refine_bits"], progress=at,
    )  # fmt: skip
    extra = {"factors": est.factors, "measured": est.measured, "forward_equivalents": est.forward_equivalents}
    extra |= {"probes": est.probes or {}}
    atomic_write_json(ckpt_dir / "estimate.json", extra)  # before the groups: a resume finds it
    for g in sorted(todo):
        on_group(g, {t.path: est.kl[t.path] for t in todo[g]})
    return extra


def _candidate_steps(rounded: str | Path | None) -> rich_candidates.Steps:
    """The commands the candidates run: capture (calibrate), then the probes' allocate (their clip
    and GPTQ roundings kept in ``rounded`` for the final quantize)."""
    return rich_candidates.Steps(
        calibrate=calibrate.calibrate, allocate=allocation.allocate, default=allocation.DEFAULT,
        rounded=None if rounded is None else Path(rounded),
    )  # fmt: skip


def run(cfg: Any) -> Any:
    """command=sensitivity: unpack the config and call :func:`sensitivity`."""

    sc = cfg.sensitivity
    mdir = source_dir(cfg)
    run_dir = Path(cfg.paths.run_dir)
    work = expand(sc.work_dir) if sc.work_dir else expand(cfg.paths.cache) / "sensitivity"
    doc = sensitivity(
        model_dir=mdir, out_dir=run_dir, work_dir=work, ref_cache_mb=sc.ref_cache_mb,
        bits=list(sc.bits), group_size=sc.group_size, mode=sc.mode, calib_path=sc.calib.path,
        samples=sc.calib.samples, seq_len=sc.calib.seq_len, seed=sc.calib.seed, method=sc.method,
        batch_size=sc.batch_size, shard=sc.shard, num_shards=sc.num_shards,
        refine=sc.refine, refine_bits=list(sc.refine_bits) or None, **_candidates(cfg, mdir),
    )  # fmt: skip
    stats = doc.pop("_stats")
    out = run_dir / "sensitivity.json"
    inputs = [mdir] + ([Path(sc.calib.path).expanduser()] if sc.calib.path else [])
    part = "" if doc["shard"] is None else f" (shard {sc.shard}/{sc.num_shards})"
    rich = doc.get("candidates")
    settings = f"{rich['settings']} settings" if rich else f"{len(doc['bits'])} bits"
    msg = (
        f"sensitivity{part}: {stats['layers']} layers x {settings} in {stats['seconds']:.1f}s "
        f"({stats['groups_resumed']} groups resumed) -> {out}"
    )
    return RunResult(
        outputs=[out, run_dir / "sensitivity.csv", run_dir / "sensitivity.png"],
        inputs=inputs,
        metrics=stats | {"method": doc["method"]},
        message=msg,
        provides={"allocate.sensitivity": str(out)}
        | ({"quant.hessians": doc["candidates"]["hessians"]} if "candidates" in doc else {}),
    )


def _candidates(cfg: Any, mdir: Path) -> dict[str, Any]:
    """sensitivity.candidates as :func:`sensitivity`'s arguments; the probes at allocate's budget.
    Hessians captured on another model than ``mdir`` are refused."""
    c, a = cfg.sensitivity.candidates, cfg.allocate
    if not c.enabled:
        return {}
    hessians = None if cfg.quant.hessians is None else hessians_file(cfg.quant.hessians)
    if hessians is not None:
        hessian.check_model(hessians, mdir)
    budget = {"probe_bpw": a.budget_bpw, "probe_bytes": a.budget_bytes}
    if a.budget_bpw is None and a.budget_bytes is None:
        budget["probe_bpw"] = rich_candidates.PROBE_BPW
    return {
        "candidate_group_sizes": list(c.group_sizes), "candidate_methods": list(c.methods),
        "candidate_modes": list(c.modes), "hessians": hessians, "out_dtype": cfg.quant.dtype,
        "threads": cfg.quant.threads, "rounded": expand(cfg.paths.cache) / "rounded",
        **(budget if c.correct else {}),
    }  # fmt: skip
