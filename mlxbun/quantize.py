"""command=quantize: stream a Hugging Face checkpoint to a quantized MLX model, module by module.

Run: ``python -m mlxbun command=quantize model.name=<dir|name|org/repo> quant.bits=4``.
Output tensors, their order, shard packing and config.json match ``mlx_lm convert`` for the
same settings (see :mod:`mlxbun.quant.plan` for how the structure is derived); memory stays at
about one shard plus a few modules in flight, whatever the model size. Tensors come through
:mod:`mlxbun.source`: files, or (``model.synthetic=true``) generated in memory as they are read.
Each shard's sha256 is computed while it is written and handed to the manifest.

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
        config.json                       with "quantization" and "quantization_config"
        tokenizer files, generation_config.json, *.py   copied from the source
        .mlxbun-quantize.json             record: {"format", "settings", "source" (a digest of
                                          config.json, file sizes and safetensors headers: no
                                          paths, no mtimes), "quantization", "files": {name:
                                          {"xxh3_128", "size"}}}; a later run reuses <out> only
                                          when settings and source match and every file verifies
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxbun.errors import InputError
from mlxbun.io.atomic import atomic_write_bytes, atomic_write_json, fsync_dir
from mlxbun.io.dtypes import OUTPUT_DTYPES as CONVERSION_DTYPES
from mlxbun.io.staging import (
    Stage,
    damaged_files,
    digest_files,
    discard_dir,
    reached,
    read_json_object,
    stable_root,
    weights_written,
)
from mlxbun.progress import Progress
from mlxbun.quant.plan import Skeleton, prepare
from mlxbun.quant.spec import Plan, QuantSpec, load_plan

log = logging.getLogger("mlxbun")

MARKER = ".mlxbun-quantize.json"
FORMAT_VERSION = 2  # of the record; 2: no paths, digests of every file
# Files mlx-lm's output carries besides weights and config (its tokenizer save + copies).
COPY_PATTERNS = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "*.tiktoken",
    "tiktoken.model",
    "generation_config.json",
    "*.py",
)
# Plain Linear/Embedding weights larger than this are read and quantized in row blocks of
# CHUNK_BYTES (quantization groups never cross a row, so the bytes are the same).
BIG_TENSOR = 128 << 20
CHUNK_BYTES = 32 << 20
_build_lock = threading.Lock()  # to_quantized draws from MLX's global PRNG: build graphs one at a time


@dataclass(frozen=True)
class Unit:
    """One step of the stream: a quantized module (its weight, bias...) or one plain tensor."""

    path: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    quant: dict[str, Any] | None
    nbytes: int


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


# ------------------------------------------------------------------------------- settings


def resolve_dtype(dtype: str | None, config: dict[str, Any]) -> str | None:
    """mlx-lm's dtype rule: the given one, else config ``torch_dtype``, else text_config ``dtype``."""
    if dtype is None:
        dtype = config.get("torch_dtype")
    if dtype is None and (text := config.get("text_config")):
        dtype = text.get("dtype")
    if dtype is not None and dtype not in CONVERSION_DTYPES:
        return None  # mlx-lm leaves the weights' own dtype for anything else
    return dtype


def source_identity(src: Path, tensors: str | None = None) -> str:
    """Digest of what defines the source and is the same in every copy of it: config.json, and
    each weight file's name, size and safetensors header (or bytes, for the index) — or, for a
    synthetic source, its spec's identity (``mlxbun.source.identity``)."""
    h = hashlib.sha256((src / "config.json").read_bytes())
    if tensors is not None:
        h.update(tensors.encode())
        return h.hexdigest()
    for f in sorted(src.glob("model*.safetensors*")):
        h.update(f"\n{f.name}:{f.stat().st_size}\n".encode())
        h.update(_safetensors_header(f) if f.suffix == ".safetensors" else f.read_bytes())
    return h.hexdigest()


def _safetensors_header(path: Path) -> bytes:
    from mlxbun.io.safetensors import HEADER_CAP

    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return f.read(min(n, HEADER_CAP))


def fingerprint(src: Path, settings: dict[str, Any], *, tensors: str | None = None) -> str:
    """Key of a conversion's staging dir: source identity, the weight files' mtimes (a source
    rewritten in place is never resumed into), settings."""
    h = hashlib.sha256(source_identity(src, tensors).encode())
    for f in sorted(src.glob("model*.safetensors*")) if tensors is None else []:
        h.update(f"{f.name}:{f.stat().st_mtime_ns}\n".encode())
    h.update(json.dumps({"format": FORMAT_VERSION, **settings}, sort_keys=True).encode())
    return h.hexdigest()


def _read_record(d: Path) -> dict[str, Any] | None:
    return read_json_object(d / MARKER)


def default_threads() -> int:
    """One conversion thread per core this process may run on (its CPU affinity)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


# ------------------------------------------------------------------------------- units


def plan_units(sk: Skeleton) -> list[Unit]:
    """The stream in mlx-lm's save order: the quantized skeleton's parameters, grouped by module."""
    from mlx.utils import tree_flatten

    units: list[Unit] = []
    for name, _ in tree_flatten(sk.model.parameters()):
        owner = name.rpartition(".")[0]
        if owner in sk.decisions:
            if units and units[-1].path == owner:
                last = units[-1]
                units[-1] = Unit(last.path, last.inputs, (*last.outputs, name), last.quant, last.nbytes)
                continue
            inputs = tuple(f"{owner}.{k}" for k, _ in tree_flatten(sk.originals[owner].parameters()))
            nbytes = sum(sk.weights[k].nbytes for k in inputs)
            units.append(Unit(owner, inputs, (name,), sk.decisions[owner], nbytes))
        else:
            units.append(Unit(name, (name,), (name,), None, sk.weights[name].nbytes))
    return units


class Converter:
    """Reads, casts and quantizes units; safe to call from several threads (one unit each)."""

    def __init__(
        self, sk: Skeleton, tensors: Any, dtype: str | None, method: str = "rtn", hessians: dict | None = None
    ) -> None:
        """``tensors``: the source's tensor reader (``mlxbun.source``)."""
        import mlx.core as mx

        self.sk, self.src, self.method, self.hessians = sk, tensors, method, hessians or {}
        self.dtype = getattr(mx, dtype) if dtype else None
        self.cast_ok = getattr(sk.model, "cast_predicate", lambda _: True)

    def read(self, name: str) -> Any:
        import mlx.core as mx

        lazy = self.sk.weights.pop(name)
        src = self.sk.sources.get(name)
        if src is not None:
            return self.src.array(src)
        mx.eval(lazy)  # already evaluated by prefetch, on the thread that built it
        return lazy

    def prefetch(self, unit: Unit) -> None:
        """Evaluate tensors sanitize built from others (e.g. stacked experts) on this thread:
        MLX streams are per thread, so a graph built here cannot be evaluated by a worker."""
        import mlx.core as mx

        built = [self.sk.weights[n] for n in unit.inputs if n not in self.sk.sources]
        if built:
            mx.eval(built)

    def cast(self, name: str, a: Any) -> Any:
        import mlx.core as mx

        if self.dtype is not None and self.cast_ok(name) and mx.issubdtype(a.dtype, mx.floating):
            return a.astype(self.dtype)
        return a

    def chunkable(self, unit: Unit) -> bool:
        """A plain Linear/Embedding whose weight is big and stored as is in the source."""
        import mlx.nn as nn

        if unit.quant is None or type(self.sk.originals.get(unit.path)) not in (nn.Linear, nn.Embedding):
            return False
        name = f"{unit.path}.weight"
        return name in self.sk.sources and self.sk.weights[name].nbytes > BIG_TENSOR

    def step(self, name: str, width: int) -> int:
        """Rows per block of a big weight: about CHUNK_BYTES of f32, a multiple of the source's
        natural block (a synthetic tensor's RNG stream) when that is smaller."""
        step = max(1, CHUNK_BYTES // max(1, width * 4))
        natural = self.src.row_step(self.sk.sources[name])
        return max(natural, step - step % natural)

    def quantize_rows(self, unit: Unit) -> dict[str, Any]:
        """mx.quantize of a big weight, block of rows by block of rows.

        The packed weight (the bulk) is assembled in one preallocated uint32 numpy array, so
        memory holds the output once, not parts plus their concatenation.
        """
        import mlx.core as mx
        import numpy as np

        name, q = f"{unit.path}.weight", unit.quant
        rows, width = self.sk.weights.pop(name).shape
        step, src = self.step(name, width), self.sk.sources[name]
        packed: Any = None
        small: list[list[Any]] = []
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            chunk = self.cast(name, self.src.rows(src, r0, r1))
            w, *rest = self.quantize_weight(chunk, q, unit.path)
            mx.eval(w, *rest)
            if packed is None:
                packed = np.empty((rows, w.shape[1]), dtype=np.uint32)
            packed[r0:r1] = np.asarray(w)
            small.append(rest)
        keys = ("scales", "biases")[: len(small[0])]
        result = {f"{unit.path}.{k}": mx.concatenate([p[i] for p in small]) for i, k in enumerate(keys)}
        result[name] = packed
        for n in unit.inputs:
            if n != name:
                result[n] = self.cast(n, self.read(n))
        self.sk.originals.pop(unit.path)
        return result

    def __call__(self, unit: Unit) -> list[tuple[str, Any]]:
        from mlx.utils import tree_flatten, tree_unflatten

        if self.chunkable(unit):
            return self.finish(unit, self.quantize_rows(unit))
        arrays = {n: self.cast(n, self.read(n)) for n in unit.inputs}
        if unit.quant is None:
            out = arrays
        else:
            prefix = unit.path + "."
            module = self.sk.originals.pop(unit.path)
            with _build_lock:
                module.update(tree_unflatten([(n[len(prefix) :], a) for n, a in arrays.items()]))
                qm = module.to_quantized(**unit.quant)
            if self.varies(unit.quant, unit.path) and (w := arrays.get(prefix + "weight")) is not None:
                qm.weight, qm.scales, qm.biases = self.quantize_weight(w, unit.quant, unit.path)
            out = {prefix + k: v for k, v in tree_flatten(qm.parameters())}
            del module, qm
        del arrays
        return self.finish(unit, out)

    def method_of(self, path: str) -> str:
        """The module's rounding method: its plan entry's, else the run's ``quant.method``."""
        return self.sk.methods.get(path, self.method)

    def varies(self, q: dict[str, Any], path: str) -> bool:
        return self.method_of(path) != "rtn" and q.get("mode", "affine") == "affine"

    def quantize_weight(self, w: Any, q: dict[str, Any], path: str) -> tuple[Any, ...]:
        """The hook where a quantizer variant (``mlxbun.quant.rounding``) replaces mx.quantize."""
        import mlx.core as mx

        if not self.varies(q, path):
            return tuple(mx.quantize(w, q["group_size"], q["bits"], mode=q.get("mode", "affine")))
        from mlxbun.quant.rounding import quantize

        h = self.hessians.get(path)
        return quantize(w, bits=q["bits"], group_size=q["group_size"], method=self.method_of(path), hessian=h)

    def finish(self, unit: Unit, out: dict[str, Any]) -> list[tuple[str, Any]]:
        import mlx.core as mx

        mx.eval([v for v in out.values() if isinstance(v, mx.array)])
        if set(out) != set(unit.outputs):
            raise RuntimeError(f"{unit.path}: produced {sorted(out)}, expected {sorted(unit.outputs)}")
        return [(n, out[n]) for n in unit.outputs]


def stream(
    units: list[Unit], convert: Converter, *, threads: int
) -> Iterator[tuple[Unit, list[tuple[str, Any]]]]:
    """Convert units on ``threads`` workers, yielding results in order; at most threads+1 in flight."""
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="quantize") as pool:
        todo = iter(units)
        window: deque[tuple[Unit, Future]] = deque()
        try:
            for unit in todo:
                convert.prefetch(unit)
                window.append((unit, pool.submit(convert, unit)))
                if len(window) > threads:
                    break
            while window:
                unit, fut = window.popleft()
                nxt = next(todo, None)
                if nxt is not None:
                    convert.prefetch(nxt)
                    window.append((nxt, pool.submit(convert, nxt)))
                yield unit, fut.result()
        finally:
            for _, fut in window:
                fut.cancel()


# ------------------------------------------------------------------------------- output files


def config_text(sk: Skeleton) -> str:
    """config.json exactly as ``mlx_lm.utils.save_config`` writes it for this model."""
    from mlxbun.quant.mlxlm import encode_tagged_floats

    config = json.loads(json.dumps(sk.config))
    config["quantization"] = sk.quantization
    config.pop("_name_or_path", None)
    if "vision_tower" not in getattr(sk.model, "model", {}):
        config.pop("vision_config", None)
    config["quantization_config"] = config["quantization"]
    return json.dumps(encode_tagged_floats(dict(sorted(config.items()))), indent=4)


def copy_side_files(src: Path, dst: Path) -> list[str]:
    """Copy tokenizer, generation config and code files; each fsync'd."""
    copied = []
    for pattern in COPY_PATTERNS:
        for f in sorted(src.glob(pattern)):
            if f.is_file() and not (dst / f.name).exists():
                atomic_write_bytes(dst / f.name, f.read_bytes())
                copied.append(f.name)
    return copied


# ------------------------------------------------------------------------------- the command


def _reusable(out: Path, identity: dict[str, Any]) -> QuantizeResult | None:
    """The existing ``out`` if it is this conversion's intact output; None when there is no
    ``out``, or when it is ours but damaged (it is then discarded, to be converted again)."""
    if not out.exists():
        return None
    record = _read_record(out)
    if record is None or {k: record.get(k) for k in identity} != identity:
        raise InputError(
            f"quant.out={str(out)!r} already exists and is not this conversion's output; choose"
            " another quant.out or delete it"
        )
    bad = damaged_files(out, record.get("files") or {}) if record.get("files") else ["no digests recorded"]
    if bad:
        log.warning("quantize: %s is damaged (%s); converting again", out, "; ".join(bad[:3]))
        discard_dir(out)
        return None
    files = sorted(p.name for p in out.glob("model*.safetensors"))
    return QuantizeResult(out, files, record.get("quantization", {}), 0, 0, 0.0, reused=True)


def _write_record(d: Path, identity: dict[str, Any], quantization: dict[str, Any] | None) -> None:
    """The record that lets a later run recognise and verify this output (hidden, last file)."""
    record = {**identity, "quantization": quantization, "files": digest_files(d)}
    atomic_write_json(d / MARKER, record)


def _write_shards(
    sk: Skeleton,
    source: Any,
    partial: Path,
    *,
    dtype: str | None,
    shard_bytes: int,
    threads: int,
    method: str = "rtn",
    hessians: dict | None = None,
) -> tuple[int, int, dict[str, str]]:
    """Stream every unit into the ShardedWriter in ``partial``; return (source, output) bytes and
    each shard's sha256 (hashed as the writer streamed it out)."""
    import mlx.core as mx

    from mlxbun.io.safetensors import INDEX_FILE
    from mlxbun.io.shards import ShardedWriter
    from mlxbun.source import open_tensors

    units = plan_units(sk)
    total = sum(u.nbytes for u in units)
    written = 0
    with (
        open_tensors(source) as tensors,
        ShardedWriter(
            partial, shard_bytes=shard_bytes, resume=True, quantization=sk.quantization, checksum="sha256"
        ) as writer,
    ):
        todo = [u for u in units if not set(u.outputs) <= writer.done_names]
        if writer.done_names:
            log.info(
                "quantize: resuming %s, %d of %d units already written",
                partial,
                len(units) - len(todo),
                len(units),
            )
        progress = Progress(total=total, unit="B", desc="quantize")
        progress.update(total - sum(u.nbytes for u in todo))
        for unit, results in stream(todo, Converter(sk, tensors, dtype, method, hessians), threads=threads):
            for name, arr in results:
                written += arr.nbytes
                writer.add(name, arr)
            del results
            progress.update(unit.nbytes)
        layout = writer.finish()
        progress.close()
    if not layout.index_written:  # mlx-lm writes the index for a single shard too
        atomic_write_json(partial / INDEX_FILE, layout.index)
    mx.clear_cache()
    return total, layout.total_size or written, layout.digests


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
) -> QuantizeResult:
    """Quantize the HF model in ``src`` into an mlx-lm-loadable directory ``out``.

    Args:
        src: model directory with config.json and model*.safetensors, or a
            :class:`mlxbun.synth.SyntheticSource` (tensors generated as they are read).
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
        hessians: a :mod:`mlxbun.quant.hessian` file; "gptq" needs it, "clip" weights columns by it.

    Example:
        >>> r = quantize_model_dir("hf/llama", "llama-4bit", bits=4, group_size=64)
        >>> r.files
        ['model.safetensors']
    """
    from mlxbun.source import identity, lazy_weights, source_dir

    t0 = time.monotonic()
    out = Path(out).expanduser().resolve()
    threads = default_threads() if threads is None else threads
    if dtype is not None and dtype not in CONVERSION_DTYPES:
        raise InputError(
            f"quant.dtype={dtype!r} is not allowed; choose one of {', '.join(CONVERSION_DTYPES)}"
        )
    from mlxbun.quant.rounding import check_method

    check_method(method)
    if method == "gptq" and hessians is None:
        raise InputError("quant.method='gptq' needs quant.hessians (a hessians.safetensors file)")
    if plan is not None and not isinstance(plan, Plan):
        plan = load_plan(plan)
    source, src = src, source_dir(src)
    sk, spec = prepare(
        src, mode=mode, bits=bits, group_size=group_size, plan=plan, mixed=mixed, weights=lazy_weights(source)
    )
    if "gptq" in sk.methods.values() and hessians is None:
        raise InputError(
            f"quant.plan gives {next(p for p, m in sk.methods.items() if m == 'gptq')!r}"
            " method 'gptq', which needs quant.hessians (a hessians.safetensors file)"
        )
    dtype = resolve_dtype(dtype, sk.config)
    settings = _settings(spec, plan, mixed, dtype, shard_bytes)
    tensors = None if isinstance(source, (str, Path)) else identity(source)
    identity_doc = {"format": FORMAT_VERSION, "settings": settings, "source": source_identity(src, tensors)}
    if method != "rtn":  # absent by default, so existing fingerprints stay as they were
        settings["method"] = method
    if hessians is not None:
        settings["hessians"] = hashlib.sha256(Path(hessians).read_bytes()).hexdigest()
    key = fingerprint(src, settings, tensors=tensors)
    # Two runs of the same conversion: the second waits, then reuses the first one's output.
    with Stage.locked(out, kind="quantize", key=key, root=partial_root) as stage:
        if (done := _reusable(out, identity_doc)) is not None:
            return done
        stage.claim(resume=resume)
        state = "complete" if weights_written(stage.dir) else "writing"
        src_bytes, out_bytes, digests = _convert(
            sk, source, stage.dir, state, dtype=dtype, shard_bytes=shard_bytes, threads=threads, method=method,
            hessians=hessians,
        )  # fmt: skip
        reached("weights")
        _finish_files(sk, src, stage.dir)
        _write_record(stage.dir, identity_doc, sk.quantization)
        stage.publish()
    files = sorted(p.name for p in out.glob("model*.safetensors"))
    seconds = time.monotonic() - t0
    return QuantizeResult(out, files, sk.quantization or {}, src_bytes, out_bytes, seconds, digests=digests)


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
) -> tuple[int, int, dict[str, str]]:
    """Write the shards unless a killed run already did (``state="complete"``)."""
    import mlx.core as mx
    import numpy as np

    if state == "complete":
        src_bytes = sum(v.nbytes for v in sk.weights.values())
        return src_bytes, sum(p.stat().st_size for p in partial.glob("model*.safetensors")), {}
    previous = mx.set_cache_limit(128 << 20)  # freed buffers go back to the OS, not a cache
    try:
        from mlxbun.quant import hessian

        # numpy, read here: MLX arrays cannot be evaluated on the worker threads that use them
        h = {k: np.asarray(v) for k, v in hessian.load(hessians).items()} if hessians is not None else None
        sizes = _write_shards(
            sk,
            source,
            partial,
            dtype=dtype,
            shard_bytes=shard_bytes,
            threads=threads,
            method=method,
            hessians=h,
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


def _finish_files(sk: Skeleton, src: Path, partial: Path) -> None:
    atomic_write_bytes(partial / "config.json", config_text(sk).encode())
    copy_side_files(src, partial)
    fsync_dir(partial)


def run(cfg: Any) -> Any:
    """command=quantize: unpack ``cfg`` into :func:`quantize_model_dir`; register the output."""
    from mlxbun.progress import human_bytes
    from mlxbun.provenance import RunResult, prehash
    from mlxbun.source import model_source, source_dir

    q = cfg.quant
    source = model_source(cfg)
    src = source_dir(source)
    out = Path(q.out).expanduser() if q.out else Path(cfg.paths.run_dir) / "model"
    partial_root = None if q.out else stable_root(cfg.paths.outputs, out)
    # The manifest's input digests: free in the HF cache, else hashed while the conversion runs.
    inputs = prehash([src], cache_dir=Path(cfg.paths.cache).expanduser() / "digests")
    res = quantize_model_dir(
        source,
        out,
        mode=q.mode,
        bits=q.bits,
        group_size=q.group_size,
        plan=q.plan,
        mixed=q.mixed,
        dtype=q.dtype,
        shard_bytes=int(cfg.io.shard_gb * (1 << 30)),
        resume=q.resume,
        threads=q.threads,
        partial_root=partial_root,
        method=q.method,
        hessians=q.hessians,
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
    verb = "reused" if res.reused else f"wrote {human_bytes(res.output_bytes)} in {res.seconds:.1f}s"
    name = f"synthetic {cfg.synth.arch} {cfg.synth.preset}" if cfg.model.synthetic else src.name
    return RunResult(
        outputs=[res.out],
        inputs=[src],
        metrics=metrics,
        message=f"quantized {name} -> {res.out} ({verb}, {len(res.files)} shard(s))",
        provides={"model.name": str(res.out)},
        digests={**inputs.result(), **{res.out / f: d for f, d in res.digests.items()}},
    )


def registry_name(cfg: Any, quantization: dict[str, Any]) -> str:
    """A name later recipes can use: ``<source>-<setting>``, e.g. ``Qwen3-4B-4bit-g64``."""
    q = cfg.quant
    if cfg.model.synthetic:
        base = f"synth-{cfg.synth.arch}-{cfg.synth.preset}"
    else:
        base = str(cfg.model.name).rstrip("/").rpartition("/")[2]
    if q.plan or q.mixed:
        tag = q.mixed or f"plan-{Path(q.plan).stem}"
    elif quantization.get("mode", "affine") == "affine":
        tag = f"{quantization.get('bits')}bit-g{quantization.get('group_size')}"
    else:
        tag = quantization["mode"]
    return f"{base}-{tag}"


def _register(cfg: Any, path: Path, quantization: dict[str, Any]) -> None:
    from mlxbun import registry

    if hasattr(registry, "register_model"):
        registry.open_db(url=cfg.registry.url, path=cfg.registry.path)
        registry.register_model(path, name=registry_name(cfg, quantization))
