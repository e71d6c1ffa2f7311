"""The model under probe: loading it, its quantizable modules, its blocks, fake quantization.

The ground floor every sensitivity estimator (``exact``, ``fisher``, ``sensitivity_ref``) and
the allocator's interaction rounds build on:

- ``load_model``: an mlx-lm model in float32 (a quantized source dequantized) and, per module,
  its original setting and source dtype; ``targets``: its quantizable modules as ``Target``s;
- ``fake_quant``: quantize -> dequantize of a weight at a candidate, in its source dtype;
- ``Stack``: mlx-lm's own forward over a slice of the blocks (start from a stored hidden state,
  or stop before a block);
- ``Spill``: arrays kept by name in a temporary directory or in memory;
- ``timed_forward``: the seconds of one forward, for duration estimates.

Example:
    >>> model, tokenizer, source = load_model("tests/fixtures/llama-text-3m")
    >>> tgts = targets(model, group_size=64, source=source, dtypes=source_dtypes(d) | source["dtypes"])
    >>> Stack(model).forward(tokens, stop=1)  # the hidden state entering block 1
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

from mlxbun.errors import InputError
from mlxbun.io.dtypes import OUTPUT_NAMES
from mlxbun.io.safetensors import open_model, read_config
from mlxbun.io.staging import ScratchDir
from mlxbun.quant import hessian, rounding
from mlxbun.quant.mlxlm import load
from mlxbun.quant.spec import QuantSpec
from mlxbun.quant.streamed import Dequantized, find_blocks


@dataclass(frozen=True)
class Target:
    """One quantizable module: where its probe starts and what its source weight is."""

    path: str
    group: int  # first block whose input it changes: 0 (also the embedding) .. L (head only)
    in_features: int
    out_features: int
    dtype: str  # the source dtype candidates are quantized from
    current: dict | None  # {"bits", "group_size", "mode"} when the source is already quantized


def load_model(model_dir: str | Path, *, key: str = "model.name") -> tuple[Any, Any, dict[str, dict]]:
    """mlx-lm model (float32, dequantized) + tokenizer + each quantized module's original setting;
    ``key``: the setting that named ``model_dir``, for the error when mlx-lm cannot load it."""
    if not (Path(model_dir) / "config.json").is_file():
        raise InputError(f"{key}={str(model_dir)!r} has no config.json; pass a Hugging Face model directory")
    read_config(Path(model_dir))  # a broken config.json: the one reader's line, not mlx-lm's
    try:
        model, tokenizer = load(str(model_dir))
    except (FileNotFoundError, ValueError) as e:
        raise InputError(f"{key}={str(model_dir)!r} cannot be loaded by mlx_lm: {e}") from None
    current, dtypes = {}, {}
    for path, mod in model.named_modules():
        if isinstance(mod, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            current[path] = {"bits": mod.bits, "group_size": mod.group_size, "mode": mod.mode}
            dtypes[path] = mod.scales.dtype if mod.mode == "affine" else mx.bfloat16
    _dequantize(model)
    model.set_dtype(mx.float32)
    for _, value in tree_flatten(model.parameters()):  # one at a time: no two copies of the model
        mx.eval(value)
    mx.clear_cache()  # the source dtype's freed copy back to the OS, not kept in MLX's cache
    model.eval()
    names = {path: str(dt).split(".")[-1] for path, dt in dtypes.items()}
    return model, tokenizer, {"current": current, "dtypes": names}


def _dequantize(model: Any) -> None:
    """mlx-lm's ``dequantize_model`` in place, each weight in slices of rows of about
    :data:`rounding.CHUNK` weights cast to float32 one after the other. The values come out in
    the scales' dtype first (the candidates' source), as there; dequantized whole, a large
    vocabulary's embedding alone set the probes' peak."""
    kinds = {
        nn.QuantizedLinear: nn.Linear,
        nn.QuantizedEmbedding: nn.Embedding,
        QuantizedSwitchLinear: SwitchLinear,
    }
    plain = []
    for name, mod in model.named_modules():
        cls = next((plain_cls for q, plain_cls in kinds.items() if isinstance(mod, q)), None)
        if cls is None:
            continue
        weight = rounding.dequantized(
            mod.weight, mod.scales, mod.get("biases"), group_size=mod.group_size, bits=mod.bits, mode=mod.mode,
            dtype=mx.float32,
        )  # fmt: skip
        kwargs = {} if cls is nn.Embedding else {"bias": "bias" in mod}
        new = cls(*weight.shape[::-1], **kwargs)
        if "bias" in mod:
            new.bias = mod.bias
        new.weight = weight
        plain.append((name, new))
    if plain:
        model.update_modules(tree_unflatten(plain))


def targets(
    model: Any, *, group_size: int, source: dict[str, dict], dtypes: dict[str, str], modules: Any = None
) -> list[Target]:
    """Quantizable modules in model order, with mlx-lm's predicate (and the model's own);
    ``modules``: the (path, module) pairs to look at (default: the model's)."""
    owner, owner_path = find_blocks(model)
    n = len(owner["layers"])
    prefix = f"{owner_path}.layers." if owner_path else "layers."
    pred = getattr(model, "quant_predicate", None)
    out = []
    for path, mod in model.named_modules() if modules is None else modules:
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


def fake_quant(
    weight: Any,
    cand: QuantSpec,
    *,
    dtype: str,
    hessian: Any = None,
    factor: Any = None,
    out_dtype: Any = mx.float32,
    codes: bool = False,
) -> Any:
    """quantize -> dequantize of ``weight`` cast to its source dtype, returned as float32.

    Rounded as ``cand.method`` says: rtn by ``mx.quantize``; clip and gptq by
    :func:`mlxbun.quant.rounding.quantize` with the module's input ``hessian`` (the weight
    quantize writes; gptq without one is clip there; ``factor``: the Hessian's
    ``rounding.gptq_factor``, when computed already). awq folds scales across modules and cannot be
    made one module at a time. Large rtn weights go in slices of rows (quantization groups never
    cross a row: the same values), each evaluated before the next, so the temporaries stay near
    ``rounding.CHUNK`` weights. ``out_dtype``: the dtype of the values returned (float32; the source dtype
    for a weight swapped in whole, so no float32 copy of an embedding is made). ``codes``: the
    rounding as a :class:`Dequantized` (codes, scales and biases; its values made a slice at a
    time where used): a large vocabulary's head swapped in beside its stored weight."""
    if cand.method != "rtn":
        return _rounded(weight, cand, dtype, hessian, factor, out_dtype, codes)
    rows = max(1, rounding.CHUNK // max(1, weight.size // max(1, weight.shape[-2])))
    if codes:
        wq, scales, *biases = _codes(weight, cand, getattr(mx, dtype), rows)
        return as_values(wq, scales, biases[0] if biases else None, cand, out_dtype, codes=True)
    if weight.shape[-2] <= rows:
        return _fake_quant(weight, cand, dtype).astype(out_dtype)

    def part(lo: int) -> Any:
        return _fake_quant(weight[..., lo : lo + rows, :], cand, dtype).astype(out_dtype)

    return rounding.filled_by_rows(weight.shape[-2], rows, part)


class Written:
    """A module's weight as quantize writes it at a setting, float32: RTN and the microscaling
    modes by ``mx.quantize``, clip and GPTQ by :func:`mlxbun.quant.rounding.quantize` with the
    module's Hessian. Those roundings go to ``rounded`` (:class:`mlxbun.quant.quantize.cache.Rounded`,
    keyed as quantize keys them), so a quantize of the same plan reads them back.

    ``dtype``: the output dtype quantize casts to (None: each module's ``dtypes`` entry)."""

    def __init__(
        self, *, dtype: str | None, dtypes: dict[str, str], hessians: Any = None, rounded: Any = None
    ) -> None:
        self.dtype, self.dtypes, self.hessians, self.rounded = dtype, dtypes, hessians, rounded
        # called with the weights of each clip or GPTQ rounding (a block of rows of a big weight)
        # as it is done: a 262,144-word embedding's rounding is minutes of the probes
        self.tick: Any = None
        self.kept: set[tuple[str, QuantSpec]] = set()  # made here and kept in ``rounded``

    def to_round(self, pairs: Sequence[tuple[str, QuantSpec]]) -> list[tuple[str, QuantSpec]]:
        """Of these (module, setting) roundings, those this will make and tick: with ``rounded``
        each once, and none it has kept already (again, it is read back from ``rounded`` in
        moments, e.g. a tied head's after its lookups', or a second probe round's)."""
        if self.rounded is None:
            return list(pairs)
        return [p for p in dict.fromkeys(pairs) if p not in self.kept]

    def __call__(
        self, path: str, w: Any, spec: QuantSpec, out_dtype: Any = mx.float32, codes: bool = False
    ) -> Any:
        dtype = self.dtype or self.dtypes.get(path, "bfloat16")
        if spec.method == "rtn" or spec.mode != "affine":
            return fake_quant(w, spec, dtype=dtype, out_dtype=out_dtype, codes=codes)
        from mlxbun.quant.quantize.convert import piece_rows  # quantize's blocks: its cache keys

        src = w.astype(getattr(mx, dtype))
        setting = {"bits": spec.bits, "group_size": spec.group_size, "method": spec.method}
        itemsize = getattr(mx, self.dtypes.get(path, "bfloat16")).size  # the source's, as quantize reads it
        step = piece_rows(src.shape[0], src.shape[-1], itemsize) if src.ndim == 2 else None
        factor: dict[str, Any] = {}  # GPTQ's factor of the module's H: once for all its blocks
        tick = self.tick if self.to_round([(path, spec)]) else None
        if step is None:
            wq, scales, biases = self._rounded(path, src, setting, factor, tick)
        else:  # in quantize's blocks of rows (rows round alone: the same values as whole)
            rows = range(0, src.shape[0], step)
            parts = [self._rounded(path, src[r : r + step], setting, factor, tick) for r in rows]
            wq = np.concatenate([np.asarray(p[0]) for p in parts])
            scales, biases = (mx.concatenate([p[k] for p in parts]) for k in (1, 2))
            del parts
        if self.rounded is not None:
            self.kept.add((path, spec))
        return as_values(mx.array(wq), scales, biases, spec, out_dtype, codes=codes)

    def _rounded(
        self, path: str, src: Any, setting: dict[str, Any], factor: dict[str, Any], tick: Any
    ) -> tuple[Any, Any, Any]:
        """``src`` (module ``path``'s weight, or a block of its rows) rounded at ``setting``: read
        back from ``rounded`` when kept there, else rounded with the module's Hessian and kept
        (``factor``: GPTQ's factor of it, filled by the first block that needs it); ``tick``
        (or None) is called with its weights."""
        file = None if self.rounded is None else self.rounded.file(path, src, **setting)
        out = None if file is None else self.rounded.get(file, path)
        if out is None:
            h = self.hessians[path] if self.hessians is not None and path in self.hessians else None
            try:
                if h is not None and setting["method"] == "gptq" and "f" not in factor:
                    factor["f"] = rounding.gptq_factor(h)
                out = rounding.quantize(src, hessian=h, factor=factor.get("f"), **setting)
            except rounding.NotPositiveDefinite as e:
                raise hessian.refused(
                    getattr(self.hessians, "path", "quant.hessians"), path, str(e)
                ) from None
            mx.eval(*out)
            rounding.check_finite(path, {f"{path}.scales": out[1], f"{path}.biases": out[2]})
            if file is not None:
                self.rounded.put(file, out, path, **setting)
        if tick is not None:
            tick(float(src.size))
        return out


def _rounded(
    weight: Any, cand: QuantSpec, dtype: str, hessian: Any, factor: Any, out_dtype: Any, codes: bool
) -> Any:
    if cand.method not in ("clip", "gptq"):
        raise ValueError(f"fake_quant: method {cand.method!r} cannot be applied to one module alone")
    src = weight.astype(getattr(mx, dtype))
    wq, s, b = rounding.quantize(
        src, bits=cand.bits, group_size=cand.group_size, method=cand.method, hessian=hessian, factor=factor
    )
    return as_values(wq, s, b, cand, out_dtype, codes=codes)


def _codes(weight: Any, cand: QuantSpec, dtype: Any, rows: int) -> list[Any]:
    """``mx.quantize`` of ``weight`` (cast to ``dtype``) a slice of ``rows`` rows at a time, each
    written into its place in the codes, scales and biases as it is made: slices and their
    concatenation would hold the codes twice (8-bit codes of a 262,144-word embedding: 1.4 GB)."""

    def part(lo: int) -> list[Any]:
        q = weight[..., lo : lo + rows, :].astype(dtype)
        return list(mx.quantize(q, group_size=cand.group_size, bits=cand.bits, mode=cand.mode))

    return rounding.filled_by_rows(weight.shape[-2], rows, part)


def as_values(wq: Any, scales: Any, biases: Any, cand: QuantSpec, dtype: Any, *, codes: bool) -> Any:
    """A rounding's values as ``dtype``: made whole, or (``codes``) a :class:`Dequantized`."""
    how = {"group_size": cand.group_size, "bits": cand.bits, "mode": cand.mode}
    if codes:
        return Dequantized(wq, scales, biases, dtype=dtype, **how)
    return rounding.dequantized(wq, scales, biases, dtype=dtype, **how)


def _fake_quant(weight: Any, cand: QuantSpec, dtype: str) -> Any:
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


class Spill:
    """Arrays kept in a temporary directory by name (.npy): reference logits, pooled gradients;
    or in memory (``in_memory``, set before the first ``put``)."""

    def __init__(self) -> None:
        self._dir = ScratchDir("mlxbun-fisher-")  # a killed run's spill goes at the next one
        self._names: dict[str, Path | np.ndarray] = {}
        self._files = 0  # files ever written: a name put again gets a new file, not another's
        self.in_memory = False

    def put(self, name: str, value: Any) -> int:
        """Stores ``value`` under ``name``; returns its bytes."""
        arr = np.array(value)
        if self.in_memory:
            self._names[name] = arr
            return arr.nbytes
        self._files += 1
        path = Path(self._dir.name) / f"{self._files}.npy"
        np.save(path, arr)
        if isinstance(old := self._names.get(name), Path):
            old.unlink()
        self._names[name] = path
        return arr.nbytes

    def has(self, name: str) -> bool:
        return name in self._names

    def get(self, name: str, *, mmap: bool = False) -> np.ndarray:
        """The array stored as ``name`` (``mmap``: a read-only map of a file, not a read)."""
        kept = self._names[name]
        if isinstance(kept, np.ndarray):
            return kept
        return np.load(kept, mmap_mode="r" if mmap else None)

    def clear(self) -> None:
        for kept in self._names.values():
            if isinstance(kept, Path):
                kept.unlink()
        self._names = {}

    def close(self) -> None:
        self._dir.cleanup()


def timed_forward(model: Any, tokens: Any, batch_size: int) -> float:
    """Seconds of one forward of a batch, from a forward of its first quarter of tokens (>= 16)."""
    length = tokens.shape[1]
    part = min(length, max(16, length // 4))
    x = mx.array(tokens[:batch_size, :part])
    t0 = time.perf_counter()
    mx.eval(model(x))
    return (time.perf_counter() - t0) * length / part
