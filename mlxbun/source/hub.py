"""What a model directory holds, read from metadata only (never tensor bytes), and where HF caches it.
Why one module: the cache walk and the model-dir reader share the bounded, regular-file-only reads that make a hostile cache safe to scan.

The Hugging Face hub cache (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
``~/.cache/huggingface/hub``)::

    <hub>/
      models--org--name/
        refs/main                   text: the revision (commit hash) that `main` points at (other
                                    refs are not read: only `main` decides the canonical one)
        blobs/<etag>                file bytes, or a symlink into the shared store (hf_hub 2.x)
        blobs/<etag>.incomplete     a partial download: ignored
        snapshots/<rev>/<file>      relative symlink -> ../../blobs/<etag>
      datasets--org--name/          not a model: skipped
      blobs/<2 hex>/<xet hash>      cache-wide shared store; <file> reaches it in two hops

A model directory (a snapshot, an mlxbun output, any local directory); only these are read::

    config.json                     model_type (text_config aware), dims, quantization, experts
    model.safetensors.index.json    weight_map; metadata.total_parameters
    *.safetensors                   header only: u64 little-endian length N, then N bytes of JSON
    optiq_vision.safetensors        the vision sidecar: its own size line, not a language weight
    README.md                       front matter `license:`
    tokenizer_config.json           chat_template mentioning `tools` (also chat_template.jinja)
    kv_config.json                  per-layer KV-cache quantization (presence only)

A corrupt entry becomes a warning on that directory's :class:`ModelInfo`; reading goes on. Only
regular files are opened (a FIFO or a link to a device is refused before a byte is read), and
every read is bounded.
"""

from __future__ import annotations

import json
import math
import operator
import os
import re
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from mlxbun.errors import InputError
from mlxbun.io.dtypes import FLOAT_ITEMSIZE
from mlxbun.io.parameters import count_parameters, quantization_block
from mlxbun.io.safetensors import open_regular, read_header

INDEX = "model.safetensors.index.json"
VISION_SIDECAR = "optiq_vision.safetensors"
NOT_WEIGHTS = {VISION_SIDECAR, "adapters.safetensors"}
MAX_JSON = 100 << 20  # a metadata JSON file (config, index, tokenizer config) larger than this too
README_HEAD = 64 << 10
VISION_PREFIXES = ("vision_tower.", "vision_model.", "visual.", "model.vision_tower.", "model.visual.")
# Speculative-decoding drafters: matched as whole tokens of model_type / architectures / repo name.
DRAFTER_TOKENS = {"drafter", "draft", "eagle", "eagle3", "medusa", "mtp", "dflash"}
DRAFTER_CONFIG_KEYS = ("medusa_num_heads", "medusa_num_layers")
LICENSE_RE = re.compile(r"^license:[ \t]*(?:[\"']?([^\"'#\n]+?)[\"']?)?[ \t]*(?:#.*)?$", re.M)
DRAFTER_HINT_RE = re.compile(r"draft|eagle|medusa|mtp|dflash", re.I)
NON_WORD_RE = re.compile(r"[^a-z0-9]+")
CAMEL_RE = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
LIST_ITEM_RE = re.compile(r"\A\s*-\s*[\"']?([^\"'#\n]+?)[\"']?\s*$", re.M)


def hub_cache_dir(override: str | os.PathLike | None = None) -> Path:
    """The HF hub cache: ``override``, else HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if override:
        return Path(override).expanduser()
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return Path(home).expanduser() / "hub"


@dataclass(frozen=True)
class Snapshot:
    """One revision of one cached repo: ``<hub>/models--org--name/snapshots/<rev>``.

    ``key`` changes whenever the snapshot's entries or the repo's blobs change (see :func:`stat_key`).
    """

    path: str
    repo_id: str
    revision: str
    refs: tuple[str, ...]
    key: str


def repo_id_of(dirname: str) -> str | None:
    """``models--org--name`` -> ``org/name``; None for datasets, spaces and anything else."""
    kind, sep, rest = dirname.partition("--")
    if kind != "models" or not sep or not rest:
        return None
    return rest.replace("--", "/")


def read_main_ref(repo_dir: str, warn: Any = None) -> str | None:
    """The revision ``refs/main`` points at (the only ref the registry's canonical rule needs).

    None when there is none; ``warn(path, why)`` hears of one that cannot be read.
    """
    path = os.path.join(repo_dir, "refs", "main")
    try:
        return read_bytes(path, 256).decode().strip() or None
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        if warn is not None:
            warn(path, f"unreadable ({type(e).__name__}: {str(e)[:80]})")
        return None


def stat_key(path: str, now_ns: int, *, racy_ns: int = 2_000_000_000) -> str:
    """mtime and inode of a directory; "" (never equal to a stored key) when too recent to trust.

    A directory's mtime ticks coarsely, so a change within the same tick as a scan would go
    unseen; like git's racy-index rule, an mtime this close to ``now`` forces a re-read next time.
    """
    try:
        st = os.stat(path)
    except OSError:
        return "-"
    return "" if now_ns - st.st_mtime_ns < racy_ns else f"{st.st_mtime_ns}.{st.st_ino}"


def is_dir(entry: os.DirEntry, warn: Any) -> bool:
    """Whether a scanned entry is a directory (links followed); one that cannot be followed (a
    symbolic link loop, a denied link) is warned about as ``warn(path, why)`` and is not."""
    try:
        return entry.is_dir()
    except OSError as e:
        warn(entry.path, f"unreadable ({e.strerror or type(e).__name__}); skipped")
        return False


def iter_snapshots(hub: str | os.PathLike, warn: Any) -> list[Snapshot]:
    """Every model snapshot in the hub cache; repos without snapshots are warned about and skipped.

    Costs a few syscalls per repo and one per snapshot: no file inside a snapshot is touched.
    """
    out: list[Snapshot] = []
    try:
        entries = sorted(os.scandir(hub), key=lambda e: e.name)
    except OSError:
        return out
    now = time.time_ns()
    for entry in entries:
        repo_id = repo_id_of(entry.name)
        if repo_id is None or not is_dir(entry, warn):
            continue
        snaps = os.path.join(entry.path, "snapshots")
        try:
            revs = sorted(e.name for e in os.scandir(snaps) if is_dir(e, warn))
        except OSError:
            warn(entry.path, "no snapshots/ directory (partial download?)")
            continue
        main = read_main_ref(entry.path, warn)
        blobs = stat_key(os.path.join(entry.path, "blobs"), now)
        for r in revs:
            path = os.path.join(snaps, r)
            key = stat_key(path, now)
            refs = ("main",) if r == main else ()
            out.append(Snapshot(path, repo_id, r, refs, key and blobs and f"hub:{key}:{blobs}"))
    return out


class FileStat(NamedTuple):
    """A top-level entry of a model directory; ``size`` is None for a broken symlink.

    A NamedTuple, not a frozen dataclass: a scan builds thousands and their construction shows.
    """

    name: str
    size: int | None
    mtime_ns: int
    ino: int


def list_files(path: str | os.PathLike, *, stat_all: bool = True) -> list[FileStat]:
    """Top-level files of ``path``, symlinks followed (through any number of hops).

    With ``stat_all=False`` only ``*.safetensors`` files are stat'ed (their sizes are needed);
    the others are reported with size 0 and found broken when opened. Every stat through a
    two-hop blob link costs, and a hub snapshot is keyed by directory stats anyway.
    """
    if not stat_all:  # names only (a subdirectory listed as a file is harmless: never opened)
        return sorted(_stat_one(path, n) if n.endswith(".safetensors") else FileStat(n, 0, 0, 0)
                      for n in os.listdir(path) if n[0] != ".")  # fmt: skip
    out = []
    with os.scandir(path) as it:
        for e in it:
            name = e.name
            if name[0] == ".":
                continue
            try:
                st = e.stat()
            except OSError:
                out.append(FileStat(name, None, 0, 0))
                continue
            if not stat.S_ISDIR(st.st_mode):
                out.append(FileStat(name, st.st_size, st.st_mtime_ns, st.st_ino))
    out.sort()
    return out


def _stat_one(path: str | os.PathLike, name: str) -> FileStat:
    try:
        st = os.stat(os.path.join(path, name))
    except OSError:
        return FileStat(name, None, 0, 0)
    return FileStat(name, st.st_size, st.st_mtime_ns, st.st_ino)


def fingerprint(files: list[FileStat]) -> str:
    """A change detector for a directory: names, sizes, mtimes and inodes of what it holds."""
    return ";".join(f"{f.name}:{f.size}:{f.mtime_ns}:{f.ino}" for f in files)


@dataclass(frozen=True)
class ModelInfo:
    """Everything the registry records about one model directory (disk state, read-only)."""

    model_type: str | None = None
    text_model_type: str | None = None
    architectures: str | None = None
    param_count: int | None = None
    weight_bytes: int = 0
    vision_bytes: int = 0
    expert_bytes: int = 0
    quant_bits: int | None = None
    quant_group_size: int | None = None
    quant_mode: str | None = None
    has_vision: bool = False
    has_kv_config: bool = False
    has_tools: bool = False
    num_layers: int | None = None
    hidden_size: int | None = None
    vocab_size: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    kv_dtype_bytes: int = 2
    sliding_window: int | None = None
    num_sliding_layers: int = 0
    num_experts: int | None = None
    experts_per_tok: int | None = None
    license: str | None = None
    is_drafter: bool = False
    warnings: tuple[str, ...] = field(default_factory=tuple)


def read_bytes(path: str | os.PathLike, limit: int | None = None) -> bytes:
    """A regular file's bytes (at most ``limit``) with the fewest syscalls: stat, open, read, close.

    A short read of a regular file is its end, so a small file costs one read.
    """
    fd = open_regular(path)
    try:
        parts: list[bytes] = []
        left, step = limit, 64 << 10  # a first read under malloc's mmap threshold, then bigger
        while left is None or left > 0:
            want = step if left is None else min(step, left)
            chunk = os.read(fd, want)
            parts.append(chunk)
            if len(chunk) < want:
                break
            left, step = None if left is None else left - len(chunk), 1 << 20
        return b"".join(parts)
    finally:
        os.close(fd)


def read_metadata(path: str | os.PathLike) -> bytes:
    """A metadata file's bytes; ValueError when it holds more than :data:`MAX_JSON` of them."""
    raw = read_bytes(path, MAX_JSON + 1)
    if len(raw) > MAX_JSON:
        raise ValueError(f"larger than {MAX_JSON} bytes, the most a metadata file may hold")
    return raw


def printable(text: str) -> str:
    """``text`` as valid UTF-8: a name that is not (a lone surrogate) shows as ``\\udcff`` escapes."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def read_model_dir(
    path: str | os.PathLike, files: list[FileStat], *, repo_id: str | None = None
) -> ModelInfo:
    """Read ``path``'s metadata files (listed in ``files``) into a :class:`ModelInfo`.

    Args:
        path: the model directory.
        files: its top-level entries, from :func:`list_files`.
        repo_id: the repo id or name, used to spot drafters named as such.

    Example:
        >>> d = Path("models--org--name/snapshots/abc")
        >>> read_model_dir(d, list_files(d)).weight_bytes
    """
    path = os.fspath(path)
    warnings: list[str] = []
    by_name = {f.name: f for f in files}
    warnings += [f"broken link: {printable(f.name)}" for f in files if f.size is None]
    warnings += [f"file name is not UTF-8: {printable(f.name)}" for f in files if not is_utf8(f.name)]
    if not files:
        warnings.append("empty directory")
    config = _json_file(path, by_name, "config.json", warnings)
    if config is None and files and "config.json" not in by_name:
        warnings.append("no config.json")
    config = config if isinstance(config, dict) else {}
    fields: dict[str, Any] = {}
    fields.update(config_fields(config))
    fields.update(_weights(path, by_name, config, warnings))
    fields["has_vision"] = bool(
        fields.pop("_vision_tensors") or "vision_config" in config or fields["vision_bytes"]
    )
    fields["has_kv_config"] = (
        by_name.get("kv_config.json") is not None and by_name["kv_config.json"].size is not None
    )
    fields["has_tools"] = _has_tools(path, by_name, warnings)
    fields["license"] = _license(path, by_name)
    fields["is_drafter"] = is_drafter(config, repo_id)
    return ModelInfo(**fields, warnings=tuple(warnings))


def _json_file(
    path: str, by_name: dict[str, FileStat], name: str, warnings: list[str], *, need: bytes = b""
) -> Any:
    """``name`` parsed, or None when absent, unreadable (a warning) or lacking the bytes ``need``.

    ``need`` skips parsing files that cannot hold what is wanted (a big tokenizer config
    without a chat template).
    """
    f = by_name.get(name)
    if f is None or f.size is None:
        return None
    try:
        raw = read_metadata(os.path.join(path, name))
        return json.loads(raw) if need in raw else None
    except (OSError, ValueError) as e:
        warnings.append(f"{name}: unreadable ({type(e).__name__}: {str(e)[:80]})")
        return None


def _int(v: Any) -> int | None:
    """A JSON number as an int; None for anything else (NaN and infinities included)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v in (math.inf, -math.inf):
        return None
    return int(v)


def config_fields(config: dict[str, Any]) -> dict[str, Any]:
    """Dims, quantization, experts and KV-cache shape from config.json (``text_config`` first)."""
    tc = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    merged = {**config, **{k: v for k, v in tc.items() if v is not None}}

    def get(*keys: str) -> Any:
        for k in keys:
            if merged.get(k) is not None:
                return merged[k]
        return None

    layers = _int(get("num_hidden_layers", "n_layer", "num_layers", "n_layers"))
    hidden = _int(get("hidden_size", "d_model", "n_embd", "dim"))
    heads = _int(get("num_attention_heads", "n_head", "n_heads"))
    head_dim = _int(get("head_dim")) or (hidden // heads if hidden and heads else None)
    archs = config.get("architectures")
    out = {
        "model_type": config.get("model_type") if isinstance(config.get("model_type"), str) else None,
        "architectures": ",".join(a for a in archs if isinstance(a, str))
        if isinstance(archs, list)
        else None,
        "num_layers": layers,
        "hidden_size": hidden,
        "vocab_size": _int(get("vocab_size")),
        "num_kv_heads": _int(get("num_key_value_heads", "n_kv_heads", "num_kv_heads")) or heads,
        "head_dim": head_dim,
        "kv_dtype_bytes": FLOAT_ITEMSIZE.get(str(get("torch_dtype", "dtype")), 2),
        "num_experts": _int(get("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")),
        "experts_per_tok": _int(get("num_experts_per_tok", "num_experts_per_token", "moe_topk")),
    }
    out["text_model_type"] = (
        tc.get("model_type") if isinstance(tc.get("model_type"), str) else out["model_type"]
    )
    out.update(_sliding(tc or config, layers))
    out.update(_quantization(config))
    return out


def _sliding(cfg: dict[str, Any], layers: int | None) -> dict[str, Any]:
    """How many layers keep only a sliding window of keys/values (bounds their KV cache)."""
    window = _int(cfg.get("sliding_window"))
    if not window or window < 0 or cfg.get("use_sliding_window") is False or not layers:
        return {"sliding_window": None, "num_sliding_layers": 0}
    types = cfg.get("layer_types")
    if isinstance(types, list):
        n = sum(1 for t in types if t == "sliding_attention")
    elif _int(cfg.get("sliding_window_pattern")):
        n = layers - layers // int(cfg["sliding_window_pattern"])
    else:
        n = layers
    return {"sliding_window": window, "num_sliding_layers": n}


def _quantization(config: dict[str, Any]) -> dict[str, Any]:
    q = config.get("quantization") or config.get("quantization_config")
    if not isinstance(q, dict):
        return {"quant_bits": None, "quant_group_size": None, "quant_mode": None}
    bits = _int(q.get("bits"))
    mode = q.get("mode") or q.get("quant_method") or ("affine" if bits else None)
    mode = mode if isinstance(mode, str) else None
    return {"quant_bits": bits, "quant_group_size": _int(q.get("group_size")), "quant_mode": mode}


def _weight_files(path: str, by_name: dict[str, FileStat], warnings: list[str]) -> tuple[list[str], Any]:
    """Language-weight shard names (from the index when present) and the index itself."""
    index = _json_file(path, by_name, INDEX, warnings)
    wmap = index.get("weight_map") if isinstance(index, dict) else None
    if isinstance(wmap, dict):
        names = sorted({str(v) for v in wmap.values()})
        missing = [n for n in names if n not in by_name]
        if missing:
            warnings.append(f"index names missing shards: {', '.join(missing[:3])}")
        return [n for n in names if n in by_name], index
    names = [n for n in by_name if n.endswith(".safetensors") and n not in NOT_WEIGHTS]
    return sorted(names), index


def _weights(path: str, by_name: dict[str, FileStat], config: dict, warnings: list[str]) -> dict[str, Any]:
    """Bytes (language, vision sidecar, experts) and parameter count, from sizes and headers.

    Parameters are counted once over every shard's tensors by mlx-lm's convention
    (:func:`mlxbun.io.parameters.count_parameters`), unless the index states the total.
    """
    names, index = _weight_files(path, by_name, warnings)
    sidecar = by_name.get(VISION_SIDECAR)
    out = {"weight_bytes": 0, "expert_bytes": 0, "vision_bytes": (sidecar.size or 0) if sidecar else 0}
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    vision_tensors = False
    for name in names:
        f = by_name[name]
        if f.size is None:
            continue
        out["weight_bytes"] += f.size
        try:
            header = read_header(file := os.path.join(path, name))
        except (OSError, InputError) as e:
            warnings.append(f"{name}: unreadable header ({str(e).removeprefix(f'{file}: ')[:80]})")
            continue
        try:
            experts, shapes, vis = _header_stats(header)
        except (TypeError, ValueError, KeyError, IndexError) as e:  # shapes or offsets that are not numbers
            warnings.append(f"{name}: malformed header entry ({str(e)[:80]})")
            continue
        out["expert_bytes"] += experts
        tensors.update(shapes)
        vision_tensors = vision_tensors or vis
    meta = index.get("metadata") if isinstance(index, dict) else None
    total = meta.get("total_parameters") if isinstance(meta, dict) else None
    counted = count_parameters(tensors, quantization=quantization_block(config), strict=False)
    out["param_count"] = _int(total) or (counted or None)
    out["_vision_tensors"] = vision_tensors
    return out


def _header_stats(header: dict[str, Any]) -> tuple[int, dict[str, tuple[str, tuple[int, ...]]], bool]:
    """(expert-tensor bytes, name -> (dtype, shape), has vision tensors) of one shard header.

    Raises TypeError or ValueError for a shape or offset that is not a list of non-negative ints.
    """
    experts, shapes, vision = 0, {}, False
    for name, info in header.items():
        if name == "__metadata__" or not isinstance(info, dict):
            continue
        if ".experts." in name or ".switch_mlp." in name:
            start, end = info["data_offsets"][:2]
            experts += int(end) - int(start)
        vision = vision or name.startswith(VISION_PREFIXES)
        shape = tuple(operator.index(d) for d in info.get("shape") or ())
        if any(d < 0 for d in shape):
            raise ValueError(f"{name}: negative dimension in shape {shape}")
        shapes[name] = (str(info.get("dtype")), shape)
    return experts, shapes, vision


def _has_tools(path: str, by_name: dict[str, FileStat], warnings: list[str]) -> bool:
    """Whether a chat template mentions ``tools`` (tokenizer_config.json or chat_template.jinja)."""
    tc = _json_file(path, by_name, "tokenizer_config.json", warnings, need=b"chat_template")
    templates = []
    if isinstance(tc, dict):
        t = tc.get("chat_template")
        templates += (
            [t] if isinstance(t, str) else [x.get("template", "") for x in t or [] if isinstance(x, dict)]
        )
    jinja = by_name.get("chat_template.jinja")
    if jinja is not None and jinja.size is not None:
        try:
            templates.append(
                read_metadata(os.path.join(path, "chat_template.jinja")).decode("utf-8", errors="replace")
            )
        except (OSError, ValueError):
            pass
    return any(isinstance(t, str) and "tools" in t for t in templates)


def _license(path: str, by_name: dict[str, FileStat]) -> str | None:
    """``license:`` from README.md front matter (a scalar or the first list item)."""
    f = by_name.get("README.md")
    if f is None or f.size is None:
        return None
    try:
        head = read_bytes(os.path.join(path, "README.md"), README_HEAD).decode("utf-8", errors="replace")
    except OSError:
        return None
    if not head.startswith("---"):
        return None
    end = head.find("\n---", 3)
    front = head[3 : end if end > 0 else len(head)]
    m = LICENSE_RE.search(front)
    if not m:
        return None
    if m.group(1):
        return m.group(1).strip()
    item = LIST_ITEM_RE.match(front[m.end() + 1 :])
    return item.group(1).strip() if item else None


def _tokens(text: str | None) -> set[str]:
    return set(NON_WORD_RE.split((text or "").lower())) - {""}


def is_drafter(config: dict[str, Any], repo_id: str | None) -> bool:
    """A speculative-decoding drafter: never a fuzzy-resolve candidate.

    The rule: a Medusa config key (``medusa_num_heads``); or a whole word of the model_type,
    text_config model_type or a CamelCase-split architecture among drafter, draft, eagle,
    eagle3, medusa, mtp, dflash (``llama_mtp``, ``EagleLlamaForCausalLM``); or a word of the
    repo name among drafter, eagle, eagle3, medusa, dflash (EAGLE heads ship with a plain
    ``llama`` config). "draft" and "mtp" in a repo *name* do not count: full models are often
    published as "...-draft" checkpoints or advertise MTP layers they carry alongside.
    """
    if any(k in config for k in DRAFTER_CONFIG_KEYS):
        return True
    if not DRAFTER_HINT_RE.search(f"{config.get('model_type')} {config.get('architectures')} "
                                  f"{config.get('text_config')} {repo_id}"):  # fmt: skip
        return False  # the common case, without tokenizing anything
    archs = config.get("architectures") if isinstance(config.get("architectures"), list) else []
    words = _tokens(str(config.get("model_type") or ""))
    tc = config.get("text_config")
    if isinstance(tc, dict):
        words |= _tokens(str(tc.get("model_type") or ""))
    for a in archs:  # CamelCase: EagleLlamaForCausalLM -> eagle llama for causal lm
        words |= _tokens(CAMEL_RE.sub(" ", str(a)))
    name_words = _tokens((repo_id or "").rpartition("/")[2])
    return bool(words & DRAFTER_TOKENS or name_words & (DRAFTER_TOKENS - {"draft", "mtp"}))
