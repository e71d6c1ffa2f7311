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
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from mlxbun.errors import DriftError, EnvironmentFailure, InputError
from mlxbun.io.atomic import atomic_write_json
from mlxbun.io.safetensors import read_config
from mlxbun.kv import format as fmt
from mlxbun.kv.state import cache_state
from mlxbun.kv.store import MismatchError, Store, StoreBusy, check_snapshot_name, common_prefix
from mlxbun.progress import Progress, human_bytes
from mlxbun.quant.mlxlm import load
from mlxbun.quant.quantize.outdir import VOCABULARY, tokenizer_warning
from mlxbun.runs.provenance import RunResult
from mlxbun.source.fingerprint import model_fingerprint, tokenizer_fingerprint
from mlxbun.source.model import model_dir

PREFILL_STEP = 512


@dataclass
class Loaded:
    model: Any
    tokenizer: Any
    path: Path
    model_fp: str
    tokenizer_fp: str

    @property
    def name(self) -> str:
        return model_reference(self.path)


def model_reference(path: Path) -> str:
    """What ``mlx_lm.load`` is given for this model, when it is path-free: ``org/name`` inside a
    Hugging Face cache (it resolves offline from there); else "" (snapshots hold no absolute
    paths, so the same run writes the same bytes anywhere; the store remembers the directory
    beside them, see :meth:`mlxbun.kv.store.Store.remember_model`)."""
    hf = next((p.name for p in path.parents if p.name.startswith("models--")), None)
    return hf[len("models--") :].replace("--", "/") if hf else ""


def store_of(cfg: Any) -> Store:
    return Store(cfg.kv.store, block_kib=cfg.kv.block_kib)


def digest_cache(cfg: Any) -> Path:
    return Path(cfg.paths.cache).expanduser() / "digests"


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


def chat_applies(loaded: Loaded, setting: bool | None) -> bool | None:
    """Whether prompts go through the tokenizer's chat template (``kv.chat_template``; None: when
    the tokenizer has one, as ``mlx_lm cache_prompt`` and ``mlx_lm generate`` do); None when the
    tokenizer has none (nothing to choose, so nothing to record)."""
    has = bool(getattr(loaded.tokenizer, "has_chat_template", False))
    if setting and not has:
        raise InputError(
            f"kv.chat_template=true but the tokenizer in {loaded.path} has no chat template; "
            "pass kv.chat_template=false or leave it unset"
        )
    return None if not has else has if setting is None else bool(setting)


def prompt_tokens(loaded: Loaded, text: str, *, chat: bool | None, reply: bool = False) -> list[int]:
    """Token ids of ``text``: plain ``encode``, or (``chat``) one user message through the chat
    template, left open as ``mlx_lm cache_prompt`` caches it or (``reply``) followed by the
    assistant's turn as ``mlx_lm generate`` prompts; the open form is a prefix of the other."""
    tok = loaded.tokenizer
    if not chat:
        return list(tok.encode(text))
    messages = [{"role": "user", "content": text}]
    if reply:
        return list(tok.apply_chat_template(messages, add_generation_prompt=True))
    return list(tok.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True))


def load_model(path: Path, *, cache_dir: Path | None = None) -> Loaded:
    """The model and tokenizer at ``path`` with their fingerprints (shard digests remembered in
    ``cache_dir``)."""
    read_config(path)  # a broken config.json: the one reader's line, not mlx-lm's
    if tokenizer_warning(path) is not None:  # transformers' own error is many lines
        raise EnvironmentFailure(  # a model directory missing files, as a broken config.json is
            f"{path}: no tokenizer files ({', '.join(VOCABULARY)}; model.name); KV caches are keyed by"
            " token ids, so copy the model's tokenizer files (one of those, with tokenizer_config.json) into it"
        )
    model, tokenizer = load(path)
    fp = model_fingerprint(path, cache_dir=cache_dir)
    return Loaded(model, tokenizer, path, fp, tokenizer_fingerprint(path))


def prefill(model: Any, tokens: list[int], cache: list[Any], *, step: int = PREFILL_STEP) -> None:
    """Run ``tokens`` through ``model`` into ``cache`` in chunks (logits discarded)."""
    for i in range(0, len(tokens), step):
        model(mx.array(tokens[i : i + step])[None], cache=cache)
        mx.eval([c.state for c in cache])


def save_prompt(
    store: Store, loaded: Loaded, *, name: str, text: str, layout: str, chat: bool | None = None
) -> tuple[Any, list[int], float]:
    """Prefill ``text`` (through the chat template with ``chat``) and save its cache as ``name``;
    returns (info, tokens, prefill seconds)."""
    tokens = prompt_tokens(loaded, text, chat=chat)
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
        model_name=loaded.name,
        chat_template=chat,
        on_bytes=bar.update,
    )
    bar.close()
    store.remember_model(loaded.model_fp, loaded.name or str(loaded.path))
    return info, tokens, seconds


def save(cfg: Any) -> Any:
    """command=kv_save: prefill kv.prompt (or kv.prompt_file) and store it as kv.name."""

    if not cfg.kv.name:
        raise InputError("kv.name is not set; pass kv.name=<snapshot name>")
    check_snapshot_name(cfg.kv.name)
    text = prompt_text(prompt=cfg.kv.prompt, prompt_file=cfg.kv.prompt_file)
    store = store_of(cfg)
    store.check_writable()  # before the model loads and the prefill runs
    loaded = load_model(model_dir(cfg), cache_dir=digest_cache(cfg))
    start = time.perf_counter()
    chat = chat_applies(loaded, cfg.kv.chat_template)
    info, tokens, prefill_s = save_prompt(
        store, loaded, name=cfg.kv.name, text=text, layout=cfg.kv.layout, chat=chat
    )
    seconds = time.perf_counter() - start - prefill_s
    record = Path(cfg.paths.run_dir) / "kv_snapshot.json"
    record.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(record, _record(info))
    metrics = {"tokens": len(tokens), "data_bytes": info.data_bytes, "written_bytes": info.written_bytes}
    metrics |= {"prefill_s": round(prefill_s, 3), "save_s": round(seconds, 3), "layout": info.layout}
    metrics["store"] = str(store.root)  # in the manifest, not the artifact: artifacts stay path-free
    msg = (
        f"saved {info.name!r}: {len(tokens)} tokens, {human_bytes(info.data_bytes)} of KV"
        f" ({human_bytes(info.written_bytes)} newly written, layout={info.layout}) in {store.root}"
    )
    if cfg.json:
        msg = json.dumps(_record(info) | metrics, indent=2, sort_keys=True)
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
        "model_name": info.model_name,
        "tokenizer": info.tokenizer,
        "chat_template": info.chat_template,
        "blocks": len(info.blocks),
    }


@dataclass
class Outcome:
    """What kv_generate did: generated ids, prompt tokens taken from the store, and why."""

    tokens: list[int]
    reused: int
    notes: list[str]


def why_not(store: Store, loaded: Loaded, tokens: list[int], *, chat: bool | None = None) -> str:
    """One line on why no stored snapshot serves ``tokens`` (encoded through the chat template
    or not, ``chat``; None: unknown): the closest near miss."""
    infos, bad = store.list()
    if not infos:
        extra = f" ({len(bad)} unreadable: {bad[0]})" if bad else ""
        return f"no snapshot in kv.store={store.root} to reuse{extra}"
    misses = []
    for s in infos:
        have = store.header(s.name)[1]["tokens"]
        shared = common_prefix(have, tokens)
        if s.model != loaded.model_fp:
            misses.append(
                (
                    0,
                    f"{s.name!r} was saved for another model ({s.model_name or s.model[:16]}; "
                    f"fingerprint {s.model[:12]} here {loaded.model_fp[:12]})",
                )
            )
        elif s.tokenizer and loaded.tokenizer_fp and s.tokenizer != loaded.tokenizer_fp:
            misses.append(
                (
                    0,
                    f"{s.name!r} was saved with another tokenizer "
                    f"(fingerprint {s.tokenizer[:12]}, here {loaded.tokenizer_fp[:12]})",
                )
            )
        elif chat is not None and s.chat_template is not None and s.chat_template != chat:
            misses.append(
                (shared + 1, f"{s.name!r} {_encoded(s.chat_template)}; this prompt {_encoded(chat)}")
            )
        elif shared < len(have):
            at = (
                f"diverges from the prompt at token {shared}" if shared < len(tokens) else "is longer than it"
            )
            misses.append((shared + 1, f"{s.name!r} ({len(have)} tokens) {at}"))
    misses.sort(key=lambda m: -m[0])
    more = f" (and {len(misses) - 1} more)" if len(misses) > 1 else ""
    return (
        f"no stored prefix of the prompt: {misses[0][1]}{more}"
        if misses
        else "no stored prefix of the prompt"
    )


def _encoded(chat: bool) -> str:
    how = (
        "through the chat template (kv.chat_template=true)"
        if chat
        else "as plain text (kv.chat_template=false)"
    )
    return f"was encoded {how}"


def continue_from(
    store: Store,
    loaded: Loaded,
    tokens: list[int],
    *,
    name: str | None,
    max_tokens: int,
    verify: bool,
    strict: bool = True,
    chat: bool | None = None,
) -> Outcome:
    """Restore the best snapshot, prefill the rest of ``tokens``, decode greedily.

    A snapshot that is corrupt (or, named, missing) raises with ``strict``; otherwise its prefix
    is recomputed and saved over it atomically, and a note says so. ``chat``: whether ``tokens``
    came through the chat template (recorded in a replaced snapshot, named in a near miss).
    """

    fp = dict(model=loaded.model_fp, tokenizer=loaded.tokenizer_fp)
    unreadable: list[str] = []

    def skipped(n: str, e: Exception) -> None:
        if strict:  # its prefix is unknown: it might have been the hit
            raise fmt.CorruptError(
                f"snapshot {n!r} cannot be read ({e}); kv.strict=true stops here"
            ) from None
        unreadable.append(f"snapshot {n!r} cannot be read ({e}); skipped (kv_verify names it)")

    hit = name or (m.name if (m := store.lookup(tokens, unreadable=skipped, **fp)) else None)
    if hit is None:
        cache = _fresh(loaded)
        notes = [*unreadable, why_not(store, loaded, tokens, chat=chat)]
        return Outcome(greedy(loaded, tokens, cache, max_tokens=max_tokens), 0, notes)
    try:
        restored = store.load(hit, tokens=tokens, verify=verify, **fp)
    except (fmt.CorruptError, InputError) as e:
        if strict or isinstance(e, MismatchError | StoreBusy) or (isinstance(e, InputError) and not name):
            raise
        return _repair(store, loaded, tokens, name=hit, why=str(e), max_tokens=max_tokens, chat=chat)
    return _continue(
        loaded, tokens, restored.cache, len(restored.tokens), max_tokens=max_tokens, notes=unreadable
    )


def _fresh(loaded: Loaded) -> list[Any]:
    return make_prompt_cache(loaded.model)


def _continue(
    loaded: Loaded, tokens: list[int], cache: list[Any], reused: int, *, max_tokens: int, notes: list[str]
) -> Outcome:
    """Decode from ``cache`` holding ``tokens[:reused]`` (the model needs at least one new token)."""
    if reused == len(tokens):
        if can_trim_prompt_cache(cache):
            trim_prompt_cache(cache, 1)
            reused -= 1
        else:
            cache, reused = _fresh(loaded), 0
            notes.append("the stored cache cannot be trimmed by the one token the model must see; prefilled")
    return Outcome(greedy(loaded, tokens[reused:], cache, max_tokens=max_tokens), reused, notes)


def _repair(
    store: Store,
    loaded: Loaded,
    tokens: list[int],
    *,
    name: str,
    why: str,
    max_tokens: int,
    chat: bool | None,
) -> Outcome:
    """Recompute the prefix snapshot ``name`` held (the whole prompt when unknown), save it over
    the damaged or missing one, and continue from it."""
    try:
        have = store.header(name)[1]["tokens"]
        n = len(have) if tokens[: len(have)] == have else len(tokens)
    except Exception:  # header unreadable or missing: its prefix is unknown
        n = len(tokens)
    cache = _fresh(loaded)
    prefill(loaded.model, tokens[:n], cache)
    note = f"snapshot {name!r} could not be used ({why}); recomputed its {n} tokens"
    try:
        store.save(
            name,
            cache,
            tokens=tokens[:n],
            model=loaded.model_fp,
            tokenizer=loaded.tokenizer_fp,
            model_name=loaded.name,
            chat_template=chat,
        )
        note += " and replaced it"
    except OSError as e:
        note += f" but could not replace it ({e})"
    note += "; recomputed tokens are not reused ones, so reused_tokens is 0"
    done = _continue(loaded, tokens, cache, n, max_tokens=max_tokens, notes=[note])
    return Outcome(done.tokens, 0, done.notes)


def greedy(loaded: Loaded, rest: list[int], cache: list[Any], *, max_tokens: int) -> list[int]:
    """mlx-lm's generate_step with its default (argmax) sampler, stopping at EOS."""
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

    if cfg.kv.name:
        check_snapshot_name(cfg.kv.name)
    text = prompt_text(prompt=cfg.kv.prompt, prompt_file=cfg.kv.prompt_file)
    loaded = load_model(model_dir(cfg), cache_dir=digest_cache(cfg))
    chat = chat_applies(loaded, cfg.kv.chat_template)
    tokens = prompt_tokens(loaded, text, chat=chat, reply=True)
    if not tokens:
        raise InputError("kv.prompt encodes to zero tokens; give a non-empty prompt")
    start = time.perf_counter()
    got = continue_from(
        store_of(cfg),
        loaded,
        tokens,
        name=cfg.kv.name,
        max_tokens=cfg.kv.max_tokens,
        verify=cfg.kv.verify,
        strict=cfg.kv.strict,
        chat=chat,
    )
    seconds = time.perf_counter() - start
    completion = loaded.tokenizer.decode(got.tokens)
    path = Path(cfg.paths.run_dir) / "generation.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "prompt_tokens": len(tokens),
        "reused_tokens": got.reused,
        "tokens": got.tokens,
        "text": completion,
    }
    atomic_write_json(path, record | {"notes": got.notes})
    metrics = {
        "prompt_tokens": len(tokens),
        "reused_tokens": got.reused,
        "generated": len(got.tokens),
        "seconds": round(seconds, 3),
    }
    if cfg.json:
        msg = json.dumps(
            record | {"notes": got.notes, "seconds": metrics["seconds"]}, indent=2, sort_keys=True
        )
    else:
        lines = [
            f"reused {got.reused} of {len(tokens)} prompt tokens from the store; generated {len(got.tokens)}:"
        ]
        msg = "\n".join([f"note: {n}" for n in got.notes] + lines + [completion])
    return RunResult(outputs=[path], inputs=[loaded.path / "config.json"], metrics=metrics, message=msg)


def ls(cfg: Any) -> Any:
    """command=kv_ls: stored snapshots (json=true for machine-readable output)."""

    store = store_of(cfg)
    infos, bad = store.list()
    rows = [
        {
            "name": s.name,
            "layout": s.layout,
            "tokens": s.tokens,
            "data_bytes": s.data_bytes,
            "disk_bytes": s.file_bytes,
            "blocks": len(s.blocks),
            "model": s.model_name or store.model_of(s.model) or None,
            "model_fingerprint": s.model[:16],
            "chat_template": s.chat_template,
            "path": str(s.path),
            "last_used": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(s.last_used)),
        }
        for s in infos
    ]
    if cfg.json:
        return RunResult(message=json.dumps({"snapshots": rows, "unreadable": bad}, indent=2, sort_keys=True))
    lines = [f"{'name':<24} {'layout':<8} {'tokens':>8} {'size':>10} {'blocks':>7}  {'last used':<19}  model"]
    lines += [
        f"{r['name']:<24} {r['layout']:<8} {r['tokens']:>8} {human_bytes(r['data_bytes']):>10} {r['blocks']:>7}"
        f"  {r['last_used']:<19}  {r['model'] or '(unnamed)'} [{r['model_fingerprint'][:12]}]"
        for r in rows
    ]
    lines += [f"warning: {b}" for b in bad]
    if rows:
        lines += [for_mlx_lm(rows[0]["name"])]
    return RunResult(message="\n".join(lines))


def for_mlx_lm(name: str) -> str:
    """Which file to hand to ``mlx_lm generate --prompt-cache-file``, and how."""
    return (
        f"for mlx_lm generate: python -m mlxbun command=kv_export kv.name={name} kv.file={name}.safetensors "
        f"model.name=<the model as you will spell --model>, then python -m mlx_lm generate --prompt-cache-file "
        f"{name}.safetensors --prompt '...' (a snapshot of an org/name model opens as it is, from snapshots/)"
    )


def verify(cfg: Any) -> Any:
    """command=kv_verify: re-hash kv.name (or every snapshot); DriftError (exit 1) on any problem.
    With json=true the report is JSON on stdout either way."""

    store = store_of(cfg)
    names = [check_snapshot_name(cfg.kv.name)] if cfg.kv.name else None
    if names:
        store.path_of(names[0])
    checked, problems = store.verify(names)
    n = len(names or store.names())
    if cfg.json:
        report = {"store": str(store.root), "snapshots": n, "bytes": checked, "problems": problems}
        text = json.dumps(report | {"ok": not problems}, indent=2, sort_keys=True)
    summary = f"kv_verify found {len(problems)} problem(s) in {store.root}: " + "; ".join(problems)
    if cfg.json:
        if problems:
            print(f"error: {summary}", file=sys.stderr)
        return RunResult(message=text, exit_code=1 if problems else 0)
    if problems:
        raise DriftError(summary)
    return RunResult(message=f"ok: {n} snapshot(s), {human_bytes(checked)} re-hashed in {store.root}")
