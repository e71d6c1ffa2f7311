"""command=quantize: stream a Hugging Face checkpoint to a quantized MLX model, module by module.

Run: ``python -m mlxbun command=quantize model.name=<dir|name|org/repo> quant.bits=4``.
Output tensors, their order, shard packing and config.json match ``mlx_lm convert`` for the
same settings (see :mod:`mlxbun.quant.plan` for how the structure is derived); memory stays at
about one shard plus a few modules in flight, whatever the model size.

On disk::

    .<out name>.partial-<fp16>/           hidden; beside <out>, or in <paths.outputs>/.partial/
                                          for the default out, so that a re-run finds it
        .mlxbun-quantize.json             marker: fingerprint of source + settings, state
        .mlxbun-shards.json               ShardedWriter journal (completed shards, digests)
        .mlxbun-shard-0000k.safetensors   completed shards
    .<out name>.partial-<fp16>.lock       flock held while a run works on it
    <out>/                                the partial dir, renamed when everything is written
        model.safetensors | model-0000i-of-0000N.safetensors, model.safetensors.index.json
        config.json                       with "quantization" and "quantization_config"
        tokenizer files, generation_config.json, *.py   copied from the source
        .mlxbun-quantize.json             the marker, so a later run recognises its own output
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxbun.errors import InputError
from mlxbun.io.atomic import atomic_write_bytes, atomic_write_json, file_lock, fsync_dir, publish_dir
from mlxbun.io.dtypes import OUTPUT_DTYPES as CONVERSION_DTYPES
from mlxbun.progress import Progress
from mlxbun.quant.plan import Skeleton, prepare
from mlxbun.quant.spec import Plan, QuantSpec, load_plan

log = logging.getLogger("mlxbun")

MARKER = ".mlxbun-quantize.json"
FORMAT_VERSION = 1
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


def fingerprint(src: Path, settings: dict[str, Any]) -> str:
    """Identity of a conversion: source files (name, size, mtime), config bytes, settings."""
    h = hashlib.sha256()
    h.update((src / "config.json").read_bytes())
    for f in sorted(src.glob("model*.safetensors*")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    h.update(json.dumps({"format": FORMAT_VERSION, **settings}, sort_keys=True).encode())
    return h.hexdigest()


def _read_marker(d: Path) -> dict[str, Any] | None:
    try:
        return json.loads((d / MARKER).read_text())
    except (OSError, ValueError):
        return None


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
        self, sk: Skeleton, src_dir: Any, dtype: str | None, method: str = "rtn", hessians: dict | None = None
    ) -> None:
        import mlx.core as mx

        self.sk, self.src, self.method, self.hessians = sk, src_dir, method, hessians or {}
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

    def read_rows(self, name: str, r0: int, r1: int) -> Any:
        """Rows [r0, r1) of a 2-D source tensor, with pread (no mapped pages left behind)."""
        import mlx.core as mx
        import numpy as np

        from mlxbun.io.safetensors import NP_DTYPES

        info = self.src.info(self.sk.sources[name])
        row = info.nbytes // info.shape[0]
        buf = bytearray((r1 - r0) * row)
        with open(info.file, "rb", buffering=0) as f:
            f.seek(info.start + r0 * row)
            f.readinto(buf)
        arr = mx.array(np.frombuffer(buf, dtype=NP_DTYPES[info.dtype]).reshape(r1 - r0, *info.shape[1:]))
        return arr.view(mx.bfloat16) if info.dtype == "BF16" else arr

    def quantize_rows(self, unit: Unit) -> dict[str, Any]:
        """mx.quantize of a big weight, block of rows by block of rows.

        The packed weight (the bulk) is assembled in one preallocated uint32 numpy array, so
        memory holds the output once, not parts plus their concatenation.
        """
        import mlx.core as mx
        import numpy as np

        name, q = f"{unit.path}.weight", unit.quant
        rows, width = self.sk.weights.pop(name).shape
        step = max(1, CHUNK_BYTES // max(1, width * 4))
        packed: Any = None
        small: list[list[Any]] = []
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            chunk = self.cast(name, self.read_rows(name, r0, r1))
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
            if self.varies(unit.quant) and (w := arrays.get(prefix + "weight")) is not None:
                qm.weight, qm.scales, qm.biases = self.quantize_weight(w, unit.quant, unit.path)
            out = {prefix + k: v for k, v in tree_flatten(qm.parameters())}
            del module, qm
        del arrays
        return self.finish(unit, out)

    def varies(self, q: dict[str, Any]) -> bool:
        return self.method != "rtn" and q.get("mode", "affine") == "affine"

    def quantize_weight(self, w: Any, q: dict[str, Any], path: str) -> tuple[Any, ...]:
        """The hook where a quantizer variant (``mlxbun.quant.rounding``) replaces mx.quantize."""
        import mlx.core as mx

        if not self.varies(q):
            return tuple(mx.quantize(w, q["group_size"], q["bits"], mode=q.get("mode", "affine")))
        from mlxbun.quant.rounding import quantize

        h = self.hessians.get(path)
        return quantize(w, bits=q["bits"], group_size=q["group_size"], method=self.method, hessian=h)

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


def _boundary(out: Path, fp: str, partial: Path) -> QuantizeResult | None:
    """Refuse an out dir that is not ours; return the existing result if it is ours and complete."""
    if out.exists():
        marker = _read_marker(out)
        if marker is None or marker.get("fingerprint") != fp:
            raise InputError(
                f"quant.out={str(out)!r} already exists and is not this conversion's output; choose"
                " another quant.out or delete it"
            )
        files = sorted(p.name for p in out.glob("model*.safetensors"))
        return QuantizeResult(out, files, marker.get("quantization", {}), 0, 0, 0.0, reused=True)
    if partial.exists() and _read_marker(partial) is None and any(partial.iterdir()):
        raise InputError(f"{partial} exists and was not written by quantize; delete it to continue")
    return None


def _sweep_stale(partial: Path) -> list[Path]:
    """Delete partial dirs of the same output that another conversion (other source bytes or
    settings, so never resumable by this run) left behind when it was killed.

    Only dirs carrying quantize's marker are touched, and only when their lock can be taken
    without waiting: a run still working on one keeps it.
    """
    import fcntl
    import re

    stem = partial.name[: -len(partial.name.rsplit("-", 1)[1])]  # ".<out>.partial-"
    pattern = re.compile(re.escape(stem) + "[0-9a-f]{16}")
    removed = []
    for d in sorted(partial.parent.iterdir()) if partial.parent.is_dir() else []:
        if d == partial or not pattern.fullmatch(d.name) or not d.is_dir() or _read_marker(d) is None:
            continue
        lock = d.with_name(d.name + ".lock")
        with open(lock, "a") as f:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            try:
                shutil.rmtree(d)
                lock.unlink(missing_ok=True)
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)
        log.info("removed %s: a killed run of another conversion to the same output", d)
        removed.append(d)
    return removed


def _claim(partial: Path, fp: str, settings: dict[str, Any], *, resume: bool) -> str:
    """Create or reuse the partial dir; return its state ("new", "writing" or "complete")."""
    marker = _read_marker(partial)
    if marker is not None and (marker.get("fingerprint") != fp or not resume):
        shutil.rmtree(partial)
        marker = None
    if marker is None:
        partial.mkdir(parents=True, exist_ok=True)
        atomic_write_json(partial / MARKER, {"fingerprint": fp, "settings": settings, "state": "writing"})
        return "new"
    return marker.get("state", "writing")


def _write_shards(
    sk: Skeleton,
    src: Path,
    partial: Path,
    *,
    dtype: str | None,
    shard_bytes: int,
    threads: int,
    method: str,
    hessians: dict | None,
) -> tuple[int, int]:
    """Stream every unit into the ShardedWriter in ``partial``; return (source, output) bytes."""
    import mlx.core as mx

    from mlxbun.io.safetensors import INDEX_FILE, open_model
    from mlxbun.io.shards import ShardedWriter

    units = plan_units(sk)
    total = sum(u.nbytes for u in units)
    written = 0
    with (
        open_model(src) as model_dir,
        ShardedWriter(partial, shard_bytes=shard_bytes, resume=True, quantization=sk.quantization) as writer,
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
        for unit, tensors in stream(todo, Converter(sk, model_dir, dtype, method, hessians), threads=threads):
            for name, arr in tensors:
                written += arr.nbytes
                writer.add(name, arr)
            del tensors
            progress.update(unit.nbytes)
        layout = writer.finish()
        progress.close()
    if not layout.index_written:  # mlx-lm writes the index for a single shard too
        atomic_write_json(partial / INDEX_FILE, layout.index)
    mx.clear_cache()
    return total, layout.total_size or written


def quantize_model_dir(
    src: str | Path,
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
    threads: int = 2,
    partial_root: str | Path | None = None,
    method: str = "rtn",
    hessians: str | Path | None = None,
) -> QuantizeResult:
    """Quantize the HF model in ``src`` into an mlx-lm-loadable directory ``out``.

    Args:
        src: model directory with config.json and model*.safetensors.
        out: output directory; must not exist (unless it is this same conversion, then reused).
        mode, bits, group_size: uniform setting, mlx-lm's per-mode defaults for None.
        plan: a :class:`Plan` or plan.json path (overrides mode/bits/group_size).
        mixed: one of mlx-lm's mixed rules (``mixed_3_6`` ...), affine only.
        dtype: dtype of non-quantized tensors; None follows config.json like mlx-lm.
        shard_bytes: ceiling of tensor bytes per output shard (mlx-lm: 5 << 30).
        resume: continue a killed run of the same conversion from its last complete shard.
        threads: modules converted in parallel.
        partial_root: where the hidden partial directory lives (default: beside ``out``).
        method: how affine weights are rounded (:mod:`mlxbun.quant.rounding`); "rtn" is mx.quantize.
        hessians: a :mod:`mlxbun.quant.hessian` file; "gptq" needs it, "clip" weights columns by it.

    Example:
        >>> r = quantize_model_dir("hf/llama", "llama-4bit", bits=4, group_size=64)
        >>> r.files
        ['model.safetensors']
    """
    t0 = time.monotonic()
    src, out = Path(src).expanduser().resolve(), Path(out).expanduser().resolve()
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
    sk, spec = prepare(src, mode=mode, bits=bits, group_size=group_size, plan=plan, mixed=mixed)
    dtype = resolve_dtype(dtype, sk.config)
    settings = _settings(spec, plan, mixed, dtype, shard_bytes, src)
    if method != "rtn":  # absent by default, so existing fingerprints stay as they were
        settings["method"] = method
    if hessians is not None:
        settings["hessians"] = hashlib.sha256(Path(hessians).read_bytes()).hexdigest()
    fp = fingerprint(src, settings)
    partial = Path(partial_root or out.parent).expanduser().resolve() / f".{out.name}.partial-{fp[:16]}"
    if (done := _boundary(out, fp, partial)) is not None:
        return done
    lock = partial.with_name(partial.name + ".lock")
    with file_lock(lock):  # two runs of the same conversion: the second waits, then reuses
        if (done := _boundary(out, fp, partial)) is not None:
            return done
        _sweep_stale(partial)
        state = _claim(partial, fp, settings, resume=resume)
        src_bytes, out_bytes = _convert(
            sk, src, partial, state, dtype=dtype, shard_bytes=shard_bytes, threads=threads, method=method,
            hessians=hessians,
        )  # fmt: skip
        _finish_files(sk, src, partial)
        out.parent.mkdir(parents=True, exist_ok=True)
        publish_dir(partial, out)
        lock.unlink(missing_ok=True)
    files = sorted(p.name for p in out.glob("model*.safetensors"))
    return QuantizeResult(out, files, sk.quantization or {}, src_bytes, out_bytes, time.monotonic() - t0)


def _convert(
    sk: Skeleton,
    src: Path,
    partial: Path,
    state: str,
    *,
    dtype: str | None,
    shard_bytes: int,
    threads: int,
    method: str = "rtn",
    hessians: str | Path | None = None,
) -> tuple[int, int]:
    """Write the shards (unless a killed run already did) and mark the partial dir complete."""
    import mlx.core as mx
    import numpy as np

    if state == "complete":
        src_bytes = sum(v.nbytes for v in sk.weights.values())
        return src_bytes, sum(p.stat().st_size for p in partial.glob("model*.safetensors"))
    previous = mx.set_cache_limit(128 << 20)  # freed buffers go back to the OS, not a cache
    try:
        from mlxbun.quant import hessian

        # numpy, read here: MLX arrays cannot be evaluated on the worker threads that use them
        h = {k: np.asarray(v) for k, v in hessian.load(hessians).items()} if hessians is not None else None
        sizes = _write_shards(
            sk, src, partial, dtype=dtype, shard_bytes=shard_bytes, threads=threads, method=method, hessians=h
        )
    finally:
        mx.set_cache_limit(previous)
    marker = _read_marker(partial) or {}
    atomic_write_json(partial / MARKER, {**marker, "state": "complete", "quantization": sk.quantization})
    return sizes


def _settings(
    spec: QuantSpec, plan: Plan | None, mixed: str | None, dtype: str | None, shard_bytes: int, src: Path
) -> dict[str, Any]:
    return {
        "source": str(src),
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
    from mlxbun.provenance import RunResult
    from mlxbun.source import model_dir

    q = cfg.quant
    src = model_dir(cfg)
    out = Path(q.out).expanduser() if q.out else Path(cfg.paths.run_dir) / "model"
    partial_root = None if q.out else _stable_partial_root(Path(cfg.paths.outputs), out)
    res = quantize_model_dir(
        src,
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
    }
    verb = "reused" if res.reused else f"wrote {res.output_bytes / 1e9:.2f} GB in {res.seconds:.1f}s"
    return RunResult(
        outputs=[res.out],
        inputs=[src],
        metrics=metrics,
        message=f"quantized {src.name} -> {res.out} ({verb}, {len(res.files)} shard(s))",
        provides={"model.name": str(res.out)},
    )


def _stable_partial_root(outputs: Path, out: Path) -> Path:
    """``<outputs>/.partial`` (stable across runs, so a re-run resumes) when on out's filesystem."""
    root = outputs.expanduser().resolve() / ".partial"
    root.mkdir(parents=True, exist_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    return root if os.stat(root).st_dev == os.stat(out.parent).st_dev else out.parent


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
