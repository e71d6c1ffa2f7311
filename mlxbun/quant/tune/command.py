"""command=tune: learned rounding — a quantized model tuned end to end to match its reference.

What it trains, for each affine quantized module below 8 bits (mx modes and 8-bit stay as they are):
- each group's scale (a log multiplier in units of 1 / (2^bits - 1), so a step moves the top
  code as far at every bit width) and bias (a shift in units of the scale);
- the RMSNorm weights (a damped log gain), which are stored unquantized and cost no bytes;
- then, in a second phase from the first's best, each code too (learned rounding, as AutoRound's
  but end to end): a trained offset in grid steps, rounded on the way forward and passed straight
  through on the way back, so a code moves to the next level once its offset passes one half
  (``tune.codes_lr``; 0 keeps the codes and skips the phase). Codes moved too far at once can
  cost the phase its epochs, never the first phase's result.

The loss is KL(reference || model) of the next-token distributions on calibration windows (what
``command=eval`` reports), minimised with Adam (each phase ``tune.epochs`` epochs: one of warm-up,
then a cosine decay); the matmuls run in float32 through the BLAS.
Every tensor keeps its shape and dtype, so the bytes on disk are the input's. The last eighth
of the windows (at least two) are validation: the epoch (of either phase) with the lowest
validation KL is written, or the input's values when no epoch beats them (``tune.json`` says which).

    <run_dir>/
        model/          the tuned model (config.json and tokenizer files copied; mlx_lm.load reads it)
        tune.json       {"reference", "calibration", "validation": [KL before, after each epoch of
                         each phase], "phases", "chosen_epoch", "codes_changed", "seconds", ...}

When the whole-model tuning does not fit in memory (about 13 bytes a quantized weight and the
reference in float32), the step records why in tune.json and hands on its input unchanged; when
it fits only without the codes' offsets (CODE_BYTES_PER_WEIGHT more), the codes stay.

Example:
    python -m mlxbun command=tune model.name=<quantized dir> tune.reference=<its source>
"""

from __future__ import annotations

import json
import logging
import math
import time
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from mlxbun import registry
from mlxbun.errors import InputError
from mlxbun.host import available_memory
from mlxbun.io.atomic import atomic_write_bytes, atomic_write_json
from mlxbun.io.digest import job_key
from mlxbun.io.safetensors import INDEX_FILE, open_model, read_config
from mlxbun.io.shards import ShardedWriter
from mlxbun.io.staging import Stage, stable_root
from mlxbun.progress import Progress, human_bytes
from mlxbun.quant.calibration import load_calibration
from mlxbun.quant.mlxlm import load
from mlxbun.quant.probe import dequantized, module_at
from mlxbun.quant.probe import load_model as load_reference
from mlxbun.quant.quantize.command import source_name
from mlxbun.quant.quantize.outdir import copy_side_files, written_files
from mlxbun.quant.rounding import BLOCK_ELEMENTS, pack
from mlxbun.runs.provenance import RunResult
from mlxbun.source.fingerprint import model_fingerprint
from mlxbun.source.model import model_dir, named_dir

log = logging.getLogger("mlxbun")

TUNE_FILE = "tune.json"
BYTES_PER_WEIGHT = 13  # its code (a byte), the float32 weight kept for the backward, its gradient, slack
CODE_BYTES_PER_WEIGHT = (
    20  # a trained code: its float32 offset, the offset's gradient, Adam's two moments, slack
)
MEMORY_SHARE = 0.8
LOGITS_CACHE_BYTES = 512 << 20  # the reference's log-probs are kept when they fit, else recomputed
# A norm's gain moves 1/NORM_DAMPING as fast as a scale: every channel it scales feeds every
# later module, and at the scales' rate the first epoch raised validation KL 30-60x at 4-6 bits.
NORM_DAMPING = 10.0
NOTHING_TO_TUNE = "model.name has no affine quantized module below 8 bits; there is nothing to tune"
VERSION = 2  # of the method: part of the job key (2: the codes are trained too)


# ----------------------------------------------------------------------------- the modules


def _modules():
    """The trainable stand-ins, built on first use (MLX is imported lazily)."""

    class TunedLinear(nn.Module):
        """An affine QuantizedLinear as its codes (one byte each; a float32 copy of a 0.5B model's
        would be 2 GB) with a trainable scale and bias per group."""

        def __init__(self, q: Any, dtype: Any) -> None:
            super().__init__()
            self._gs, self._bits, self._dtype, self._rate = q.group_size, q.bits, dtype, 0.0
            self._steps = float(2**q.bits - 1)  # grid steps across a group's range
            codes = dequantized(
                q.weight, mx.ones_like(q.scales), mx.zeros_like(q.biases), group_size=q.group_size, bits=q.bits,
                dtype=mx.uint8,
            )  # fmt: skip
            rows, cols = codes.shape
            self._codes = codes.reshape(rows, cols // q.group_size, q.group_size)
            mx.eval(self._codes)
            self._s0, self._b0 = q.scales.astype(mx.float32), q.biases.astype(mx.float32)
            self._bias = q["bias"] if "bias" in q else None
            self.log_scale = mx.zeros_like(self._s0)
            self.shift = mx.zeros_like(self._s0)

        def train_codes(self, rate: float) -> None:
            """Make the codes trainable: each moves by its offset x ``rate`` (grid steps), rounded.
            Made only once the training starts: a float32 offset a weight."""
            self._rate = rate
            self.offset = mx.zeros(self._codes.shape, mx.float32)

        def codes(self) -> Any:
            """The codes (float32): as stored, or moved by their rounded offsets and kept on the
            grid, the rounding's gradient passed straight through."""
            q = self._codes.astype(mx.float32)
            if not self._rate:
                return q
            q = q + self._rate * self.offset
            return q + mx.stop_gradient(mx.clip(mx.round(q), 0, self._steps) - q)

        def codes_changed(self) -> int:
            if not self._rate:
                return 0
            return int(mx.sum(self.codes().astype(mx.uint8) != self._codes).item())

        def scales_biases(self) -> tuple[Any, Any]:
            """The stored (rounded to the model's dtype) scales and biases, as float32."""
            s = self._s0 * mx.exp(self.log_scale / self._steps)
            b = self._b0 + self._s0 * self.shift
            return s.astype(self._dtype).astype(mx.float32), b.astype(self._dtype).astype(mx.float32)

        def stored_tensors(self, path: str) -> dict[str, Any]:
            s, b = self.scales_biases()
            out = {f"{path}.scales": s.astype(self._dtype), f"{path}.biases": b.astype(self._dtype)}
            if self._rate:
                out[f"{path}.weight"] = _packed(self.codes().astype(mx.uint8), self._bits)
            return out

        def weight(self) -> Any:
            s, b = self.scales_biases()
            w = self.codes() * s[..., None] + b[..., None]
            return w.reshape(w.shape[0], -1)

        def __call__(self, x: Any) -> Any:
            y = x.astype(mx.float32) @ self.weight().T
            return y if self._bias is None else y + self._bias

    class TunedEmbedding(TunedLinear):
        def __call__(self, ids: Any) -> Any:
            s, b = self.scales_biases()
            codes = self.codes()[ids] if self._rate else self._codes[ids].astype(mx.float32)
            w = codes * s[ids][..., None] + b[ids][..., None]
            return w.reshape(*ids.shape, -1)

        def as_linear(self, x: Any) -> Any:
            return x.astype(mx.float32) @ self.weight().T

    class TunedNorm(nn.Module):
        """An RMSNorm with a trainable log gain (damped), trained on its value rounded to the stored dtype."""

        def __init__(self, norm: Any) -> None:
            super().__init__()
            self._dtype, self._eps = norm.weight.dtype, norm.eps
            self._w0 = norm.weight.astype(mx.float32)
            self.log_gain = mx.zeros_like(self._w0)

        def stored(self) -> Any:
            w = self._w0 * mx.exp(self.log_gain / NORM_DAMPING)
            return w + mx.stop_gradient(w.astype(self._dtype).astype(mx.float32) - w)

        def stored_tensors(self, path: str) -> dict[str, Any]:
            return {f"{path}.weight": self.stored().astype(self._dtype)}

        def __call__(self, x: Any) -> Any:
            return mx.fast.rms_norm(x, self.stored(), self._eps)

    return TunedLinear, TunedEmbedding, TunedNorm


def _packed(codes: Any, bits: int) -> Any:
    """Codes (rows, groups, group) uint8 -> mlx's packed uint32 weight (rows, cols * bits / 32), in
    blocks of rows (the packing's temporaries are 4 x bits bytes a code)."""
    codes = codes.reshape(codes.shape[0], -1)
    step = max(1, BLOCK_ELEMENTS // codes.shape[1])
    return mx.array(
        np.concatenate([pack(np.asarray(codes[r : r + step]), bits) for r in range(0, codes.shape[0], step)])
    )


def tunable(model: Any) -> list[tuple[str, Any]]:
    """(path, module) of each affine quantized module below 8 bits, in model order."""
    return [
        (path, m)
        for path, m in model.named_modules()
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) and m.mode == "affine" and m.bits < 8
    ]


def norms(model: Any) -> list[tuple[str, Any]]:
    """(path, module) of each RMSNorm (mlx's own; a model's variant such as Gemma's 1 + w stays)."""
    return [(p, m) for p, m in model.named_modules() if type(m) is nn.RMSNorm]


# ----------------------------------------------------------------------------- the tuning


def memory_need(model: Any, ref_params: int, *, codes: bool) -> int:
    weights = sum(m.weight.size * 32 // m.bits for _, m in tunable(model))
    return (BYTES_PER_WEIGHT + (CODE_BYTES_PER_WEIGHT if codes else 0)) * weights + 4 * ref_params


def tune_model(
    model: Any,
    reference: Any,
    tokens: np.ndarray,
    *,
    epochs: int,
    lr: float,
    batch_size: int,
    seed: int,
    codes_lr: float = 0.0,
    patience: int = 0,
    min_kl: float = 0.0,
    max_minutes: float | None = None,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Tune ``model`` in place (its quantized modules and norms swapped for trainable stand-ins);
    returns the record and the stored tensors of the best epoch (scales, biases, norm weights,
    and the packed codes when ``codes_lr`` trains them: Adam's step for their offsets, in grid steps).

    Training stops after ``patience`` epochs (0: never) without a new best validation KL. When
    the input's validation KL is below ``min_kl``, or the training would take longer than
    ``max_minutes`` at the speed of the first validation window (then of the whole first
    validation pass), nothing is trained: the tensors are None and the record's "reason" says why."""
    linear_cls, embedding_cls, norm_cls = _modules()
    swaps = []
    for path, q in tunable(model):
        cls = embedding_cls if isinstance(q, nn.QuantizedEmbedding) else linear_cls
        swaps.append((path, cls(q, q.scales.dtype)))
    if not swaps:
        raise InputError(NOTHING_TO_TUNE)
    tuned_norms = [(path, norm_cls(m)) for path, m in norms(model)]
    model.update_modules(tree_unflatten(swaps + tuned_norms))
    model.freeze()
    for _, m in swaps:
        m.unfreeze(keys=["log_scale", "shift"], recurse=False)
    for _, m in tuned_norms:
        m.unfreeze(keys=["log_gain"], recurse=False)
    model.train()

    n = tokens.shape[0]
    n_val = max(2, n // 8)
    if n - n_val < 1:
        raise InputError(f"tune.samples={n} is too few; tune needs at least 3 (2 are validation)")
    val, train = mx.array(tokens[n - n_val :]), mx.array(tokens[: n - n_val])

    def log_probs(logits: Any) -> Any:
        logits = logits.astype(mx.float32)
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    def target(x: Any) -> Any:
        return mx.stop_gradient(log_probs(reference(x)))

    vocab = target(val[:1]).shape[-1]
    cache = (n * tokens.shape[1] * vocab * 4) <= LOGITS_CACHE_BYTES
    batches = [slice(i, i + batch_size) for i in range(0, train.shape[0], batch_size)]
    val_t = [target(val[i : i + 1]) for i in range(n_val)] if cache else None
    if cache:
        mx.eval(val_t)

    def kl(x: Any, t: Any) -> Any:
        lq = log_probs(model(x))
        return (mx.exp(t) * (t - lq)).sum(-1).mean()

    def validated(lo: int, hi: int, total: float = 0.0) -> float:
        """``total`` plus the KL of validation windows ``lo`` to ``hi``, summed in order."""
        for i in range(lo, hi):
            t = val_t[i] if cache else target(val[i : i + 1])
            total += kl(val[i : i + 1], t).item()
        return total

    def validation() -> float:
        """The mean validation KL; a non-finite one (a step that overflowed) as +inf, never the best."""
        v = validated(0, n_val) / n_val
        if not math.isfinite(v):
            log.warning("tune: the validation KL is %s; this epoch cannot be the one written", v)
            return math.inf
        return v

    def snapshot() -> dict[str, Any]:
        return tree_map(lambda a: mx.array(a), model.trainable_parameters())

    start = time.monotonic()
    windows = {"train": train.shape[0], "val": n_val}
    # the first window alone decides a run that would outlast max_minutes EARLY_MARGIN times over
    # (a big model's whole validation pass is minutes); its time includes the first call's start-up
    first = validated(0, 1)
    phases = 2 if codes_lr else 1
    predicted = (time.monotonic() - start) * (n_val - 1 + _forwards(windows, phases * epochs, cache=cache))
    limit = None if max_minutes is None else EARLY_MARGIN * max_minutes
    why = _skip_reason(first, predicted, epochs=phases * epochs, min_kl=-math.inf, max_minutes=limit)
    if why is not None:
        why = why.replace(f"tune.max_minutes={limit:g}", f"{EARLY_MARGIN} x tune.max_minutes={max_minutes:g}")
    done = 1
    if why is None:
        history = [validated(1, n_val, first) / n_val]
        predicted = (time.monotonic() - start) / n_val * _forwards(windows, phases * epochs, cache=cache)
        why = _skip_reason(
            history[0], predicted, epochs=phases * epochs, min_kl=min_kl, max_minutes=max_minutes
        )
        done = n_val
    else:
        history = [first]
    if why is not None:
        record = {
            "validation": [round(history[0], 6)],
            "validation_windows": done,
            "chosen_epoch": 0,
            "reason": why,
            "predicted_seconds": round(predicted, 1),
            "seconds": round(time.monotonic() - start, 3),
            "forward_equivalents": round(2 * done / n, 2),
        }
        return record, None
    train_t = [target(train[b]) for b in batches] if cache else None
    if cache:
        mx.eval(train_t)
    grad_fn = nn.value_and_grad(model, kl)
    mx.random.seed(seed)
    rng = np.random.default_rng(seed)
    best, best_epoch = snapshot(), 0

    def phase(name: str) -> None:
        """``epochs`` epochs of Adam over the trainable values (one epoch of linear warm-up, then a
        cosine decay), from the best so far; keeps the best epoch by validation KL."""
        nonlocal best, best_epoch
        total, warm = max(1, epochs * len(batches)), len(batches)
        schedule = optim.join_schedules(
            [optim.linear_schedule(lr / warm, lr, warm), optim.cosine_decay(lr, max(1, total - warm))], [warm]
        )
        opt = optim.Adam(learning_rate=schedule)
        state = [model.state, opt.state]

        @partial(mx.compile, inputs=state, outputs=state)
        def step(x: Any, t: Any) -> Any:
            loss, grads = grad_fn(x, t)
            opt.update(model, grads)
            return loss

        progress = Progress(total=epochs * len(batches), unit="steps", desc=f"tune ({name})", heartbeat=True)
        opened = len(history)  # this phase's first epoch
        started = history[best_epoch]
        for epoch in range(1, epochs + 1):
            for k in rng.permutation(len(batches)):
                b = batches[k]
                t = train_t[k] if cache else target(train[b])
                mx.eval(step(train[b], t), state)
                progress.update(1)
            history.append(validation())
            log.info(
                "tune (%s): epoch %d/%d, validation KL %.5f (the phase started at %.5f)",
                name, epoch, epochs, history[-1], started,
            )  # fmt: skip
            if history[-1] < history[best_epoch]:
                best, best_epoch = snapshot(), len(history) - 1
            elif patience and len(history) - 1 - max(best_epoch, opened - 1) >= patience and epoch < epochs:
                log.info("tune: no new best in %d epochs; stopping after epoch %d", patience, epoch)
                break
        progress.close()
        phase_epochs.append(len(history) - opened)

    phase_epochs: list[int] = []
    phase("scales")
    if codes_lr:
        # then the codes too, from the best scales: a step that moves codes too far can only lose
        # its own epochs (at 1.5x this rate the 8-layer fixture's codes never beat their start)
        model.update(best)
        for _, m in swaps:
            m.train_codes(codes_lr / lr)  # one Adam for all: an offset's step is lr x rate
            m.unfreeze(keys=["offset"], recurse=False)
        best = snapshot()  # the same values, the offsets at 0
        phase("codes")
    model.update(best)
    ran = len(history) - 1
    record = {
        "validation": [round(v, 6) if math.isfinite(v) else None for v in history],
        "chosen_epoch": best_epoch,
        "epochs_run": ran,
        "phases": ["scales", "codes"] if codes_lr else ["scales"],
        "phase_epochs": phase_epochs,  # epochs each phase ran (tune.patience can stop one early)
        "chosen_phase": _chosen_phase(best_epoch, phase_epochs),
        "predicted_seconds": round(predicted, 1),
        "trainable": {
            "groups": int(sum(m._s0.size for _, m in swaps)),
            "codes": int(sum(m._codes.size for _, m in swaps)) if codes_lr else 0,
            "norm_weights": int(sum(m._w0.size for _, m in tuned_norms)),
        },
        "codes_changed": int(sum(m.codes_changed() for _, m in swaps)),
        "seconds": round(time.monotonic() - start, 3),
        "forward_equivalents": round((_forwards(windows, ran, cache=cache) + 2 * n_val) / n, 1),
    }
    return record, {k: v for path, m in swaps + tuned_norms for k, v in m.stored_tensors(path).items()}


def _chosen_phase(epoch: int, phase_epochs: list[int]) -> str | None:
    """The phase whose epoch ``epoch`` (of the validation list) is; None for the input's values."""
    for name, end in zip(("scales", "codes"), np.cumsum(phase_epochs), strict=False):
        if 0 < epoch <= end:
            return name
    return None


EARLY_MARGIN = 4  # the first validation window hands on only a run predicted this many times too long


def _forwards(windows: dict[str, int], epochs: int, *, cache: bool) -> int:
    """Window forwards of ``epochs`` after the first validation pass: a training window costs 3
    (its backward 2) and its reference 1 (once, when the reference's log-probs are cached); each
    epoch's validation 1 a window, and the reference's again when not cached."""
    train = windows["train"] * (3 * epochs + (1 if cache else epochs))
    return train + windows["val"] * epochs * (1 if cache else 2)


def _skip_reason(
    kl: float, predicted: float, *, epochs: int, min_kl: float, max_minutes: float | None
) -> str | None:
    """Why the input is handed on untrained (None: train it)."""
    if kl < min_kl:
        return f"the input's validation KL {kl:.3g} is below tune.min_kl={min_kl:g}"
    if max_minutes is not None and predicted > 60 * max_minutes:
        return (
            f"{epochs} epochs would take about {predicted / 60:.0f} min at the speed of the first"
            f" validation window(s), over tune.max_minutes={max_minutes:g}"
        )
    return None


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


# ----------------------------------------------------------------------------- command


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


def check_reference(model: Any, reference: Any, ref_dir: Path) -> None:
    """Refuse a reference that is not the quantized model's source: each tuned module must be
    there with the weight shape it was quantized from."""
    for path, q in tunable(model):
        want = (q.weight.shape[0], q.weight.shape[1] * 32 // q.bits)
        try:
            got = tuple(module_at(reference, path).weight.shape)
        except (AttributeError, IndexError):
            got = None
        if got != want:
            there = "missing" if got is None else f"{got[0]} x {got[1]}"
            raise InputError(
                f"tune.reference={str(ref_dir)!r} is not the model model.name was quantized from:"
                f" its {path} is {there}, model.name's is {want[0]} x {want[1]}"
            )


def run(cfg: Any) -> Any:
    """command=tune: tune ``model.name`` (quantized) against ``tune.reference`` into ``<run_dir>/model``."""
    t = cfg.tune
    src, ref_dir = model_dir(cfg), _reference_dir(cfg)
    run_dir = Path(cfg.paths.run_dir)
    out = run_dir / "model"
    config = (src / "config.json").read_text() if (src / "config.json").is_file() else ""
    if '"quantization"' not in config:
        raise InputError(
            f"model.name={str(src)!r} is not a quantized model (its config.json has no quantization)"
        )
    model, tokenizer = load(str(src))
    if not tunable(model):  # refused before anything is staged
        raise InputError(NOTHING_TO_TUNE)
    reference, _, _ = load_reference(ref_dir, key="tune.reference")
    check_reference(model, reference, ref_dir)
    c = cfg.sensitivity.calib
    calib = load_calibration(
        tokenizer=tokenizer, path=c.path, samples=t.samples, seq_len=t.seq_len, seed=c.seed
    )
    record: dict[str, Any] = {
        "version": VERSION,
        "input": str(src),
        "reference": str(ref_dir),
        "calibration": calib.to_dict(),
        "settings": {
            "epochs": t.epochs, "lr": t.lr, "codes_lr": t.codes_lr, "batch_size": t.batch_size, "patience": t.patience,
            "min_kl": t.min_kl, "max_minutes": t.max_minutes,
        },
    }  # fmt: skip
    ref_params = sum(v.size for _, v in tree_flatten(reference.parameters()))
    avail = available_memory()
    need, need_codes = (memory_need(model, ref_params, codes=c) for c in (False, True))
    codes_lr = t.codes_lr
    if codes_lr and avail is not None and need_codes > MEMORY_SHARE * avail:
        codes_lr = 0.0
        record["codes"] = (
            f"kept: training them needs about {human_bytes(need_codes)},"
            f" over {MEMORY_SHARE:.0%} of the {human_bytes(avail)} available"
        )
        log.info("tune: the codes stay (%s)", record["codes"])

    def handed_on(why: str, **measured: Any) -> RunResult:
        log.warning("tune: skipped (%s); the input model is handed on unchanged", why)
        atomic_write_json(run_dir / TUNE_FILE, {**record, "status": "skipped", "reason": why, **measured})
        return RunResult(
            outputs=[run_dir / TUNE_FILE],
            metrics={
                "skipped": why,
                **{k: measured[k] for k in ("seconds", "forward_equivalents") if k in measured},
            },
            message=f"tune skipped ({why}); {src} is handed on",
            provides={"model.name": str(src)},
        )

    if t.epochs == 0:
        return handed_on("tune.epochs=0")
    if avail is not None and need > MEMORY_SHARE * avail:
        return handed_on(
            f"tuning needs about {human_bytes(need)}, over {MEMORY_SHARE:.0%} of the {human_bytes(avail)} available"
        )
    fingerprint = model_fingerprint(src, depth="header")
    key = job_key("tune", VERSION, fingerprint, str(ref_dir), record["settings"], calib.fingerprint, cfg.seed)
    with Stage.locked(out, kind="tune", key=key, root=stable_root(cfg.paths.outputs, out)) as stage:
        stage.claim(resume=False)
        result, tensors = tune_model(
            model, reference, calib.tokens, epochs=t.epochs, lr=t.lr, batch_size=t.batch_size, seed=cfg.seed,
            patience=t.patience, min_kl=t.min_kl, max_minutes=t.max_minutes, codes_lr=codes_lr,
        )  # fmt: skip
        del reference
        if tensors is None:
            stage.discard()  # nothing to write: the input is handed on
            return handed_on(result.pop("reason"), **result)
        write_tuned(src, stage.dir, tensors, shard_bytes=cfg.io.shard_bytes)
        stage.publish()
    record |= {"status": "tuned" if result["chosen_epoch"] else "unchanged", **result}
    atomic_write_json(run_dir / TUNE_FILE, record)
    name = _register(cfg, out, src)
    v = result["validation"]
    return RunResult(
        outputs=[out, run_dir / TUNE_FILE],
        inputs=[src, ref_dir],
        metrics={
            "validation_kl_before": v[0],
            "validation_kl_after": v[result["chosen_epoch"]],
            "chosen_epoch": result["chosen_epoch"],
            "chosen_phase": result["chosen_phase"],
            "codes_changed": result["codes_changed"],
            "seconds": result["seconds"],
            "forward_equivalents": result["forward_equivalents"],
        },
        message=(
            f"tuned {src.name}: validation KL {v[0]:.4g} -> {v[result['chosen_epoch']]:.4g}"
            f" (epoch {result['chosen_epoch']} of {result['epochs_run']}, {result['chosen_phase']} phase,"
            f" {result['codes_changed']} codes moved) -> {out} (registered as {name})"
            if result["chosen_epoch"]
            else f"{src.name} unchanged by tune: none of its {result['epochs_run']} epochs beat the input's"
            f" validation KL {v[0]:.4g}; its values are written to {out} (registered as {name})"
        ),
        provides={"model.name": str(out)},
        written=written_files(out),
    )


def _register(cfg: Any, out: Path, src: Path) -> str:
    """Index the tuned model as its input's registry name + ``-tuned`` (e.g.
    ``Qwen3-4B-mixed-3.50bpw-tuned``), so later recipes can name it; returns the name."""
    registry.open_db(url=cfg.registry.url, path=cfg.registry.path)
    name = f"{source_name(str(src))}-tuned"
    registry.register_model(out, name=name)
    return name
