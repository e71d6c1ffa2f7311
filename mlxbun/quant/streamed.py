"""A model read from its safetensors a decoder block at a time: the engine the heavy steps stream through.

Memory holds mlx-lm's model skeleton (parameters lazy, never evaluated), the embedding and the
head (float32 where they are matmuls), one decoder block's weights in float32 at a time, and the
hidden states of the windows in flight; never the whole model in float32 and never the logits of
every token at once. The same code runs a 0.5B and a 27B model: memory grows with one block's
width and the vocabulary, time with depth.

mlx-lm's own code computes everything (embedding scale, masks, blocks, final norm, tied head):
each block is called with the arguments the model's forward gives it, recorded once per length.

Example:
    >>> s = Stream("tests/fixtures/llama-text-3m")
    >>> h = s.embed(tokens)                   # [n, T, D] float32
    >>> for i in range(s.n_blocks):
    ...     with s.loaded(i):                 # block i's weights read from disk, released after
    ...         h = s.run(i, h)
    >>> total = s.kl_sum(h_ref, h)            # summed KL(ref || cur) over the tokens, token slices
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from mlxbun.errors import InputError
from mlxbun.io.parameters import quant_params, quantization_block
from mlxbun.io.safetensors import open_model, read_config
from mlxbun.kl import kl_logits
from mlxbun.quant.mlxlm import load_config, model_classes
from mlxbun.quant.rounding import dequantized

# Logits (and their temporaries, about four copies) of this many bytes at once at most: the
# head runs on slices of tokens, whatever the vocabulary.
LOGIT_BYTES = 256 << 20


class _Stop(Exception):
    pass


class _Recorder(nn.Module):
    """Stands in for a block: records the arguments it is called with and passes the state on;
    ``stop``: raises instead (the forward ends there)."""

    def __init__(self, block: Any, seen: list, stop: bool) -> None:
        super().__init__()
        object.__setattr__(self, "_block", block)
        object.__setattr__(self, "_seen", seen)
        object.__setattr__(self, "_stop", stop)

    def __getattr__(self, key: str) -> Any:  # e.g. use_sliding, read by the model's forward
        try:
            return super().__getattr__(key)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_block"), key)

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        object.__getattribute__(self, "_seen").append((x, args, kwargs))
        if object.__getattribute__(self, "_stop"):
            raise _Stop
        return x


Tap = Callable[[mx.array, mx.array], mx.array]


class _Feed(nn.Module):
    """Stands in for the embedding when only the head runs: returns the hidden state it is given;
    a tied head's ``as_linear`` is the real embedding's (through ``tap``, when given)."""

    def __init__(self, embedding: Any, h: Any, tap: Tap | None = None) -> None:
        super().__init__()
        object.__setattr__(self, "_embedding", embedding)
        object.__setattr__(self, "_h", h)
        object.__setattr__(self, "_tap", tap)

    def __call__(self, tokens: Any) -> Any:
        return object.__getattribute__(self, "_h")

    def as_linear(self, x: Any) -> Any:
        y = object.__getattribute__(self, "_embedding").as_linear(x)
        tap = object.__getattribute__(self, "_tap")
        return y if tap is None else tap(x, y)


class _Tapped(nn.Module):
    """Stands in for a head Linear: its output through ``tap(x, y)``."""

    def __init__(self, module: Any, tap: Tap) -> None:
        super().__init__()
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "_tap", tap)

    def __call__(self, x: Any) -> Any:
        return object.__getattribute__(self, "_tap")(x, object.__getattribute__(self, "_module")(x))


class _Added(nn.Module):
    """Stands in for the embedding: its rows plus ``add`` (same shape as the lookup's output)."""

    def __init__(self, embedding: Any, add: Any) -> None:
        super().__init__()
        object.__setattr__(self, "_embedding", embedding)
        object.__setattr__(self, "_add", add)

    def __call__(self, tokens: Any) -> Any:
        return object.__getattribute__(self, "_embedding")(tokens).astype(
            mx.float32
        ) + object.__getattribute__(self, "_add")

    def as_linear(self, x: Any) -> Any:
        return object.__getattribute__(self, "_embedding").as_linear(x)


HEAD_CHUNK_BYTES = 64 << 20  # float32 bytes of the head's matrix cast at once


def chunked_matmul(x: mx.array, w: mx.array) -> mx.array:
    """``x @ w.T`` in float32, ``w`` (its stored dtype) cast a slice of its rows at a time, each
    slice's product evaluated before the next is cast: a large vocabulary's head is never copied
    to float32 whole (evaluated as one graph, every slice's cast is alive at once)."""
    rows = max(1, HEAD_CHUNK_BYTES // (4 * w.shape[-1]))
    x = x.astype(mx.float32)
    if w.shape[0] <= rows:
        return x @ w.astype(mx.float32).T
    parts = []
    for lo in range(0, w.shape[0], rows):
        parts.append(x @ w[lo : lo + rows].astype(mx.float32).T)
        mx.eval(parts[-1])
    return mx.concatenate(parts, axis=-1)


class Dequantized:
    """A quantized embedding's or head's weight, its values (``dtype``) made only where they are
    taken: the rows a lookup selects, or the slices of vocabulary :func:`chunked_matmul`
    multiplies by. An exact stream (tune's quantized model) holds the packed codes and float32
    scales and biases, about a fifth of the float32 matrix (Gemma-3-27B's embedding: 5.6 GB in
    float32); a probe's rounded head or embedding swapped in (:meth:`Stream.swapped`) its codes
    beside the stored weight, not a second copy of it."""

    def __init__(
        self,
        packed: mx.array,
        scales: mx.array,
        biases: mx.array | None,
        *,
        dtype: Any = mx.float32,
        **how: Any,
    ) -> None:
        self.packed, self.scales, self.biases, self.dtype, self.how = packed, scales, biases, dtype, how
        self.shape = (packed.shape[0], packed.shape[1] * 32 // how["bits"])

    def __getitem__(self, rows: Any) -> mx.array:
        biases = None if self.biases is None else self.biases[rows]
        return dequantized(self.packed[rows], self.scales[rows], biases, dtype=self.dtype, **self.how)

    def astype(self, dtype: Any) -> mx.array:
        return self[:].astype(dtype)


class _Head(nn.Module):
    """Stands in for a head (a Linear, or an Embedding that is also the head): its weight stays in
    its stored dtype and the logits are computed by :func:`chunked_matmul`; an embedding's lookup
    is its own."""

    def __init__(self, module: Any) -> None:
        super().__init__()
        object.__setattr__(self, "_module", module)

    @property
    def weight(self) -> mx.array:
        return object.__getattribute__(self, "_module").weight

    def __call__(self, x: Any) -> Any:
        m = object.__getattribute__(self, "_module")
        if isinstance(m, nn.Embedding):
            return m(x)
        y = chunked_matmul(x, m.weight)
        return y + m.bias if "bias" in m else y

    def as_linear(self, x: Any) -> Any:
        return chunked_matmul(x, object.__getattribute__(self, "_module").weight)


def _set_weight(mod: Any, w: mx.array | Dequantized) -> None:
    """A module's weight: an array as its parameter, a :class:`Dequantized` as a plain attribute
    (no parameter of the model holds it whole)."""
    if isinstance(w, Dequantized):
        mod.pop("weight", None)
        object.__setattr__(mod, "weight", w)
    else:
        mod.__dict__.pop("weight", None)
        mod["weight"] = w


def find_blocks(model: Any) -> tuple[Any, str]:
    """The module holding the decoder block list and its path (``model`` for llama's ``model.layers``)."""
    best = None
    for path, mod in model.named_modules():
        layers = mod.get("layers") if isinstance(mod, dict) else None
        if isinstance(layers, list) and layers and all(isinstance(x, nn.Module) for x in layers):
            if best is None or path.count(".") < best[0].count("."):
                best = (path, mod)
    if best is None:
        raise InputError(f"model class {type(model).__name__} has no block list 'layers'; cannot stream it")
    return best[1], best[0]


class Stream:
    """One model, its weights read from ``model_dir`` a decoder block at a time (module docstring).

    A quantized source (an mlx-lm quantized directory) is dequantized as it is read: its modules
    run as plain float32 linears of the values it stores, rounded to its scales' dtype (the source
    a candidate is quantized again from), or exactly (``exact``: what the quantized model computes)."""

    def __init__(self, model_dir: str | Path, *, key: str = "model.name", exact: bool = False) -> None:
        self.dir, self.exact = Path(model_dir), exact
        if not (self.dir / "config.json").is_file():
            raise InputError(
                f"{key}={str(self.dir)!r} has no config.json; pass a Hugging Face model directory"
            )
        read_config(self.dir)  # a broken config.json: the one reader's line
        self.config = load_config(self.dir)
        self.reader = open_model(self.dir)
        model_class, args_class = model_classes(self.config)
        try:
            self.model = model_class(args_class.from_dict(self.config))
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(f"{key}={str(self.dir)!r}: config.json does not fit mlx-lm ({e})") from None
        self.sources = self._sources(key)
        self.owner, owner_path = find_blocks(self.model)
        self.blocks = list(self.owner["layers"])
        self.n_blocks = len(self.blocks)
        self.prefix = f"{owner_path}.layers." if owner_path else "layers."
        self._lazy = {i: dict(tree_flatten(b.parameters())) for i, b in enumerate(self.blocks)}
        self._calls: dict[int, list] = {}
        self._paths = self._find_outside()
        self._load_outside()
        for path in {self.embedding_path, *self.head_paths}:
            self._set_module(path, _Head(self.module(path)))
        self.model.eval()

    # ------------------------------------------------------------------ reading weights

    def _sources(self, key: str) -> dict[str, str]:
        """Model parameter -> source tensor it is read from (mlx-lm's ``sanitize`` renames and
        drops followed on lazy views, as mlx-lm loads)."""
        raw = {}
        for f in self.reader.files:
            raw.update(mx.load(str(f)))
        by_id = {id(v): k for k, v in raw.items()}
        weights = self.model.sanitize(dict(raw)) if hasattr(self.model, "sanitize") else dict(raw)
        params = dict(tree_flatten(self.model.parameters()))
        out = {}
        for name in params:
            v = weights.get(name)
            src = by_id.get(id(v)) if v is not None else None
            if src is None or raw[src] is not v:
                raise InputError(
                    f"{key}={str(self.dir)!r}: tensor {name!r} is missing or built by mlx-lm at load"
                    " time (e.g. stacked experts); this model type cannot be streamed a block at a time"
                )
            out[name] = src
        return out

    def read(self, name: str) -> mx.array:
        """Model parameter ``name`` in float32, read from disk (a quantized module's dequantized)."""
        quantized = self._quantized(name, exact=self.exact)
        # in slices of rows: whole, a large vocabulary's temporaries are several times its size
        w = quantized[:] if quantized is not None else self.reader.array(self.sources[name])
        w = w.astype(mx.float32)
        mx.eval(w)
        return w

    def _quant_of(self, name: str) -> dict | None:
        """The quantization (bits, group_size, mode) parameter ``name`` is stored with; None when
        it is stored unquantized."""
        src = self.sources[name]
        base = src[: -len(".weight")] if src.endswith(".weight") else None
        if base is None or f"{base}.scales" not in self.reader:
            return None
        scales = self.reader.info(f"{base}.scales")
        q = quant_params(
            base, weight_shape=tuple(self.reader.info(src).shape), scales_shape=tuple(scales.shape),
            scales_dtype=scales.dtype, quantization=quantization_block(self.config),
        )  # fmt: skip
        return {"bits": q["bits"], "group_size": q["group_size"], "mode": q.get("mode", "affine")}

    def source(self) -> dict[str, dict]:
        """A quantized source's settings: {"current": {module: {bits, group_size, mode}},
        "dtypes": {module: its scales' dtype}} (both empty for an unquantized source)."""
        current, dtypes = {}, {}
        for name in self.sources:
            if (q := self._quant_of(name)) is None:
                continue
            path = name[: -len(".weight")]
            current[path] = q
            dtypes[path] = self.stored_dtype(name) if q["mode"] == "affine" else "bfloat16"
        return {"current": current, "dtypes": dtypes}

    def stored_dtype(self, name: str) -> str:
        """The dtype a module's weight is stored in (a quantized module: its scales' dtype)."""
        src = self.sources[name]
        base = src[: -len(".weight")]
        info = self.reader.info(f"{base}.scales" if f"{base}.scales" in self.reader else src)
        return {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}.get(info.dtype, "bfloat16")

    def _load_outside(self) -> None:
        """The parameters outside the blocks: the embedding's and head's weights in their stored
        dtype (exact when ``exact``: float32), the rest (final norm, biases) in float32."""
        inside = {f"{self.prefix}{i}." for i in range(self.n_blocks)}
        outside = [n for n in self.sources if not any(n.startswith(p) for p in inside)]
        big = {f"{p}.weight" for p in (self.embedding_path, *self.head_paths)}
        params = []
        for n in outside:
            if n not in big:
                params.append((n, self.read(n)))
                continue
            mod = self._base(n[: -len(".weight")])
            if self.exact and (quantized := self._quantized(n)) is not None:
                _set_weight(mod, quantized)
                continue
            if self._quant_of(n) is None:  # as stored: never a float32 copy of a large vocabulary
                w = self.reader.array(self.sources[n])
                w = w.astype(mx.float32) if self.exact else w
            else:
                w = self.read(n).astype(getattr(mx, self.stored_dtype(n)))
            mx.eval(w)
            _set_weight(mod, w)
        self.model.update(tree_unflatten(params))

    @contextmanager
    def outside_released(self, length: int) -> Iterator[None]:
        """The embedding's and head's weights freed while only the blocks run, on windows of
        ``length`` tokens (tune's block loop: at a 262,144-word vocabulary and width 5,376 they are
        2.8 GB in bfloat16), read again after."""
        self._args(0, length)  # the blocks' call arguments, recorded while the embedding is there
        for path in {self.embedding_path, *self.head_paths}:
            mod = self._base(path)
            if "weight" in mod:
                mod["weight"] = mx.zeros((0,), mx.float32)
            else:
                object.__setattr__(mod, "weight", None)
        mx.clear_cache()
        try:
            yield
        finally:
            self._load_outside()

    def _quantized(self, name: str, *, exact: bool = True) -> Dequantized | None:
        """A quantized parameter as :class:`Dequantized` (float32 values a slice at a time; with
        ``exact`` the affine scales and biases are float32, the values the model computes with,
        not rounded to the scales' dtype); None when it is not quantized."""
        if (q := self._quant_of(name)) is None:
            return None
        src = self.sources[name]
        base = src[: -len(".weight")]
        scales, biases = self.reader.array(f"{base}.scales"), None
        if q["mode"] == "affine":
            biases = self.reader.array(f"{base}.biases")
            if exact:
                scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
        return Dequantized(self.reader.array(src), scales, biases, **q)

    def block_names(self, i: int) -> list[str]:
        """Block ``i``'s parameters, relative to the block."""
        return list(self._lazy[i])

    def load(
        self, i: int, overrides: dict[str, mx.array] | None = None, *, skip: Collection[str] = ()
    ) -> dict[str, mx.array]:
        """Block ``i``'s weights read (float32) and set; ``overrides`` replace some (relative names),
        ``skip`` are left unread (a module about to be swapped out). Returns what was read."""
        weights = {n: self.read(f"{self.prefix}{i}.{n}") for n in self._lazy[i] if n not in skip}
        self.set(i, weights | (overrides or {}))
        return weights

    def set(self, i: int, weights: dict[str, mx.array]) -> None:
        self.blocks[i].update(tree_unflatten(list(weights.items())))

    def release(self, i: int) -> None:
        """Block ``i`` back to its never-evaluated parameters: its weights' memory is freed."""
        self.blocks[i].update(tree_unflatten(list(self._lazy[i].items())))

    @contextmanager
    def loaded(self, i: int) -> Iterator[dict[str, mx.array]]:
        try:
            yield self.load(i)
        finally:
            self.release(i)

    # ------------------------------------------------------------------ running

    def _record(self, tokens: mx.array, stop: int) -> list:
        """The (input, args, kwargs) of blocks 0..stop as the model's forward calls them."""
        seen: list = []
        self.owner["layers"] = [
            _Recorder(b, seen, stop=(j == stop)) for j, b in enumerate(self.blocks[: stop + 1])
        ] + self.blocks[stop + 1 :]
        try:
            self.model(tokens)
        except _Stop:
            pass
        finally:
            self.owner["layers"] = self.blocks
        return seen

    def _args(self, i: int, length: int) -> tuple[tuple, dict]:
        if length not in self._calls:
            seen = self._record(mx.zeros((1, length), mx.int32), stop=self.n_blocks - 1)
            self._calls[length] = [(a, k) for _, a, k in seen]
        return self._calls[length][i]

    def embed(self, tokens: np.ndarray | mx.array, *, add: mx.array | None = None) -> mx.array:
        """The hidden state entering block 0 (the model's embedding stage), float32; ``add`` is
        added to the looked-up rows (a tap: the gradient there is the lookups')."""
        if add is None:
            x = self._record(mx.array(tokens), stop=0)[0][0].astype(mx.float32)
            mx.eval(x)
            return x
        owner, name, embedding = self._embedding()
        setattr(owner, name, _Added(embedding, add))
        try:
            return self._record(mx.array(tokens), stop=0)[0][0].astype(mx.float32)
        finally:
            setattr(owner, name, embedding)

    def run(self, i: int, h: mx.array) -> mx.array:
        """Block ``i`` (loaded) on ``h`` ([n, T, D])."""
        args, kwargs = self._args(i, h.shape[1])
        return self.blocks[i](h, *args, **kwargs)

    def head(self, h: mx.array, *, tap: Tap | None = None) -> mx.array:
        """The model after its last block (final norm, head) on ``h`` ([n, T, D]): float32 logits.
        ``tap(x, logits)`` sees the head's input and output and returns the logits used."""
        owner, layers = self.owner, self.blocks
        embed_owner, name, embedding = self._embedding()
        owner["layers"] = [_Recorder(b, [], stop=False) for b in layers]  # pass-throughs
        setattr(embed_owner, name, _Feed(embedding, h, tap))
        heads = [] if tap is None or self.head_paths == (self.embedding_path,) else list(self.head_paths)
        for p in heads:
            self._set_module(p, _Tapped(self.module(p), tap))
        try:
            return self.model(mx.zeros(h.shape[:2], mx.int32)).astype(mx.float32)
        finally:
            for p in heads:
                self._set_module(p, object.__getattribute__(self.module(p), "_module"))
            setattr(embed_owner, name, embedding)
            owner["layers"] = layers

    def _set_module(self, path: str, module: Any) -> None:
        parent_path, _, name = path.rpartition(".")
        parent = self.module(parent_path) if parent_path else self.model
        setattr(parent, name, module)

    def _embedding(self) -> tuple[Any, str, Any]:
        """(its parent, its name, the embedding as the model holds it)."""
        parent_path, _, name = self.embedding_path.rpartition(".")
        parent = self.module(parent_path) if parent_path else self.model
        return parent, name, getattr(parent, name)

    @property
    def embedding_path(self) -> str:
        return self._outside()[0]

    @property
    def head_paths(self) -> tuple[str, ...]:
        """The modules whose weight makes the logits: ``lm_head``, or a tied embedding."""
        return self._outside()[1]

    def _outside(self) -> tuple[str, tuple[str, ...]]:
        return self._paths

    def _find_outside(self) -> tuple[str, tuple[str, ...]]:
        inside = [f"{self.prefix}{i}." for i in range(self.n_blocks)]
        embedding, heads = None, []
        for path, mod in self.model.named_modules():
            if any(path.startswith(p) for p in inside) or "weight" not in mod:
                continue
            if isinstance(mod, nn.Embedding) and embedding is None:
                embedding = path
            elif isinstance(mod, nn.Linear):
                heads.append(path)
        return embedding, tuple(heads) or (embedding,)

    def named_modules(self) -> list[tuple[str, Any]]:
        """The model's (path, module) pairs, the head and embedding as mlx-lm built them."""
        heads = {self.embedding_path, *self.head_paths}
        return [(p, self._base(p) if p in heads else m) for p, m in self.model.named_modules()]

    def module(self, path: str) -> Any:
        mod = self.model
        for part in path.split("."):
            mod = mod[int(part)] if isinstance(mod, list) else getattr(mod, part)
        return mod

    def _base(self, path: str) -> Any:
        mod = self.module(path)
        return object.__getattribute__(mod, "_module") if isinstance(mod, _Head) else mod

    def weight_shape(self, path: str) -> tuple[int, ...]:
        """The shape of module ``path``'s weight as the model computes with it (not as stored)."""
        if path.startswith(self.prefix):
            i, _, rel = path[len(self.prefix) :].partition(".")
            return tuple(self._lazy[int(i)][f"{rel}.weight"].shape)
        return tuple(self._base(path).weight.shape)

    def weight(self, path: str) -> mx.array:
        """The weight of a module outside the blocks (embedding, head), in its stored dtype."""
        return self._base(path).weight

    @contextmanager
    def swapped(self, weights: dict[str, mx.array | Dequantized]) -> Iterator[None]:
        """Modules outside the blocks with other weights for a while (path -> weight, or a
        :class:`Dequantized` one: its codes, its values made a slice at a time)."""
        saved = {p: self._base(p).weight for p in weights}
        try:
            for p, w in weights.items():  # a fake-quantized weight is exact in the stored dtype
                if not isinstance(w, Dequantized):
                    w = w.astype(saved[p].dtype)
                    mx.eval(w)  # cast once, here: not inside every slice's logits
                _set_weight(self._base(p), w)
            yield
        finally:
            for p, w in saved.items():
                _set_weight(self._base(p), w)

    @property
    def vocab(self) -> int:
        return int(self._embedding()[2].weight.shape[0])

    def head_share(self) -> float:
        """The head's part of one forward's work, by multiply-adds per token: a large vocabulary's
        head costs as much as several blocks (Qwen2.5-0.5B's: 9 of its 24), which progress and
        ETAs must weigh."""
        blocks = sum(int(p.size) for b in self._lazy.values() for p in b.values())
        head = int(np.prod(self.weight(self.head_paths[0] if self.head_paths else self.embedding_path).shape))
        return head / (head + blocks)

    def token_rows(self) -> int:
        """Tokens whose logits (and temporaries) fit :data:`LOGIT_BYTES` at once."""
        return max(1, LOGIT_BYTES // (16 * self.vocab))

    def kl_sum(
        self,
        h_ref: mx.array,
        h_cur: mx.array,
        *,
        head: dict[str, mx.array] | None = None,
        ref_logits: list | None = None,
    ) -> float:
        """Summed over every token, KL(ref || cur) of the head's distributions on the last hidden
        states ``h_ref`` and ``h_cur`` ([n, T, D]), in slices of tokens; float64 on the host.
        ``head``: other weights of the head's modules for the current side (path -> weight);
        ``ref_logits``: a list that keeps the reference's logits a slice each (filled on first use)."""
        a = h_ref.reshape(-1, h_ref.shape[-1])
        b = h_cur.reshape(-1, h_cur.shape[-1])
        step, total = self.token_rows(), 0.0
        for j, lo in enumerate(range(0, a.shape[0], step)):
            if ref_logits is not None and j < len(ref_logits):
                ref = ref_logits[j]
            else:
                ref = self.head(a[None, lo : lo + step])
                if ref_logits is not None:
                    mx.eval(ref)
                    ref_logits.append(ref)
            with self.swapped(head or {}):
                cur = self.head(b[None, lo : lo + step])
            total += float(kl_logits(ref, cur).sum().item())
        return total
