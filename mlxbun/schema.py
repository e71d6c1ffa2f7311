"""Structured-config dataclasses: the types, choices and ranges of every command's arguments.

Hydra composes YAML from ``conf/`` and ``recipes/`` against :class:`Config` (registered in the
ConfigStore as ``mlxbun_schema``), so unknown keys and wrong types fail at compose time. Choices
and ranges are checked in ``__post_init__``, which runs when the CLI turns the composed config
into these dataclasses (``OmegaConf.to_object``). Each error names the key, the value and what is
allowed. Command modules receive the resulting :class:`Config` object: plain dataclasses, no
omegaconf.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

from mlxbun.errors import InputError
from mlxbun.io.dtypes import OUTPUT_DTYPES
from mlxbun.quant.spec import ALL_BITS, ALL_GROUPS, MODES, Rule, check_budget, check_mixed, spec_for

# Model dimensions a synth spec may set explicitly (each overrides the preset's value).
SYNTH_DIMS = (
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "vocab_size",
)
ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text")


def choose(key: str, value: Any, allowed: tuple | list) -> None:
    """Raise an InputError unless ``value`` is one of ``allowed``."""
    if value not in allowed:
        shown = ", ".join(str(a) for a in allowed)
        raise InputError(f"{key}={value!r} is not allowed; choose one of {shown}")


def positive(key: str, value: float | int | None, *, allow_zero: bool = False) -> None:
    """Raise an InputError unless ``value`` is None or > 0 (>= 0 with allow_zero)."""
    if value is None:
        return
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise InputError(f"{key}={value!r} is out of range; it must be {bound}")


@dataclass
class CommandCfg:
    name: str = "help"


@dataclass
class PathsCfg:
    # Root of run directories; each run's own directory (Hydra's output dir) is run_dir.
    outputs: str = "outputs"
    run_dir: str = "${hydra:runtime.output_dir}"
    cache: str = "~/.cache/mlxbun"


@dataclass
class IoCfg:
    # Ceiling of tensor data per shard in GiB (mlx-lm: 5); see mlxbun.io.shards.
    shard_gb: float = 5.0
    # Write a full shard on a background thread while the next fills (peak memory: two shards).
    overlap: bool = False

    def __post_init__(self) -> None:
        positive("io.shard_gb", self.shard_gb)

    @property
    def shard_bytes(self) -> int:
        return max(1, int(self.shard_gb * (1 << 30)))


@dataclass
class ModelCfg:
    # A local model directory, a registry name, or an HF repo id in the local cache.
    name: str | None = None
    # Build a same-shaped random checkpoint from `synth` instead of reading `name`.
    synthetic: bool = False


@dataclass
class SynthCfg:
    arch: str = "llama"
    # Named size preset (see mlxbun.synth.PRESETS); explicit dims below override it.
    preset: str = "tiny"
    hidden_size: int | None = None
    intermediate_size: int | None = None
    num_layers: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    vocab_size: int | None = None
    tie_embeddings: bool | None = None
    dtype: str = "bfloat16"
    seed: int = 0
    # Planted structure so quantization, rotation and sensitivity have something to find.
    outlier_channels: int = 0
    outlier_scale: float = 20.0
    # What outlier_scale multiplies: "weights", "activations" or "both" (see mlxbun/synth.py).
    outlier_target: str = "both"
    norm_jitter: float = 0.0
    out: str | None = None

    def __post_init__(self) -> None:
        choose("synth.arch", self.arch, ARCHS)
        choose("synth.dtype", self.dtype, OUTPUT_DTYPES)
        for k in SYNTH_DIMS:
            positive(f"synth.{k}", getattr(self, k))
        positive("synth.outlier_channels", self.outlier_channels, allow_zero=True)
        positive("synth.outlier_scale", self.outlier_scale)
        positive("synth.norm_jitter", self.norm_jitter, allow_zero=True)
        choose("synth.outlier_target", self.outlier_target, ("weights", "activations", "both"))


@dataclass
class InspectCfg:
    # A model directory, a .safetensors file or a registry name; defaults to model.name.
    path: str | None = None
    # false hides the per-tensor table (and per-module entries in json=true output).
    tensors: bool = True


@dataclass
class QuantCfg:
    mode: str = "affine"
    bits: int | None = None
    group_size: int | None = None
    # Per-layer plan file (from `allocate` or hand-written) or an mlx-lm mixed rule.
    plan: str | None = None
    mixed: str | None = None
    # dtype of the tensors left unquantized; None follows config.json's torch_dtype (as mlx-lm).
    dtype: str | None = None
    # Output model directory; None writes <run_dir>/model (a re-run resumes a killed one).
    out: str | None = None
    resume: bool = True
    # Modules read, cast and quantized in parallel.
    threads: int = 2
    # How affine weights are rounded: rtn (mx.quantize), clip (per-group range search) or gptq.
    method: str = "rtn"
    # Input Hessians (mlxbun.quant.hessian file): gptq needs them; clip weights columns by them.
    hessians: str | None = None

    def __post_init__(self) -> None:
        spec_for(self.mode, self.bits, self.group_size, key="quant")
        if self.dtype is not None:
            choose("quant.dtype", self.dtype, OUTPUT_DTYPES)
        check_mixed(self.mixed, mode=self.mode, plan=self.plan)
        positive("quant.threads", self.threads)
        from mlxbun.quant.rounding import check_method

        check_method(self.method, mode=self.mode)
        from mlxbun.quant.rounding import check_method

        check_method(self.method, mode=self.mode)


@dataclass
class CalibCfg:
    # A text file (``### kind lang`` sections) or JSONL ({"text"} | {"messages"} | {"prompt",
    # "completion"}); None uses the built-in varied set mlxbun/data/calibration.txt.
    path: str | None = None
    samples: int = 24
    seq_len: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        positive("sensitivity.calib.samples", self.samples)
        positive("sensitivity.calib.seq_len", self.seq_len)


@dataclass
class SensitivityCfg:
    bits: list[int] = field(default_factory=lambda: [4, 8])
    # None: the mode's default (affine 64, mxfp4 32, nvfp4 16, mxfp8 32).
    group_size: int | None = 64
    mode: str = "affine"
    # fast: reuse block inputs, batch, float32 BLAS; reference: the seed's one-forward-per-sample.
    method: str = "fast"
    batch_size: int = 8
    # Split the work over Hydra multirun jobs: sensitivity.shard=range(0,N) sensitivity.num_shards=N.
    shard: int = 0
    num_shards: int = 1
    calib: CalibCfg = field(default_factory=CalibCfg)
    # Keep reference log-probs (float64, samples x seq_len x vocab) when they fit this many MiB.
    ref_cache_mb: float = 1024.0
    # Root of the per-group checkpoints (a rerun resumes); None: <paths.cache>/sensitivity.
    work_dir: str | None = None
    # For sensitivity_merge: shard run dirs, sensitivity.json files, or a multirun sweep dir.
    inputs: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        choose("sensitivity.method", self.method, ("fast", "reference"))
        if not self.bits:
            raise InputError("sensitivity.bits=[] is empty; give at least one bit width, e.g. [4, 8]")
        for b in self.bits:
            spec_for(self.mode, b, self.group_size, key="sensitivity")
        positive("sensitivity.batch_size", self.batch_size)
        positive("sensitivity.ref_cache_mb", self.ref_cache_mb, allow_zero=True)
        positive("sensitivity.num_shards", self.num_shards)
        if not 0 <= self.shard < self.num_shards:
            raise InputError(
                f"sensitivity.shard={self.shard} is out of range; it must be in 0..{self.num_shards - 1}"
                f" for sensitivity.num_shards={self.num_shards}"
            )


@dataclass
class AllocateCfg:
    # sensitivity.json or the run directory holding it (a pipeline's sensitivity step sets it).
    sensitivity: str | None = None
    # More runs on the same model and calibration (other group sizes or modes): more candidates.
    extra_sensitivity: list[str] = field(default_factory=list)
    # Candidates: measured settings with these bits / group sizes / modes ([] = any measured).
    bits: list[int] = field(default_factory=list)
    group_sizes: list[int] = field(default_factory=list)
    modes: list[str] = field(default_factory=list)
    # Exactly one: bits per weight over every stored tensor, or bytes of the .safetensors files.
    budget_bpw: float | None = None
    budget_bytes: int | None = None
    # Setting of modules the sensitivity did not probe (e.g. embeddings); the plan's default.
    default_bits: int = 4
    default_group_size: int = 64
    default_mode: str = "affine"
    # "PATTERN:MIN_BITS" rules, e.g. lm_head:6, embed_tokens:6, layers.first.mlp.down_proj:6.
    protect: list[str] = field(default_factory=list)
    # Knapsack DP states before option sizes get rounded up (see mlxbun/quant/knapsack.py).
    max_states: int = 65536
    # Quantize with the plan and measure the mixed model's KL against the reference.
    check: bool = True

    def __post_init__(self) -> None:
        positive("allocate.budget_bpw", self.budget_bpw)
        positive("allocate.budget_bytes", self.budget_bytes)
        check_budget(self.budget_bpw, self.budget_bytes, required=False)
        # Candidate filters may name any mode's bits and group sizes.
        for b in self.bits:
            choose("allocate.bits", b, ALL_BITS)
        for g in self.group_sizes:
            choose("allocate.group_sizes", g, ALL_GROUPS)
        for m in self.modes:
            choose("allocate.modes", m, MODES)
        spec_for(self.default_mode, self.default_bits, self.default_group_size, key="allocate.default")
        positive("allocate.max_states", self.max_states)
        for rule in self.protect:
            Rule.parse(rule)


@dataclass
class FoldCfg:
    seed: int = 0
    dtype: str | None = None
    verify: bool = True

    def __post_init__(self) -> None:
        if self.dtype is not None:
            choose("fold.dtype", self.dtype, OUTPUT_DTYPES)


@dataclass
class KvCfg:
    store: str = "${paths.cache}/kv"
    name: str | None = None
    prompt: str | None = None
    prompt_file: str | None = None
    layout: str = "blocks"
    block_kib: int = 1024
    verify: bool = True
    cap_gb: float | None = None
    max_tokens: int = 32
    execute: bool = False

    def __post_init__(self) -> None:
        choose("kv.layout", self.layout, ("snapshot", "blocks"))
        positive("kv.block_kib", self.block_kib)
        positive("kv.cap_gb", self.cap_gb)
        positive("kv.max_tokens", self.max_tokens)


@dataclass
class RegistryFilterCfg:
    vision: bool | None = None
    max_gb: float | None = None
    query: str | None = None
    license: str | None = None
    model_type: str | None = None
    quantized: bool | None = None
    # Every cached revision, not only each repo's canonical one (refs/main).
    all_revisions: bool = False
    # Also directories that could not be read (broken links, unreadable JSON), with the reason.
    broken: bool = False

    def __post_init__(self) -> None:
        positive("registry.filter.max_gb", self.max_gb)


@dataclass
class RegistryFitCfg:
    budget_gb: float = 16.0
    context: int = 8192
    vision: bool = False

    def __post_init__(self) -> None:
        positive("registry.fit.budget_gb", self.budget_gb)
        positive("registry.fit.context", self.context)


@dataclass
class RegistryCfg:
    # Any playhouse.db_url URL (sqlite:///..., postgresql://...); None uses `path` (sqlite).
    url: str | None = None
    path: str = "${paths.cache}/registry.db"
    # HF hub cache to scan; None follows HF_HUB_CACHE, HF_HOME/hub, ~/.cache/huggingface/hub.
    hub_cache: str | None = None
    # Local model directories, or directories of model directories, indexed as well.
    paths: list[str] = field(default_factory=list)
    # Root under which registry_scan finds models written by mlxbun runs; None skips them.
    runs_root: str | None = "${paths.outputs}"
    filter: RegistryFilterCfg = field(default_factory=RegistryFilterCfg)
    fit: RegistryFitCfg = field(default_factory=RegistryFitCfg)


@dataclass
class RunsCfg:
    command: str | None = None
    recipe: str | None = None
    status: str | None = None
    limit: int = 50
    # For command=verify: the run directory whose outputs are re-hashed against its manifest.
    dir: str | None = None

    def __post_init__(self) -> None:
        if self.status is not None:
            choose("runs.status", self.status, ("running", "ok", "failed"))
        positive("runs.limit", self.limit)


@dataclass
class PipelineCfg:
    # Commands run in order in one run directory (see mlxbun/pipeline.py).
    steps: list[str] = field(default_factory=list)


@dataclass
class Config:
    command: CommandCfg = field(default_factory=CommandCfg)
    seed: int = 0
    verbose: bool = False
    json: bool = False
    # Optimized BLAS for MLX on Linux: "auto" (find one), "off", or a path to a shared library.
    blas: str = "auto"
    paths: PathsCfg = field(default_factory=PathsCfg)
    io: IoCfg = field(default_factory=IoCfg)
    model: ModelCfg = field(default_factory=ModelCfg)
    synth: SynthCfg = field(default_factory=SynthCfg)
    inspect: InspectCfg = field(default_factory=InspectCfg)
    quant: QuantCfg = field(default_factory=QuantCfg)
    sensitivity: SensitivityCfg = field(default_factory=SensitivityCfg)
    allocate: AllocateCfg = field(default_factory=AllocateCfg)
    fold: FoldCfg = field(default_factory=FoldCfg)
    kv: KvCfg = field(default_factory=KvCfg)
    registry: RegistryCfg = field(default_factory=RegistryCfg)
    runs: RunsCfg = field(default_factory=RunsCfg)
    pipeline: PipelineCfg = field(default_factory=PipelineCfg)


def check_keys(data: dict[str, Any], cls: type = None, prefix: str = "") -> None:
    """Raise an InputError naming the first key of ``data`` that ``cls`` (default Config) lacks.

    Hydra lets ``+key=value`` add keys to a structured config; they would be silently ignored.
    """
    cls = cls or Config
    known = {f.name: f for f in fields(cls)}
    for key, value in data.items():
        if key not in known:
            allowed = ", ".join(sorted(known))
            raise InputError(f"unknown config key {prefix}{key!r}; keys here are: {allowed}")
        sub = _dataclass_type(known[key].type)
        if sub is not None and isinstance(value, dict):
            check_keys(value, sub, f"{prefix}{key}.")


def _dataclass_type(annotation: Any) -> type | None:
    cls = globals().get(annotation) if isinstance(annotation, str) else annotation
    return cls if isinstance(cls, type) and is_dataclass(cls) else None


def register() -> None:
    """Register :class:`Config` in Hydra's ConfigStore as ``mlxbun_schema``."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="mlxbun_schema", node=Config)
