"""What eval prints and draws: a table of the candidates (fits 120 columns), llama.cpp's report item
for item (a column per candidate), and eval.png (mean and 99.9% KLD against size on disk)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from mlxbun.eval.stats import DP_PERCENTILES, KLD_PERCENTILES
from mlxbun.progress import human_bytes

WIDTH = 120  # terminal columns every line fits
GAP = "  "

# (header, cell) of the candidate table after its label
COLUMNS = (
    ("size", lambda r: human_bytes(r["bytes"])),
    ("bpw", lambda r: f"{r['bpw']:.3f}"),
    ("mean KLD", lambda r: f"{r['kld_mean']:.5f}±{r['kld_mean_err']:.5f}"),
    ("99.9% KLD", lambda r: f"{r['kld_p99_9']:.4f}"),
    ("same top p", lambda r: f"{100 * r['same_top']:.2f}±{100 * r['same_top_err']:.2f}%"),
    ("RMS Δp", lambda r: f"{100 * r['rms_dp']:.3f}±{100 * r['rms_dp_err']:.3f}%"),
    ("PPL(Q)/PPL(base)", lambda r: f"{r['ppl_ratio']:.4f}±{r['ppl_ratio_err']:.4f}"),
)


def _fit(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _align(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [GAP.join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def table(doc: dict[str, Any]) -> str:
    """One row per scored candidate, named by its label (cut to fit 120 columns)."""
    cells = [[h for h, _ in COLUMNS]] + [[f(r) for _, f in COLUMNS] for r in doc["candidates"]]
    rest = sum(max(len(r[i]) for r in cells) for i in range(len(COLUMNS))) + len(GAP) * len(COLUMNS)
    room = max(WIDTH - rest, 8)
    labels = ["candidate"] + [_fit(r["label"], room) for r in doc["candidates"]]
    return "\n".join(_align([[lab, *row] for lab, row in zip(labels, cells, strict=True)]))


def _pm(value: str, err: str) -> str:
    return f"{value} ± {err}"


def _pct(key: str, q: float) -> str:
    """llama.cpp's row label of a percentile: ``99.9%  ``, `` 5.0%  ``, ``Median ``."""
    return "Median " if key == "median" else f"{q:4.1f}%  "


def _items() -> list[tuple[str, Any]]:
    """llama.cpp's report lines in its order: (label, cell of a row) or (section title, None)."""
    kld = [(f"{_pct(k, q)} KLD", lambda r, k=k: f"{r[f'kld_{k}']:.6f}") for k, q in KLD_PERCENTILES]
    dp = [(f"{_pct(k, q)} Δp", lambda r, k=k: f"{100 * r[f'dp_{k}']:.3f}%") for k, q in DP_PERCENTILES]
    return [
        ("====== Perplexity statistics ======", None),
        ("Mean PPL(Q)", lambda r: _pm(f"{r['ppl']:.6f}", f"{r['ppl_err']:.6f}")),
        ("Mean PPL(base)", lambda r: _pm(f"{r['ppl_ref']:.6f}", f"{r['ppl_ref_err']:.6f}")),
        ("Cor(ln(PPL(Q)), ln(PPL(base)))", lambda r: f"{100 * r['ppl_cor']:.2f}%"),
        (
            "Mean ln(PPL(Q)/PPL(base))",
            lambda r: _pm(f"{r['ln_ppl_ratio']:.6f}", f"{r['ln_ppl_ratio_err']:.6f}"),
        ),
        ("Mean PPL(Q)/PPL(base)", lambda r: _pm(f"{r['ppl_ratio']:.6f}", f"{r['ppl_ratio_err']:.6f}")),
        ("Mean PPL(Q)-PPL(base)", lambda r: _pm(f"{r['ppl_diff']:.6f}", f"{r['ppl_diff_err']:.6f}")),
        ("====== KL divergence statistics ======", None),
        ("Mean    KLD", lambda r: _pm(f"{r['kld_mean']:.6f}", f"{r['kld_mean_err']:.6f}")),
        ("Maximum KLD", lambda r: f"{r['kld_max']:.6f}"),
        *kld,
        ("Minimum KLD", lambda r: f"{r['kld_min']:.6f}"),
        ("Tail bound (mean)", lambda r: f"{r['kld_bound']:.2e}"),
        ("====== Token probability statistics ======", None),
        ("Mean    Δp", lambda r: _pm(f"{100 * r['dp_mean']:.3f}", f"{100 * r['dp_mean_err']:.3f} %")),
        ("Maximum Δp", lambda r: f"{100 * r['dp_max']:.3f}%"),
        *dp,
        ("Minimum Δp", lambda r: f"{100 * r['dp_min']:.3f}%"),
        ("RMS Δp", lambda r: _pm(f"{100 * r['rms_dp']:.3f}", f"{100 * r['rms_dp_err']:.3f} %")),
        ("Same top p", lambda r: _pm(f"{100 * r['same_top']:.3f}", f"{100 * r['same_top_err']:.3f} %")),
    ]


def llama_report(doc: dict[str, Any]) -> str:
    """llama.cpp's report, one column per candidate, as many candidates a block as fit 120 columns."""
    items, rows = _items(), doc["candidates"]
    label_w = max(len(lab) for lab, f in items if f is not None)
    widths = [max(len(f(r)) for _, f in items if f is not None) for r in rows]
    blocks, i = [], 0
    while i < len(rows):
        n, used = 1, label_w + len(GAP) + widths[i]
        while i + n < len(rows) and used + len(GAP) + widths[i + n] <= WIDTH:
            used += len(GAP) + widths[i + n]
            n += 1
        cols, ws = rows[i : i + n], widths[i : i + n]

        def line(label: str, cells: list[str], ws: list[int] = ws) -> str:
            return GAP.join(
                [label.ljust(label_w), *(c.ljust(w) for c, w in zip(cells, ws, strict=True))]
            ).rstrip()

        lines = [line("", [_fit(r["label"], w) for r, w in zip(cols, ws, strict=True)])]
        lines += [lab if f is None else line(lab, [f(r) for r in cols]) for lab, f in items]
        blocks.append("\n".join(lines))
        i += n
    return "\n\n".join(blocks)


def pareto(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats in both size and KLD, by size."""
    order = sorted(range(len(points)), key=lambda i: points[i])
    front, best = [], float("inf")
    for i in order:
        if points[i][1] < best:
            front.append(i)
            best = points[i][1]
    return front


def plot_png(doc: dict[str, Any]) -> bytes:
    """Mean and 99.9% KLD against size on disk, each with its Pareto front, points named by label;
    deterministic PNG bytes, the canvas grown to hold every label (nothing clipped)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["candidates"]
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for key, label, marker in (("kld_mean", "mean KLD", "o"), ("kld_p99_9", "99.9% KLD", "^")):
        pts = [(r["bytes"] / 2**20, max(r[key], 1e-12)) for r in rows]
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=label)
        front = pareto(pts)
        ax.plot([pts[i][0] for i in front], [pts[i][1] for i in front], linestyle="--", linewidth=1)
        for r, p in zip(rows, pts, strict=True):
            ax.annotate(
                r["label"], p, fontsize=7, xytext=(4, 3), textcoords="offset points", annotation_clip=False
            )
    ax.set_yscale("log")
    ax.margins(x=0.12, y=0.15)
    ax.set_xlabel("size on disk (MiB)")
    ax.set_ylabel("KLD vs reference (nats)")
    source = Path(doc["text"]["source"]).name
    ax.set_title(
        f"{doc['text']['scored_tokens']} tokens of {source}; reference {doc['reference']['label']}",
        fontsize=8,
    )
    ax.legend(fontsize=8)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, metadata={"Software": None}, bbox_inches="tight", pad_inches=0.15)
    plt.close(fig)
    return buf.getvalue()
