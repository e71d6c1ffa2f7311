"""Run provenance: ``manifest.json`` in every run directory, file hashing, and ``verify``.

A run directory looks like::

    outputs/<command>/<YYYY-mm-dd_HH-MM-SS_ffffff>/
        manifest.json        resolved config, overrides, recipe (+ git blob hash), git commit and
                             dirty flag, versions, platform, seed, BLAS, start/end, status,
                             sha256 + size of every input and output file
        <artifacts...>       whatever the command wrote (model dirs, plan.json, ...)

Artifacts are deterministic; only the manifest carries timestamps. ``verify`` re-hashes the
outputs listed in a manifest and reports every file that drifted.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from mlxbun.errors import DriftError, InputError
from mlxbun.io.atomic import atomic_write_bytes, atomic_write_json

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class RunResult:
    """What a command's ``run(cfg)`` hands back to the CLI boundary.

    Args:
        outputs: files or directories written (hashed into the manifest).
        inputs: files or directories read (hashed into the manifest).
        metrics: JSON-able numbers stored in the manifest and the RunRecord.
        message: printed to stdout when the run ends.
        provides: config keys for later pipeline steps, e.g. {"model.name": "<dir>"}.
        digests: sha256 the command already knows (file path -> hex digest), e.g. computed
            while it wrote the file; the manifest uses them instead of reading the file again.
    """

    outputs: list[Path] = field(default_factory=list)
    inputs: list[Path] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    message: str = ""
    provides: dict[str, str] = field(default_factory=dict)
    digests: dict[Path, str] = field(default_factory=dict)


def sha256_file(path: Path, *, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


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
    remembered in ``cache_dir`` under its identity (device, inode, size, mtime in ns, resolved
    path), so a sweep over one source model hashes its shards once.

    Any change to the file changes its mtime and so its key; ``cache_dir=None`` always hashes.
    """
    if (named := named_sha256(path)) is not None:
        return named
    if cache_dir is None:
        return sha256_file(path)
    st = path.stat()
    ident = f"{path.resolve()}\0{st.st_dev}\0{st.st_ino}\0{st.st_size}\0{st.st_mtime_ns}"
    key = hashlib.sha256(ident.encode()).hexdigest()
    entry = cache_dir / key[:2] / key
    try:
        digest = entry.read_text().strip()
        if len(digest) == 64:
            return digest
    except OSError:
        pass
    digest = sha256_file(path)
    entry.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(entry, digest.encode())
    return digest


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


def git_info(root: Path = REPO_ROOT) -> dict[str, Any]:
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
    from importlib import metadata

    import mlxbun

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
    metrics: dict[str, Any] = field(default_factory=dict)
    # Where digests of unchanged input files are remembered; outputs are always hashed afresh.
    digest_cache: Path | None = None

    def recipe_info(self) -> dict[str, Any] | None:
        if self.recipe is None:
            return None
        path = REPO_ROOT / "recipes" / f"{self.recipe}.yaml"
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
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "inputs": self.inputs,
            "outputs": self.outputs,
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
            self.outputs = hash_paths(result.outputs, base=self.run_dir, known=known)
            self.metrics = result.metrics
        return self.write()


@dataclass(frozen=True)
class Drift:
    path: str
    expected: str
    found: str


def verify_run(run_dir: str | Path) -> list[Drift]:
    """Re-hash the outputs listed in ``run_dir/manifest.json``; return every difference."""
    import json

    run_dir = Path(run_dir).expanduser()
    mpath = run_dir / MANIFEST
    if not mpath.is_file():
        raise InputError(f"runs.dir={str(run_dir)!r} has no {MANIFEST}; pass a run directory")
    try:
        manifest = json.loads(mpath.read_text())
        outputs = manifest["outputs"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise DriftError(f"{mpath}: manifest is unreadable ({e})") from None
    drift = []
    for rel, want in outputs.items():
        path = Path(rel) if os.path.isabs(rel) else run_dir / rel
        if not path.is_file():
            drift.append(Drift(rel, want["sha256"], "missing"))
            continue
        got = sha256_file(path)
        if got != want["sha256"]:
            drift.append(Drift(rel, want["sha256"], got))
    return drift


def run(cfg: Any) -> RunResult:
    """command=verify: re-hash a run's outputs; exit 1 listing every drifted file."""
    if not cfg.runs.dir:
        raise InputError("runs.dir is not set; pass runs.dir=<run directory with manifest.json>")
    drift = verify_run(cfg.runs.dir)
    if drift:
        lines = [f"{d.path}: expected {d.expected[:16]}… found {d.found[:16]}" for d in drift]
        raise DriftError(f"{len(drift)} output(s) drifted in {cfg.runs.dir}: " + "; ".join(lines))
    return RunResult(message=f"verified: every output of {cfg.runs.dir} matches its manifest")
