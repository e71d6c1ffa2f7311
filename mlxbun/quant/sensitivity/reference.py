"""The seed-faithful sensitivity sweep (OptIQ style), kept as the reference the fast path must match.

For each quantizable module and each candidate: quantize -> dequantize that module's weight only,
run a full forward of every calibration sample on its own (batch 1, all blocks, norm and head),
score KL(ref || cur) = mean over tokens of sum_v p_ref (log p_ref - log p_cur) (float32 logits,
softmax and sums in float64), average
over samples, and restore the weight exactly. A candidate equal to the module's current setting
(an already-quantized source) scores 0 without forwards. Reference logits are computed once.
Cost: modules x candidates x samples full forwards; use ``method=reference`` only to check.

Example:
    >>> from mlxbun.quant.sensitivity.setup import prepare
    >>> s = prepare(model_dir=d, bits=[4, 8], group_size=64, mode="affine", calib_path=None,
    ...             samples=4, seq_len=128, seed=0, method="reference", batch_size=1)
    >>> kls = reference_kl(s.model, s.tokens, s.targets, s.cands)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

from mlxbun.kl import kl
from mlxbun.quant.probe import fake_quant, module_at


def _score(model: Any, samples: list, ref: list, target: Any, cand: Any) -> float:
    if cand.matches(target.current):
        return 0.0
    mod = module_at(model, target.path)
    original = mod.weight
    mod.weight = fake_quant(original, cand, dtype=target.dtype).astype(original.dtype)
    try:
        kls = []
        for x, r in zip(samples, ref, strict=True):
            logits = model(x)
            mx.eval(logits)
            kls.append(kl(r, logits))
    finally:
        mod.weight = original
    return sum(kls) / len(kls)


def reference_sweep(
    model: Any,
    tokens: Any,
    groups: dict[int, list],
    cands: list,
    *,
    on_group: Callable[[int, dict], None],
    progress: Any = None,
    dtype: str = "float32",
) -> None:
    """Score every target of ``groups`` the straightforward way; hand each group to ``on_group``.

    ``dtype="bfloat16"`` runs the forwards the way the seed runs on a bf16 checkpoint (model
    weights and activations in bf16; the model is converted in place). Its numbers then differ
    from float32 by bf16 rounding; the default float32 is what the fast path must equal.
    """
    if dtype != "float32":
        model.set_dtype({"bfloat16": mx.bfloat16, "float16": mx.float16}[dtype])
    samples = [mx.array(tokens[i : i + 1]) for i in range(tokens.shape[0])]
    ref = []
    for x in samples:
        logits = model(x)
        mx.eval(logits)
        ref.append(logits)
    for g in sorted(groups):
        results = {}
        for target in groups[g]:
            results[target.path] = {str(c.bits): _score(model, samples, ref, target, c) for c in cands}
            if progress is not None:
                progress.update(1)
        on_group(g, results)


def reference_kl(
    model: Any, tokens: Any, targets: list, cands: list, *, dtype: str = "float32"
) -> dict[str, dict[str, float]]:
    """{path: {bits: kl}} for ``targets``, computed the seed's way (no checkpoints, no batching)."""
    out: dict[str, dict[str, float]] = {}
    groups: dict[int, list] = {}
    for t in targets:
        groups.setdefault(t.group, []).append(t)
    reference_sweep(model, tokens, groups, cands, on_group=lambda g, r: out.update(r), dtype=dtype)
    return out
