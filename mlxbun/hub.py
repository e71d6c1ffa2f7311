"""What a model directory holds, read from metadata only (never tensor bytes), and where HF caches it.

The Hugging Face hub cache (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
``~/.cache/huggingface/hub``)::

    <hub>/
      models--org--name/
        refs/main                   text: the revision (commit hash) that `main` points at
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

A corrupt entry becomes a warning on that directory's :class:`ModelInfo`; reading goes on.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

INDEX = "model.safetensors.index.json"
VISION_SIDECAR = "optiq_vision.safetensors"
NOT_WEIGHTS = {VISION_SIDECAR, "adapters.safetensors"}
MAX_HEADER = 100 << 20  # a safetensors header larger than this is hostile, not a model
README_HEAD = 64 << 10
EXPERT_MARKS = (".experts.", ".switch_mlp.")
VISION_PREFIXES = ("vision_tower.", "vision_model.", "visual.", "model.vision_tower.", "model.visual.")
# Speculative-decoding drafters: matched as whole tokens of model_type / architectures / repo name.
DRAFTER_TOKENS = {"drafter", "draft", "eagle", "eagle3", "medusa", "mtp", "dflash"}
DRAFTER_CONFIG_KEYS = ("medusa_num_heads", "medusa_num_layers")
DTYPE_BYTES = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2}
LICENSE_RE = re.compile(r"^license:[ \t]*(?:[\"']?([^\"'#\n]+?)[\"']?)?[ \t]*(?:#.*)?$", re.M)
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
    """One revision of one cached repo: ``<hub>/models--org--name/snapshots/<rev>``."""

    path: Path
    repo_id: str
    revision: str
    refs: tuple[str, ...]


def repo_id_of(dirname: str) -> str | None:
    """``models--org--name`` -> ``org/name``; None for datasets, spaces and anything else."""
    kind, sep, rest = dirname.partition("--")
    if kind != "models" or not sep or not rest:
        return None
    return rest.replace("--", "/")


def read_refs(repo_dir: Path) -> dict[str, list[str]]:
    """revision -> the ref names (``main``, ``refs/pr/1``) pointing at it."""
    out: dict[str, list[str]] = {}
    refs = repo_dir / "refs"
    for root, _dirs, files in os.walk(refs):
        for name in files:
            p = os.path.join(root, name)
            try:
                with open(p) as f:
                    rev = f.read().strip()
            except OSError:
                continue
            out.setdefault(rev, []).append(os.path.relpath(p, refs))
    return out


def iter_snapshots(hub: Path, warn: Any) -> list[Snapshot]:
    """Every model snapshot in the hub cache; repos without snapshots are warned about and skipped."""
    out: list[Snapshot] = []
    try:
        entries = sorted(os.scandir(hub), key=lambda e: e.name)
    except OSError:
        return out
    for entry in entries:
        repo_id = repo_id_of(entry.name)
        if repo_id is None or not entry.is_dir():
            continue
        snaps = os.path.join(entry.path, "snapshots")
        try:
            revs = sorted(e.name for e in os.scandir(snaps) if e.is_dir())
        except OSError:
            warn(entry.path, "no snapshots/ directory (partial download?)")
            continue
        refs = read_refs(Path(entry.path))
        out += [Snapshot(Path(snaps) / r, repo_id, r, tuple(sorted(refs.get(r, ())))) for r in revs]
    return out


@dataclass(frozen=True)
class FileStat:
    """A top-level entry of a model directory; ``size`` is None for a broken symlink."""

    name: str
    size: int | None
    mtime_ns: int
    ino: int


def list_files(path: Path) -> list[FileStat]:
    """Top-level files of ``path``, symlinks followed (through any number of hops)."""
    out = []
    with os.scandir(path) as it:
        for e in it:
            if e.name.startswith("."):
                continue
            try:
                st = e.stat()
            except OSError:
                out.append(FileStat(e.name, None, 0, 0))
                continue
            if not e.is_dir():
                out.append(FileStat(e.name, st.st_size, st.st_mtime_ns, st.st_ino))
    return sorted(out, key=lambda f: f.name)


def fingerprint(files: list[FileStat]) -> str:
    """A change detector for a directory: names, sizes, mtimes and inodes of what it holds."""
    return ";".join(f"{f.name}:{f.size}:{f.mtime_ns}:{f.ino}" for f in files)


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (u64 LE length + JSON), without touching tensor bytes.

    Example:
        >>> header = read_safetensors_header(Path("model.safetensors"))
        >>> header["model.embed_tokens.weight"]["shape"]
    """
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path.name}: shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        size = os.fstat(f.fileno()).st_size
        if n > MAX_HEADER or n > size - 8:
            raise ValueError(f"{path.name}: header length {n} exceeds the file ({size} bytes)")
        header = json.loads(f.read(n))
    if not isinstance(header, dict):
        raise ValueError(f"{path.name}: header is not a JSON object")
    return header


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


def read_json(path: Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_model_dir(path: Path, files: list[FileStat], *, repo_id: str | None = None) -> ModelInfo:
    """Read ``path``'s metadata files (listed in ``files``) into a :class:`ModelInfo`.

    Args:
        path: the model directory.
        files: its top-level entries, from :func:`list_files`.
        repo_id: the repo id or name, used to spot drafters named as such.

    Example:
        >>> d = Path("models--org--name/snapshots/abc")
        >>> read_model_dir(d, list_files(d)).weight_bytes
    """
    warnings: list[str] = []
    by_name = {f.name: f for f in files}
    warnings += [f"broken link: {f.name}" for f in files if f.size is None]
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


def _json_file(path: Path, by_name: dict[str, FileStat], name: str, warnings: list[str]) -> Any:
    f = by_name.get(name)
    if f is None or f.size is None:
        return None
    try:
        return read_json(path / name)
    except (OSError, ValueError) as e:
        warnings.append(f"{name}: unreadable ({type(e).__name__}: {str(e)[:80]})")
        return None


def _int(v: Any) -> int | None:
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def config_fields(config: dict[str, Any]) -> dict[str, Any]:
    """Dims, quantization, experts and KV-cache shape from config.json (``text_config`` first)."""
    tc = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}

    def get(*keys: str) -> Any:
        for k in keys:
            for src in (tc, config):
                if src.get(k) is not None:
                    return src[k]
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
        "kv_dtype_bytes": DTYPE_BYTES.get(str(get("torch_dtype", "dtype")), 2),
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
    if not window or cfg.get("use_sliding_window") is False or not layers:
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
    return {"quant_bits": bits, "quant_group_size": _int(q.get("group_size")), "quant_mode": mode}


def _weight_files(path: Path, by_name: dict[str, FileStat], warnings: list[str]) -> tuple[list[str], Any]:
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


def _weights(path: Path, by_name: dict[str, FileStat], config: dict, warnings: list[str]) -> dict[str, Any]:
    """Bytes (language, vision sidecar, experts) and parameter count, from sizes and headers."""
    names, index = _weight_files(path, by_name, warnings)
    sidecar = by_name.get(VISION_SIDECAR)
    out = {"weight_bytes": 0, "expert_bytes": 0, "vision_bytes": (sidecar.size or 0) if sidecar else 0}
    params, vision_tensors = 0, False
    bits = (
        _int((config.get("quantization") or {}).get("bits"))
        if isinstance(config.get("quantization"), dict)
        else None
    )
    for name in names:
        f = by_name[name]
        if f.size is None:
            continue
        out["weight_bytes"] += f.size
        try:
            header = read_safetensors_header(path / name)
        except (OSError, ValueError) as e:
            warnings.append(f"{name}: unreadable header ({str(e)[:80]})")
            continue
        experts, n, vis = _header_stats(header, bits)
        out["expert_bytes"] += experts
        params += n
        vision_tensors = vision_tensors or vis
    total = (index.get("metadata") or {}).get("total_parameters") if isinstance(index, dict) else None
    out["param_count"] = _int(total) or (params or None)
    out["_vision_tensors"] = vision_tensors
    return out


def _header_stats(header: dict[str, Any], bits: int | None) -> tuple[int, int, bool]:
    """(expert-tensor bytes, logical parameter count, has vision tensors) of one shard header."""
    experts = params = 0
    vision = False
    for name, info in header.items():
        if name == "__metadata__" or not isinstance(info, dict):
            continue
        start, end = (info.get("data_offsets") or (0, 0))[:2]
        if any(m in name for m in EXPERT_MARKS):
            experts += end - start
        vision = vision or name.startswith(VISION_PREFIXES)
        params += _logical_params(name, info, header, bits)
    return experts, params, vision


def _logical_params(name: str, info: dict[str, Any], header: dict[str, Any], bits: int | None) -> int:
    """Elements of a tensor, unpacking quantized uint32 weights; scales and biases of those count 0."""
    n = 1
    for d in info.get("shape") or ():
        n *= int(d)
    stem, _, leaf = name.rpartition(".")
    quantized = f"{stem}.scales" in header
    if quantized and leaf in ("scales", "biases"):
        return 0
    if quantized and leaf == "weight" and info.get("dtype") == "U32" and bits:
        return n * 32 // bits
    return n


def _has_tools(path: Path, by_name: dict[str, FileStat], warnings: list[str]) -> bool:
    """Whether a chat template mentions ``tools`` (tokenizer_config.json or chat_template.jinja)."""
    tc = _json_file(path, by_name, "tokenizer_config.json", warnings)
    templates = []
    if isinstance(tc, dict):
        t = tc.get("chat_template")
        templates += (
            [t] if isinstance(t, str) else [x.get("template", "") for x in t or [] if isinstance(x, dict)]
        )
    jinja = by_name.get("chat_template.jinja")
    if jinja is not None and jinja.size is not None:
        try:
            templates.append((path / "chat_template.jinja").read_text(encoding="utf-8", errors="replace"))
        except OSError:
            pass
    return any(isinstance(t, str) and "tools" in t for t in templates)


def _license(path: Path, by_name: dict[str, FileStat]) -> str | None:
    """``license:`` from README.md front matter (a scalar or the first list item)."""
    f = by_name.get("README.md")
    if f is None or f.size is None:
        return None
    try:
        with open(path / "README.md", encoding="utf-8", errors="replace") as fh:
            head = fh.read(README_HEAD)
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
    return set(re.split(r"[^a-z0-9]+", (text or "").lower())) - {""}


def is_drafter(config: dict[str, Any], repo_id: str | None) -> bool:
    """A speculative-decoding drafter (EAGLE, Medusa, MTP-only, "drafter"/"draft" model types)."""
    if any(k in config for k in DRAFTER_CONFIG_KEYS):
        return True
    archs = config.get("architectures") if isinstance(config.get("architectures"), list) else []
    words = _tokens(str(config.get("model_type") or ""))
    tc = config.get("text_config")
    if isinstance(tc, dict):
        words |= _tokens(str(tc.get("model_type") or ""))
    for a in archs:  # CamelCase: EagleLlamaForCausalLM -> eagle llama for causal lm
        words |= _tokens(re.sub(r"(?<=[a-z0-9])(?=[A-Z])", " ", str(a)))
    name_words = _tokens((repo_id or "").rpartition("/")[2])
    return bool(words & DRAFTER_TOKENS or name_words & (DRAFTER_TOKENS - {"draft", "mtp"}))
