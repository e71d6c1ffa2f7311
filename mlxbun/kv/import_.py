"""command=kv_import: bring a prompt-cache file written by ``mlx_lm cache_prompt`` into the store.

    python -m mlx_lm cache_prompt --model <dir> --prompt "$(cat system.txt)" --prompt-cache-file sys.safetensors
    python -m mlxbun command=kv_import model.name=<dir> kv.file=sys.safetensors kv.name=system \
        kv.prompt_file=system.txt

mlx-lm's file holds no token ids, so the prompt it cached is given again (``kv.prompt`` or
``kv.prompt_file``) and tokenized as ``cache_prompt`` does (through the chat template when the
tokenizer has one; ``kv.chat_template`` as for kv_save, and recorded in the snapshot so that
kv_generate, which encodes the same way, reuses it). The import is checked before anything is stored: cache classes on the
allow-list, one cache per model layer, the cache length equal to the prompt's token count, and
every value finite, and (``kv.verify=true``) a sample of prompt positions (the last among them)
recomputed with the given model, each from the file's own cache of the tokens before it, must
reproduce the file's keys and values there in every layer — another model does not, nor another
prompt that differs at a sampled position. The cache is then saved as a snapshot with this model's fingerprints.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import can_trim_prompt_cache, load_prompt_cache, make_prompt_cache, trim_prompt_cache

from mlxbun.errors import DriftError, InputError
from mlxbun.kv import state
from mlxbun.kv.commands import (
    Loaded,
    chat_applies,
    digest_cache,
    load_model,
    prompt_text,
    prompt_tokens,
    store_of,
)
from mlxbun.kv.store import check_snapshot_name
from mlxbun.progress import human_bytes
from mlxbun.runs.provenance import RunResult
from mlxbun.source.model import model_dir

# recomputed K/V of the last token may differ from the file's by float rounding only
TOLERANCE = 0.02


def check_file(file: str | None) -> Path:
    if not file:
        raise InputError("kv.file is not set; pass kv.file=<prompt-cache .safetensors file>")
    path = Path(file).expanduser()
    if path.suffix != ".safetensors":
        raise InputError(f"kv.file={file!r} must end in .safetensors (what mlx_lm cache_prompt writes)")
    if not path.is_file():
        raise InputError(f"kv.file={file!r} is not a file")
    return path


def read_prompt_cache(path: Path) -> tuple[list[Any], dict[str, str]]:
    """The caches and user metadata of an mlx-lm prompt-cache file; classes are checked against
    the allow-list before mlx-lm builds anything from their names."""
    try:
        _, meta = mx.load(str(path), return_metadata=True)
    except Exception as e:
        raise InputError(f"kv.file={str(path)!r} is not a safetensors file ({e})") from None
    classes = {k: v for k, v in meta.items() if k.startswith("1.")}
    if not classes or "2.0" not in meta:
        raise InputError(
            f"kv.file={str(path)!r} is not an mlx-lm prompt-cache file (no cache classes in its metadata)"
        )
    bad = sorted({v for v in classes.values() if v not in state.CLASSES})
    if bad:
        raise InputError(
            f"kv.file={str(path)!r}: cache class {bad[0]!r} is not supported; choose one of {', '.join(state.CLASSES)}"
        )
    try:
        cache, user = load_prompt_cache(str(path), return_metadata=True)
        state.cache_state(cache)  # refuses classes (also inside a CacheList) outside the allow-list
    except InputError as e:
        raise InputError(f"kv.file={str(path)!r}: {e}") from None
    except Exception as e:
        raise InputError(
            f"kv.file={str(path)!r} is not a loadable prompt cache ({type(e).__name__}: {e})"
        ) from None
    return cache, user if isinstance(user, dict) else {}


def cache_tokens(cache: list[Any]) -> int:
    """The token count every layer of ``cache`` agrees on."""
    offsets = {int(c.offset) for c in _leaves(cache)}
    if len(offsets) != 1:
        raise InputError(f"the prompt cache's layers disagree on their length: {sorted(offsets)}")
    return offsets.pop()


def _leaves(cache: list[Any]) -> list[Any]:
    return [s for c in cache for s in (c.caches if type(c).__name__ == "CacheList" else [c])]


def check_against(loaded: Loaded, cache: list[Any], tokens: list[int], *, path: Path) -> None:
    """Layers, classes and length fit the model and prompt (InputError naming what differs)."""
    want = [type(c).__name__ for c in make_prompt_cache(loaded.model)]
    got = [type(c).__name__ for c in cache]
    if got != want:
        raise InputError(
            f"kv.file={str(path)!r} holds {len(got)} caches {sorted(set(got))}; the model makes {len(want)} {sorted(set(want))}"
        )
    n = cache_tokens(cache)
    if n != len(tokens):
        raise InputError(
            f"kv.file={str(path)!r} caches {n} tokens but the prompt encodes to {len(tokens)}; "
            "pass the prompt it was made from (kv.prompt or kv.prompt_file)"
        )


def check_trailing_space(
    loaded: Loaded, cache: list[Any], text: str, tokens: list[int], *, path: Path, chat: bool | None
) -> None:
    """A length mismatch that the prompt's trailing white space explains (a file's final newline)
    is named as such, with the fix."""
    n, stripped = cache_tokens(cache), text.rstrip()
    if n == len(tokens) or stripped == text or len(prompt_tokens(loaded, stripped, chat=chat)) != n:
        return
    raise InputError(
        f"kv.file={str(path)!r} caches {n} tokens; the prompt given encodes to {len(tokens)} because it ends in "
        f"{text[len(stripped) :]!r} (token {n}: {tokens[n:]}), which the cached prompt did not; pass the prompt "
        "without it (strip the prompt file's final newline, or give kv.prompt=...)"
    )


SAMPLES = 16  # prompt positions recomputed in every layer (the first and last among them)


def check_finite(cache: list[Any], n: int, *, path: Path) -> None:
    """Every float value of the first ``n`` tokens of every layer is finite (NaN/Inf: InputError)."""
    for i, s in enumerate(state.cache_state(cache)):
        for name, t in s.tensors.items():
            if t.dtype == "uint32":
                continue  # packed quantized values are integers; their scales and biases are checked
            bad = ~np.isfinite(_as_f32(t.buf[:, :, :n], t.dtype))
            if bad.any():
                pos = int(np.nonzero(bad.any(axis=(0, 1, 3)))[0][0])
                raise InputError(
                    f"kv.file={str(path)!r} holds {int(bad.sum())} non-finite values (NaN or Inf) in layer {i} "
                    f"{name}, the first at token {pos}; it is no usable cache"
                )


def sample_positions(n: int, k: int = SAMPLES) -> list[int]:
    """Up to ``k`` token positions spread over ``1..n-1`` (the last included), in descending order."""
    return sorted({int(round(x)) for x in np.linspace(1, n - 1, min(k, n - 1))}, reverse=True)


def recompute_check(loaded: Loaded, cache: list[Any], tokens: list[int], *, path: Path) -> float:
    """Recompute sampled prompt positions, each from the file's own cache of the tokens before it;
    the keys and values must match the file's there in every layer. Returns the largest relative
    difference (DriftError naming the layer and position past the tolerance; NaN never passes)."""
    if len(tokens) < 2 or not can_trim_prompt_cache(cache):
        raise InputError(
            f"kv.file={str(path)!r} cannot be checked by recomputing its tokens (untrimmable "
            "or one-token cache); pass kv.verify=false to import it unchecked"
        )
    positions = sample_positions(len(tokens))
    want = {p: _at(cache, p) for p in positions}
    worst, have = 0.0, len(tokens)
    for p in positions:  # descending: each trim only drops what was already checked
        trim_prompt_cache(cache, have - p)
        loaded.model(mx.array(tokens[p : p + 1])[None], cache=cache)
        have = p + 1
        for name, a in want[p].items():
            b = _at(cache, p)[name]
            diff = float(np.max(np.abs(a - b), initial=0.0)) / max(
                float(np.max(np.abs(a), initial=0.0)), 1e-6
            )
            diff = diff if np.isfinite(diff) else float("inf")
            if diff > TOLERANCE:
                raise DriftError(
                    f"kv.file={str(path)!r} was not made by this model from this prompt: recomputing token "
                    f"{p} ({tokens[p]}) differs in layer {name} by {diff:.2g} (relative; at most {TOLERANCE} "
                    "is rounding)"
                )
            worst = max(worst, diff)
    return worst


def _as_f32(raw: np.ndarray, dtype: str) -> np.ndarray:
    return (raw.astype(np.uint32) << 16).view(np.float32) if dtype == "bfloat16" else raw.astype(np.float32)


def _at(cache: list[Any], p: int) -> dict[str, np.ndarray]:
    """Float keys/values/scales at token position ``p`` of every layer, as float32 numpy."""
    out = {}
    for i, s in enumerate(state.cache_state(cache)):
        for name, t in s.tensors.items():
            if t.dtype == "uint32":
                continue  # packed quantized weights: their scales and biases stand for them
            out[f"{i}.{name}"] = _as_f32(t.buf[:, :, p], t.dtype)
    return out


def run(cfg: Any) -> Any:
    """command=kv_import: verify kv.file against the model and prompt, store it as kv.name."""

    if not cfg.kv.name:
        raise InputError("kv.name is not set; pass kv.name=<snapshot name>")
    check_snapshot_name(cfg.kv.name)
    path = check_file(cfg.kv.file)
    text = prompt_text(prompt=cfg.kv.prompt, prompt_file=cfg.kv.prompt_file)
    store = store_of(cfg)
    store.check_writable()
    cache, _ = read_prompt_cache(path)
    loaded = load_model(model_dir(cfg), cache_dir=digest_cache(cfg))
    chat = chat_applies(loaded, cfg.kv.chat_template)
    tokens = prompt_tokens(loaded, text, chat=chat)
    check_trailing_space(loaded, cache, text, tokens, path=path, chat=chat)
    check_against(loaded, cache, tokens, path=path)
    check_finite(cache, len(tokens), path=path)
    checked = None
    if cfg.kv.verify:
        checked = recompute_check(loaded, read_prompt_cache(path)[0], tokens, path=path)
    info = store.save(
        cfg.kv.name,
        cache,
        tokens=tokens,
        model=loaded.model_fp,
        tokenizer=loaded.tokenizer_fp,
        layout=cfg.kv.layout,
        model_name=loaded.name,
        chat_template=chat,
    )
    store.remember_model(loaded.model_fp, loaded.name or str(loaded.path))
    how = (
        "unchecked (kv.verify=false)"
        if checked is None
        else f"{len(sample_positions(info.tokens))} positions recomputed in every layer within {checked:.1e}"
    )
    msg = f"imported {str(path)!r} as {info.name!r}: {info.tokens} tokens, {human_bytes(info.data_bytes)}, {how}"
    metrics = {"tokens": info.tokens, "data_bytes": info.data_bytes, "recompute_diff": checked}
    if cfg.json:
        msg = json.dumps(metrics | {"name": info.name, "file": str(path), "model": info.model_name}, indent=2)
    return RunResult(
        outputs=[info.path], inputs=[path], metrics=metrics | {"store": str(store.root)}, message=msg
    )
