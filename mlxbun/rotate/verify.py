"""Does a rotated checkpoint compute what its source computes? Mean KL of the two models' logits.

Both directories are loaded with mlx-lm and run on the same seeded tokens; the tolerance is by
the rotated weights' dtype, or, for models very sensitive to rounding, relative to the source
with its own weights jittered by that dtype's unit roundoff.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from mlxbun.io.safetensors import open_model
from mlxbun.kl import kl as _kl
from mlxbun.quant.mlxlm import load_model

log = logging.getLogger("mlxbun")

# ---------------------------------------------------------------------------- verification

# Allowed mean KL(source ‖ rotated) by the rotated weights' dtype. Storing rotated weights
# re-rounds them, which costs KL of the order of the dtype's rounding; a fold mistake in one
# layer gives KL ~ 1 or more. Models whose function is very sensitive to rounding
# (large planted outliers) are judged against the source with its own weights jittered by the
# dtype's unit roundoff instead: KL within BASELINE_FACTOR of that is rounding, not a bad fold.
KL_TOLERANCE = {"F32": 1e-6, "F16": 1e-3, "BF16": 1e-2}
UNIT_ROUNDOFF = {"F32": 2.0**-24, "F16": 2.0**-11, "BF16": 2.0**-8}
BASELINE_FACTOR = 10.0


@dataclass(frozen=True)
class VerifyReport:
    """Logits of a rotated model against its source on the same random tokens.

    Args:
        max_abs: max |Δlogit| over tokens and vocabulary.
        logit_scale: std of the source logits.
        kl: mean over tokens of KL(source ‖ rotated).
        tokens: number of random tokens.
        kl_tolerance: the KL allowed for the rotated weights' dtype.
        forward: dtype of both forwards ("float64" when it fits in memory, else "float32").
        baseline_kl: KL(source ‖ source with weights jittered by the unit roundoff), computed
            only when ``kl`` exceeds ``kl_tolerance``.
    """

    max_abs: float
    logit_scale: float
    kl: float
    tokens: int
    kl_tolerance: float
    forward: str
    baseline_kl: float | None = None

    @property
    def rel(self) -> float:
        return self.max_abs / max(self.logit_scale, 1e-30)

    @property
    def ok(self) -> bool:
        if self.kl <= self.kl_tolerance:
            return True
        return self.baseline_kl is not None and self.kl <= BASELINE_FACTOR * self.baseline_kl

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_abs_dlogit": self.max_abs,
            "logit_scale": self.logit_scale,
            "rel": self.rel,
            "kl": self.kl,
            "kl_tolerance": self.kl_tolerance,
            "tokens": self.tokens,
            "forward": self.forward,
            "baseline_kl": self.baseline_kl,
            "ok": self.ok,
        }


def _logits(path: Path, tokens: np.ndarray, forward: str, *, jitter: float = 0.0) -> np.ndarray:
    """Logits of the model in ``path`` (loaded by mlx-lm, cast to ``forward``) on the CPU.

    ``jitter`` > 0 first multiplies every matrix by (1 + δ), δ ~ U(-jitter, jitter), seeded.
    """
    model, _ = load_model(Path(path), lazy=True)
    with mx.stream(mx.cpu):  # float64 runs on the CPU only: the cast too
        model.set_dtype(getattr(mx, forward))
        if jitter:
            _jitter(model, jitter)
        logits = model(mx.array(tokens)[None])[0].astype(mx.float64)
        mx.eval(logits)
    return np.asarray(logits)


def _jitter(model: Any, jitter: float) -> None:
    mx.random.seed(0)  # parameters come in a fixed order, so the noise is reproducible
    params = []
    for name, v in tree_flatten(model.parameters()):
        if v.ndim > 1:
            v = v * (1 + mx.random.uniform(-jitter, jitter, v.shape).astype(v.dtype))
        params.append((name, v))
    model.update(tree_unflatten(params))


def _forward_dtype(params: int) -> str | None:
    """float64 when a copy fits in 25% of memory, float32 within 40%, else None (skip)."""
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if 8 * params <= 0.25 * physical:
        return "float64"
    return "float32" if 4 * params <= 0.4 * physical else None


def verify_rotation(
    src: str | Path, rotated: str | Path, *, n_tokens: int = 64, seed: int = 0
) -> VerifyReport | None:
    """Compare the logits of ``rotated`` and ``src`` on ``n_tokens`` seeded random tokens.

    Both load through mlx-lm's own loader (no custom code) and run one at a time in float64
    (float32 for models too large for that), so the difference is what storing the rotated
    weights cost. Returns None (and logs why) when even a float32 copy would not fit in memory.

    Example:
        >>> rep = verify_rotation("models/llama", "models/llama-r1", n_tokens=64)
        >>> rep.ok, rep.rel, rep.kl
    """

    src, rotated = Path(src), Path(rotated)
    with open_model(rotated) as m:
        params = sum(math.prod(i.shape) for i in m.infos().values())
        dtypes = {i.dtype for i in m.infos().values()} & set(KL_TOLERANCE)
        vocab = int(m.config["vocab_size"])
    forward = _forward_dtype(params)
    if forward is None:
        log.warning("rotate: verification skipped: a float32 copy of %s would not fit in memory", src)
        return None
    tokens = np.random.default_rng(seed).integers(0, vocab, size=n_tokens)
    ref, cur = _logits(src, tokens, forward), _logits(rotated, tokens, forward)
    worst = max(dtypes, key=KL_TOLERANCE.__getitem__)
    report = VerifyReport(
        float(np.max(np.abs(ref - cur))),
        float(np.std(ref)),
        _kl(ref, cur),
        n_tokens,
        KL_TOLERANCE[worst],
        forward,
    )
    if report.kl <= report.kl_tolerance:
        return report
    baseline = _kl(ref, _logits(src, tokens, forward, jitter=UNIT_ROUNDOFF[worst]))
    return replace(report, baseline_kl=baseline)
