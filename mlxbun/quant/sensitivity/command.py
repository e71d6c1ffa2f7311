"""command=sensitivity: per-layer KL(reference || one layer quantized) at candidate bit widths.

``method`` chooses the estimator that makes the numbers:

- ``fisher`` (default, ``fisher.py``): a second-order estimate from one forward and a backward a
  block at a time, scaled per candidate by measured whole-model KLs: about 4 + candidates
  forward passes in all, linear in depth;
- ``exact`` (``exact.py``): every (module, candidate) measured from the stored hidden state;
- ``reference`` (``reference.py``): the same numbers as ``exact``, the slow way.

This command prepares the sweep (:mod:`mlxbun.quant.sensitivity.setup`), shards the work, keeps
per-group checkpoints and writes the reports. Work is grouped by the first block a module changes
("group" = block index; 0 also holds the embedding, L is the head). With candidates beyond RTN it
then runs their stages, each kept so that a rerun resumes (:class:`Stages`)::

    <cache>/sensitivity/<key>/          the sweep's checkpoints (setup.py)
        candidates/<key>/               hessians.safetensors (captured when none is given),
                                        scored.json, corrected-v<V>-<dtype>-<budget>.json
    <run_dir>/
        sensitivity.json, .csv, .png    the results (format: ``file.py``)

Example:
    >>> doc = sensitivity(model_dir="tests/fixtures/llama-text-3m", out_dir="out", work_dir="work")
    >>> doc["layers"][0]["path"], doc["layers"][0]["kl"]["4"]
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxbun.errors import InputError
from mlxbun.io.atomic import atomic_write_json
from mlxbun.io.digest import job_key
from mlxbun.progress import Progress
from mlxbun.quant import calibrate, hessian
from mlxbun.quant.allocate import allocation, check
from mlxbun.quant.hessian import Hessians
from mlxbun.quant.plan import HESSIANS_NAME, hessians_file
from mlxbun.quant.probe import Target, timed_forward
from mlxbun.quant.quantize import command as quantize
from mlxbun.quant.sensitivity import candidates as rich_candidates
from mlxbun.quant.sensitivity import fisher
from mlxbun.quant.sensitivity.exact import Sweep, group_cost
from mlxbun.quant.sensitivity.file import (
    LayerSensitivity,
    Sensitivity,
    document,
    parse_setting_key,
    setting_key,
    write_reports,
)
from mlxbun.quant.sensitivity.reference import reference_sweep
from mlxbun.quant.sensitivity.setup import Checkpoints, Setup, assign_groups, prepare
from mlxbun.quant.spec import QuantSpec
from mlxbun.quant.streamed import Stream
from mlxbun.runs.provenance import RunResult
from mlxbun.source.fingerprint import shard_sha256
from mlxbun.source.model import expand
from mlxbun.source.model import model_dir as source_dir

log = logging.getLogger("mlxbun.sensitivity")


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
    rich: Rich | None = None,
    hessians: str | Path | None = None,
) -> dict[str, Any]:
    """Per-layer KL sensitivities of ``model_dir``; writes sensitivity.json/.csv/.png to ``out_dir``.

    Args:
        model_dir: a bf16/f16/f32 checkpoint or an mlx-lm quantized model directory.
        out_dir: where the reports go (the run directory).
        work_dir: root of per-group checkpoints (keyed by model, calibration and settings).
        bits, group_size, mode: the candidates (``mode`` as in ``mx.quantize``).
        calib_path, samples, seq_len, seed: calibration (see ``mlxbun.quant.calibration``).
        method: "fisher" (the default), "exact" or "reference" (module docstring).
        batch_size: samples per forward (fisher, exact).
        refine, refine_bits: fisher only: the fraction of modules (largest first) probed exactly on
            the calibration subset at ``refine_bits`` (default: the middle candidate), each
            module's estimate then scaled to its probe (``fisher.refine_kl``); 0 turns it off.
        shard, num_shards: compute only this shard's groups (merge with ``sensitivity_merge``).
        ref_cache_mb, stop_after_groups: the exact sweep's reference cache; stop (raising
            KeyboardInterrupt) after this many new groups (tests).
        rich: candidates beyond RTN (:class:`Rich`), each module's KL scored from its input Hessian
            (``hessians``; None: captured on the calibration) and the measured RTN KL
            (:mod:`mlxbun.quant.sensitivity.candidates`), corrected by probes at ``rich``'s budget.
    Returns the sensitivity.json document (also written) and ``_stats`` (not written).
    """
    say = "sensitivity (%s): loading and fingerprinting %s, tokenizing %d x %d calibration tokens"
    log.info(say, method, model_dir, samples, seq_len)
    s = prepare(
        model_dir=model_dir, bits=list(bits), group_size=group_size, mode=mode, calib_path=calib_path,
        samples=samples, seq_len=seq_len, seed=seed, method=method, batch_size=batch_size,
        refine=refine, refine_bits=refine_bits,
    )  # fmt: skip
    t0 = time.monotonic()
    kls, todo, mine, ckpt = _sweep(
        s, Path(work_dir), shard=shard, num_shards=num_shards, batch_size=batch_size,
        ref_cache_mb=ref_cache_mb, stop_after=stop_after_groups,
    )  # fmt: skip
    shard_info = None if num_shards == 1 else {"index": shard, "count": num_shards, "groups": mine}
    record = None
    if rich is not None:
        if num_shards != 1:
            raise InputError("sensitivity.candidates needs the whole model: set sensitivity.num_shards=1")
        calib = s.settings["calibration"] | {"path": calib_path, "seed": seed}
        kls, record = extend(
            s, kls, rich, model_dir=Path(model_dir), hessians=hessians, calib=calib, ckpt=ckpt
        )
    doc = document(tgts=s.targets, kls=kls, settings=s.settings, shard=shard_info)
    if record is not None:
        doc["candidates"] = record
    if s.settings["method"] == "fisher" and (ckpt.dir / "estimate.json").is_file():
        doc["estimate"] = json.loads((ckpt.dir / "estimate.json").read_text())
    write_reports(doc, Path(out_dir))
    stats = {
        "seconds": round(time.monotonic() - t0, 3),
        "groups_computed": len(todo),
        "layers": len(doc["layers"]),
    }
    stats |= {"groups_resumed": len(mine) - len(todo), "checkpoints": str(ckpt.dir)}
    return doc | {"_stats": stats | ({"candidates_seconds": record["seconds"]} if record else {})}


def _sweep(
    s: Setup, work_dir: Path, *, shard: int, num_shards: int, batch_size: int, ref_cache_mb: float, stop_after
) -> tuple[dict, dict, list[int], Checkpoints]:
    """This shard's groups measured, or read back from their checkpoints: (KLs, the groups computed,
    the shard's groups, the checkpoints)."""
    groups: dict[int, list[Target]] = {}
    for t in s.targets:
        groups.setdefault(t.group, []).append(t)
    mine = assign_groups(groups, num_shards=num_shards, n_blocks=s.n_blocks, n_cands=len(s.cands))[shard]
    ckpt = Checkpoints(work_dir, s.settings)
    kls, todo = {}, {}
    for g in mine:
        done = ckpt.load(g)
        if done is not None and all(t.path in done for t in groups[g]):
            kls.update(done)
        else:
            todo[g] = groups[g]
    method = s.settings["method"]
    first = {"fisher": "one backward pass for the estimate", "exact": "timing one forward for the ETA"}
    log.info(
        "sensitivity (%s): %d of %d groups to compute (%d resumed), %d candidates each; %s",
        method, len(todo), len(mine), len(mine) - len(todo), len(s.cands),
        first.get(method, "one forward per sample and probe"),
    )  # fmt: skip
    _compute(s, todo, ckpt, kls, batch_size=batch_size, ref_cache_mb=ref_cache_mb, stop_after=stop_after)
    return kls, todo, mine, ckpt


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


# ---------------------------------------------------------------- candidates beyond RTN


@dataclass(frozen=True)
class Rich:
    """sensitivity.candidates: the settings beyond RTN, the probes' budget and where their
    roundings are kept (:mod:`mlxbun.quant.quantize.cache`)."""

    group_sizes: list[int]
    methods: list[str]
    modes: list[str]
    budget_bpw: float | None = None
    budget_bytes: int | None = None
    out_dtype: str | None = "bfloat16"
    rounded: Path | None = None
    threads: int = 1

    def key(self, hessians: str | Path | None) -> str:
        """The work directory's key: the settings the scores depend on, and the Hessians given."""
        h = None if hessians is None else shard_sha256(Path(hessians), cache_dir=None)
        parts = {"group_sizes": self.group_sizes, "methods": self.methods, "modes": self.modes, "hessians": h}
        return job_key("candidates", rich_candidates.VERSION, parts | {"version": rich_candidates.VERSION})


class Stages:
    """The candidates' stages under one work directory: each written once whole (atomically), so a
    rerun resumes from the last one done."""

    def __init__(self, root: Path) -> None:
        self.dir = root
        root.mkdir(parents=True, exist_ok=True)

    def read(self, name: str) -> dict[str, Any] | None:
        p = self.dir / name
        return json.loads(p.read_text()) if p.is_file() else None

    def write(self, name: str, doc: dict[str, Any]) -> None:
        atomic_write_json(self.dir / name, doc)


def extend(
    s: Setup,
    kls: dict,
    rich: Rich,
    *,
    model_dir: Path,
    hessians: str | Path | None,
    calib: dict,
    ckpt: Checkpoints,
) -> tuple[dict[str, dict[str, float]], dict[str, Any]]:
    """sensitivity.json's "kl" of every module (``kls``: the measured RTN bits) with every
    candidate added (scored from the input Hessians, captured here when none are given), corrected
    by the probes at the budget when there is one; and the "candidates" record."""
    stages = Stages(ckpt.dir / "candidates" / rich.key(hessians))
    group, mode = s.cands[0].group_size, s.cands[0].mode
    bits = sorted({int(k) for kl in kls.values() for k in kl})
    specs = rich_candidates.settings(
        bits, group_sizes=[group, *rich.group_sizes], methods=["rtn", *rich.methods], modes=rich.modes
    )
    seconds: dict[str, float] = {}
    hessians = _hessians(stages, hessians, model_dir, calib, seconds)
    keys = _Keys(group, mode, stages.dir)
    scored = _scores(stages, s, keys, kls, specs, hessians, rich.threads, seconds)
    out, probes = scored["kl"], []
    if rich.budget_bpw is not None or rich.budget_bytes is not None:
        out, probes = _probes(stages, s, keys, scored["kl"], rich, model_dir, hessians, seconds)
    record = {
        "group_sizes": sorted({group, *rich.group_sizes}),
        "methods": sorted({"rtn", *rich.methods}),
        "modes": sorted(rich.modes),
        "settings": len(specs),
        "hessians": str(hessians),
        "gptq": f"closed form scaled by one exact GPTQ per module and bits at group {rich_candidates.ANCHOR_GROUP}",
        "rows": f"a weight of over {rich_candidates.SCORE_WEIGHTS} weights: a fixed sample of its rows"
        f" (at least {rich_candidates.MIN_SCORE_ROWS})",
        "probes": probes,
        "probe_budget": {"bpw": rich.budget_bpw, "bytes": rich.budget_bytes},
        "seconds": seconds,  # the stages computed by this run (the others were cached)
    }
    return out, record


@dataclass(frozen=True)
class _Keys:
    """sensitivity.json's setting keys ("affine:3:64:gptq") and back, for one sweep."""

    group: int
    mode: str
    source: Path

    def keyed(self, values: dict[str, dict[QuantSpec, float]]) -> dict[str, dict[str, float]]:
        return {
            p: {setting_key(s, group=self.group, mode=self.mode): v for s, v in kl.items()}
            for p, kl in values.items()
        }

    def specced(self, values: dict[str, dict[str, float]]) -> dict[str, dict[QuantSpec, float]]:
        return {
            p: {
                parse_setting_key(k, group=self.group, mode=self.mode, source=str(self.source)): v
                for k, v in kl.items()
            }
            for p, kl in values.items()
        }


def _hessians(
    stages: Stages, hessians: str | Path | None, model_dir: Path, calib: dict, seconds: dict
) -> Path:
    """The input Hessians given, or captured on the calibration (``command=calibrate``'s capture)."""
    if hessians is not None:
        return Path(hessians)
    path = stages.dir / HESSIANS_NAME
    if not path.is_file():
        log.info("sensitivity.candidates: capturing input Hessians on the calibration text")
        done = calibrate.calibrate(
            model_dir=model_dir, out_dir=stages.dir, calib_path=calib.get("path"), samples=calib["samples"],
            seq_len=calib["seq_len"], seed=calib["seed"],
        )  # fmt: skip
        seconds["hessians"] = round(done.seconds, 3)
    return path


def _scores(
    stages: Stages, s: Setup, keys: _Keys, kls: dict, specs: list, hessians: Path, threads: int, seconds: dict
) -> dict[str, Any]:
    """Every module's candidates' KL before correction (scored.json); the modules finished before a
    kill are kept every SAVE_EVERY seconds (scored.partial.json) and not scored again."""
    scored = stages.read("scored.json")
    if scored is not None:
        return scored
    t0 = time.monotonic()
    part = stages.read("scored.partial.json") or {"kl": {}, "gptq_scales": {}, "seconds": 0.0}
    saved = [time.monotonic()]
    progress = Progress(total=len(kls), unit="modules", desc="sensitivity (candidates)", heartbeat=True)
    progress.update(len(part["kl"]))

    def keep(path: str, kl: dict[QuantSpec, float], scales: dict[str, float]) -> None:
        part["kl"] |= keys.keyed({path: kl})
        part["gptq_scales"][path] = scales
        progress.update(1)
        if time.monotonic() - saved[0] >= rich_candidates.SAVE_EVERY:
            stages.write("scored.partial.json", part | {"seconds": part["seconds"] + time.monotonic() - t0})
            saved[0] = time.monotonic()

    try:
        rich_candidates.score(
            weight=s.weight, targets=s.targets, hessians=Hessians(hessians), measured=keys.specced(kls), specs=specs,
            base_group=keys.group, done=set(part["kl"]), on_module=keep, threads=threads,
        )  # fmt: skip
    finally:
        progress.close()
    scored = part | {"seconds": round(part["seconds"] + time.monotonic() - t0, 3)}
    stages.write("scored.json", scored)
    (stages.dir / "scored.partial.json").unlink(missing_ok=True)
    seconds["score"] = scored["seconds"]
    return scored


def _probes(
    stages: Stages,
    s: Setup,
    keys: _Keys,
    kl: dict,
    rich: Rich,
    model_dir: Path,
    hessians: Path,
    seconds: dict,
) -> tuple[dict[str, dict[str, float]], list[dict[str, Any]]]:
    """The scores corrected by whole-model probes around the plan at the budget
    (:func:`mlxbun.quant.sensitivity.candidates.corrected`), kept per budget and dtype."""
    budget = f"{rich.budget_bpw}bpw" if rich.budget_bpw is not None else f"{rich.budget_bytes}B"
    name = f"corrected-v{check.VERSION}-{rich.out_dtype}-{budget}.json"
    done = stages.read(name)
    if done is None:
        t0 = time.monotonic()
        values = keys.specced(kl)

        def plan(estimates: dict) -> dict:
            sens = Sensitivity({p: LayerSensitivity(p, 0, v) for p, v in estimates.items()})
            return allocation.allocate(
                sens, model_dir=model_dir, budget_bpw=rich.budget_bpw, budget_bytes=rich.budget_bytes,
                out_dtype=rich.out_dtype,
            ).layers  # fmt: skip

        fixed, probes = rich_candidates.corrected(
            values, plan, stream=s.stream or Stream(model_dir), hessians=hessians, tokens=s.tokens,
            out_dtype=rich.out_dtype, rounded=rich.rounded,
        )  # fmt: skip
        done = {"kl": keys.keyed(fixed), "probes": probes, "seconds": round(time.monotonic() - t0, 3)}
        stages.write(name, done)
        seconds["probes"] = done["seconds"]
    return done["kl"], done["probes"]


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
    bpw, nbytes = a.budget_bpw, a.budget_bytes
    if bpw is None and nbytes is None:
        bpw = rich_candidates.PROBE_BPW
    rich = Rich(
        group_sizes=sorted(c.group_sizes), methods=sorted(c.methods), modes=sorted(c.modes),
        budget_bpw=bpw if c.correct else None, budget_bytes=nbytes if c.correct else None,
        out_dtype=cfg.quant.dtype, rounded=expand(cfg.paths.cache) / "rounded",
        threads=quantize.default_threads() if cfg.quant.threads is None else cfg.quant.threads,
    )  # fmt: skip
    return {"rich": rich, "hessians": hessians}
