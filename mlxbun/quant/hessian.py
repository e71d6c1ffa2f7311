"""Per-module input second moments H = sum of x x^T over calibration tokens (the GPTQ Hessian).

The output error of a linear layer on the calibration inputs is ``trace(dW H dW^T)``; its
diagonal is the per-column importance the activation-weighted range search uses, and
``sqrt(diag(H) / tokens)`` the per-channel activation size AWQ scales by (:mod:`mlxbun.quant.awq`).
A tied embedding, when used as the output head, gets the H of the head's inputs under its own path.
Hessians are the bulk of a capture (q/k/v and gate/up each store the H their shared input has):
:func:`write` puts each block's in the file as soon as the block is done.

Capture is streamed block by block: the calibration tokens are embedded once, then each decoder
block runs over the hidden states of all samples (with hooks on its linears) and hands its output
to the next, so memory holds the hidden states of the calibration set plus one block's
activations; with the weights loaded lazily (:func:`load_lazy`), :func:`write` drops each block
once done, so it also holds about one block of weights at a time. From the CLI (and with a cache
keyed by model and calibration): ``command=calibrate`` (:mod:`mlxbun.quant.calibrate`).

On disk::

    hessians.safetensors      one float32 (in, in) tensor per module path;
                              metadata {"format": "mlxbun-hessians", "tokens": "<n>"} and, when
                              written by command=calibrate (:mod:`mlxbun.quant.calibrate`),
                              "model" (its fingerprint) and "calibration" (the samples' record, JSON)

Example:
    >>> h = capture(model, calib.tokens)          # model: float32 mlx-lm model
    >>> save(h, out / "hessians.safetensors", tokens=calib.tokens.size)
    >>> output_error(w_quantized - w, h["model.layers.0.mlp.down_proj"])
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from mlxbun.errors import InputError
from mlxbun.io.atomic import atomic_open
from mlxbun.io.safetensors import SafetensorsFile, read_config
from mlxbun.quant import mlxlm
from mlxbun.quant.streamed import find_blocks
from mlxbun.source.fingerprint import model_fingerprint

FORMAT = "mlxbun-hessians"


def _accumulate(store: dict, path: str, x: Any) -> None:
    xf = x.reshape(-1, x.shape[-1]).astype(mx.float32)
    # addmm adds the batch's Gram matrix into the running H's buffer (the old H is donated, on the
    # CPU backend): a sum then an add holds a second H, the largest thing a wide down_proj's
    # capture has (MLX's CUDA backend holds the second H either way)
    store[path] = xf.T @ xf if path not in store else mx.addmm(store[path], xf.T, xf)


class _Catcher(nn.Module):
    """Stands in for a Linear: records its input's Gram matrix, then calls it (``call=False``: a
    head whose output nobody needs returns one zero column instead of the full logits)."""

    def __init__(self, module: Any, path: str, store: dict, call: bool = True) -> None:
        super().__init__()
        self.module, self.path, self.store, self.call = module, path, store, call

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        _accumulate(self.store, self.path, x)
        if not self.call:
            return mx.zeros((*x.shape[:-1], 1), x.dtype)
        return self.module(x, *args, **kwargs)


class _Stop(Exception):
    pass


class _StandIn(nn.Module):
    """Stands in for a block; other attributes (e.g. ``use_sliding``, read by the model's forward)
    come from the block it replaces, which is not registered as a child."""

    def __init__(self, block: Any) -> None:
        super().__init__()
        object.__setattr__(self, "_block", block)

    def __getattr__(self, key: str) -> Any:
        try:
            return super().__getattr__(key)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_block"), key)


class _Record(_StandIn):
    """Stands in for a block in the first pass: keeps the arguments it is called with (masks may
    differ per block, e.g. sliding-window layers) and passes the hidden state on; the last one stops."""

    def __init__(self, block: Any, seen: list, last: bool) -> None:
        super().__init__(block)
        object.__setattr__(self, "_seen", seen)
        object.__setattr__(self, "_last", last)

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        object.__getattribute__(self, "_seen").append((x, args, kwargs))
        if object.__getattribute__(self, "_last"):
            raise _Stop
        return x


class _Pass(_StandIn):
    """Stands in for a block already run: returns its input (the stored output of the last block)."""

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        return x


class _Feed(nn.Module):
    """Stands in for the embedding in the final pass: returns the last block's output for the batch;
    its ``as_linear`` (a tied head) records its input and skips the logits."""

    def __init__(self, embed: Any, path: str, store: dict) -> None:
        super().__init__()
        self.embed, self.path, self.store, self.h = embed, path, store, None

    def __call__(self, tokens: Any) -> Any:
        return self.h

    def as_linear(self, x: Any) -> Any:
        _accumulate(self.store, self.path, x)
        return mx.zeros((*x.shape[:-1], 1), x.dtype)  # the logits are not needed


def _hook(module: Any, prefix: str, store: dict) -> list[tuple[str, Any]]:
    """Replace every Linear under ``module`` by a catcher; the (relative path, original) pairs."""
    leaves = tree_flatten(module.leaf_modules(), is_leaf=nn.Module.is_module)
    linears = [(p, m) for p, m in leaves if isinstance(m, nn.Linear)]
    module.update_modules(tree_unflatten([(p, _Catcher(m, prefix + p, store)) for p, m in linears]))
    return linears


def _blocks(model: Any) -> tuple[list, str]:
    owner, owner_path = find_blocks(model)
    return owner["layers"], f"{owner_path}.layers." if owner_path else "layers."


def _entry_states(model: Any, layers: list, tokens: np.ndarray, batch_size: int) -> list[list]:
    """Per block, per batch of samples: (hidden state entering block 0, the block's args, kwargs)."""
    saved = list(layers)
    seen: list[list] = [[] for _ in saved]
    layers[:] = [_Record(b, seen[i], i == len(saved) - 1) for i, b in enumerate(saved)]
    try:
        for i in range(0, len(tokens), batch_size):
            try:
                model(mx.array(tokens[i : i + batch_size]))
            except _Stop:
                pass
    finally:
        layers[:] = saved
    mx.eval([x for x, _, _ in seen[0]])
    return seen


def _run_block(block: Any, prefix: str, states: list, store: dict) -> list:
    """Run ``block`` over every batch with hooks on its linears; the states entering the next block."""
    originals = _hook(block, prefix, store)
    try:
        out = []
        for x, args, kwargs in states:
            y = block(x, *args, **kwargs)
            mx.eval(y, list(store.values()))
            out.append((y, args, kwargs))
    finally:
        block.update_modules(tree_unflatten(originals))
    return out


def _run_head(model: Any, layers: list, states: list, store: dict) -> None:
    """The model after its last block (final norm, head) on the last block's outputs."""
    leaves = dict(tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module))
    embeds = [(p, m) for p, m in leaves.items() if isinstance(m, nn.Embedding)]
    saved = list(layers)
    layers[:] = [_Pass(b) for b in saved]
    feeds = [(p, m, _Feed(m, p, store)) for p, m in embeds]
    model.update_modules(tree_unflatten([(p, f) for p, _, f in feeds]))
    outside = [(p, m) for p, m in leaves.items() if isinstance(m, nn.Linear) and ".layers." not in f".{p}"]
    model.update_modules(tree_unflatten([(p, _Catcher(m, p, store, call=False)) for p, m in outside]))
    try:
        for x, _, _ in states:
            for _, _, f in feeds:
                f.h = x
            mx.eval(model(mx.zeros((x.shape[0], x.shape[1]), mx.int32)), list(store.values()))
    finally:
        layers[:] = saved
        model.update_modules(tree_unflatten([(p, m) for p, m, _ in feeds] + outside))


def capture(
    model: Any,
    tokens: np.ndarray,
    *,
    batch_size: int = 8,
    release: bool = False,
    sink: Callable[[str, np.ndarray], None] | None = None,
    on_block: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """H of every Linear (and a tied embedding's head use) over ``tokens`` (samples, seq_len).

    Streamed block by block (module docstring). ``release=True`` drops each block's weights once
    it has run (the model is unusable afterwards): with a lazily loaded model, memory then holds
    about one block of weights. ``sink(path, H)`` takes each block's Hessians as soon as the block
    is done (they are then not kept, and the returned dict is empty). ``on_block()`` is called
    after each block and after the head (``n_blocks + 1`` calls: progress).
    """
    store: dict[str, Any] = {}
    layers, prefix = _blocks(model)
    calls = _entry_states(model, layers, tokens, batch_size)
    states = calls[0]
    for i in range(len(layers)):
        states = [(x, a, k) for (x, _, _), (_, a, k) in zip(states, calls[i], strict=True)]
        states = _run_block(layers[i], f"{prefix}{i}.", states, store)
        if release:  # empty arrays in place of the weights: the block's memory is freed
            layers[i].update(tree_map(lambda a: mx.zeros((0,), a.dtype), layers[i].parameters()))
        _drain(store, sink)
        if on_block is not None:
            on_block()
    _run_head(model, layers, states, store)
    _drain(store, sink)
    if on_block is not None:
        on_block()
    return store


def n_blocks(model: Any) -> int:
    """The decoder blocks :func:`capture` runs one at a time."""
    return len(_blocks(model)[0])


def _drain(store: dict[str, Any], sink: Callable[[str, np.ndarray], None] | None) -> None:
    for path in sorted(store) if sink is not None else ():
        sink(path, np.asarray(store.pop(path)))


def load_lazy(model_dir: str | Path) -> tuple[Any, Any]:
    """mlx-lm model (float32, weights read from disk only when a block first runs) and tokenizer."""
    read_config(Path(model_dir))  # a broken config.json: the one reader's line, not mlx-lm's
    try:
        model, tokenizer = mlxlm.load(model_dir, lazy=True)
    except (FileNotFoundError, ValueError) as e:
        raise InputError(f"model.name={str(model_dir)!r} cannot be loaded by mlx_lm: {e}") from None
    model = mlxlm.dequantize_model(model)
    # Embeddings keep their stored dtype: a row lookup is exact in it, and a large vocabulary's
    # float32 copy would be the biggest thing in memory (the head's logits are never computed).
    embeds = [(m, m.weight) for _, m in model.named_modules() if isinstance(m, nn.Embedding)]
    model.set_dtype(mx.float32)
    for m, w in embeds:
        m.weight = w
    model.eval()
    return model, tokenizer


def write(
    model: Any,
    tokens: np.ndarray,
    out: str | Path,
    *,
    batch_size: int = 8,
    meta: Mapping[str, str] | None = None,
    on_block: Callable[[], None] | None = None,
) -> str:
    """:func:`capture` of a lazily loaded ``model`` (released block by block) straight into the
    file ``out`` (:class:`Writer`): memory holds one block's weights and Hessians at a time.
    Returns the file's sha256."""
    with Writer(out) as writer:
        capture(model, tokens, batch_size=batch_size, release=True, sink=writer.add, on_block=on_block)
        return writer.finish(tokens=tokens.size, meta=meta)


class Writer:
    """Writes Hessians as they come (data to a hidden spool file beside ``path``), then
    :meth:`finish` puts the safetensors header (sorted names) in front and renames atomically:
    memory holds one module's H at a time. Without ``finish`` nothing is published."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.spool_path = self.path.with_name(f".{self.path.name}.spool")
        self.spool = open(self.spool_path, "wb")  # noqa: SIM115  (closed by finish / __exit__)
        self.entries: dict[str, dict[str, Any]] = {}
        self.offset = 0

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.spool.close()
        self.spool_path.unlink(missing_ok=True)

    def add(self, name: str, h: Any) -> None:
        data = np.ascontiguousarray(np.asarray(h, dtype=np.float32))
        if data.ndim != 2 or data.shape[0] != data.shape[1] or name in self.entries:
            raise ValueError(f"hessian {name!r}: shape {data.shape}, or written twice")
        self.spool.write(data.tobytes())
        end = self.offset + data.nbytes
        self.entries[name] = {"dtype": "F32", "shape": list(data.shape), "data_offsets": [self.offset, end]}
        self.offset = end

    def finish(self, *, tokens: int, meta: Mapping[str, str] | None = None) -> str:
        """Publish the file and return its sha256 (computed as it is written); ``meta``: more
        metadata strings (e.g. "model", "calibration")."""
        self.spool.close()
        header = {
            "__metadata__": {**(meta or {}), "format": FORMAT, "tokens": str(tokens)},
            **dict(sorted(self.entries.items())),
        }
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        digest = hashlib.sha256(struct.pack("<Q", len(text)) + text)
        with atomic_open(self.path) as f, open(self.spool_path, "rb") as data:
            f.write(struct.pack("<Q", len(text)) + text)
            while block := data.read(16 << 20):
                digest.update(block)
                f.write(block)
        return digest.hexdigest()


def save(hessians: dict[str, Any], path: str | Path, *, tokens: int) -> None:
    """Write ``hessians`` atomically as one safetensors file (:class:`Writer`)."""
    with Writer(path) as writer:
        for name in sorted(hessians):
            writer.add(name, hessians[name])
        writer.finish(tokens=tokens)


def load(path: str | Path) -> dict[str, Any]:
    """Read a file written by :func:`save`; refuses anything else."""
    arrays, meta = mx.load(str(path), return_metadata=True)
    if meta.get("format") != FORMAT:
        raise InputError(
            f"quant.hessians={str(path)!r} is not an mlxbun hessians file (format={meta.get('format')!r})"
        )
    for name, h in arrays.items():
        if h.ndim != 2 or h.shape[0] != h.shape[1]:
            raise InputError(
                f"quant.hessians={str(path)!r}: {name!r} has shape {tuple(h.shape)}; expected (n, n)"
            )
        check(np.asarray(h.astype(mx.float32)), file=path, module=name)
    return arrays


class Hessians(Mapping):
    """A hessians file read one module at a time (a float32 numpy copy per lookup, its mapped pages
    dropped after): quantizing holds only the Hessians of the modules in flight. Thread-safe."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.file = SafetensorsFile(path)
        if self.file.metadata.get("format") != FORMAT:
            raise InputError(
                f"quant.hessians={str(path)!r} is not an mlxbun hessians file"
                f" (format={self.file.metadata.get('format')!r})"
            )
        for name, info in self.file.infos().items():
            if len(info.shape) != 2 or info.shape[0] != info.shape[1] or info.dtype != "F32":
                raise InputError(
                    f"quant.hessians={str(path)!r}: {name!r} has shape {tuple(info.shape)} ({info.dtype});"
                    " expected float32 (n, n)"
                )

    def __getitem__(self, path: str) -> np.ndarray:
        if path not in self.file:
            raise KeyError(path)
        out = np.array(self.file.numpy(path), dtype=np.float32, copy=True)
        self.file.release(path)
        check(out, file=self.file.path, module=path)
        return out

    def __contains__(self, path: object) -> bool:
        # Mapping's own would read and check the module's H only to answer
        return path in self.file

    def check_shapes(self, in_features: Mapping[str, int]) -> None:
        """Each module's H is (in, in) for the ``in_features`` of that module in the model."""
        for module, info in self.file.infos().items():
            n = in_features.get(module)
            if n is not None and info.shape[0] != n:
                raise refused(
                    self.file.path, module, f"has shape {tuple(info.shape)}; the model's in_features is {n}"
                )

    def __iter__(self) -> Iterator[str]:
        return iter(self.file.names())

    def __len__(self) -> int:
        return len(self.file.names())


def check_model(path: str | Path, model_dir: str | Path, *, key: str = "model.name") -> bool:
    """Refuse Hessians captured on another model: the "model" fingerprint command=calibrate
    recorded in the file (``model_fingerprint(depth="sampled")``) against ``model_dir``'s.
    False when the file records none (written by :func:`save`): it is then checked by shapes only."""
    with SafetensorsFile(path) as f:
        recorded = f.metadata.get("model")
    if not recorded:
        return False
    actual = model_fingerprint(model_dir, depth="sampled")
    if recorded != actual:
        raise InputError(
            f"quant.hessians={str(path)!r} was captured on another model (fingerprint {recorded[:12]})"
            f" than {key}={str(model_dir)!r} ({actual[:12]}); capture this model's Hessians"
            f" (python -m mlxbun command=calibrate {key}=...)"
        )
    return True


SYMMETRY_TOL = 1e-4  # |H - H^T| relative to max diag(H): float32 accumulation stays far below
TILE = 512  # compared a square tile at a time: no second copy of a large H, cache-friendly


def refused(file: str | Path, module: str, what: str) -> InputError:
    """The one line for a module's Hessian that cannot be used."""
    return InputError(
        f"quant.hessians={str(file)!r}: {module!r} {what}; capture the Hessians again"
        " (python -m mlxbun command=calibrate)"
    )


def check(h: np.ndarray, *, file: str | Path, module: str) -> None:
    """Refuse an H that no set of inputs gives: a NaN or Inf, a negative diagonal, an asymmetry,
    or an entry beyond sqrt(H_ii H_jj) (not positive semi-definite). The rest of positive
    definiteness is the Cholesky GPTQ takes (``mlxbun.quant.rounding.inverse_factor``)."""
    finite = np.isfinite(h)
    if not finite.all():
        raise refused(file, module, f"holds {int(h.size - finite.sum())} NaN or Inf value(s)")
    d = np.diag(h).astype(np.float64)
    if (d < 0).any():
        i = int(np.argmin(d))
        raise refused(file, module, f"has a negative diagonal entry H[{i},{i}]={d[i]:.6g}")
    tol = np.float32(SYMMETRY_TOL * max(float(d.max(initial=0.0)), 1e-30))
    root = np.sqrt(d).astype(np.float32) * np.float32(np.sqrt(1 + SYMMETRY_TOL))
    for i in range(0, h.shape[0], TILE):  # square tiles of the upper half, each against its mirror
        for j in range(i, h.shape[0], TILE):
            tile = h[i : i + TILE, j : j + TILE]
            if np.abs(tile - h[j : j + TILE, i : i + TILE].T).max(initial=0) > tol:
                raise refused(file, module, "is not symmetric")
            if (np.abs(tile) > root[i : i + TILE, None] * root[None, j : j + TILE] + tol).any():
                raise refused(file, module, "is not positive semi-definite (|H_ij| > sqrt(H_ii H_jj))")


def output_error(dw: Any, h: Any) -> float:
    """``trace(dW H dW^T)``: summed squared output error of a weight change on the captured inputs."""
    dw = dw.astype(mx.float32)
    return float(mx.sum((dw @ h) * dw))
