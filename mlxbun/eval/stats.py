"""llama.cpp's ``llama-perplexity --kl-divergence`` report, item for item, from per-token arrays.

Read in llama.cpp's tools/perplexity/perplexity.cpp (``kl_divergence``): an uncertainty is the
standard error of a mean, sqrt(var / (n - 1)) with var the population variance; PPL's is PPL times
the standard error of the mean NLL; ln(PPL(Q)/PPL(base))'s comes from both and their covariance
(the standard error of the per-token NLL difference); RMS Δp's is 0.5 / RMS times that of mean Δp²;
"same top p"'s is sqrt(p (1 - p) / (n - 1)); percentiles interpolate linearly between the sorted
values at fraction * (n - 1) (numpy's default). Δp and "same top p" are fractions here (llama.cpp
prints percent). Everything runs in float64 numpy on the small per-token arrays.
"""

from __future__ import annotations

import numpy as np

# (key suffix, percentile) in llama.cpp's order, after "Maximum"
KLD_PERCENTILES = (("p99_9", 99.9), ("p99", 99.0), ("p95", 95.0), ("p90", 90.0), ("median", 50.0),
                   ("p10", 10.0), ("p5", 5.0), ("p1", 1.0), ("p0_1", 0.1))  # fmt: skip
DP_PERCENTILES = (("p99_9", 99.9), ("p99", 99.0), ("p95", 95.0), ("p90", 90.0), ("p75", 75.0),
                  ("median", 50.0), ("p25", 25.0), ("p10", 10.0), ("p5", 5.0), ("p1", 1.0),
                  ("p0_1", 0.1))  # fmt: skip


def sem(x: np.ndarray) -> float:
    """Standard error of the mean (0 for one value)."""
    return float(np.std(x, ddof=1) / np.sqrt(len(x))) if len(x) > 1 else 0.0


def _spread(x: np.ndarray, name: str, percentiles: tuple[tuple[str, float], ...]) -> dict[str, float]:
    pct = np.percentile(x, [q for _, q in percentiles])
    out = {f"{name}_max": float(x.max()), f"{name}_min": float(x.min())}
    return out | {f"{name}_{k}": float(v) for (k, _), v in zip(percentiles, pct, strict=True)}


def perplexity(nll_ref: np.ndarray, nll_cur: np.ndarray, dnll: np.ndarray) -> dict[str, float]:
    """PPL(Q), PPL(base), their correlation, ln ratio, ratio and difference, each ± its error."""
    n = len(nll_ref)
    ppl, ppl_ref = float(np.exp(nll_cur.mean())), float(np.exp(nll_ref.mean()))
    se_cur, se_ref = sem(nll_cur), sem(nll_ref)
    cov = float(np.cov(nll_cur, nll_ref, ddof=0)[0, 1] / (n - 1)) if n > 1 else 0.0
    ln_ratio, ln_err = float(dnll.mean()), sem(dnll)
    diff_var = (ppl * se_cur) ** 2 + (ppl_ref * se_ref) ** 2 - 2 * ppl * ppl_ref * cov
    return {
        "ppl": ppl,
        "ppl_err": ppl * se_cur,
        "ppl_ref": ppl_ref,
        "ppl_ref_err": ppl_ref * se_ref,
        "ppl_cor": cov / (se_cur * se_ref) if se_cur > 0 and se_ref > 0 else 0.0,
        "ln_ppl_ratio": ln_ratio,
        "ln_ppl_ratio_err": ln_err,
        "ppl_ratio": float(np.exp(ln_ratio)),
        "ppl_ratio_err": float(np.exp(ln_ratio)) * ln_err,
        "ppl_diff": ppl - ppl_ref,
        "ppl_diff_err": float(np.sqrt(max(diff_var, 0.0))),
    }


def summary(stats: dict[str, np.ndarray]) -> dict[str, float]:
    """The report of :func:`mlxbun.eval.score.per_token`'s per-token arrays over every token, plus
    ``kld_bound`` (the mean of the per-token tail bounds: the mean KLD is low by at most it)."""
    kld, dp, n = stats["kld"], stats["dp"], len(stats["kld"])
    nll_ref = stats["nll_ref"]
    nll_cur = nll_ref + stats["dnll"]
    same = float(np.mean(stats["same_top"]))
    dp2 = dp**2
    rms = float(np.sqrt(dp2.mean()))
    out: dict[str, float] = {"tokens": n} | perplexity(nll_ref, nll_cur, stats["dnll"])
    out |= {"kld_mean": float(kld.mean()), "kld_mean_err": sem(kld)} | _spread(kld, "kld", KLD_PERCENTILES)
    out |= {"dp_mean": float(dp.mean()), "dp_mean_err": sem(dp)} | _spread(dp, "dp", DP_PERCENTILES)
    return out | {
        "rms_dp": rms,
        "rms_dp_err": sem(dp2) / (2 * rms) if rms > 0 else 0.0,
        "same_top": same,
        "same_top_err": float(np.sqrt(same * (1 - same) / max(n - 1, 1))),
        "kld_bound": float(stats["bound"].mean()),
    }
