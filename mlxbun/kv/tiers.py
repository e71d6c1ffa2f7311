"""Prompt caches of a server: a byte-capped LRU in memory over the KV store on disk.

A request's prompt starts from the longest usable prefix found in memory, else on disk; a cache
that holds more than the shared prefix is trimmed to it (as mlx-lm's server does). Finished
prompts go back to memory at once and to the store on a background writer
(:class:`Persister`), which never blocks a response. Entries live in a :class:`Keyspace`: the
model and tokenizer fingerprints, the chat template and the cache class with its KV
quantization, so an entry made under any other setting is never a hit.

On disk the entries are ordinary store snapshots named ``serve-<keyspace>-<tokens>``::

    <kv.store>/snapshots/serve-<16 hex of the keyspace>-<32 hex of the tokens' sha256>.<suffix>

so ``kv_ls``, ``kv_verify``, ``kv_gc`` and ``kv_export`` see them as they see any snapshot.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

from mlxbun.errors import InputError
from mlxbun.kv import format as fmt
from mlxbun.kv.store import Store, common_prefix

log = logging.getLogger("mlxbun")

PREFIX = "serve-"
# a disk entry is restored only when it serves at least 1/RESTORE_RATIO of the tokens it holds
RESTORE_RATIO = 16


@dataclass(frozen=True)
class Keyspace:
    """Everything besides the tokens that decides what a cache holds.

    Args:
        model, tokenizer: fingerprints (mlxbun.kv.fingerprint).
        template: the chat template text ("" when the tokenizer has none).
        cache: the cache class and its KV quantization, e.g. ``KVCache`` or
            ``QuantizedKVCache/bits=4/group_size=64`` (:func:`cache_kind`).
    """

    model: str
    tokenizer: str
    template: str
    cache: str

    @property
    def digest(self) -> str:
        text = "\0".join(("mlxbun.serve/1", self.model, self.tokenizer, self.template, self.cache))
        return hashlib.sha256(text.encode()).hexdigest()

    @property
    def prefix(self) -> str:
        return f"{PREFIX}{self.digest[:16]}-"

    def name(self, tokens: Sequence[int]) -> str:
        """The snapshot name of a cache holding ``tokens`` in this keyspace."""
        return f"{self.prefix}{fmt.tokens_sha256(list(tokens))[:32]}"


def cache_kind(classes: Sequence[str], *, bits: int | None, group_size: int) -> str:
    """The keyspace's cache field: the classes a fresh cache has, and the KV quantization."""
    kind = "+".join(sorted(set(classes)))
    return f"{kind}/bits={bits}/group_size={group_size}" if bits else kind


def leaf_caches(cache: list[Any]) -> list[Any]:
    """Every cache object of a prompt cache, a CacheList's members in its place."""
    return [s for c in cache for s in getattr(c, "caches", (c,))]


def kind_of(cache: list[Any]) -> str:
    """The keyspace's cache field of a built cache (its classes and KV quantization)."""
    leaves = leaf_caches(cache)
    quantized = [c for c in leaves if type(c).__name__ == "QuantizedKVCache"]
    if len({(c.bits, c.group_size) for c in quantized}) > 1:
        return "mixed KV quantization"
    bits = quantized[0].bits if quantized else None
    group = quantized[0].group_size if quantized else 0
    return cache_kind([type(c).__name__ for c in leaves], bits=bits, group_size=group)


def nbytes(cache: list[Any]) -> int:
    return sum(int(c.nbytes) for c in cache)


def offset(cache: list[Any]) -> int:
    """How many tokens a prompt cache holds (its first layer's offset)."""
    return int(cache[0].offset)


def usable(have: Sequence[int], want: Sequence[int], *, trimmable: bool) -> int:
    """How many of ``want``'s tokens a cache holding ``have`` serves: the shared prefix, at most
    all but the last token of ``want`` (the model must see one), and only all of ``have`` when
    the cache cannot be trimmed."""
    n = min(common_prefix(have, want), len(want) - 1)
    if n < len(have) and not trimmable:
        return 0
    return max(n, 0)


def trimmed(cache: list[Any], have: int, keep: int) -> list[Any]:
    if keep < have:
        trim_prompt_cache(cache, have - keep)
    return cache


def _trimmable(cache: list[Any]) -> bool:
    return can_trim_prompt_cache(cache)


@dataclass
class Hit:
    """A cache for a prompt: ``reused`` leading tokens come from ``source`` (memory, disk, none)."""

    cache: list[Any] | None
    reused: int
    source: str
    notes: list[str] = field(default_factory=list)


class MemoryTier:
    """An LRU of prompt caches under a byte cap; a hit is a deep copy, so entries never change.

    Args:
        max_bytes: evict least recently used entries until the held caches fit (0: keep none).
    """

    def __init__(self, *, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.entries: OrderedDict[tuple[int, ...], tuple[list[Any], int]] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self.entries)

    def nearest(self, tokens: Sequence[int]) -> Hit | None:
        best, best_n = None, 0
        for have, (cache, _) in self.entries.items():
            n = usable(have, tokens, trimmable=_trimmable(cache))
            if n > best_n:
                best, best_n = have, n
        if best is None:
            return None
        self.entries.move_to_end(best)
        cache = copy.deepcopy(self.entries[best][0])
        return Hit(trimmed(cache, len(best), best_n), best_n, "memory")

    def insert(self, tokens: Sequence[int], cache: list[Any]) -> None:
        """Hold ``cache`` (holding ``tokens``); a trimmable cache replaces those holding a prefix
        of ``tokens`` (they serve nothing it does not)."""
        key = tuple(tokens)
        self._drop(key)
        if _trimmable(cache):
            for have in [h for h in self.entries if key[: len(h)] == h]:
                self._drop(have)
        size = nbytes(cache)
        if size > self.max_bytes:
            return
        self.entries[key] = (cache, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self.entries)))

    def _drop(self, key: tuple[int, ...]) -> None:
        if key in self.entries:
            self.bytes -= self.entries.pop(key)[1]


class DiskTier:
    """The store's snapshots of one keyspace, indexed by their tokens when the server starts.

    A snapshot that turns out corrupt or foreign on restore is a miss with a log line; it is
    dropped from the index and saved again once a request's recomputed tokens cover its own
    (:meth:`PromptCaches.put`).
    """

    def __init__(self, store: Store, space: Keyspace, *, verify: bool = True) -> None:
        self.store, self.space, self.verify = store, space, verify
        self.index: dict[str, tuple[int, ...]] = {}
        self.damaged: dict[str, tuple[int, ...]] = {}
        self._lock = threading.Lock()
        for name in store.names():
            if name.startswith(space.prefix):
                self._index(name)

    def _index(self, name: str) -> None:
        try:
            _, h = self.store.header(name)
        except (fmt.CorruptError, fmt.UnsupportedError, InputError, OSError) as e:
            log.warning("serve: %s; skipped (kv_verify names it)", e)
            return
        if h["model"] != self.space.model or (h["tokenizer"] or "") != self.space.tokenizer:
            log.warning("serve: snapshot %r was saved for another model or tokenizer; skipped", name)
            return
        self.index[name] = tuple(h["tokens"])

    def add(self, name: str, tokens: Sequence[int]) -> None:
        with self._lock:
            self.index[name] = tuple(tokens)
            self.damaged.pop(name, None)

    def forget(self, name: str) -> None:
        with self._lock:
            self.index.pop(name, None)

    def nearest(self, tokens: Sequence[int], *, at_least: int = 0) -> Hit | None:
        """Restore the snapshot serving most of ``tokens`` (more than ``at_least``), or None."""
        with self._lock:
            ranked = sorted(
                ((usable(have, tokens, trimmable=True), name) for name, have in self.index.items()),
                reverse=True,
            )
        notes = []
        for n, name in ranked:
            if n <= at_least:
                break
            if n * RESTORE_RATIO < len(self.index.get(name, ())):
                continue  # reading the whole snapshot to reuse a sliver of it costs more than it saves
            try:
                cache = self._load(name)
            except (fmt.CorruptError, fmt.UnsupportedError, InputError, OSError) as e:
                line = (
                    f"snapshot {name!r} cannot be used ({e}); a miss, recomputed and replaced"
                    " (once a request's tokens cover it)"
                )
                log.warning("serve: %s", line)
                notes.append(line)
                with self._lock:
                    self.damaged[name] = self.index.pop(name, ())
                continue
            have = offset(cache)
            n = usable(self.index.get(name, ())[:have], tokens, trimmable=_trimmable(cache))
            if n > at_least:
                return Hit(trimmed(cache, have, n), n, "disk", notes)
        return Hit(None, 0, "none", notes) if notes else None

    def _load(self, name: str) -> list[Any]:
        space = self.space
        got = self.store.load(name, model=space.model, tokenizer=space.tokenizer, verify=self.verify)
        if tuple(got.tokens) != self.index.get(name) or kind_of(got.cache) != space.cache:
            raise fmt.CorruptError(
                f"snapshot {name!r} holds {kind_of(got.cache)} caches, not the {space.cache} its name promises"
            )
        return got.cache


class Persister:
    """Background saves of finished prompts into the store, at most ``max_pending`` waiting.

    The arrays are referenced in the caller's thread (a few ms) and written on the store's
    worker thread; a save that is still waiting when the queue is full is dropped (logged), so
    a burst of requests never makes a response wait for the disk. :meth:`close` flushes the
    waiting saves or drops them; a save already running always finishes, and the store
    publishes each one atomically, so a kill at any moment leaves the old entry or the new one.
    """

    def __init__(self, store: Store, *, layout: str, model_name: str, max_pending: int = 8) -> None:
        self.store, self.layout, self.model_name = store, layout, model_name
        self.max_pending = max_pending
        self.pending: deque[tuple[str, Future]] = deque()
        self.written = self.dropped = self.failed = 0
        self._lock = threading.RLock()  # a cancel runs the done callback in the cancelling thread

    def submit(
        self, name: str, cache: list[Any], *, tokens: Sequence[int], space: Keyspace, on_done: Any
    ) -> None:
        with self._lock:
            while self.pending and self.pending[0][1].done():
                self.pending.popleft()
            if len(self.pending) >= self.max_pending:
                self._drop_oldest_waiting()
            fut = self.store.save_async(
                name,
                cache,
                tokens=list(tokens),
                model=space.model,
                tokenizer=space.tokenizer,
                layout=self.layout,
                model_name=self.model_name,
            )
            self.pending.append((name, fut))
        fut.add_done_callback(lambda f: self._done(name, f, tokens, on_done))

    def _drop_oldest_waiting(self) -> None:
        for name, fut in self.pending:
            if fut.cancel():
                log.warning(
                    "serve: dropped the waiting save of %r (more than %d saves waiting)",
                    name,
                    self.max_pending,
                )
                return

    def _done(self, name: str, fut: Future, tokens: Sequence[int], on_done: Any) -> None:
        with self._lock:
            if fut.cancelled():
                self.dropped += 1
                return
            if (e := fut.exception()) is not None:
                self.failed += 1
                log.warning("serve: saving %r failed: %s", name, e)
                return
            self.written += 1
        on_done(name, tokens)

    def waiting(self) -> int:
        with self._lock:
            return sum(not f.done() for _, f in self.pending)

    def close(self, *, flush: bool) -> None:
        """Write (``flush``) or drop the waiting saves, and wait for the running one."""
        if not flush:
            with self._lock:
                for _, fut in self.pending:
                    fut.cancel()
        self.store.close()


class PromptCaches:
    """Memory first, then disk; finished prompts back into both (disk in the background).

    Args:
        space: the keyspace of every entry.
        memory: the in-memory LRU.
        disk: the store's entries (None: memory only).
        persister: background writer into the same store (None: nothing is written).
        evict: called after each save to keep the store under its size (``kv.cap_gb``);
            returns the names of the snapshots it removed.
    """

    def __init__(
        self,
        space: Keyspace,
        memory: MemoryTier,
        disk: DiskTier | None = None,
        persister: Persister | None = None,
        *,
        evict: Callable[[], list[str]] | None = None,
    ) -> None:
        self.space, self.memory, self.disk, self.persister = space, memory, disk, persister
        self.evict = evict

    def fetch(self, tokens: Sequence[int]) -> Hit:
        """The cache serving most of ``tokens`` (``Hit.cache`` None when nothing does)."""
        hit = self.memory.nearest(tokens)
        if self.disk is not None:
            found = self.disk.nearest(tokens, at_least=hit.reused if hit else 0)
            if found is not None and (hit is None or found.reused > hit.reused):
                return found
            if found is not None and hit is not None:
                hit.notes += found.notes
        return hit or Hit(None, 0, "none")

    def put(self, tokens: Sequence[int], cache: list[Any]) -> None:
        """Keep ``cache`` (holding ``tokens``) in memory and persist it in the background; a
        damaged snapshot whose tokens it covers is saved again from it."""
        tokens = tuple(tokens)
        self.memory.insert(tokens, cache)
        if self.disk is None or self.persister is None:
            return
        name = self.space.name(tokens)
        for bad, have in list(self.disk.damaged.items()):
            if bad != name and have and tokens[: len(have)] == have and _trimmable(cache):
                self._save(bad, trimmed(copy.deepcopy(cache), len(tokens), len(have)), have)
        if name not in self.disk.index:
            self._save(name, cache, tokens)

    def _save(self, name: str, cache: list[Any], tokens: Sequence[int]) -> None:
        self.persister.submit(name, cache, tokens=tokens, space=self.space, on_done=self._saved)

    def _saved(self, name: str, tokens: Sequence[int]) -> None:
        self.disk.add(name, tokens)
        for evicted in self.evict() if self.evict is not None else ():
            self.disk.forget(evicted)
