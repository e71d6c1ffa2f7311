"""command=eval: how much did quantization cost? KL-divergence of candidates against a reference.

``python -m mlxbun command=eval model.name=<reference> 'eval.candidates=[<dir>, <name>, ...]'``
prints a table of the candidates (bytes on disk, bits per weight, mean KLD ±, 99.9% KLD, same top
p ±, RMS Δp ±, PPL ratio ±) and llama.cpp's ``llama-perplexity --kl-divergence`` report item for
item, a column per candidate (:mod:`mlxbun.eval.stats`).

A candidate is anything ``mlx_lm.load`` opens (mlxbun or ``mlx_lm convert``/gptq/awq/dwq outputs,
HF cache downloads), named by path or registry name; tables name it by its registry name (or its
directory's). Every model runs dequantized in float32 on MLX's default device (the GPU on Apple
silicon), a batch of windows at a time; the per-token math runs there too, in slices of tokens
(:mod:`mlxbun.eval.score`), and only per-token numbers come back to the host.

Text: ``eval.text`` or the built-in held-out text ``mlxbun/data/heldout.txt`` (Lewis Carroll,
"Alice's Adventures in Wonderland", Project Gutenberg #11, Millennium Fulcrum Edition 3.0: public
domain; the Gutenberg header and footer removed), never the calibration text. ``eval.tokens``
tokens in disjoint windows of ``eval.seq_len`` drawn by ``eval.seed``. A candidate whose run
recorded its calibration is checked for shared 32-token spans with the evaluation windows:
refused unless ``eval.allow_overlap=true``, which warns.

Disk::

    <paths.cache>/eval/<key>/        the reference's top-K record (mlxbun.eval.record)
    <run_dir>/
        eval.json                    {"version", "kind", "reference", "text", "top_k", "candidates": [...],
                                      "failed": [...]}
        eval.png                     mean and 99.9% KLD against size, the Pareto front drawn

A candidate whose logits are not finite (NaN or Inf) is not scored: it is listed under ``failed``
with its size and the first scored token that was not finite, the others are scored and written
(eval.json, eval.png), and the run then ends failed (exit 1, the line names it): a failed run puts
no rows in the registry's eval results, so ``runs runs.command=eval`` never ranks a broken model.
"""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path
from typing import Any

from mlxbun.errors import InputError, NumericFailure
from mlxbun.eval import record
from mlxbun.eval.inputs import (
    HELDOUT,
    Candidate,
    check_candidate,
    check_overlap,
    check_reference,
    encode,
    read_text,
    text_json,
    unique_labels,
    windows,
)
from mlxbun.eval.report import WIDTH, llama_report, plot_png, table
from mlxbun.eval.score import NonFinite, per_token
from mlxbun.eval.stats import summary
from mlxbun.io.atomic import atomic_write_bytes, atomic_write_json
from mlxbun.quant.allocate import budget
from mlxbun.quant.probe import load_model
from mlxbun.runs.provenance import RunResult
from mlxbun.source.model import expand, model_dir, named_dir

__all__ = ["HELDOUT", "Candidate", "encode", "evaluate", "read_text", "run", "windows"]

VERSION = 2  # eval.json; 2: llama.cpp's whole report, labels, "failed"


def size(path: Path, *, parameters: int) -> dict[str, Any]:
    s = budget.measure(path, parameters=parameters)
    return {"bytes": s.file_bytes, "bpw": s.bpw}


def _failure(row: int, seq_len: int) -> str:
    window, pos = divmod(row, seq_len - 1)
    return f"statistics not finite (NaN or infinite logits) from scored token {row} (window {window}, position {pos + 1})"


def evaluate(
    *,
    ref_dir: Path,
    candidates: list[Candidate],
    text_path: str | None = None,
    tokens: int = 8192,
    seq_len: int = 512,
    seed: int = 0,
    top_k: int | None = None,
    batch_size: int = 4,
    cache: Path,
    allow_overlap: bool = False,
    ref_label: str | None = None,
) -> dict[str, Any]:
    """KLD statistics of every candidate against ``ref_dir`` (the eval.json document).

    The reference (quantized? top_k, seq_len), the text and every candidate (tokenizer,
    vocabulary, context, calibration overlap) are checked before any forward. ``top_k`` None: the
    whole vocabulary up to 2048 log-probs per token.

    Example:
        >>> doc = evaluate(ref_dir=src, candidates=[Candidate("q4", q4_dir)], tokens=2048, cache=cache)
        >>> doc["candidates"][0]["kld_mean"], doc["candidates"][0]["kld_p99_9"]
    """
    from mlxbun.quant.mlxlm import load_tokenizer

    vocab, k = check_reference(ref_dir, top_k=top_k, seq_len=seq_len)
    raw, source = read_text(text_path)
    tok = load_tokenizer(ref_dir)
    text = windows(encode(tok, raw), source=source, tokens=tokens, seq_len=seq_len, seed=seed)
    shares = {}
    for c in candidates:
        check_candidate(c, ref_text=text, text=raw, vocab=vocab, seq_len=seq_len, seed=seed)
        shares[c.name] = check_overlap(c, text, tok, allow=allow_overlap)
    params = budget.read_source(ref_dir).parameters
    t0 = time.perf_counter()
    ref, hit = record.reference(ref_dir, text, k=k, cache=cache, batch_size=batch_size,
                                loader=lambda d: load_model(d)[0])  # fmt: skip
    reference = {"path": str(ref_dir), "label": ref_label or ref_dir.name, **size(ref_dir, parameters=params),
                 "cache_hit": hit, "seconds": time.perf_counter() - t0, "vocab": vocab}  # fmt: skip
    rows, failed = [], []
    for c in candidates:
        t0 = time.perf_counter()
        base = {"name": c.name, "label": c.short, "path": str(c.path), **size(c.path, parameters=params)}
        try:
            per_token_stats = per_token(
                load_model(c.path)[0], ref, text, batch_size=batch_size, desc=f"eval {c.short}"
            )
        except NonFinite as e:
            failed.append(base | {"error": _failure(e.row, seq_len)})
            continue
        rows.append(base | summary(per_token_stats) | {"calibration_overlap": shares[c.name],
                                                  "seconds": time.perf_counter() - t0})  # fmt: skip
    return {"version": VERSION, "kind": "mlxbun.eval", "reference": reference, "text": text_json(text),
            "top_k": k, "candidates": rows, "failed": failed}  # fmt: skip


# ------------------------------------------------------------------------------- command


def candidates_of(names: list[str], *, reg: Any) -> list[Candidate]:
    """Each ``eval.candidates`` entry as a model directory (path or registry name), labelled by the
    name the registry knows it by (else its directory's), repeats numbered."""
    from mlxbun.quant.quantize.command import source_name

    if not names:
        raise InputError("eval.candidates=[] is empty; name at least one model directory or registry name")
    paths = [named_dir(n, reg=reg, key="eval.candidates") for n in names]
    labels = unique_labels([source_name(n) if expand(n).is_dir() else n for n in names])
    return [Candidate(name=n, path=p, label=lab) for n, p, lab in zip(names, paths, labels, strict=True)]


def note(doc: dict[str, Any]) -> str:
    """What the reference record keeps, and how low each mean KLD may be for it."""
    k, vocab = doc["top_k"], doc["reference"]["vocab"]
    if k >= vocab:
        return f"reference: all {vocab} log-probs per token: every KLD is exact"
    bound = max((r["kld_bound"] for r in doc["candidates"]), default=0.0)
    line = f"reference: top {k} of {vocab} log-probs + tail mass per token; each mean KLD is low by at most {bound:.2g}"
    over = [r["label"] for r in doc["candidates"] if r["kld_bound"] > r["kld_mean"]]
    line += f" (more than {', '.join(over)}'s mean KLD: raise eval.top_k)" if over else ""
    return textwrap.fill(line, width=WIDTH, subsequent_indent="  ")


def run(cfg: Any) -> Any:
    """command=eval: unpack the config and call :func:`evaluate`."""
    from mlxbun.quant.quantize.command import source_name

    e = cfg.eval
    ref_dir = model_dir(cfg)
    cands = candidates_of(list(e.candidates), reg=cfg.registry)
    doc = evaluate(
        ref_dir=ref_dir, candidates=cands, text_path=e.text, tokens=e.tokens, seq_len=e.seq_len, seed=e.seed,
        top_k=e.top_k, batch_size=e.batch_size, cache=expand(cfg.paths.cache), allow_overlap=e.allow_overlap,
        ref_label=source_name(str(cfg.model.name or ref_dir)),
    )  # fmt: skip
    run_dir = Path(cfg.paths.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    out_json, out_png = run_dir / "eval.json", run_dir / "eval.png"
    atomic_write_json(out_json, _stable(doc))
    if doc["candidates"]:
        atomic_write_bytes(out_png, plot_png(doc))
    if doc["failed"]:
        why = "; ".join(f"{f['label']!r} ({f['path']}): {f['error']}" for f in doc["failed"])
        raise NumericFailure(f"eval.candidates: {why}; the other candidates' results are in {out_json}")
    metrics = {"reference": str(ref_dir), "reference_cache_hit": doc["reference"]["cache_hit"],
               "candidates": [_metric_row(r) for r in doc["candidates"]]}  # fmt: skip
    if cfg.json:
        msg = json.dumps(doc, indent=2, sort_keys=True)
    else:
        msg = f"{table(doc)}\n\n{llama_report(doc)}\n\n{note(doc)}\n-> {out_json}"
    inputs = [ref_dir, *(c.path for c in cands)] + ([expand(e.text)] if e.text else [])
    return RunResult(outputs=[out_json, out_png], inputs=inputs, metrics=metrics, message=msg)


def _stable(doc: dict[str, Any]) -> dict[str, Any]:
    """eval.json without timings: the same inputs give the same bytes."""
    ref = {k: v for k, v in doc["reference"].items() if k not in ("seconds", "cache_hit")}
    rows = [{k: v for k, v in r.items() if k != "seconds"} for r in doc["candidates"]]
    return doc | {"reference": ref, "candidates": rows}


def _metric_row(r: dict[str, Any]) -> dict[str, Any]:
    keep = ("name", "label", "path", "bytes", "bpw", "kld_mean", "kld_mean_err", "kld_p99_9", "same_top",
            "ppl_ratio", "seconds")  # fmt: skip
    return {k: r[k] for k in keep}
