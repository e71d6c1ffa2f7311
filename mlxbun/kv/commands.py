"""The kv_save, kv_generate, kv_ls and kv_verify commands over a :class:`mlxbun.kv.store.Store`.

    python -m mlxbun command=kv_save model.name=<dir> kv.name=system kv.prompt_file=system.txt
    python -m mlxbun command=kv_generate model.name=<dir> kv.prompt_file=question.txt kv.max_tokens=64
    python -m mlxbun command=kv_ls            # or json=true
    python -m mlxbun command=kv_verify        # exit 1 on any corrupt block or snapshot

``kv_generate`` restores the stored snapshot whose tokens are the longest prefix of the prompt
(or ``kv.name``), prefills only the rest and decodes greedily: the tokens equal a from-scratch run.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxbun.errors import DriftError, InputError
from mlxbun.io.atomic import atomic_write_json
from mlxbun.kv.fingerprint import model_fingerprint, tokenizer_fingerprint
from mlxbun.kv.store import Store, check_snapshot_name

PREFILL_STEP = 512


@dataclass
class Loaded:
    model: Any
    tokenizer: Any
    path: Path
    model_fp: str
    tokenizer_fp: str


def store_of(cfg: Any) -> Store:
    return Store(cfg.kv.store, block_kib=cfg.kv.block_kib)


def prompt_text(*, prompt: str | None, prompt_file: str | None) -> str:
    """The prompt from exactly one of kv.prompt / kv.prompt_file."""
    if (prompt is None) == (prompt_file is None):
        raise InputError("set exactly one of kv.prompt=<text> or kv.prompt_file=<path>")
    if prompt is not None:
        return prompt
    path = Path(prompt_file).expanduser()
    if not path.is_file():
        raise InputError(f"kv.prompt_file={prompt_file!r} is not a file")
    return path.read_text()


def load_model(path: Path) -> Loaded:
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(path))
    return Loaded(model, tokenizer, path, model_fingerprint(path), tokenizer_fingerprint(path))


def prefill(model: Any, tokens: list[int], cache: list[Any], *, step: int = PREFILL_STEP) -> None:
    """Run ``tokens`` through ``model`` into ``cache`` in chunks (logits discarded)."""
    import mlx.core as mx

    for i in range(0, len(tokens), step):
        model(mx.array(tokens[i : i + step])[None], cache=cache)
        mx.eval([c.state for c in cache])


def save_prompt(
    store: Store, loaded: Loaded, *, name: str, text: str, layout: str
) -> tuple[Any, list[int], float]:
    """Prefill ``text`` and save its cache as ``name``; returns (info, tokens, prefill seconds)."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlxbun.kv.state import cache_state
    from mlxbun.progress import Progress

    tokens = list(loaded.tokenizer.encode(text))
    if not tokens:
        raise InputError("kv.prompt encodes to zero tokens; give a non-empty prompt")
    cache = make_prompt_cache(loaded.model)
    start = time.perf_counter()
    prefill(loaded.model, tokens, cache)
    seconds = time.perf_counter() - start
    nbytes = sum(t.nbytes for s in cache_state(cache) for t in s.tensors.values())
    bar = Progress(total=nbytes, unit="B", desc=f"kv save {name}")
    info = store.save(
        name,
        cache,
        tokens=tokens,
        model=loaded.model_fp,
        tokenizer=loaded.tokenizer_fp,
        layout=layout,
        on_bytes=bar.update,
    )
    bar.close()
    return info, tokens, seconds


def save(cfg: Any) -> Any:
    """command=kv_save: prefill kv.prompt (or kv.prompt_file) and store it as kv.name."""
    from mlxbun.provenance import RunResult
    from mlxbun.source import model_dir

    if not cfg.kv.name:
        raise InputError("kv.name is not set; pass kv.name=<snapshot name>")
    check_snapshot_name(cfg.kv.name)
    text = prompt_text(prompt=cfg.kv.prompt, prompt_file=cfg.kv.prompt_file)
    loaded = load_model(model_dir(cfg))
    store = store_of(cfg)
    start = time.perf_counter()
    info, tokens, prefill_s = save_prompt(store, loaded, name=cfg.kv.name, text=text, layout=cfg.kv.layout)
    seconds = time.perf_counter() - start - prefill_s
    record = Path(cfg.paths.run_dir) / "kv_snapshot.json"
    record.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(record, _record(info))
    metrics = {"tokens": len(tokens), "data_bytes": info.data_bytes, "written_bytes": info.written_bytes}
    metrics |= {"prefill_s": round(prefill_s, 3), "save_s": round(seconds, 3), "layout": info.layout}
    metrics["store"] = str(store.root)  # in the manifest, not the artifact: artifacts stay path-free
    msg = (
        f"saved {info.name!r}: {len(tokens)} tokens, {info.data_bytes / 1e6:.1f} MB of KV"
        f" ({info.written_bytes / 1e6:.1f} MB newly written, layout={info.layout}) in {store.root}"
    )
    inputs = [loaded.path / "config.json"] + (
        [Path(cfg.kv.prompt_file).expanduser()] if cfg.kv.prompt_file else []
    )
    return RunResult(outputs=[record, info.path], inputs=inputs, metrics=metrics, message=msg)


def _record(info: Any) -> dict[str, Any]:
    return {
        "name": info.name,
        "layout": info.layout,
        "tokens": info.tokens,
        "data_bytes": info.data_bytes,
        "model": info.model,
        "tokenizer": info.tokenizer,
        "blocks": len(info.blocks),
    }


def continue_from(
    store: Store, loaded: Loaded, tokens: list[int], *, name: str | None, max_tokens: int, verify: bool
) -> tuple[list[int], int]:
    """Restore the best snapshot, prefill the rest of ``tokens``, decode greedily.

    Returns (generated token ids, prompt tokens taken from the store).
    """
    from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

    fp = dict(model=loaded.model_fp, tokenizer=loaded.tokenizer_fp)
    hit = name or (m.name if (m := store.lookup(tokens, **fp)) else None)
    cache, reused = make_prompt_cache(loaded.model), 0
    if hit is not None:
        restored = store.load(hit, tokens=tokens, verify=verify, **fp)
        reused = len(restored.tokens)
        if reused == len(tokens):  # the model needs at least one token to produce logits
            if can_trim_prompt_cache(restored.cache):
                trim_prompt_cache(restored.cache, 1)
                reused -= 1
            else:
                reused = 0
        if reused:
            cache = restored.cache
    return greedy(loaded, tokens[reused:], cache, max_tokens=max_tokens), reused


def greedy(loaded: Loaded, rest: list[int], cache: list[Any], *, max_tokens: int) -> list[int]:
    """mlx-lm's generate_step with its default (argmax) sampler, stopping at EOS."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    eos = set(getattr(loaded.tokenizer, "eos_token_ids", ()) or ())
    out = []
    for tok, _ in generate_step(mx.array(rest), loaded.model, max_tokens=max_tokens, prompt_cache=cache):
        tok = int(tok)
        if tok in eos:
            break
        out.append(tok)
    return out


def generate(cfg: Any) -> Any:
    """command=kv_generate: restore the best cached prefix of the prompt and generate."""
    from mlxbun.provenance import RunResult
    from mlxbun.source import model_dir

    if cfg.kv.name:
        check_snapshot_name(cfg.kv.name)
    text = prompt_text(prompt=cfg.kv.prompt, prompt_file=cfg.kv.prompt_file)
    loaded = load_model(model_dir(cfg))
    tokens = list(loaded.tokenizer.encode(text))
    if not tokens:
        raise InputError("kv.prompt encodes to zero tokens; give a non-empty prompt")
    start = time.perf_counter()
    out, reused = continue_from(
        store_of(cfg), loaded, tokens, name=cfg.kv.name, max_tokens=cfg.kv.max_tokens, verify=cfg.kv.verify
    )
    seconds = time.perf_counter() - start
    completion = loaded.tokenizer.decode(out)
    path = Path(cfg.paths.run_dir) / "generation.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(
        path, {"prompt_tokens": len(tokens), "reused_tokens": reused, "tokens": out, "text": completion}
    )
    metrics = {
        "prompt_tokens": len(tokens),
        "reused_tokens": reused,
        "generated": len(out),
        "seconds": round(seconds, 3),
    }
    msg = (
        f"reused {reused} of {len(tokens)} prompt tokens from the store; generated {len(out)}:\n{completion}"
    )
    return RunResult(outputs=[path], inputs=[loaded.path / "config.json"], metrics=metrics, message=msg)


def ls(cfg: Any) -> Any:
    """command=kv_ls: stored snapshots (json=true for machine-readable output)."""
    from mlxbun.provenance import RunResult

    infos, bad = store_of(cfg).list()
    rows = [
        {
            "name": s.name,
            "layout": s.layout,
            "tokens": s.tokens,
            "data_bytes": s.data_bytes,
            "disk_bytes": s.file_bytes,
            "blocks": len(s.blocks),
            "model": s.model[:16],
            "last_used": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(s.last_used)),
        }
        for s in infos
    ]
    if cfg.json:
        return RunResult(message=json.dumps({"snapshots": rows, "unreadable": bad}, indent=2, sort_keys=True))
    lines = [f"{'name':<24} {'layout':<8} {'tokens':>8} {'MB':>10} {'blocks':>7}  {'last used':<19}  model"]
    lines += [
        f"{r['name']:<24} {r['layout']:<8} {r['tokens']:>8} {r['data_bytes'] / 1e6:>10.1f} {r['blocks']:>7}"
        f"  {r['last_used']:<19}  {r['model']}"
        for r in rows
    ]
    lines += [f"warning: {b}" for b in bad]
    return RunResult(message="\n".join(lines))


def verify(cfg: Any) -> Any:
    """command=kv_verify: re-hash kv.name (or every snapshot); DriftError (exit 1) on any problem."""
    from mlxbun.provenance import RunResult

    store = store_of(cfg)
    names = [check_snapshot_name(cfg.kv.name)] if cfg.kv.name else None
    if names:
        store.path_of(names[0])
    checked, problems = store.verify(names)
    if problems:
        raise DriftError(
            f"kv_verify found {len(problems)} problem(s) in {store.root}: " + "; ".join(problems)
        )
    n = len(names or store.names())
    return RunResult(message=f"ok: {n} snapshot(s), {checked / 1e6:.1f} MB re-hashed in {store.root}")
