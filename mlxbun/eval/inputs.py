"""eval's inputs, checked before any forward: the text and its windows, the reference, the candidates.

Every check here reads config.json, tokenizers and the text only; a bad input is one line (exit 2)
before the reference's record or any candidate's forward is computed.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mlxbun.errors import InputError
from mlxbun.io.safetensors import quantization_block, read_config
from mlxbun.quant.calibration import Windows, choose_windows, fingerprint, load_calibration

HELDOUT = Path(__file__).resolve().parent.parent / "data" / "heldout.txt"
SPAN = 32  # tokens in a span shared with the calibration that counts as overlap
DEFAULT_TOP_K = 2048  # eval.top_k unset: the whole vocabulary up to this many log-probs per token
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")

log = logging.getLogger("mlxbun")


@dataclass(frozen=True)
class Candidate:
    """A model compared with the reference: ``name`` as given, ``label`` (short, unique) for tables."""

    name: str
    path: Path
    label: str = ""

    @property
    def short(self) -> str:
        return self.label or self.name


# ------------------------------------------------------------------------------- text


def read_text(path: str | None) -> tuple[str, str]:
    """(text, source name) of ``eval.text``, or of the built-in held-out text."""
    if path is None:
        return HELDOUT.read_text(encoding="utf-8"), "builtin:heldout.txt"
    p = Path(path).expanduser()
    if not p.is_file():
        raise InputError(f"eval.text={path!r} is not a file; pass a text file or leave it unset")
    data = p.read_bytes()
    try:
        return data.decode("utf-8"), str(p.resolve())
    except UnicodeDecodeError as e:
        raise InputError(
            f"eval.text={path!r} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start});"
            " pass a text file"
        ) from None


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


def text_json(text: Windows) -> dict[str, Any]:
    """The evaluation windows as eval.json and the reference's meta.json record them."""
    n, length = text.tokens.shape
    return {"source": text.source, "fingerprint": text.fingerprint, "windows": int(n), "seq_len": int(length),
            "scored_tokens": int(n * (length - 1)), "stream_tokens": text.stream_tokens}  # fmt: skip


# ------------------------------------------------------------------------------- models


def config_vocab(model_dir: Path, *, key: str = "eval.candidates") -> int | None:
    if not (model_dir / "config.json").is_file():
        raise InputError(f"{key}: {str(model_dir)!r} has no config.json; it is not a model directory")
    cfg = read_config(model_dir)
    return cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")


def context_length(model_dir: Path) -> tuple[str, int] | None:
    """(config key, value) of the longest sequence the model's config.json allows, if it says."""
    cfg = read_config(model_dir)
    for block in (cfg, cfg.get("text_config") or {}):
        for k in CONTEXT_KEYS:
            if isinstance(block.get(k), int) and not isinstance(block.get(k), bool):
                return k, block[k]
    return None


def check_reference(ref_dir: Path, *, top_k: int | None, seq_len: int) -> tuple[int, int]:
    """(vocabulary, K) of the reference, or one line: a quantized reference, eval.top_k beyond the
    vocabulary, eval.seq_len beyond its context. Reads config.json only."""
    vocab = config_vocab(ref_dir, key="model.name")
    if not isinstance(vocab, int):
        raise InputError(f"model.name={str(ref_dir)!r}: config.json gives no vocab_size; eval needs one")
    q = quantization_block(read_config(ref_dir))
    if q is not None:
        setting = f"{q.get('bits')}-bit" if q.get("bits") else str(q.get("mode", "quantized"))
        raise InputError(
            f"model.name={str(ref_dir)!r} is quantized ({setting}); eval's reference is the unquantized model"
            " the candidates were made from: pass that as model.name"
        )
    if top_k is not None and top_k > vocab:
        raise InputError(
            f"eval.top_k={top_k} exceeds the reference's vocabulary of {vocab}; choose 1..{vocab}"
            f" ({vocab} keeps every log-prob: no tail, no bound) or leave it unset"
        )
    check_context(ref_dir, seq_len=seq_len, key="model.name")
    return vocab, min(vocab, DEFAULT_TOP_K) if top_k is None else top_k


def check_context(model_dir: Path, *, seq_len: int, key: str) -> None:
    ctx = context_length(model_dir)
    if ctx is not None and seq_len > ctx[1]:
        raise InputError(
            f"eval.seq_len={seq_len} is longer than the context of {key}={str(model_dir)!r}"
            f" ({ctx[0]}={ctx[1]}); choose eval.seq_len <= {ctx[1]}"
        )


def check_candidate(
    cand: Candidate, *, ref_text: Windows, text: str, vocab: int, seq_len: int, seed: int
) -> None:
    """One clear error when a candidate cannot be compared: another tokenizer, vocabulary or a
    shorter context."""
    from mlxbun.quant.mlxlm import load_tokenizer

    cfg_vocab = config_vocab(cand.path)
    if cfg_vocab != vocab:
        raise InputError(
            f"eval.candidates has {cand.name!r} with vocab_size={cfg_vocab}; the reference has {vocab}:"
            " a model of another vocabulary cannot be compared"
        )
    check_context(cand.path, seq_len=seq_len, key="eval.candidates")
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


def unique_labels(names: list[str]) -> list[str]:
    """``names`` with repeats numbered (``q4``, ``q4#2``): a table's rows must be told apart."""
    seen: dict[str, int] = {}
    out = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append(n if seen[n] == 1 else f"{n}#{seen[n]}")
    return out


# ------------------------------------------------------------------------------- calibration overlap


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
