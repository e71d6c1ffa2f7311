"""command=quantize: stream a Hugging Face checkpoint to a quantized MLX model, module by module.

Run: ``python -m mlxbun command=quantize model.name=<dir|name|org/repo> quant.bits=4``.
Output tensors, their order, shard packing and config.json match ``mlx_lm convert`` for the
same settings (see :mod:`mlxbun.quant.skeleton` for how the structure is derived); memory stays at
a few modules in flight, whatever the model or shard size: the writer is told every output
tensor in advance (:meth:`mlxbun.quant.quantize.convert.Converter.planned`) and writes each one as it
comes. Tensors come through :mod:`mlxbun.source.model`: files, or (``model.synthetic=true``) generated in memory as they are read.
The stream of units and its thread pool are in :mod:`mlxbun.quant.quantize.stream`; the output's other
files and its record in :mod:`mlxbun.quant.quantize.outdir`. Each shard is hashed once, while it is
written (sha256 for the manifest, XXH3-128 for the record, in one pass); a resume trusts the
journal's digests of the shards it keeps.

On disk (the staging protocol of :mod:`mlxbun.io.staging`, kind "quantize")::

    .<out name>.partial-<key16>/          staging dir, beside <out> or in <paths.outputs>/.partial/
                                          for the default out, so that a re-run finds it; key:
                                          source identity, weight files' mtimes, settings
        .mlxbun-stage.json                stage marker (never published)
        .mlxbun-shards.json               ShardedWriter journal (completed shards, digests)
        .mlxbun-shard-0000k.safetensors   completed shards
    .<out name>.partial-<key16>.lock      flock held while a run works on it
    <out>/                                the staging dir, renamed when everything is written
        model.safetensors | model-0000i-of-0000N.safetensors, model.safetensors.index.json
        config.json, tokenizer files ...  and the record .mlxbun-quantize.json
                                          (:mod:`mlxbun.quant.quantize.outdir`); a later run reuses <out>
                                          only when settings, source and the source's bytes
                                          match and every file verifies
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxbun import registry
from mlxbun.errors import InputError
from mlxbun.io.atomic import atomic_write_json
from mlxbun.io.dtypes import OUTPUT_DTYPES as CONVERSION_DTYPES
from mlxbun.io.safetensors import INDEX_FILE
from mlxbun.io.shards import ShardedWriter
from mlxbun.io.staging import DIGEST, Stage, reached, read_json_object, stable_root, weights_written
from mlxbun.progress import Progress, human_bytes
from mlxbun.quant import awq, hessian, workers
from mlxbun.quant.plan import Plan, check_hessians, hessians_file, load_plan
from mlxbun.quant.quantize.cache import Rounded
from mlxbun.quant.quantize.convert import Converter, resolve_dtype
from mlxbun.quant.quantize.outdir import (
    FORMAT_VERSION,
    MARKER,
    fingerprint,
    reusable,
    source_content,
    source_identity,
    tokenizer_warning,
    write_record,
    write_side_files,
    written_files,
)
from mlxbun.quant.quantize.stream import Unit, plan_units, stream
from mlxbun.quant.skeleton import Skeleton, prepare
from mlxbun.quant.spec import QuantSpec, check_method
from mlxbun.runs.provenance import RunResult, prehash
from mlxbun.source import hub
from mlxbun.source.model import identity, lazy_weights, model_source, open_tensors, source_dir

__all__ = ["MARKER", "QuantizeResult", "quantize_model_dir", "run"]

log = logging.getLogger("mlxbun")


@dataclass(frozen=True)
class QuantizeResult:
    """What :func:`quantize_model_dir` produced."""

    out: Path
    files: list[str]
    quantization: dict[str, Any]
    source_bytes: int
    output_bytes: int
    seconds: float
    reused: bool = False
    # shard file name -> sha256, computed while the shard was written (empty when reused)
    digests: dict[str, str] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()  # e.g. no tokenizer: the output will not load in mlx_lm


# ------------------------------------------------------------------------------- settings


def default_threads() -> int:
    """One conversion thread per core this process may run on (its CPU affinity)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


# ------------------------------------------------------------------------------- the command


@dataclass(frozen=True)
class Written:
    """What the conversion wrote: source and output tensor bytes, and each shard's digests
    computed as the writer streamed it out (or kept from the journal of a resumed run)."""

    source_bytes: int
    output_bytes: int
    sha256: dict[str, str] = field(default_factory=dict)
    xxh3: dict[str, str] = field(default_factory=dict)


def _write_shards(
    sk: Skeleton,
    source: Any,
    partial: Path,
    *,
    dtype: str | None,
    shard_bytes: int,
    threads: int,
    method: str = "rtn",
    hessians: Mapping | None = None,
    rounded: Any = None,
) -> Written:
    """Stream every unit into the ShardedWriter in ``partial``."""
    units = plan_units(sk)
    total = sum(u.nbytes for u in units)
    written = 0
    with ExitStack() as stack:
        tensors = stack.enter_context(open_tensors(source))
        fold = _awq_fold(sk, tensors, hessians) if method == "awq" else None
        h_file = getattr(hessians, "path", None)
        if fold is not None:
            hessians = fold.hessians(hessians or {})
        convert = Converter(sk, tensors, dtype, method, hessians, fold, hessians_file=h_file, rounded=rounded)
        rounds = _to_round(convert, units)
        # weights clip or GPTQ round (source bytes / 2): a big model's go to worker processes
        convert.pool = stack.enter_context(workers.pool(threads=threads, weights=sum(rounds.values()) // 2))
        writer = ShardedWriter(
            partial,
            shard_bytes=shard_bytes,
            resume=True,
            quantization=sk.quantization,
            checksum="sha256",
            extra_digests=(DIGEST,),
            verify=False,  # kept shards: size, mtime and header; the record's digests catch the rest
            tensors=convert.planned(units),  # each tensor written as it comes: no shard is held
        )
        with writer:
            todo = [u for u in units if not set(u.outputs) <= writer.done_names]
            progress = _progress(partial, units, todo, rounds)
            for unit, results in stream(todo, convert, threads=threads):
                for name, arr in results:
                    written += arr.nbytes
                    writer.add(name, arr)
                del results
                progress.update(unit.nbytes, work=rounds.get(unit.path, 0))
            layout = writer.finish()
            progress.close()
    if not layout.index_written:  # mlx-lm writes the index for a single shard too
        atomic_write_json(partial / INDEX_FILE, layout.index)
    mx.clear_cache()
    if convert.rounded is not None and (convert.rounded.hits or convert.rounded.misses):
        log.info(
            "quantize: %d rounded module(s) read back from %s, %d rounded here",
            convert.rounded.hits, convert.rounded.dir, convert.rounded.misses,
        )  # fmt: skip
    xxh3 = {n: d[DIGEST] for n, d in layout.extra_digests.items() if DIGEST in d}
    return Written(total, layout.total_size or written, layout.digests, xxh3)


def _to_round(convert: Converter, units: list[Unit]) -> dict[str, int]:
    """The modules this run clips or GPTQ-rounds itself: path -> source bytes. Not those whose
    rounding at their setting is kept (the probes' of a ``+recipe=best`` run): those are read
    back in a moment, and weighing them as roundings read 3.6x the time left at 0.5B's shapes."""
    varied = [u for u in units if u.quant is not None and convert.varies(u.quant, u.path)]
    # the kept files' headers are read only when some module is rounded at all (not for RTN)
    kept = convert.rounded.kept() if convert.rounded is not None and varied else set()
    return {
        u.path: u.nbytes
        for u in varied
        if (u.path, convert.method_of(u.path), u.quant["bits"], u.quant["group_size"]) not in kept
    }


def _progress(partial: Path, units: list[Unit], todo: list[Unit], rounds: dict[str, int]) -> Progress:
    """Progress over the units still to convert, in bytes, with the bytes of the modules rounded
    here (``rounds``) as its work: a module's rounding costs many times its reading and writing.
    A resumed run's rate and ETA count only the bytes this run converts."""
    left = sum(u.nbytes for u in todo)
    work = sum(rounds.get(u.path, 0) for u in todo)
    if len(todo) < len(units):
        kept = sum(u.nbytes for u in units) - left
        log.info(
            "quantize: resuming %s, %d of %d units (%s of source) already written",
            partial,
            len(units) - len(todo),
            len(units),
            human_bytes(kept),
        )
    return Progress(total=left, unit="B", desc="quantize", work_total=work or None)


def _awq_fold(sk: Skeleton, tensors: Any, hessians: Mapping | None) -> Any:
    """Activation-aware scales for this conversion (:mod:`mlxbun.quant.awq`), searched before streaming."""

    def read(name: str) -> Any:
        src = sk.sources.get(name)
        if src is not None:
            return tensors.array(src)
        mx.eval(sk.weights[name])
        return sk.weights[name]

    names = set(sk.weights)
    return awq.search(
        names=names, config=sk.config, read=read, hessians=hessians or {}, quant=sk.decisions.get
    )


def quantize_model_dir(
    src: str | Path | Any,
    out: str | Path,
    *,
    mode: str = "affine",
    bits: int | None = None,
    group_size: int | None = None,
    plan: Plan | str | Path | None = None,
    mixed: str | None = None,
    dtype: str | None = None,
    shard_bytes: int = 5 << 30,
    resume: bool = True,
    threads: int | None = None,
    partial_root: str | Path | None = None,
    method: str = "rtn",
    hessians: str | Path | None = None,
    rounded: str | Path | None = None,
    digests: str | Path | None = None,
) -> QuantizeResult:
    """Quantize the HF model in ``src`` into an mlx-lm-loadable directory ``out``.

    Args:
        src: model directory with config.json and model*.safetensors, or a
            :class:`mlxbun.synth.values.SyntheticSource` (tensors generated as they are read).
        out: output directory; must not exist (unless it is this same conversion, then reused).
        mode, bits, group_size: uniform setting, mlx-lm's per-mode defaults for None.
        plan: a :class:`Plan` or plan.json path (overrides mode/bits/group_size).
        mixed: one of mlx-lm's mixed rules (``mixed_3_6`` ...), affine only.
        dtype: dtype of non-quantized tensors; None follows config.json like mlx-lm.
        shard_bytes: ceiling of tensor bytes per output shard (mlx-lm: 5 << 30).
        resume: continue a killed run of the same conversion from its last complete shard.
        threads: modules converted in parallel (None: one per core this process may use).
        partial_root: where the hidden partial directory lives (default: beside ``out``).
        method: how affine weights are rounded (:mod:`mlxbun.quant.rounding`); "rtn" is mx.quantize.
        hessians: a :mod:`mlxbun.quant.hessian` file; "gptq" and "awq" need it, "clip" weights
            columns by it.
        rounded: where clip and GPTQ roundings with these Hessians are kept and read back
            (:mod:`mlxbun.quant.quantize.cache`; command=quantize: ``<paths.cache>/rounded``); None: not kept.
        digests: where the source shards' sha256 are remembered per file identity, for the
            content identity a reuse of ``out`` checks (command=quantize: ``<paths.cache>/digests``);
            None reads the whole source each time ``out`` is reused or written.

    Example:
        >>> r = quantize_model_dir("hf/llama", "llama-4bit", bits=4, group_size=64)
        >>> r.files
        ['model.safetensors']
    """
    t0 = time.monotonic()
    conv = Conversion.prepare(
        src, mode=mode, bits=bits, group_size=group_size, plan=plan, mixed=mixed, dtype=dtype,
        shard_bytes=shard_bytes, method=method, hessians=hessians, digests=digests,
    )  # fmt: skip
    threads = default_threads() if threads is None else threads
    out = Path(out).expanduser().resolve()
    return conv.write(out, resume=resume, threads=threads, partial_root=partial_root, rounded=rounded, t0=t0)


@dataclass(frozen=True)
class Conversion:
    """A conversion checked and planned, before anything is written: the source, its skeleton
    quantized by the settings, and the key that names this conversion (what a resume or a reuse
    must match)."""

    source: Any
    src: Path
    sk: Skeleton
    dtype: str | None
    shard_bytes: int
    method: str
    hessians: Path | None
    settings: dict[str, Any]
    identity: dict[str, Any]
    key: str
    digests: Path | None = None

    @functools.cached_property
    def content(self) -> str:
        """The source's content identity (:func:`source_content`): computed once, when a reuse is
        checked or the record written (by then a command's prehash of the same shards is done)."""
        tensors = None if isinstance(self.source, (str, Path)) else identity(self.source)
        return source_content(self.src, tensors, cache_dir=self.digests)

    @classmethod
    def prepare(
        cls,
        source: Any,
        *,
        mode: str,
        bits: int | None,
        group_size: int | None,
        plan: Plan | str | Path | None,
        mixed: str | None,
        dtype: str | None,
        shard_bytes: int,
        method: str,
        hessians: str | Path | None,
        digests: str | Path | None = None,
    ) -> Conversion:
        """Check every input (InputError naming the first bad one) and build the skeleton."""
        if dtype is not None and dtype not in CONVERSION_DTYPES:
            raise InputError(
                f"quant.dtype={dtype!r} is not allowed; choose one of {', '.join(CONVERSION_DTYPES)}"
            )
        check_method(method)
        hessians = None if hessians is None else hessians_file(hessians)
        if plan is not None and not isinstance(plan, Plan):
            plan = load_plan(plan)
        check_hessians(method, plan, hessians)
        src = source_dir(source)
        sk, spec = prepare(
            src,
            mode=mode,
            bits=bits,
            group_size=group_size,
            plan=plan,
            mixed=mixed,
            weights=lazy_weights(source),
        )
        if hessians is not None:
            _check_hessian_shapes(sk, hessians)
            _check_hessian_model(hessians, source)
        dtype = resolve_dtype(dtype, sk.config)
        settings = _settings(spec, plan, mixed, dtype, shard_bytes)
        tensors = None if isinstance(source, (str, Path)) else identity(source)
        identity_doc = {
            "format": FORMAT_VERSION,
            "settings": settings,
            "source": source_identity(src, tensors),
        }
        if method != "rtn":  # absent by default, so existing fingerprints stay as they were
            settings["method"] = method
        if hessians is not None:
            with open(hessians, "rb") as f:  # streamed: a Hessians file can be larger than the model
                settings["hessians"] = hashlib.file_digest(f, "sha256").hexdigest()
        key = fingerprint(src, settings, tensors=tensors)
        cache = None if digests is None else Path(digests).expanduser()
        return cls(source, src, sk, dtype, shard_bytes, method, hessians, settings, identity_doc, key, cache)

    def write(
        self,
        out: Path,
        *,
        resume: bool,
        threads: int,
        partial_root: str | Path | None,
        rounded: Any,
        t0: float,
    ) -> QuantizeResult:
        """Convert into ``out`` through a staging directory, or reuse ``out`` when it already holds
        this conversion; two runs of the same conversion: the second waits, then reuses."""
        with Stage.locked(
            out, kind="quantize", key=self.key, root=partial_root, setting="quant.out"
        ) as stage:
            if (done := reusable(out, self.identity, lambda: self.content)) is not None:
                return QuantizeResult(
                    out, done[1], done[0], 0, 0, 0.0, reused=True, warnings=_warnings(self.src)
                )
            stage.claim(resume=resume)
            state = "complete" if weights_written(stage.dir) else "writing"
            kept = None
            if rounded is not None and self.hessians is not None:
                kept = Rounded(rounded, self.settings["hessians"])
            w = _convert(
                self.sk, self.source, stage.dir, state, dtype=self.dtype, shard_bytes=self.shard_bytes,
                threads=threads, method=self.method, hessians=self.hessians, rounded=kept,
            )  # fmt: skip
            reached("weights")
            write_side_files(self.sk, self.src, stage.dir)
            write_record(stage.dir, self.identity, self.sk.quantization, content=self.content, known=w.xxh3)
            stage.publish()
        files = sorted(p.name for p in out.glob("model*.safetensors"))
        q, seconds = self.sk.quantization or {}, time.monotonic() - t0
        return QuantizeResult(
            out,
            files,
            q,
            w.source_bytes,
            w.output_bytes,
            seconds,
            digests=w.sha256,
            warnings=_warnings(self.src),
        )


def _warnings(src: Path) -> tuple[str, ...]:
    """What makes the output less than a stock mlx-lm model, each logged once."""
    found = tuple(w for w in (tokenizer_warning(src),) if w is not None)
    for w in found:
        log.warning("quantize: %s", w)
    return found


def _check_hessian_shapes(sk: Skeleton, path: str | Path) -> None:
    """Before any work: the file is a Hessians file whose every H fits its module's inputs."""
    in_features = {n[: -len(".weight")]: w.shape[-1] for n, w in sk.weights.items() if n.endswith(".weight")}
    h = hessian.Hessians(path)
    try:
        h.check_shapes(in_features)
    finally:
        h.file.close()


def _check_hessian_model(path: Path, source: Any) -> None:
    """Before any work: the Hessians were captured on this model (the fingerprint calibrate
    recorded), or say that only their shapes could be checked."""
    if not isinstance(source, (str, Path)):
        log.warning(
            "quantize: a synthetic source has no files to fingerprint; %s is checked by shapes only", path
        )
    elif not hessian.check_model(path, source_dir(source)):
        log.warning("quantize: %s records no model (not written by calibrate); checked by shapes only", path)


def _convert(
    sk: Skeleton,
    source: Any,
    partial: Path,
    state: str,
    *,
    dtype: str | None,
    shard_bytes: int,
    threads: int,
    method: str = "rtn",
    hessians: str | Path | None = None,
    rounded: Any = None,
) -> Written:
    """Write the shards unless a killed run already did (``state="complete"``)."""
    if state == "complete":
        src_bytes = sum(v.nbytes for v in sk.weights.values())
        return Written(src_bytes, sum(p.stat().st_size for p in partial.glob("model*.safetensors")))
    previous = mx.set_cache_limit(128 << 20)  # freed buffers go back to the OS, not a cache
    try:
        # numpy, read one module at a time: MLX arrays cannot be evaluated on the worker threads
        h = hessian.Hessians(hessians) if hessians is not None else None
        sizes = _write_shards(
            sk,
            source,
            partial,
            dtype=dtype,
            shard_bytes=shard_bytes,
            threads=threads,
            method=method,
            hessians=h,
            rounded=rounded,
        )
    finally:
        mx.set_cache_limit(previous)
    return sizes


def _settings(
    spec: QuantSpec, plan: Plan | None, mixed: str | None, dtype: str | None, shard_bytes: int
) -> dict[str, Any]:
    return {
        "default": spec.to_dict(),
        "plan": plan.to_dict() if plan is not None else None,
        "mixed": mixed,
        "dtype": dtype,
        "shard_bytes": shard_bytes,
    }


def run(cfg: Any) -> Any:
    """command=quantize: unpack ``cfg`` into :func:`quantize_model_dir`; register the output."""
    q = cfg.quant
    source = model_source(cfg)
    src = source_dir(source)
    out = Path(q.out).expanduser() if q.out else Path(cfg.paths.run_dir) / "model"
    partial_root = None if q.out else stable_root(cfg.paths.outputs, out)
    # The manifest's input digests: free in the HF cache, else hashed while the conversion runs.
    digests = Path(cfg.paths.cache).expanduser() / "digests"
    inputs = prehash([src], cache_dir=digests)
    res = quantize_model_dir(
        source,
        out,
        mode=q.mode,
        bits=q.bits,
        group_size=q.group_size,
        plan=q.plan,
        mixed=q.mixed,
        dtype=q.dtype,
        shard_bytes=cfg.io.shard_bytes,
        resume=q.resume,
        threads=q.threads,
        partial_root=partial_root,
        method=q.method,
        hessians=q.hessians,
        rounded=Path(cfg.paths.cache).expanduser() / "rounded",
        digests=digests,
    )
    _register(cfg, res.out, res.quantization)
    rate = res.source_bytes / res.seconds / 1e9 if res.seconds else 0.0
    metrics = {
        "source_bytes": res.source_bytes,
        "output_bytes": res.output_bytes,
        "seconds": round(res.seconds, 3),
        "gb_per_s": round(rate, 3),
        "shards": len(res.files),
        "reused": res.reused,
        "threads": q.threads or default_threads(),
    }
    if res.warnings:
        metrics["warnings"] = list(res.warnings)
    verb = "reused" if res.reused else f"wrote {human_bytes(res.output_bytes)} in {res.seconds:.1f}s"
    name = f"synthetic {cfg.synth.arch} {cfg.synth.preset}" if cfg.model.synthetic else src.name
    return RunResult(
        outputs=[res.out],
        inputs=[src],
        metrics=metrics,
        message=f"quantized {name} -> {res.out} ({verb}, {len(res.files)} shard(s))",
        provides={"model.name": str(res.out)},
        digests={**inputs.result(), **{res.out / f: d for f, d in res.digests.items()}},
        written=written_files(res.out),
    )


def registry_name(cfg: Any, quantization: dict[str, Any]) -> str:
    """A name later recipes can use: ``<source>-<setting>``, e.g. ``Qwen3-4B-4bit-g64`` or
    ``llama-text-3m-mixed-4.50bpw``."""
    q = cfg.quant
    if cfg.model.synthetic:
        base = f"synth-{cfg.synth.arch}-{cfg.synth.preset}"
    else:
        base = source_name(str(cfg.model.name))
    if q.plan or q.mixed:
        tag = q.mixed or plan_tag(Path(q.plan))
    elif quantization.get("mode", "affine") == "affine":
        tag = f"{quantization.get('bits')}bit-g{quantization.get('group_size')}"
    else:
        tag = quantization["mode"]
    return f"{base}-{tag}"


def source_name(name: str) -> str:
    """A readable name of ``model.name``: a repo id's or directory's last part; a hub snapshot's
    repo name (not its revision); for an mlxbun output directory (``.../model``) the name the
    registry knows it by, else its config's model_type."""
    path = Path(name).expanduser()
    if not path.is_dir():
        return name.rstrip("/").rpartition("/")[2]
    path = path.resolve()
    if path.parent.name == "snapshots" and (repo := hub.repo_id_of(path.parent.parent.name)):
        return repo.rpartition("/")[2]
    if path.name != "model":
        return path.name
    known = registry.ModelRecord.get_or_none(registry.ModelRecord.path == str(path))
    if known is not None and known.name != "model":
        return known.name
    config = read_json_object(path / "config.json") or {}
    return str(config.get("model_type") or path.parent.name)


def plan_tag(plan: Path) -> str:
    """``mixed-4.50bpw`` for a plan ``allocate`` wrote (its predicted bits per weight), else
    ``plan-<file name>`` (``plan`` alone for a file named plan.json)."""
    bpw = (read_json_object(plan) or {}).get("predicted_bpw")
    if isinstance(bpw, (int, float)) and not isinstance(bpw, bool):
        return f"mixed-{bpw:.2f}bpw"
    return "plan" if plan.stem == "plan" else f"plan-{plan.stem}"


def _register(cfg: Any, path: Path, quantization: dict[str, Any]) -> None:
    registry.open_db(url=cfg.registry.url, path=cfg.registry.path)
    registry.register_model(path, name=registry_name(cfg, quantization))
