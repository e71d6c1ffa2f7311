"""Whole-model KL of many variants of a model in one streamed pass: each block read once.

A variant is the model with some modules at other settings (a calibration group at a candidate,
a plan's probe). Every variant shares the reference's hidden state up to the first block it
changes; from there each carries its own state through the later blocks, all advanced together
as each block is read (:class:`mlxbun.quant.stream.Stream`), and each is compared with the
reference at the head. Memory: one block, one hidden state of the windows per variant in flight.

    ref = Reference.capture(stream, tokens)          # boundary states and the reference's last state
    kls = measure(stream, ref, [{"model.layers.3.mlp.down_proj": QuantSpec(bits=3)}, ...], fake=fq)

``fake(path, weight, spec, out_dtype=float32, codes=False)`` gives a module's weight at a
setting (float32 in, ``out_dtype`` out; with ``codes`` a
:class:`mlxbun.quant.streamed.Dequantized`): quantize -> dequantize for RTN and the microscaling
modes, a rounding with the module's Hessian for clip and GPTQ.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from mlxbun.quant.spec import QuantSpec
from mlxbun.quant.streamed import Stream

Fake = Callable[..., mx.array]  # (path, weight, spec, out_dtype=mx.float32) -> the weight at spec
REF_LOGITS_BYTES = 512 << 20
Variant = Mapping[str, QuantSpec]


@dataclass
class Reference:
    """The reference's hidden states on some windows: entering each block (``states[i]``) and
    leaving the last (``final``), kept in memory."""

    tokens: np.ndarray
    states: list[mx.array] = field(default_factory=list)
    final: mx.array | None = None
    # the head's logits on ``final``, a slice of tokens each, kept once computed when they fit
    # REF_LOGITS_BYTES (every variant is compared with them); None: recomputed each time
    logits: list | None = field(default_factory=list)

    @classmethod
    def capture(cls, stream: Stream, tokens: np.ndarray) -> Reference:
        ref = cls(tokens=np.asarray(tokens))
        h = stream.embed(ref.tokens)
        for i in range(stream.n_blocks):
            ref.states.append(h)
            with stream.loaded(i):
                h = stream.run(i, h)
                mx.eval(h)
        ref.final = h
        return ref.fit(stream)

    def fit(self, stream: Stream) -> Reference:
        """Keep the head's logits only when they fit :data:`REF_LOGITS_BYTES`."""
        if int(np.prod(self.final.shape[:-1])) * stream.vocab * 4 > REF_LOGITS_BYTES:
            self.logits = None
        return self

    @property
    def tokens_total(self) -> int:
        return int(self.tokens.size)


def block_of(stream: Stream, path: str) -> int:
    """The block a module belongs to: -1 outside the blocks before them (the embedding), n after
    them (the head: ``lm_head`` and the final norm)."""
    if path.startswith(stream.prefix):
        return int(path[len(stream.prefix) :].split(".")[0])
    return -1 if path == stream.embedding_path else stream.n_blocks


def measure(
    stream: Stream,
    ref: Reference,
    variants: Sequence[Variant],
    *,
    fake: Fake,
    tick: Callable[..., None] | None = None,
) -> list[float]:
    """Mean KL(reference || variant) per token of each variant on the reference's windows.
    ``tick(forwards, work=weights)`` is called as work is done: a block or the head run for one
    variant over the windows is its part of a forward (:meth:`Stream.head_share`), and ``work``
    the weights clip or GPTQ rounded for it (:func:`roundings`: the probes' time is mostly
    those roundings, not their forwards)."""
    tick = tick or (lambda forwards, work=0.0: None)
    head_share = stream.head_share()
    share = (1 - head_share) / stream.n_blocks
    emb = stream.embedding_path
    starts = [min((block_of(stream, p) for p in v), default=stream.n_blocks) for v in variants]
    states: dict[int, mx.array] = {}
    for k, v in enumerate(variants):
        if starts[k] < 0:  # the embedding changes: the lookups differ from block 0 on
            rounded = fake(emb, stream.weight(emb), v[emb], out_dtype=stream.weight(emb).dtype, codes=True)
            with stream.swapped({emb: rounded}):
                states[k] = stream.embed(ref.tokens)
                mx.eval(states[k])
            del rounded  # not held through the blocks (8-bit codes of a 262,144-word embedding: 1.4 GB)
            tick(0.0, work=_work(stream, emb, v[emb], fake))
    # the blocks alone: neither the embedding nor the head is held while they run
    with stream.outside_released(ref.tokens.shape[1]):
        for i in range(max(0, min(starts, default=0)), stream.n_blocks):
            active = [k for k in range(len(variants)) if starts[k] <= i]
            for k in active:
                states.setdefault(k, ref.states[i])
            weights = stream.load(i)
            memo: dict[tuple[str, QuantSpec], mx.array] = {}
            try:
                for k in active:
                    mine = _in_block(stream, i, variants[k])
                    overrides, work = {}, 0.0
                    for rel, spec in mine.items():
                        if (rel, spec) not in memo:
                            memo[(rel, spec)] = fake(
                                f"{stream.prefix}{i}.{rel}", weights[f"{rel}.weight"], spec
                            )
                            mx.eval(memo[(rel, spec)])
                            work += _work(stream, f"{stream.prefix}{i}.{rel}", spec, fake)
                        overrides[f"{rel}.weight"] = memo[(rel, spec)]
                    stream.set(i, weights | overrides)
                    states[k] = stream.run(i, states[k])
                    mx.eval(states[k])
                    tick(share, work=work)
            finally:
                stream.release(i)
    out = []
    for k, v in enumerate(variants):
        out.append(_head_kl(stream, ref, states.pop(k, ref.final), v, fake))
        heads = [p for p in v if p in stream.head_paths]  # a tied one is rounded again (read back)
        tick(head_share, work=sum(_work(stream, p, v[p], fake) for p in heads))
    return out


def roundings(stream: Stream, variants: Sequence[Variant]) -> list[tuple[str, QuantSpec]]:
    """The clip and GPTQ roundings :func:`measure` makes for ``variants`` (module, setting): each
    module and setting once in the blocks; the embedding for the lookups and each head for the
    logits, once per variant that sets them (a tied one twice)."""
    emb, heads = stream.embedding_path, set(stream.head_paths)
    lookups = [(p, s) for v in variants for p, s in v.items() if p == emb]
    inside = dict.fromkeys((p, s) for v in variants for p, s in v.items() if p != emb and p not in heads)
    logits = [(p, s) for v in variants for p, s in v.items() if p in heads]
    return [(p, s) for p, s in (*lookups, *inside, *logits) if _work(stream, p, s)]


def rounding_work(stream: Stream, pairs: Sequence[tuple[str, QuantSpec]]) -> float:
    """The weights of these roundings (:func:`roundings`), as :func:`measure`'s ``tick`` counts them."""
    return float(sum(_work(stream, p, s) for p, s in pairs))


def _work(stream: Stream, path: str, spec: QuantSpec, fake: Fake | None = None) -> float:
    """Weights of module ``path`` a clip or GPTQ rounding at ``spec`` takes (0: RTN, microscaling,
    or a ``fake`` that ticks its roundings itself: ``fake.tick`` set)."""
    if spec.method == "rtn" or spec.mode != "affine" or getattr(fake, "tick", None) is not None:
        return 0.0
    return float(np.prod(stream.weight_shape(path)))


def _in_block(stream: Stream, i: int, variant: Variant) -> dict[str, QuantSpec]:
    """The variant's modules in block ``i``, by path relative to the block."""
    prefix = f"{stream.prefix}{i}."
    return {p[len(prefix) :]: s for p, s in variant.items() if p.startswith(prefix)}


def _head_kl(stream: Stream, ref: Reference, final: mx.array, variant: Variant, fake: Fake) -> float:
    """Mean KL at the head; a variant that sets the head (or a tied embedding) swaps its weight:
    its codes, made into values in the stored dtype a slice of vocabulary at a time (neither a
    float32 nor a second stored-dtype copy of a large vocabulary's head)."""
    heads = {p: s for p, s in variant.items() if p in stream.head_paths}
    swaps = {
        p: fake(p, stream.weight(p), s, out_dtype=stream.weight(p).dtype, codes=True)
        for p, s in heads.items()
    }
    return stream.kl_sum(ref.final, final, head=swaps, ref_logits=ref.logits) / ref.tokens_total
