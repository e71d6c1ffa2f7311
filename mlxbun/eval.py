"""command=eval: how much did quantization cost? KL-divergence of candidates against a reference.

``python -m mlxbun command=eval model.name=<reference> 'eval.candidates=[<dir>, <name>, ...]'``
prints one row per candidate (bytes on disk, bits per weight, mean KLD ± its standard error,
median, 90/95/99/99.9% and max KLD, same top p ±, RMS Δp ±, PPL of both models and their ratio),
as llama.cpp's ``llama-perplexity --kl-divergence`` reports them; statistics in :mod:`mlxbun.kl`.

A candidate is anything ``mlx_lm.load`` opens (mlxbun or ``mlx_lm convert``/gptq/awq/dwq outputs,
HF cache downloads), named by path or registry name. Every model runs dequantized in float32
(BLAS matmuls on Linux CPU), in batches of windows; numpy works on a few MiB of rows at a time.

Text: ``eval.text`` or the built-in held-out text ``mlxbun/data/heldout.txt`` (Lewis Carroll,
"Alice's Adventures in Wonderland", Project Gutenberg #11, Millennium Fulcrum Edition 3.0: public
domain; the Gutenberg header and footer removed), never the calibration text. ``eval.tokens``
tokens in disjoint windows of ``eval.seq_len`` drawn by ``eval.seed``. A candidate whose run
recorded its calibration (an allocate/sensitivity/quantize run's manifest beside a plan.json) is
checked for shared 32-token spans with the evaluation windows: refused unless
``eval.allow_overlap=true``, which warns.

Disk::

    <paths.cache>/eval/<key>/        key = job_key(model + tokenizer fingerprints, tokens, top_k)
        reference.npz                top-K log-probs, token ids, tail mass, next-token log-prob
        meta.json                    what the key covers
    <run_dir>/
        eval.json                    {"version", "reference", "text", "top_k", "candidates": [...]}
        eval.png                     mean and 99.9% KLD against size, the Pareto front drawn

The reference's top ``eval.top_k`` log-probs (plus the tail mass) are all a candidate needs; the KL
that misses, and its per-token bound, are in :mod:`mlxbun.kl`; the bound's mean is reported.
"""

from __future__ import annotations

import io
import json
import logging
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlxbun import kl
from mlxbun.errors import InputError
from mlxbun.io.atomic import atomic_write_bytes, atomic_write_json
from mlxbun.io.digest import job_key
from mlxbun.io.safetensors import read_config
from mlxbun.progress import Progress, human_bytes
from mlxbun.quant.allocate import budget
from mlxbun.quant.calibration import Windows, choose_windows, fingerprint, load_calibration
from mlxbun.quant.mlxlm import load_tokenizer
from mlxbun.quant.probe import load_model
from mlxbun.runs.provenance import RunResult
from mlxbun.source.fingerprint import model_fingerprint, tokenizer_fingerprint
from mlxbun.source.model import expand, model_dir, named_dir

VERSION = 1
HELDOUT = Path(__file__).resolve().parent / "data" / "heldout.txt"
ROW_BYTES = 64 << 20  # float64 log-prob rows handled by numpy at once
SPAN = 32  # tokens in a span shared with the calibration that counts as overlap

log = logging.getLogger("mlxbun")


def text_json(text: Windows) -> dict[str, Any]:
    """The evaluation windows as eval.json and the reference's meta.json record them."""
    n, length = text.tokens.shape
    return {"source": text.source, "fingerprint": text.fingerprint, "windows": int(n), "seq_len": int(length),
            "scored_tokens": int(n * (length - 1)), "stream_tokens": text.stream_tokens}  # fmt: skip


def read_text(path: str | None) -> tuple[str, str]:
    """(text, source name) of ``eval.text``, or of the built-in held-out text."""
    if path is None:
        return HELDOUT.read_text(encoding="utf-8"), "builtin:heldout.txt"
    p = expand(path)
    if not p.is_file():
        raise InputError(f"eval.text={path!r} is not a file; pass a text file or leave it unset")
    return p.read_text(encoding="utf-8"), str(p.resolve())


def encode(tokenizer: Any, text: str) -> np.ndarray:
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
    except TypeError:
        ids = tokenizer.encode(text)
    return np.asarray(ids, dtype=np.int32)


def windows(stream: np.ndarray, *, source: str, tokens: int, seq_len: int, seed: int) -> Windows:
    """``tokens`` tokens (rounded up to whole windows) in disjoint windows of ``seq_len``."""
    n = -(-tokens // seq_len)
    if len(stream) < seq_len:
        raise InputError(
            f"eval.text={source!r} holds {len(stream)} tokens, shorter than one window of eval.seq_len={seq_len};"
            " pass a longer text or lower eval.seq_len"
        )
    if n * seq_len > len(stream):
        raise InputError(
            f"eval.tokens={tokens} needs {n} windows of {seq_len} tokens; eval.text={source!r} holds"
            f" {len(stream) // seq_len}; lower eval.tokens or pass a longer text"
        )
    starts = choose_windows(len(stream), samples=n, seq_len=seq_len, seed=seed)
    w = np.stack([stream[s : s + seq_len] for s in starts]).astype(np.int32)
    return Windows(tokens=w, fingerprint=fingerprint(w), source=source, seed=seed, stream_tokens=len(stream))


# ------------------------------------------------------------------------------- candidates


@dataclass(frozen=True)
class Candidate:
    name: str
    path: Path


def check_candidate(
    cand: Candidate, *, ref_text: Windows, text: str, vocab: int, seq_len: int, seed: int
) -> None:
    """One clear error when a candidate cannot be compared: another tokenizer or vocabulary."""
    cfg_vocab = config_vocab(cand.path)
    if cfg_vocab != vocab:
        raise InputError(
            f"eval.candidates has {cand.name!r} with vocab_size={cfg_vocab}; the reference has {vocab}:"
            " a model of another vocabulary cannot be compared"
        )
    try:
        tok = load_tokenizer(cand.path)
    except Exception as e:  # noqa: BLE001 - any tokenizer failure is this candidate's bad input
        raise InputError(f"eval.candidates has {cand.name!r}, whose tokenizer does not load: {e}") from None
    mine = windows(encode(tok, text), source=ref_text.source, tokens=ref_text.tokens.size, seq_len=seq_len,
                   seed=seed)  # fmt: skip
    if mine.fingerprint != ref_text.fingerprint:
        raise InputError(
            f"eval.candidates has {cand.name!r}, whose tokenizer encodes the text differently from the"
            " reference's; KL needs the same tokens"
        )


def config_vocab(model_dir: Path) -> int | None:
    p = model_dir / "config.json"
    if not p.is_file():
        raise InputError(
            f"eval.candidates: {str(model_dir)!r} has no config.json; it is not a model directory"
        )
    cfg = read_config(model_dir)
    return cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")


def recorded_calibration(model_dir: Path, tokenizer: Any) -> np.ndarray | None:
    """The calibration tokens a candidate's run recorded (its manifest's sensitivity.calib), if any."""
    for d in (model_dir, model_dir.parent):
        man = d / "manifest.json"
        if (d / "plan.json").is_file() and man.is_file():
            c = ((json.loads(man.read_text()).get("config") or {}).get("sensitivity") or {}).get("calib")
            if c:
                calib = load_calibration(
                    tokenizer=tokenizer,
                    path=c.get("path"),
                    samples=c["samples"],
                    seq_len=c["seq_len"],
                    seed=c["seed"],
                )
                return calib.tokens
    return None


def overlap(eval_windows: np.ndarray, calib: np.ndarray, *, span: int = SPAN) -> float:
    """Fraction of the evaluation's ``span``-token spans that also occur in the calibration tokens."""

    def spans(rows: np.ndarray) -> list[bytes]:
        view = np.lib.stride_tricks.sliding_window_view(
            np.ascontiguousarray(rows, dtype="<i4"), span, axis=-1
        )
        return [s.tobytes() for s in view.reshape(-1, span)]

    if eval_windows.shape[1] < span or calib.shape[1] < span:
        return 0.0
    seen = set(spans(calib))
    mine = spans(eval_windows)
    return sum(s in seen for s in mine) / len(mine)


def check_overlap(cand: Candidate, text: Windows, tokenizer: Any, *, allow: bool) -> float:
    calib = recorded_calibration(cand.path, tokenizer)
    share = overlap(text.tokens, calib) if calib is not None else 0.0
    if share > 0:
        msg = (
            f"eval: {100 * share:.1f}% of the evaluation's {SPAN}-token spans are in the calibration tokens"
            f" {cand.name!r} was planned on; pass another eval.text"
        )
        if not allow:
            raise InputError(msg + " (or eval.allow_overlap=true to report it anyway)")
        log.warning("WARNING: %s; the KL below is in-sample for this candidate", msg)
    return share


# ------------------------------------------------------------------------------- forwards


def forward_rows(model: Any, text: Windows, *, batch_size: int, desc: str):
    """Yield (float64 log-probs ``[rows, vocab]``, next tokens ``[rows]``) over every window, a few
    MiB of rows at a time, with progress (rate and ETA) on stderr."""
    w = text.tokens
    prog = Progress(total=w.shape[0] * (w.shape[1] - 1), unit="tok", desc=desc, heartbeat=True)
    try:
        for i in range(0, len(w), batch_size):
            logits = model(mx.array(w[i : i + batch_size]))[:, :-1].astype(mx.float32)
            mx.eval(logits)
            vocab = logits.shape[-1]
            flat, targets = logits.reshape(-1, vocab), w[i : i + batch_size, 1:].reshape(-1)
            step = max(1, ROW_BYTES // (8 * vocab))
            for r in range(0, len(targets), step):
                yield kl.log_probs(flat[r : r + step]), targets[r : r + step]
            prog.update(len(targets))
    finally:
        prog.close()


def reference_key(ref_dir: Path, text: Windows, *, top_k: int, digests: Path) -> dict[str, Any]:
    return {
        "version": VERSION,
        "model": model_fingerprint(ref_dir, cache_dir=digests),
        "tokenizer": tokenizer_fingerprint(ref_dir),
        "tokens": text.fingerprint,
        "top_k": top_k,
    }


def reference(ref_dir: Path, text: Windows, *, top_k: int, cache: Path, batch_size: int) -> tuple[dict, bool]:
    """The reference's top-K record over every scored token, from ``cache`` or one forward pass.

    Returns (record, hit): a hit did no reference forward.
    """
    key = reference_key(ref_dir, text, top_k=top_k, digests=cache / "digests")
    d = cache / "eval" / job_key("eval", VERSION, key)
    path = d / "reference.npz"
    if path.is_file():
        try:
            with np.load(path) as z:
                rec = {k: z[k] for k in z.files}
            if len(rec["target"]) == text.tokens.shape[0] * (text.tokens.shape[1] - 1):
                return rec, True
            log.warning("eval: the cached reference %s has the wrong length; computing it again", path)
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
            log.warning("eval: the cached reference %s is unreadable (%s); computing it again", path, e)
    model, _, _ = load_model(ref_dir)
    parts = [kl.top_k(logp, t, k=top_k) for logp, t in forward_rows(model, text, batch_size=batch_size,
                                                                   desc="eval reference")]  # fmt: skip
    rec = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    rec["vocab"] = np.array(_vocab(model))
    buf = io.BytesIO()
    np.savez(buf, **rec)
    d.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, buf.getvalue())
    atomic_write_json(d / "meta.json", key | {"text": text_json(text)})
    return rec, False


def _vocab(model: Any) -> int:
    return int(model.args.vocab_size)


def score(cand: Candidate, ref: dict, text: Windows, *, batch_size: int) -> dict[str, np.ndarray]:
    """Per-token statistics (:func:`mlxbun.kl.token_stats`) of one candidate over every window."""
    model, _, _ = load_model(cand.path)
    parts, at = [], 0
    for logp, targets in forward_rows(model, text, batch_size=batch_size, desc=f"eval {cand.name}"):
        rows = slice(at, at + len(targets))
        parts.append(
            kl.token_stats({k: ref[k][rows] for k in ("idx", "logp", "tail", "target")}, logp, targets)
        )
        at += len(targets)
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def size(model_dir: Path, *, parameters: int) -> dict[str, Any]:
    s = budget.measure(model_dir, parameters=parameters)
    return {"bytes": s.file_bytes, "bpw": s.bpw}


# ------------------------------------------------------------------------------- library entry point


def evaluate(
    *,
    ref_dir: Path,
    candidates: list[Candidate],
    text_path: str | None = None,
    tokens: int = 8192,
    seq_len: int = 512,
    seed: int = 0,
    top_k: int = 1024,
    batch_size: int = 4,
    cache: Path,
    allow_overlap: bool = False,
) -> dict[str, Any]:
    """KLD statistics of every candidate against ``ref_dir`` (the eval.json document).

    Every candidate is checked (tokenizer, vocabulary, calibration overlap) before any forward.

    Example:
        >>> doc = evaluate(ref_dir=src, candidates=[Candidate("q4", q4_dir)], tokens=2048, cache=cache)
        >>> doc["candidates"][0]["kld_mean"], doc["candidates"][0]["kld_p99_9"]
    """
    raw, source = read_text(text_path)
    tok = load_tokenizer(ref_dir)
    text = windows(encode(tok, raw), source=source, tokens=tokens, seq_len=seq_len, seed=seed)
    vocab = config_vocab(ref_dir)
    shares = {}
    for c in candidates:
        check_candidate(c, ref_text=text, text=raw, vocab=vocab, seq_len=seq_len, seed=seed)
        shares[c.name] = check_overlap(c, text, tok, allow=allow_overlap)
    t0 = time.perf_counter()
    ref, hit = reference(ref_dir, text, top_k=top_k, cache=cache, batch_size=batch_size)
    ref_seconds = time.perf_counter() - t0
    params = budget.read_source(ref_dir).parameters
    rows = []
    for c in candidates:
        t0 = time.perf_counter()
        stats = kl.summary(score(c, ref, text, batch_size=batch_size))
        rows.append({"name": c.name, "path": str(c.path), **size(c.path, parameters=params), **stats,
                     "calibration_overlap": shares[c.name], "seconds": time.perf_counter() - t0})  # fmt: skip
    return {
        "version": VERSION,
        "kind": "mlxbun.eval",
        "reference": {
            "path": str(ref_dir),
            **size(ref_dir, parameters=params),
            "cache_hit": hit,
            "seconds": ref_seconds,
            "vocab": vocab,
        },  # fmt: skip
        "text": text_json(text),
        "top_k": top_k,
        "candidates": rows,
    }


COLUMNS = (
    ("name", "{}"), ("size", "{}"), ("bpw", "{:.3f}"), ("KLD mean", "{kld_mean:.5f}±{kld_mean_err:.5f}"),
    ("median", "{kld_median:.5f}"), ("90%", "{kld_p90:.4f}"), ("95%", "{kld_p95:.4f}"), ("99%", "{kld_p99:.4f}"),
    ("99.9%", "{kld_p99_9:.4f}"), ("max", "{kld_max:.4f}"), ("same top p", "{same_top:.4f}±{same_top_err:.4f}"),
    ("RMS Δp", "{rms_dp:.4f}±{rms_dp_err:.4f}"), ("PPL ref", "{ppl_ref:.3f}"), ("PPL", "{ppl:.3f}±{ppl_err:.3f}"),
    ("PPL ratio", "{ppl_ratio:.4f}±{ppl_ratio_err:.4f}"),
)  # fmt: skip


def table(doc: dict[str, Any]) -> str:
    """One row per candidate, columns aligned."""
    rows = [[h for h, _ in COLUMNS]]
    for r in doc["candidates"]:
        cells = [r["name"], human_bytes(r["bytes"]), f"{r['bpw']:.3f}"]
        rows.append(cells + [fmt.format(**r) for _, fmt in COLUMNS[3:]])
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)


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
    """Mean and 99.9% KLD against size on disk, each with its Pareto front; deterministic PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["candidates"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label, marker in (("kld_mean", "mean KLD", "o"), ("kld_p99_9", "99.9% KLD", "^")):
        pts = [(r["bytes"] / 2**20, max(r[key], 1e-12)) for r in rows]
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=label)
        front = pareto(pts)
        ax.plot([pts[i][0] for i in front], [pts[i][1] for i in front], linestyle="--", linewidth=1)
        for r, p in zip(rows, pts, strict=True):
            ax.annotate(r["name"], p, fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_yscale("log")
    ax.set_xlabel("size on disk (MiB)")
    ax.set_ylabel("KLD vs reference (nats)")
    ax.set_title(f"{doc['text']['scored_tokens']} tokens of {doc['text']['source']}", fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()


# ------------------------------------------------------------------------------- command


def candidates_of(names: list[str], *, reg: Any) -> list[Candidate]:
    """Each ``eval.candidates`` entry as a model directory (path or registry name)."""
    if not names:
        raise InputError("eval.candidates=[] is empty; name at least one model directory or registry name")
    return [Candidate(name=n, path=named_dir(n, reg=reg, key="eval.candidates")) for n in names]


def run(cfg: Any) -> Any:
    """command=eval: unpack the config and call :func:`evaluate`."""
    e = cfg.eval
    ref_dir = model_dir(cfg)
    cands = candidates_of(list(e.candidates), reg=cfg.registry)
    doc = evaluate(
        ref_dir=ref_dir, candidates=cands, text_path=e.text, tokens=e.tokens, seq_len=e.seq_len, seed=e.seed,
        top_k=e.top_k, batch_size=e.batch_size, cache=expand(cfg.paths.cache), allow_overlap=e.allow_overlap,
    )  # fmt: skip
    run_dir = Path(cfg.paths.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    out_json, out_png = run_dir / "eval.json", run_dir / "eval.png"
    atomic_write_json(out_json, _stable(doc))
    atomic_write_bytes(out_png, plot_png(doc))
    metrics = {"reference": str(ref_dir), "reference_cache_hit": doc["reference"]["cache_hit"],
               "candidates": [_metric_row(r) for r in doc["candidates"]]}  # fmt: skip
    bound = max(r["kld_bound"] for r in doc["candidates"])
    note = f"reference: top-{doc['top_k']} log-probs + tail mass; each mean KLD is low by at most {bound:.2g}"
    msg = json.dumps(doc, indent=2, sort_keys=True) if cfg.json else f"{table(doc)}\n{note}\n-> {out_json}"
    inputs = [ref_dir, *(c.path for c in cands)] + ([expand(e.text)] if e.text else [])
    return RunResult(outputs=[out_json, out_png], inputs=inputs, metrics=metrics, message=msg)


def _stable(doc: dict[str, Any]) -> dict[str, Any]:
    """eval.json without timings: the same inputs give the same bytes."""
    ref = {k: v for k, v in doc["reference"].items() if k not in ("seconds", "cache_hit")}
    rows = [{k: v for k, v in r.items() if k != "seconds"} for r in doc["candidates"]]
    return doc | {"reference": ref, "candidates": rows}


def _metric_row(r: dict[str, Any]) -> dict[str, Any]:
    keep = ("name", "path", "bytes", "bpw", "kld_mean", "kld_mean_err", "kld_p99_9", "same_top", "ppl_ratio",
            "seconds")  # fmt: skip
    return {k: r[k] for k in keep}
