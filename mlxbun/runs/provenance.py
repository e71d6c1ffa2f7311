"""Run provenance: ``manifest.json`` in every run directory, file hashing, and verifying a run.

A run directory looks like::

    outputs/<command>/<YYYY-mm-dd_HH-MM-SS_ffffff>/
        manifest.json        resolved config, overrides, recipe (+ git blob hash), git commit and
                             dirty flag, versions, platform, seed, BLAS, start/end, status,
                             sha256 + size of every input and output file
        <artifacts...>       whatever the command wrote (model dirs, plan.json, ...)

Artifacts are deterministic; only the manifest carries timestamps. ``verify`` checks that a run
completed, re-hashes the outputs listed in its manifest, finds files added to its output
directories, and reads nothing outside the run directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import mlxbun
from mlxbun.errors import DriftError, InputError
from mlxbun.io.atomic import TMP_MARK, atomic_write_bytes, atomic_write_json
from mlxbun.io.digest import file_digest

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
# A run that ended well: "ok" (what runrecord writes); "completed" is accepted too.
COMPLETED = ("completed", "ok")
OUTSIDE = "outside the run directory; not read"
# Config keys that name where a command writes (kv_export writes kv.file): outputs under them are
# the run's own, verified like those in the run directory.
WRITE_KEYS = ("quant.out", "synth.out", "kv.store", "kv.file")


@dataclass
class RunResult:
    """What a command's ``run(cfg)`` hands back to the CLI boundary.

    Args:
        outputs: files or directories written (hashed into the manifest).
        inputs: files or directories read (hashed into the manifest).
        metrics: JSON-able numbers stored in the manifest and the RunRecord.
        message: printed to stdout when the run ends.
        provides: config keys for later pipeline steps, e.g. {"model.name": "<dir>"}.
        exit_code: the process exit code of a read-only command whose answer is "no" (1).
        digests: sha256 the command already knows (file path -> hex digest), e.g. computed
            while it wrote the file; the manifest uses them instead of reading the file again.
        written: what the command wrote inside ``outputs`` when that is not all they hold (a
            reused ``quant.out`` may hold files someone added): only these are recorded as
            outputs; None means every file under ``outputs``.
    """

    outputs: list[Path] = field(default_factory=list)
    inputs: list[Path] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    message: str = ""
    provides: dict[str, str] = field(default_factory=dict)
    exit_code: int = 0
    digests: dict[Path, str] = field(default_factory=dict)
    written: list[Path] | None = None


def named_sha256(path: Path) -> str | None:
    """The sha256 a Hugging Face cache file carries in its name, else None.

    In the cache, ``snapshots/<rev>/<file>`` links to ``blobs/<sha256>`` for LFS files (weights),
    named by the sha256 the hub verified on download; small git files are named by a 40-hex
    git blob hash and get no free digest.
    """
    if not path.is_symlink():
        return None
    target = path.resolve()
    name = target.name
    if target.parent.name == "blobs" and len(name) == 64 and all(c in "0123456789abcdef" for c in name):
        return name
    return None


def cached_sha256(path: Path, cache_dir: Path | None) -> str:
    """sha256 of ``path``: from its name in a Hugging Face cache (:func:`named_sha256`), else
    remembered in ``cache_dir`` under its identity (resolved path, device, inode, size, mtime and
    ctime in ns), so a sweep over one source model hashes its shards once: an unchanged file
    costs a stat, a changed one a full read.

    Any write to the file changes its ctime, which no one can set back (an mtime can be, with
    ``touch -d`` or ``cp -p``), and so its key; file times tick with the kernel's coarse clock
    (milliseconds), so only a rewrite within the tick of the one hashed would go unseen. Two threads asking for the same file hash it once
    (the second waits for the first). ``cache_dir=None`` always hashes.
    """
    if (named := named_sha256(path)) is not None:
        return named
    if cache_dir is None:
        return file_digest(path, "sha256")
    st = path.stat()
    ident = f"{path.resolve()}\0{st.st_dev}\0{st.st_ino}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}"
    key = hashlib.sha256(ident.encode()).hexdigest()
    entry = cache_dir / key[:2] / key
    with _hashing(key):
        try:
            digest = entry.read_text().strip()
            if len(digest) == 64:
                return digest
        except OSError:
            pass
        digest = file_digest(path, "sha256")
        entry.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(entry, digest.encode())
    return digest


_HASHING: dict[str, threading.Lock] = {}
_HASHING_LOCK = threading.Lock()


@contextlib.contextmanager
def _hashing(key: str) -> Iterator[None]:
    """Held while one file identity is hashed: a prehash thread and the command's own thread
    asking for the same shard read it once."""
    with _HASHING_LOCK:
        lock = _HASHING.setdefault(key, threading.Lock())
    with lock:
        yield


def _files_under(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))


def hash_paths(
    paths: list[Path],
    *,
    base: Path | None = None,
    cache_dir: Path | None = None,
    known: dict[Path, str] | None = None,
) -> dict[str, dict[str, Any]]:
    """sha256 and size of every file in ``paths`` (directories recursively), keyed by path.

    Keys are relative to ``base`` when the file lies under it, else absolute. Files are hashed on
    one thread per core (hashlib releases the GIL), so a sharded model hashes in parallel;
    ``cache_dir`` reuses digests of unchanged files (see :func:`cached_sha256`) and ``known``
    (path -> sha256) gives digests computed elsewhere, e.g. while the file was written.
    """
    files: dict[str, Path] = {}
    for root in map(Path, paths):
        if root.exists():
            files.update((_rel(f, base), f) for f in _files_under(root))
    files.pop(MANIFEST, None)
    given = {Path(p).resolve(): d for p, d in (known or {}).items()}

    def digest(f: Path) -> str:
        return given.get(f.resolve()) or cached_sha256(f, cache_dir)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        digests = dict(zip(files, pool.map(digest, files.values()), strict=True))
    return {k: {"sha256": digests[k], "size": files[k].stat().st_size} for k in sorted(files)}


def prehash(paths: list[Path], *, cache_dir: Path | None) -> Future:
    """Start hashing ``paths`` (as :func:`hash_paths` would, filling ``cache_dir``) on a
    background thread, so a command overlaps it with its own work; the future gives
    {path: sha256} for :attr:`RunResult.digests`.

    Example:
        >>> pending = prehash([src], cache_dir=cache)
        >>> ...  # convert
        >>> RunResult(inputs=[src], digests=pending.result())
    """
    files = [f for root in map(Path, paths) if root.exists() for f in _files_under(root)]
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prehash")
    future = pool.submit(lambda: {f: cached_sha256(f, cache_dir) for f in files})
    pool.shutdown(wait=False)
    return future


def _rel(path: Path, base: Path | None) -> str:
    resolved = path.resolve()
    if base is not None:
        try:
            return str(resolved.relative_to(base.resolve()))
        except ValueError:
            pass
    return str(resolved)


def git_info(root: Path = mlxbun.REPO_ROOT) -> dict[str, Any]:
    """Commit and dirty flag of the source tree, or nulls outside a git checkout."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, check=True
        ).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain"))}
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}


def git_blob_hash(path: Path) -> str:
    """The git blob hash of a file (what ``git hash-object`` prints), computed in Python."""
    data = Path(path).read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def versions() -> dict[str, str | None]:
    def ver(pkg: str) -> str | None:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    return {
        "python": sys.version.split()[0],
        "mlxbun": mlxbun.__version__,
        "mlx": ver("mlx"),
        "mlx-lm": ver("mlx-lm"),
        "hydra-core": ver("hydra-core"),
    }


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


@dataclass
class Manifest:
    """The manifest of one run; ``write`` publishes it atomically into ``run_dir``."""

    run_dir: Path
    command: str
    config: dict[str, Any]
    overrides: list[str]
    recipe: str | None
    seed: int
    blas: dict[str, Any]
    started_at: str = field(default_factory=now_iso)
    finished_at: str | None = None
    status: str = "running"
    error: str | None = None
    inputs: dict[str, Any] = field(default_factory=dict)
    outputs: dict[str, Any] = field(default_factory=dict)
    # The files and directories the command said it wrote: no other file may appear inside them.
    output_roots: list[str] = field(default_factory=list)
    # Hidden files inside output directories (resume markers and the like): hashed and verified,
    # but not artifacts, so outside the same-bytes promise that ``outputs`` makes.
    side_files: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    # Where digests of unchanged input files are remembered; outputs are always hashed afresh.
    digest_cache: Path | None = None
    # Where relative paths in ``config`` (quant.out=out/model) were taken from.
    cwd: str = field(default_factory=os.getcwd)

    def recipe_info(self) -> dict[str, Any] | None:
        if self.recipe is None:
            return None
        path = mlxbun.REPO_ROOT / "recipes" / f"{self.recipe}.yaml"
        blob = git_blob_hash(path) if path.is_file() else None
        return {"name": self.recipe, "file": f"recipes/{self.recipe}.yaml", "git_blob": blob}

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": MANIFEST_VERSION,
            "command": self.command,
            "status": self.status,
            "error": self.error,
            "recipe": self.recipe_info(),
            "overrides": self.overrides,
            "config": self.config,
            "seed": self.seed,
            "git": git_info(),
            "versions": versions(),
            "platform": {
                "system": platform.system(),
                "machine": platform.machine(),
                "release": platform.release(),
                "python": platform.python_implementation(),
            },
            "blas": self.blas,
            "cwd": self.cwd,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "inputs": self.inputs,
            "outputs": self.outputs,
            "output_roots": self.output_roots,
            "side_files": self.side_files,
            "metrics": self.metrics,
        }

    def write(self) -> Path:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / MANIFEST
        atomic_write_json(path, self.to_dict())
        return path

    def finish(self, *, status: str, result: RunResult | None = None, error: str | None = None) -> Path:
        self.status, self.error, self.finished_at = status, error, now_iso()
        if result is not None:
            known = result.digests
            self.inputs = hash_paths(
                result.inputs, base=self.run_dir, cache_dir=self.digest_cache, known=known
            )
            written = [Path(p) for p in (result.outputs if result.written is None else result.written)]
            visible = [p for p in written if p.is_dir() or not p.name.startswith(".")]
            self.outputs = hash_paths(visible, base=self.run_dir, known=known)
            self.output_roots = sorted(
                {_rel(Path(p), self.run_dir) for p in result.outputs if Path(p).exists()}
            )
            hidden = [
                f
                for p in written
                for f in (_every_file_under(p) if p.is_dir() else [p])
                if f.name.startswith(".")
            ]
            self.side_files = hash_paths(hidden, base=self.run_dir)
            self.metrics = result.metrics
        return self.write()


def _every_file_under(path: Path) -> list[Path]:
    """Every file inside directory ``path``, hidden ones included; not an atomic write's temp name."""
    if not path.is_dir():
        return []
    return sorted(p for p in path.rglob("*") if p.is_file() and not _is_temp(p.name))


def _is_temp(name: str) -> bool:
    return name.startswith(".") and TMP_MARK in name


@dataclass(frozen=True)
class Drift:
    """One difference: ``expected`` "absent" for an added file; ``found`` a digest, "missing", or why
    the file was not read."""

    path: str
    expected: str
    found: str

    def describe(self) -> str:
        if self.expected == "absent":
            what = "" if self.found == "added" else f" {self.found}"
            return f"{self.path}:{what} added (not in the manifest)"
        if self.found in ("missing", OUTSIDE) or len(self.found) != 64:
            return f"{self.path}: {self.found}"
        return f"{self.path}: expected {self.expected[:16]}… found {self.found[:16]}"


def verify_run(run_dir: str | Path) -> list[Drift]:
    """Check a completed run against ``run_dir/manifest.json``; return every difference, by path.

    A run whose status is not completed raises DriftError (a killed run's outputs are empty).
    Every listed output is re-hashed; every file inside an output directory must be listed
    (hidden files included); a listed path that leads outside ``run_dir`` and outside every place
    the run's config told it to write (:data:`WRITE_KEYS`) is refused, not read. Each path is
    reported once.
    """
    run_dir = Path(run_dir).expanduser()
    manifest = _read_manifest(run_dir)
    if manifest.get("status") not in COMPLETED:
        raise DriftError(
            f"runs.dir={str(run_dir)!r}: status is {manifest.get('status')!r}, not completed "
            "(killed, failed or still running); there is nothing to verify"
        )
    roots = write_roots(manifest, run_dir.resolve())
    outputs = {**manifest["outputs"], **manifest.get("side_files", {})}
    drift = [d for rel, want in outputs.items() if (d := _check(roots, rel, want["sha256"]))]
    drift += _added(roots, manifest.get("output_roots", []), outputs)
    first = {d.path: d for d in reversed(drift)}  # one line per path: the listed file's own check
    return sorted(first.values(), key=lambda d: d.path)


def write_roots(manifest: dict[str, Any], run_dir: Path) -> list[Path]:
    """``run_dir`` and every path the manifest's config names under :data:`WRITE_KEYS`, resolved
    from the directory the run started in."""
    cwd = Path(manifest.get("cwd") or os.getcwd())
    roots = [run_dir]
    for key in WRITE_KEYS:
        value: Any = manifest.get("config") or {}
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        root = (cwd / Path(value).expanduser()).resolve() if isinstance(value, str) and value else None
        if root is not None and root != Path(root.anchor):  # "/" would let a manifest name any file
            roots.append(root)
    return roots


def _read_manifest(run_dir: Path) -> dict[str, Any]:
    mpath = run_dir / MANIFEST
    if not mpath.is_file():
        raise InputError(f"runs.dir={str(run_dir)!r} has no {MANIFEST}; pass a run directory")
    try:
        manifest = json.loads(mpath.read_text())
        listed = [*manifest["outputs"].values(), *manifest.get("side_files", {}).values()]
        if not all(isinstance(v["sha256"], str) for v in listed):
            raise TypeError("an output's sha256 is not a string")
        if not all(isinstance(r, str) for r in manifest.get("output_roots", [])):
            raise TypeError("an output root is not a string")
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
        raise DriftError(f"{mpath}: manifest is unreadable ({e})") from None
    return manifest


def _inside(roots: list[Path], rel: str) -> Path | None:
    """``rel`` (relative to the run directory ``roots[0]``, or absolute) with links resolved, or
    None when that leads outside every root."""
    path = (roots[0] / rel).resolve()
    return path if any(path.is_relative_to(r) for r in roots) else None


def _check(roots: list[Path], rel: str, want: str) -> Drift | None:
    path = _inside(roots, rel)
    if path is None:
        return Drift(rel, want, OUTSIDE)
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return Drift(rel, want, "missing")
    if not stat.S_ISREG(mode):
        return Drift(rel, want, "not a regular file")
    got = file_digest(path, "sha256")
    return Drift(rel, want, got) if got != want else None


def _added(roots: list[Path], output_roots: list[str], outputs: dict[str, Any]) -> list[Drift]:
    """Files inside the output directories that the manifest does not list."""
    drift = []
    for root in output_roots:
        path = _inside(roots, root)
        if path is None:
            drift.append(Drift(root, "a directory inside the run", OUTSIDE))
        elif path.is_dir():
            found = ((_key(f, roots[0]), kind) for f, kind in _entries_under(path))
            drift += [Drift(r, "absent", kind) for r, kind in found if r not in outputs and r != MANIFEST]
    return drift


def _key(path: Path, run_dir: Path) -> str:
    """How the manifest names ``path``: relative to the run directory when inside it."""
    return str(path.relative_to(run_dir)) if path.is_relative_to(run_dir) else str(path)


def _entries_under(path: Path) -> list[tuple[Path, str]]:
    """Everything inside directory ``path`` as (path, kind): "added" for a regular file (not an
    atomic write's temp name), else what it is: a symbolic link, FIFO, other special file or
    empty directory. Links are not followed."""
    found = []
    for dirpath, dirnames, filenames in os.walk(path):
        here = Path(dirpath)
        if here != path and not dirnames and not filenames:
            found.append((here, "an empty directory"))
        for name in dirnames + filenames:
            mode = os.lstat(here / name).st_mode
            if stat.S_ISREG(mode) and not _is_temp(name):
                found.append((here / name, "added"))
            elif not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
                found.append((here / name, _special(mode)))
    return sorted(found)


def _special(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    return "a FIFO" if stat.S_ISFIFO(mode) else "a special file"
