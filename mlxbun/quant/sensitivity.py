"""command=sensitivity: per-layer KL(reference || one layer quantized) at candidate bit widths.

One module: the exact sweep, its checkpoints and the command share one settings key and document.

``method`` chooses how the numbers are made:

- ``fisher`` (default, ``fisher.py``): a second-order estimate from one forward + backward per
  calibration batch, scaled per candidate by one whole-model forward: about 3 + candidates
  forward passes in all, linear in depth;
- ``exact`` (this module, below): every (module, candidate) measured;
- ``reference`` (``sensitivity_ref.py``): the same numbers as ``exact``, the slow way.

Exact: for every quantizable module (the ones mlx-lm's quantize would touch) and every candidate bit
width, the module's weight is quantized then dequantized, the calibration samples run through the
model, and the score is KL(ref || cur) = mean over tokens of sum_v p_ref (log p_ref - log p_cur)
of the float32 logits (softmax and sums in float64), averaged over samples. ``sensitivity_ref.py``
does exactly that, one full forward per sample. This module computes the same numbers faster:

- a module in block i only changes blocks i..L: the reference hidden state entering block i is
  kept (for all samples, one block boundary at a time) and each probe runs blocks i..L only;
  ``lm_head`` probes run the head only;
- samples run in batches; weights are float32 (fake-quantized candidates too), so matmuls go
  through the optimized BLAS on Linux CPU (MLX's bf16 and quantized CPU matmuls do not);
- reference probabilities are computed once and kept when they fit ``ref_cache_mb``; the next
  probe is queued (``mx.async_eval``) while numpy scores the previous one.

The model runs through mlx-lm's own class, so every architecture with a block loop works: probes
swap the block list for one whose first entries pass the stored hidden state through.

Work is grouped by the first block a module changes ("group" = block index; 0 also holds the
embedding, L is the head). Groups are the unit of sharding and of checkpoints::

    <cache>/sensitivity/<key>/          key = sha256(model, calibration, settings)[:20]
        meta.json                       settings and fingerprints of this key
        groups/0003.json                results of group 3 (atomic; a rerun skips it)
    <run_dir>/
        sensitivity.json                versioned results (schema below), sorted keys
        sensitivity.csv                 path, params, kl@bits...
        sensitivity.png                 heatmap, modules x bits, log10 KL

sensitivity.json: {"version": 1, "kind": "mlxbun.sensitivity", "metric": ..., "method",
"bits", "group_size", "mode", "model": {fingerprint, model_type, num_layers, quantized},
"calibration": {fingerprint, source, samples, seq_len, seed, stream_tokens}, "all_layers": [...],
"layers": [{"path", "group", "in_features", "out_features", "params", "current", "kl": {"4": ..}}],
"shard": null | {"index", "count", "groups"}}.

Example:
    >>> doc = sensitivity(model_dir="tests/fixtures/llama-text-3m", out_dir="out", work_dir="work")
    >>> doc["layers"][0]["path"], doc["layers"][0]["kl"]["4"]
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mlxbun import blas
from mlxbun.errors import InputError
from mlxbun.io.atomic import atomic_write_bytes, atomic_write_json, dumps_json
from mlxbun.io.dtypes import OUTPUT_NAMES
from mlxbun.io.safetensors import open_model, read_config
from mlxbun.kl import kl_from_stats, ref_stats
from mlxbun.progress import Progress
from mlxbun.provenance import RunResult
from mlxbun.quant.calib import load_calibration
from mlxbun.quant.sensitivity_ref import reference_sweep
from mlxbun.quant.spec import QuantSpec, spec_for
from mlxbun.source import expand
from mlxbun.source import model_dir as source_dir

log = logging.getLogger("mlxbun.sensitivity")

SCHEMA_VERSION = 1
KIND = "mlxbun.sensitivity"
METRIC = "kl(ref||cur) of float32 logits (float64 softmax), mean over tokens, then over samples"
# The method's own settings that change the numbers, kept in sensitivity.json (fisher: the last three).
METHOD_SETTINGS = ("batch_size", "refine", "refine_bits", "estimator")


@dataclass(frozen=True)
class Target:
    """One quantizable module: where its probe starts and what its source weight is."""

    path: str
    group: int  # first block whose input it changes: 0 (also the embedding) .. L (head only)
    in_features: int
    out_features: int
    dtype: str  # the source dtype candidates are quantized from
    current: dict | None  # {"bits", "group_size", "mode"} when the source is already quantized

    def row(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "group": self.group,
            "in_features": self.in_features,
            "out_features": self.out_features,
            "params": self.in_features * self.out_features,
            "current": self.current,
        }


# ---------------------------------------------------------------- model


def candidates(bits: list[int], *, group_size: int | None, mode: str) -> list[QuantSpec]:
    """The candidate settings, checked against what MLX's quantize supports for ``mode``."""
    return [spec_for(mode, b, group_size, key="sensitivity") for b in sorted(set(bits))]


def find_blocks(model: Any) -> tuple[Any, str]:
    """The module holding the transformer block list (``model.model.layers`` for llama)."""
    import mlx.nn as nn

    best = None
    for path, mod in model.named_modules():
        layers = mod.get("layers") if isinstance(mod, dict) else None
        if isinstance(layers, list) and layers and all(isinstance(x, nn.Module) for x in layers):
            if best is None or path.count(".") < best[0].count("."):
                best = (path, mod)
    if best is None:
        raise InputError(f"model class {type(model).__name__} has no block list 'layers'; cannot probe")
    return best[1], best[0]


def load_model(model_dir: str | Path) -> tuple[Any, Any, dict[str, dict]]:
    """mlx-lm model (float32, dequantized) + tokenizer + each quantized module's original setting."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.utils import dequantize_model, load

    read_config(Path(model_dir))  # a broken config.json: the one reader's line, not mlx-lm's
    try:
        model, tokenizer = load(str(model_dir))
    except (FileNotFoundError, ValueError) as e:
        raise InputError(f"model.name={str(model_dir)!r} cannot be loaded by mlx_lm: {e}") from None
    current, dtypes = {}, {}
    for path, mod in model.named_modules():
        if isinstance(mod, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            current[path] = {"bits": mod.bits, "group_size": mod.group_size, "mode": mod.mode}
            dtypes[path] = mod.scales.dtype if mod.mode == "affine" else mx.bfloat16
    # Dequantized weights come out in the scales' dtype: that is the candidates' source.
    model = dequantize_model(model)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    model.eval()
    names = {path: str(dt).split(".")[-1] for path, dt in dtypes.items()}
    return model, tokenizer, {"current": current, "dtypes": names}


def targets(model: Any, *, group_size: int, source: dict[str, dict], dtypes: dict[str, str]) -> list[Target]:
    """Quantizable modules in model order, with mlx-lm's predicate (and the model's own)."""
    owner, owner_path = find_blocks(model)
    n = len(owner["layers"])
    prefix = f"{owner_path}.layers." if owner_path else "layers."
    pred = getattr(model, "quant_predicate", None)
    out = []
    for path, mod in model.named_modules():
        if not hasattr(mod, "to_quantized") or "weight" not in mod:
            continue
        if mod.weight.shape[-1] % group_size or (pred is not None and not pred(path, mod)):
            continue
        out.append(
            Target(
                path=path,
                group=block_of(path, prefix=prefix, n_blocks=n),
                in_features=int(mod.weight.shape[-1]),
                out_features=int(mod.weight.shape[0]),
                dtype=dtypes.get(path, "bfloat16"),
                current=source["current"].get(path),
            )
        )
    return sorted(out, key=lambda t: (t.group, t.path != "lm_head", _natural(t.path)))


def block_of(path: str, *, prefix: str, n_blocks: int) -> int:
    """The first block a change of ``path`` runs: its own block, ``n_blocks`` for the head."""
    if path.startswith(prefix):
        return int(path[len(prefix) :].split(".")[0])
    if path == "lm_head" or path.endswith(".lm_head"):
        return n_blocks
    return 0  # embeddings and anything outside the blocks: a full forward is always exact


def _natural(path: str) -> list:
    return [int(p) if p.isdigit() else p for p in path.split(".")]


def source_dtypes(model_dir: str | Path) -> dict[str, str]:
    """Each module's stored weight dtype (bf16 source) from the safetensors headers."""

    md = open_model(Path(model_dir))
    out = {}
    for name in md.names():
        if name.endswith(".weight"):
            out[name[: -len(".weight")]] = OUTPUT_NAMES.get(md.info(name).dtype, "bfloat16")
    return out


FAKE_QUANT_CHUNK = 1 << 22  # weights quantized at once: bounds the temporaries of a large embedding


def fake_quant(weight: Any, cand: QuantSpec, *, dtype: str) -> Any:
    """quantize -> dequantize of ``weight`` cast to its source dtype, returned as float32.

    Large weights go in slices of rows (quantization groups never cross a row: the same values),
    each evaluated before the next, so the temporaries stay near ``FAKE_QUANT_CHUNK`` weights."""
    import mlx.core as mx

    rows = max(1, FAKE_QUANT_CHUNK // max(1, weight.size // max(1, weight.shape[0])))
    if weight.shape[0] <= rows:
        return _fake_quant(weight, cand, dtype)
    parts = []
    for lo in range(0, weight.shape[0], rows):
        parts.append(_fake_quant(weight[lo : lo + rows], cand, dtype))
        mx.eval(parts[-1])
    return mx.concatenate(parts)


def _fake_quant(weight: Any, cand: QuantSpec, dtype: str) -> Any:
    import mlx.core as mx

    src = weight.astype(getattr(mx, dtype))
    parts = mx.quantize(src, group_size=cand.group_size, bits=cand.bits, mode=cand.mode)
    biases = parts[2] if len(parts) > 2 else None
    deq = mx.dequantize(
        parts[0], parts[1], biases, group_size=cand.group_size, bits=cand.bits, mode=cand.mode
    )
    return deq.astype(mx.float32)


def module_at(model: Any, path: str) -> Any:
    mod = model
    for part in path.split("."):
        mod = mod[int(part)] if isinstance(mod, list) else getattr(mod, part)
    return mod


# ---------------------------------------------------------------- partial forwards


class _Skip:
    """Stands in for a block before the start: passes its input through (attributes delegate)."""

    def __init__(self, layer: Any) -> None:
        self._layer = layer

    def __getattr__(self, key: str) -> Any:
        return getattr(self._layer, key)

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        return x


class _Inject(_Skip):
    """The block just before the start: returns the stored hidden state."""

    def __init__(self, layer: Any, h: Any) -> None:
        super().__init__(layer)
        self._h = h

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        return self._h


class _Halt(Exception):
    def __init__(self, h: Any) -> None:
        self.h = h


class _Stop(_Skip):
    """The last block to run: runs it, then stops the forward with its output."""

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        raise _Halt(self._layer(x, *args, **kwargs))


class Stack:
    """Runs mlx-lm's own forward over a slice of the blocks.

    ``forward(tokens, start=i, h=h_i)`` runs blocks i..L (+ norm and head) on the hidden state
    ``h_i`` entering block i; ``stop=j`` instead returns the hidden state entering block j.
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self.owner, _ = find_blocks(model)
        self.blocks = list(self.owner["layers"])
        self.n = len(self.blocks)

    def forward(self, tokens: Any, *, start: int = 0, h: Any = None, stop: int | None = None) -> Any:
        layers = list(self.blocks)
        if start > 0:
            layers[: start - 1] = [_Skip(b) for b in self.blocks[: start - 1]]
            layers[start - 1] = _Inject(self.blocks[start - 1], h)
        if stop is not None:
            layers[stop - 1] = _Stop(self.blocks[stop - 1])
        self.owner["layers"] = layers
        try:
            return self.model(tokens)
        except _Halt as e:
            return e.h
        finally:
            self.owner["layers"] = self.blocks


# ---------------------------------------------------------------- fast sweep


class Sweep:
    """The fast exact sweep over groups; results go to ``on_group(group, {path: {bits: kl}})``.

    Probe forwards are built lazily and queued with ``mx.async_eval`` one ahead, so MLX computes
    the next probe while numpy scores the previous one (KL in float64 runs on the CPU too).
    """

    def __init__(self, model: Any, tokens: Any, *, batch_size: int, ref_cache_mb: float = 1024) -> None:
        import mlx.core as mx

        self.stack = Stack(model)
        self.model = model
        n = tokens.shape[0]
        self.batches = [mx.array(tokens[i : i + batch_size]) for i in range(0, n, batch_size)]
        self.n_samples = n
        self.h_last = [self._eval(self.stack.forward(b, stop=self.stack.n)) for b in self.batches]
        self.ref_cache_mb = ref_cache_mb
        self._ref: list | None = None

    @staticmethod
    def _eval(x: Any) -> Any:
        import mlx.core as mx

        mx.eval(x)
        return x

    def ref_logits(self, j: int) -> Any:
        """Reference logits of batch j (lazy; built with the weights in place now)."""
        return self.stack.forward(self.batches[j], start=self.stack.n, h=self.h_last[j])

    def cache_refs(self) -> None:
        """Keep every batch's reference statistics when they fit ``ref_cache_mb``."""
        first = ref_stats(self.ref_logits(0))
        if first[0].nbytes * len(self.batches) <= self.ref_cache_mb * (1 << 20):
            self._ref = [first] + [ref_stats(self.ref_logits(k)) for k in range(1, len(self.batches))]

    def advance(self, hs: list | None, frm: int, to: int) -> list | None:
        """Hidden states entering block ``to`` from those entering block ``frm`` (None = tokens)."""
        if to == 0:
            return None
        if to == self.stack.n:
            return self.h_last
        if frm == to:
            return hs
        return [
            self._eval(self.stack.forward(b, start=frm, h=None if hs is None else hs[j], stop=to))
            for j, b in enumerate(self.batches)
        ]

    def probe_graphs(self, g: int, target: Target, cand: QuantSpec, hs: list | None):
        """Lazy (logits, ref logits or None) per batch with ``target`` fake-quantized; weight restored."""
        import mlx.core as mx

        mod = module_at(self.model, target.path)
        original = mod.weight
        quantized = fake_quant(original, cand, dtype=target.dtype)
        for j, b in enumerate(self.batches):
            ref = None if self._ref is not None else self.ref_logits(j)
            mod.weight = quantized  # the graph keeps this array; swapping back does not change it
            try:
                logits = self.stack.forward(b, start=g, h=None if hs is None else hs[j])
            finally:
                mod.weight = original
            mx.async_eval(logits if ref is None else [logits, ref])
            yield j, logits, ref

    def jobs(self, groups: dict[int, list[Target]], cands: list[QuantSpec]):
        """Every probe in order, then ("done", g) after the last probe of group g."""
        hs, at = None, 0
        for g in sorted(groups):
            hs, at = self.advance(hs, at, g), g
            for t in groups[g]:
                for c in cands:
                    if c.matches(t.current):
                        yield "zero", g, t, c, None
                        continue
                    for job in self.probe_graphs(g, t, c, hs):
                        yield "probe", g, t, c, job
            yield "done", g, None, None, None

    def run(
        self, groups: dict[int, list[Target]], cands: list[QuantSpec], *, on_group, progress=None
    ) -> None:
        self.cache_refs()
        self.n_cands = len(cands)
        totals: dict[int, dict[str, dict[str, float]]] = {}
        pending = None
        for job in self.jobs(groups, cands):
            if pending is not None:
                self._consume(pending, totals, groups, on_group, progress)
            pending = job  # the job just queued computes while the previous one is scored
        if pending is not None:
            self._consume(pending, totals, groups, on_group, progress)

    def _consume(self, job: tuple, totals: dict, groups: dict, on_group, progress) -> None:
        kind, g, t, c, payload = job
        if kind == "done":
            results = {
                p: {b: v / self.n_samples for b, v in kl.items()} for p, kl in totals.pop(g, {}).items()
            }
            on_group(g, results)
            return
        acc = totals.setdefault(g, {}).setdefault(t.path, {})
        acc.setdefault(str(c.bits), 0.0)
        if progress is not None:  # a module counts once all its probes are in; work = blocks run
            share = 1.0 / (self.n_cands * (len(self.batches) if kind == "probe" else 1))
            progress.update(share, work=share * self.n_cands * (self.stack.n - g + 1))
        if kind == "probe":
            j, logits, ref = payload
            stats = self._ref[j] if ref is None else ref_stats(ref)
            for v in kl_from_stats(stats, logits).tolist():  # sample order, as the reference sums
                acc[str(c.bits)] += v


# ---------------------------------------------------------------- sharding and checkpoints


def group_cost(g: int, targets_in: list[Target], n_blocks: int, n_cands: int) -> int:
    return len(targets_in) * n_cands * (n_blocks - g + 1)


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


def model_fingerprint(model_dir: str | Path, *, samples: int = 16, chunk: int = 1 << 16) -> str:
    """sha256 over config.json, every safetensors header and sampled data chunks (fast on 50 GB)."""
    root = Path(model_dir)
    h = hashlib.sha256()
    for f in sorted(root.glob("*.safetensors")) + [root / "config.json"]:
        if not f.is_file():
            continue
        h.update(f.name.encode() + b"\0")
        size = f.stat().st_size
        with open(f, "rb") as fh:
            if f.suffix != ".safetensors" or size <= samples * chunk:
                h.update(fh.read())
                continue
            n = int.from_bytes(fh.read(8), "little")
            h.update(size.to_bytes(8, "little") + fh.read(n))
            for k in range(samples):
                fh.seek(8 + n + (size - 8 - n - chunk) * k // max(samples - 1, 1))
                h.update(fh.read(chunk))
    return h.hexdigest()


class Checkpoints:
    """Per-group results under a work dir keyed by the model, calibration and settings."""

    def __init__(self, root: Path, settings: dict[str, Any]) -> None:
        key = hashlib.sha256(dumps_json(settings).encode()).hexdigest()[:20]
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


# ---------------------------------------------------------------- result document and reports


def document(
    *, tgts: list[Target], kls: dict[str, dict], settings: dict[str, Any], shard: dict | None
) -> dict[str, Any]:
    """The sensitivity.json document for the targets whose results are in ``kls``."""
    layers = [t.row() | {"kl": kls[t.path]} for t in tgts if t.path in kls]
    return {
        "version": SCHEMA_VERSION,
        "kind": KIND,
        "metric": METRIC,
        "method": settings["method"],
        "bits": settings["bits"],
        "group_size": settings["group_size"],
        "mode": settings["mode"],
        "model": settings["model"],
        "calibration": settings["calibration"],
        "runtime": settings["runtime"],
        **{k: settings[k] for k in METHOD_SETTINGS if k in settings},
        "all_layers": [t.path for t in tgts],
        "layers": layers,
        "shard": shard,
    }


def write_reports(doc: dict[str, Any], out_dir: Path) -> list[Path]:
    """sensitivity.json, .csv and .png in ``out_dir`` (each written atomically)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "sensitivity.json", out_dir / "sensitivity.csv", out_dir / "sensitivity.png"]
    atomic_write_json(paths[0], doc)
    atomic_write_bytes(paths[1], to_csv(doc).encode())
    atomic_write_bytes(paths[2], heatmap_png(doc))
    return paths


def to_csv(doc: dict[str, Any]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["path", "group", "in_features", "out_features", "params"] + [f"kl_{b}" for b in doc["bits"]])
    for r in doc["layers"]:
        kl = [repr(r["kl"][str(b)]) for b in doc["bits"]]
        w.writerow([r["path"], r["group"], r["in_features"], r["out_features"], r["params"], *kl])
    return buf.getvalue()


def heatmap_png(doc: dict[str, Any]) -> bytes:
    """Modules x bits heatmap of log10 KL (zeros masked), deterministic PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["layers"]
    data = np.array([[r["kl"][str(b)] for b in doc["bits"]] for r in rows], dtype=np.float64).reshape(
        len(rows), len(doc["bits"])
    )
    shown = np.ma.masked_less_equal(data, 0.0)
    fig, ax = plt.subplots(figsize=(2.5 + 0.9 * len(doc["bits"]), 1.5 + 0.16 * max(len(rows), 1)))
    im = ax.imshow(np.ma.log10(shown), aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_xticks(range(len(doc["bits"])), [f"{b}-bit" for b in doc["bits"]])
    ax.set_yticks(range(len(rows)), [r["path"] for r in rows], fontsize=6)
    ax.set_title(f"log10 KL, {doc['mode']} g{doc['group_size']}", fontsize=9)
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()


# ---------------------------------------------------------------- library entry point


@dataclass
class Setup:
    model: Any
    tokens: Any
    targets: list[Target]
    cands: list[QuantSpec]
    settings: dict[str, Any]


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
    )
    n_blocks = Stack(model).n
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
            "fingerprint": model_fingerprint(model_dir),
            "model_type": getattr(model, "model_type", None) or _config(model_dir).get("model_type"),
            "num_layers": n_blocks,
            "quantized": bool(source["current"]),
        },
        "calibration": calib.to_dict(),
    }
    return Setup(model=model, tokens=calib.tokens, targets=tgts, cands=cands, settings=settings)


def _fisher_settings(refine: float, refine_bits: list[int] | None) -> dict[str, Any]:
    from mlxbun.quant.fisher import VERSION  # deferred: fisher.py builds on this module

    return {"refine": refine, "refine_bits": sorted(refine_bits or []), "estimator": VERSION}


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
) -> dict[str, Any]:
    """Per-layer KL sensitivities of ``model_dir``; writes sensitivity.json/.csv/.png to ``out_dir``.

    Args:
        model_dir: a bf16/f16/f32 checkpoint or an mlx-lm quantized model directory.
        out_dir: where the reports go (the run directory).
        work_dir: root of per-group checkpoints (keyed by model, calibration and settings).
        bits, group_size, mode: the candidates (``mode`` as in ``mx.quantize``).
        calib_path, samples, seq_len, seed: calibration (see ``mlxbun.quant.calib``).
        method: "fisher" (``fisher.py``: estimated from one backward pass, the default),
            "exact" (this module) or "reference" (``sensitivity_ref``: one full forward per
            sample and probe; slow, for checking).
        batch_size: samples per forward (fisher, exact).
        refine, refine_bits: fisher only: the fraction of modules (largest first) probed exactly on
            the calibration subset at ``refine_bits`` (default: the middle candidate), each
            module's estimate then scaled to its probe (``fisher.refine_kl``); 0 turns it off.
        shard, num_shards: compute only this shard's groups (merge with ``sensitivity_merge``).
        ref_cache_mb: keep reference log-probs for all samples when they fit in this budget.
        stop_after_groups: stop (raising KeyboardInterrupt) after this many new groups (tests).

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
    n_blocks = Stack(s.model).n
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
    doc = document(tgts=s.targets, kls=kls, settings=s.settings, shard=shard_info)
    if s.settings["method"] == "fisher" and (ckpt.dir / "estimate.json").is_file():
        doc["estimate"] = json.loads((ckpt.dir / "estimate.json").read_text())
    write_reports(doc, Path(out_dir))
    stats = {
        "seconds": round(time.monotonic() - t0, 3),
        "groups_computed": len(todo),
        "groups_resumed": len(mine) - len(todo),
        "layers": len(doc["layers"]),
        "checkpoints": str(ckpt.dir),
    }
    return doc | {"_stats": stats}


def runtime() -> dict[str, Any]:
    """What changes the numbers besides model, calibration and settings: mlx version and BLAS."""
    import mlx.core as mx

    info = blas.load()  # what was loaded before mlx.core (cached), or the bundled BLAS
    return {"mlx": mx.__version__, "blas": info.get("library") if info.get("loaded") else "bundled"}


def _compute(
    s: Setup, todo: dict, ckpt: Checkpoints, kls: dict, *, batch_size, ref_cache_mb, stop_after
) -> dict[str, Any] | None:
    """Fill ``kls`` for the groups in ``todo`` (each saved as it completes); the fisher extras."""
    if not todo:
        return None
    method = s.settings["method"]
    n_blocks = Stack(s.model).n
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
            from mlxbun.quant.fisher import timed_forward  # deferred: fisher.py imports this module

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
    from mlxbun.quant.fisher import estimate  # deferred: fisher.py builds on this module's Sweep

    def at(fraction: float) -> None:
        progress.update(fraction * progress.total - progress.done, work=fraction - progress.work)

    est = estimate(
        s.model, s.tokens, s.targets, s.cands, batch_size=batch_size, seed=s.settings["calibration"]["seed"],
        refine=s.settings["refine"], refine_bits=s.settings["refine_bits"], progress=at, hint=progress.hint,
    )  # fmt: skip
    extra = {"factors": est.factors, "measured": est.measured, "forward_equivalents": est.forward_equivalents}
    extra |= {"probes": est.probes or {}}
    atomic_write_json(ckpt_dir / "estimate.json", extra)  # before the groups: a resume finds it
    for g in sorted(todo):
        on_group(g, {t.path: est.kl[t.path] for t in todo[g]})
    return extra


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
        refine=sc.refine, refine_bits=list(sc.refine_bits) or None,
    )  # fmt: skip
    stats = doc.pop("_stats")
    out = run_dir / "sensitivity.json"
    inputs = [mdir] + ([Path(sc.calib.path).expanduser()] if sc.calib.path else [])
    part = "" if doc["shard"] is None else f" (shard {sc.shard}/{sc.num_shards})"
    msg = (
        f"sensitivity{part}: {stats['layers']} layers x {len(doc['bits'])} bits in {stats['seconds']:.1f}s "
        f"({stats['groups_resumed']} groups resumed) -> {out}"
    )
    return RunResult(
        outputs=[out, run_dir / "sensitivity.csv", run_dir / "sensitivity.png"],
        inputs=inputs,
        metrics=stats | {"method": doc["method"]},
        message=msg,
        provides={"allocate.sensitivity": str(out)},
    )
