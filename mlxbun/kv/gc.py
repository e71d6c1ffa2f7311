"""command=kv_gc: plan, then (with kv.execute=true) free unreferenced KV blocks and LRU snapshots.

Safety against writers is a **lock**, not a grace period: every saver holds the store's
``.lock`` shared (``fcntl.flock``) from its first block write until its manifest is published,
and :func:`execute` holds it exclusive (behind the ``.gate`` turnstile, so savers that keep
overlapping cannot starve it). Under the exclusive lock no save is in flight, so
``execute`` re-reads every manifest and deletes only blocks that are still unreferenced — a block
a writer re-used or wrote after the plan was made survives. Leftover temporary files can only
belong to dead writers then, and are removed too. A manifest that cannot be read blocks all block
deletion (its references are unknown); ``kv_verify`` names it.

The size cap (``kv.cap_gb``) evicts whole snapshots, least recently used first (last use is the
mtime of ``used/<name>``), until the store fits; a snapshot used again after the plan is kept.

Example:
    >>> p = plan(Store(root), cap_bytes=10 << 30)
    >>> print(p.blocks_freed, p.bytes_freed); execute(Store(root), p)
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mlxbun.io.atomic import TMP_MARK, atomic_write_json, fsync_dir
from mlxbun.kv import format as fmt
from mlxbun.kv.store import FILES, SnapshotInfo, Store
from mlxbun.progress import human_bytes
from mlxbun.runs.provenance import RunResult


@dataclass(frozen=True)
class GcPlan:
    """What a GC run frees. ``evict`` pairs a snapshot with its last use when planned."""

    evict: tuple[tuple[str, float], ...]
    blocks: tuple[str, ...]
    temp_files: tuple[str, ...]
    bytes_freed: int
    bytes_before: int
    unreadable: tuple[str, ...] = ()

    @property
    def blocks_freed(self) -> int:
        return len(self.blocks)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["evict"] = [{"name": n, "last_used": t} for n, t in self.evict]
        d["bytes_after"] = self.bytes_before - self.bytes_freed
        return d


def _size(p: Path) -> int | None:
    """Size of ``p`` without following links, or None when a racing writer renamed it away."""
    try:
        return p.lstat().st_size
    except FileNotFoundError:
        return None


def _block_files(store: Store) -> dict[str, int]:
    if not store.blocks.is_dir():
        return {}
    out = {}
    for p in store.blocks.iterdir():
        if fmt.HEX64.fullmatch(p.name) and not p.is_symlink() and p.is_file():
            if (size := _size(p)) is not None:
                out[p.name] = size
    return out


def _temp_files(store: Store) -> dict[str, int]:
    # Listed without the store lock (a plan only looks): a writer may publish a temp meanwhile.
    out = {}
    for d in (store.snapshots, store.blocks):
        if d.is_dir():
            for p in d.iterdir():
                if p.name.startswith(".") and TMP_MARK in p.name and (size := _size(p)) is not None:
                    out[str(p.relative_to(store.root))] = size
    return out


def _snapshots(store: Store) -> tuple[list[SnapshotInfo], list[str]]:
    return store.list()


def _evictions(
    infos: list[SnapshotInfo], sizes: dict[str, int], used_bytes: int, cap: int
) -> list[SnapshotInfo]:
    """LRU snapshots to drop so that ``used_bytes`` (after freeing orphans) fits ``cap``."""
    refs: dict[str, int] = {}
    for s in infos:
        for b in set(s.blocks):
            refs[b] = refs.get(b, 0) + 1
    out = []
    for s in sorted(infos, key=lambda s: (s.last_used, s.name)):
        if used_bytes <= cap:
            break
        used_bytes -= s.path.stat().st_size
        for b in set(s.blocks):
            refs[b] -= 1
            if refs[b] == 0:
                used_bytes -= sizes.get(b, 0)
        out.append(s)
    return out


def plan(store: Store, *, cap_bytes: int | None = None) -> GcPlan:
    """Blocks (and, over ``cap_bytes``, LRU snapshots) a GC would free, with the bytes."""
    infos, bad = _snapshots(store)
    sizes, temps = _block_files(store), _temp_files(store)
    referenced = {b for s in infos for b in s.blocks}
    orphans = [] if bad else sorted(set(sizes) - referenced)
    total = sum(sizes.values()) + sum(s.path.stat().st_size for s in infos) + sum(temps.values())
    used_now = total - sum(sizes[b] for b in orphans) - sum(temps.values())
    evicted = _evictions(infos, sizes, used_now, cap_bytes) if cap_bytes is not None and not bad else []
    left = {b for s in infos if s not in evicted for b in s.blocks}
    freed_blocks = sorted(set(sizes) - left) if not bad else []
    freed = (
        sum(sizes[b] for b in freed_blocks)
        + sum(s.path.stat().st_size for s in evicted)
        + sum(temps.values())
    )
    return GcPlan(
        evict=tuple((s.name, s.last_used) for s in evicted),
        blocks=tuple(freed_blocks),
        temp_files=tuple(sorted(temps)),
        bytes_freed=freed,
        bytes_before=total,
        unreadable=tuple(bad),
    )


def _evict(store: Store, name: str, planned_use: float) -> int:
    used = store.used / name
    if used.exists() and used.stat().st_mtime != planned_use:
        return 0  # used again since the plan: keep it
    freed = 0
    for suffix in FILES:
        p = store.snapshots / f"{name}{suffix}"
        if p.exists():
            freed += p.stat().st_size
            p.unlink()
    used.unlink(missing_ok=True)
    return freed


def execute(store: Store, p: GcPlan, *, timeout: float | None = None) -> GcPlan:
    """Carry out ``p`` under the exclusive store lock; returns what was actually freed."""
    with store.locked(exclusive=True, timeout=timeout):
        freed, evicted = 0, []
        for name, last in p.evict:
            got = _evict(store, name, last)
            if got:
                evicted.append((name, last))
                freed += got
        if store.snapshots.is_dir():
            fsync_dir(store.snapshots)
        infos, bad = _snapshots(store)
        live = {b for s in infos for b in s.blocks}
        gone = []
        for b in p.blocks if not bad else ():
            path = store.blocks / b
            if b not in live and path.is_file() and not path.is_symlink():
                freed += path.stat().st_size
                path.unlink()
                gone.append(b)
        temps = _temp_files(store)
        for rel, size in temps.items():
            (store.root / rel).unlink(missing_ok=True)
            freed += size
        if store.blocks.is_dir():
            fsync_dir(store.blocks)
    return GcPlan(tuple(evicted), tuple(gone), tuple(sorted(temps)), freed, p.bytes_before, tuple(bad))


def run(cfg: Any) -> Any:
    """command=kv_gc: write gc_plan.json; with kv.execute=true also free and write gc_done.json."""

    store = Store(cfg.kv.store, block_kib=cfg.kv.block_kib)
    cap = cfg.kv.cap_bytes
    p = plan(store, cap_bytes=cap)
    run_dir = Path(cfg.paths.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    outputs = [run_dir / "gc_plan.json"]
    atomic_write_json(outputs[0], p.to_dict())
    msg = (
        f"kv_gc plan: {len(p.blocks)} blocks, {len(p.evict)} LRU snapshots, {len(p.temp_files)} temp files;"
        f" {human_bytes(p.bytes_freed)} of {human_bytes(p.bytes_before)}"
    )
    if p.unreadable:
        msg += f"\nwarning: {len(p.unreadable)} unreadable snapshot(s) keep every block: " + "; ".join(
            p.unreadable
        )
    done = p
    if cfg.kv.execute:
        done = execute(store, p)
        outputs.append(run_dir / "gc_done.json")
        atomic_write_json(outputs[1], done.to_dict())
        msg += f"\nfreed {human_bytes(done.bytes_freed)} ({len(done.blocks)} blocks, {len(done.evict)} snapshots)"
    else:
        msg += "\npass kv.execute=true to free them"
    metrics = {"planned_bytes": p.bytes_freed, "freed_bytes": done.bytes_freed if cfg.kv.execute else 0}
    metrics |= {"blocks": len(done.blocks), "evicted": len(done.evict), "bytes_before": p.bytes_before}
    if cfg.json:
        msg = json.dumps(
            {"plan": p.to_dict(), "done": done.to_dict() if cfg.kv.execute else None},
            indent=2,
            sort_keys=True,
        )
    return RunResult(outputs=outputs, metrics=metrics, message=msg)
