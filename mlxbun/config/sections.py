"""The config sections of every command but the quantization ones: paths, io, model, synth,
inspect, fold, kv, serve, registry, runs and pipeline (those are :mod:`mlxbun.config.quant`).

Each section is a dataclass Hydra composes YAML against; its ``__post_init__`` checks choices and
ranges when the CLI builds the config, and the comment above a field is its ``help=true`` text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlxbun.config.checks import (
    MAX_BYTES,
    MAX_GB,
    MAX_RUNS_LIMIT,
    MAX_TOKENS,
    RUN_STATUSES,
    at_most,
    check_outputs,
    choose,
    gib_bytes,
    gib_key,
    not_empty,
    positive,
)
from mlxbun.errors import InputError
from mlxbun.io.dtypes import OUTPUT_DTYPES
from mlxbun.quant.spec import KV_BITS, KV_GROUPS
from mlxbun.synth.arch import ARCHS, SYNTH_DIMS


@dataclass
class CommandCfg:
    # The command to run (python -m mlxbun lists them).
    name: str = "help"


@dataclass
class PathsCfg:
    # Root of run directories; each run's own directory (Hydra's output dir) is run_dir.
    outputs: str = "outputs"
    # This run's directory (set by Hydra; pipelines set one per step).
    run_dir: str = "${hydra:runtime.output_dir}"
    # Registry, KV store, digests and synthetic checkpoints live under here.
    cache: str = "~/.cache/mlxbun"

    def __post_init__(self) -> None:
        check_outputs(self.outputs)


@dataclass
class IoCfg:
    # Ceiling of tensor data per shard in GiB (mlx-lm: 5); see mlxbun.io.shards.
    shard_gb: float = 5.0

    def __post_init__(self) -> None:
        gib_key("io.shard_gb", self.shard_gb)

    @property
    def shard_bytes(self) -> int:
        return gib_bytes(self.shard_gb)


@dataclass
class ModelCfg:
    # A local model directory, a registry name, or an HF repo id in the local cache.
    name: str | None = None
    # Build a same-shaped random checkpoint from `synth` instead of reading `name`.
    synthetic: bool = False


@dataclass
class SynthCfg:
    # Architecture: llama, qwen2, qwen3, mistral or gemma3_text.
    arch: str = "llama"
    # Named size preset: tiny, small, 1b ... 27b (mlxbun.synth.arch.PRESETS); the dims below override it.
    preset: str = "tiny"
    # Model width (overrides the preset).
    hidden_size: int | None = None
    # MLP width (overrides the preset).
    intermediate_size: int | None = None
    # Decoder layers (overrides the preset).
    num_layers: int | None = None
    # Attention heads (overrides the preset).
    num_heads: int | None = None
    # Key/value heads (overrides the preset).
    num_kv_heads: int | None = None
    # Per-head width (overrides the preset; derived when None).
    head_dim: int | None = None
    # Vocabulary size (overrides the preset).
    vocab_size: int | None = None
    # Share the embedding with the LM head (None keeps the preset's choice).
    tie_embeddings: bool | None = None
    # Stored dtype: bfloat16, float16 or float32.
    dtype: str = "bfloat16"
    # Every tensor's values derive from this seed.
    seed: int = 0
    # Outlier channels planted, >= 0, so quantization, rotation and sensitivity have something to find.
    outlier_channels: int = 0
    # Factor applied to the planted outlier channels (finite, > 0).
    outlier_scale: float = 20.0
    # What outlier_scale multiplies: "weights", "activations" or "both" (see mlxbun/synth/values.py).
    outlier_target: str = "both"
    # Std of noise added to RMSNorm gains, >= 0.
    norm_jitter: float = 0.0
    # Output model directory; None writes <run_dir>/model.
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
        not_empty("synth.out", self.out)


@dataclass
class InspectCfg:
    # A model directory, a .safetensors file or a registry name; defaults to model.name.
    path: str | None = None
    # false hides the per-tensor table (and per-module entries in json=true output).
    tensors: bool = True


@dataclass
class FoldCfg:
    # Seed of the random ±1 signs of the Hadamard rotation.
    seed: int = 0
    # dtype of the rotated weights; None keeps the source's.
    dtype: str | None = None
    # Compare logits before and after the fold on a few tokens.
    verify: bool = True

    def __post_init__(self) -> None:
        if self.dtype is not None:
            choose("fold.dtype", self.dtype, OUTPUT_DTYPES)


@dataclass
class KvCfg:
    # Root of the KV store (snapshots, blocks, manifests).
    store: str = "${paths.cache}/kv"
    # Snapshot name to save, restore or verify.
    name: str | None = None
    # Prompt text (or kv.prompt_file).
    prompt: str | None = None
    # File holding the prompt (or kv.prompt).
    prompt_file: str | None = None
    # snapshot: one mlx-lm prompt-cache file; blocks: deduplicated blocks (see README, KV caches).
    layout: str = "snapshot"
    # Target size of one block in KiB, >= 1 (blocks layout).
    block_kib: int = 1024
    # Re-hash every tensor and block on restore.
    verify: bool = True
    # kv_gc: evict least recently used snapshots until the store is under this many GiB, > 0.
    cap_gb: float | None = None
    # Tokens kv_generate decodes after the prompt, 1 .. 2^24.
    max_tokens: int = 32
    # kv_gc: false prints the plan, true frees the blocks.
    execute: bool = False
    # kv_generate: true exits 1 on a corrupt snapshot; false recomputes and replaces it.
    strict: bool = False
    # kv_import: the mlx-lm prompt-cache file to bring in; kv_export: the file to write.
    file: str | None = None
    # kv_export: replace an existing kv.file (never one inside the store or a model directory).
    overwrite: bool = False
    # Encode prompts through the tokenizer's chat template, as mlx-lm does (null: when it has one).
    chat_template: bool | None = None

    def __post_init__(self) -> None:
        choose("kv.layout", self.layout, ("snapshot", "blocks"))
        positive("kv.block_kib", self.block_kib)
        at_most("kv.block_kib", self.block_kib, MAX_BYTES >> 10, "8 EiB")
        gib_key("kv.cap_gb", self.cap_gb)
        positive("kv.max_tokens", self.max_tokens)
        at_most("kv.max_tokens", self.max_tokens, MAX_TOKENS, "above any model's context")

    @property
    def cap_bytes(self) -> int | None:
        return gib_bytes(self.cap_gb)


@dataclass
class RegistryFilterCfg:
    # true: only vision-capable models; false: only text models.
    vision: bool | None = None
    # Only models whose weights take at most this many GiB.
    max_gb: float | None = None
    # Case-insensitive substring of the repo id, name or model type.
    query: str | None = None
    # License from the README front matter (case-insensitive), e.g. apache-2.0.
    license: str | None = None
    # config.json model_type (or its text_config model_type), e.g. llama.
    model_type: str | None = None
    # true: only quantized models; false: only unquantized ones.
    quantized: bool | None = None
    # Every cached revision, not only each repo's canonical one (refs/main).
    all_revisions: bool = False
    # Also directories that could not be read (broken links, unreadable JSON), with the reason.
    broken: bool = False

    def __post_init__(self) -> None:
        gib_key("registry.filter.max_gb", self.max_gb)


@dataclass
class RegistryFitCfg:
    # Memory budget in GiB, > 0.
    budget_gb: float = 16.0
    # Tokens of KV cache to count, 1 .. 2^24.
    context: int = 8192
    # Count the vision tower too.
    vision: bool = False

    def __post_init__(self) -> None:
        gib_key("registry.fit.budget_gb", self.budget_gb)
        positive("registry.fit.context", self.context)
        at_most("registry.fit.context", self.context, MAX_TOKENS, "above any model's context")


@dataclass
class RegistryCfg:
    # Any playhouse.db_url URL (sqlite:///..., postgresql://...); None uses `path` (sqlite).
    url: str | None = None
    # sqlite database file used when url is None.
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
    # Only runs of this command.
    command: str | None = None
    # Only runs of this recipe.
    recipe: str | None = None
    # Only runs in this status: running, ok, failed or interrupted.
    status: str | None = None
    # Newest runs listed, 1 .. 10^9.
    limit: int = 50
    # For command=verify: the run directory whose outputs are re-hashed against its manifest.
    dir: str | None = None
    # With runs.command=eval: one row per evaluated candidate, best mean KLD first, only those at
    # most this many GiB on disk (None: any size) ...
    max_gb: float | None = None
    # ... and only runs whose reference (model.name's directory) contains this text.
    model: str | None = None

    def __post_init__(self) -> None:
        if self.status is not None:
            choose("runs.status", self.status, RUN_STATUSES)
        positive("runs.limit", self.limit)
        positive("runs.max_gb", self.max_gb)
        at_most("runs.limit", self.limit, MAX_RUNS_LIMIT)
        self._check_filters()

    def _check_filters(self) -> None:
        """runs.command=eval lists evaluated candidates (runs.max_gb, runs.model), any other value
        recorded runs (runs.status, runs.recipe): a filter of the other listing would be ignored."""
        eval_only = {"max_gb": self.max_gb, "model": self.model}
        runs_only = {"status": self.status, "recipe": self.recipe}
        for key, value in (runs_only if self.command == "eval" else eval_only).items():
            if value is None:
                continue
            if self.command == "eval":
                raise InputError(
                    f"runs.{key}={value!r} filters recorded runs, which runs.command=eval does not list"
                    " (it lists evaluated candidates); drop it"
                )
            raise InputError(
                f"runs.{key}={value!r} filters evaluated candidates, so it is read only with"
                " runs.command=eval; add runs.command=eval or drop it"
            )


@dataclass
class ServeCfg:
    # Address to listen on (0.0.0.0 for every interface).
    host: str = "127.0.0.1"
    # TCP port (0: any free port, printed at start).
    port: int = 8080
    # GiB of prompt caches kept in memory (least recently used evicted first; 0: none).
    cache_gb: float = 2.0
    # Completion tokens when a request gives no max_tokens.
    max_tokens: int = 512
    # Persist finished prompts into kv.store (in the background) and reuse them after a restart.
    persist: bool = True
    # On SIGTERM: true writes the saves still waiting, false drops them (a running save finishes).
    flush: bool = True
    # Saves waiting at most; beyond it the oldest waiting one is dropped (responses never wait).
    max_pending: int = 8
    # Quantize the KV cache to this many bits (mlx-lm QuantizedKVCache: 2-8); None keeps it as is.
    kv_bits: int | None = None
    # Group size of the KV quantization.
    kv_group_size: int = 64
    # Sequences generated together at most, in [1, 1024] (continuous batching; more wait for a place).
    max_batch: int = 32
    # Prompt tokens a new sequence reads per step, >= 1, so running streams keep their pace meanwhile.
    prefill_step: int = 512
    # Compute in float32 (16-bit weights upcast at load): on a Linux CPU, through OpenBLAS, several
    # times faster than bfloat16; twice the weights' memory; tokens may differ from 16-bit compute.
    float32: bool = False

    def __post_init__(self) -> None:
        positive("serve.max_batch", self.max_batch)
        at_most("serve.max_batch", self.max_batch, 1024, "a batch far beyond what one machine decodes")
        positive("serve.prefill_step", self.prefill_step)
        at_most("serve.prefill_step", self.prefill_step, MAX_TOKENS, "above any model's context")
        positive("serve.port", self.port, allow_zero=True)
        at_most("serve.port", self.port, 65535, "the largest TCP port")
        positive("serve.cache_gb", self.cache_gb, allow_zero=True)
        at_most("serve.cache_gb", self.cache_gb, MAX_GB, "8 EiB")
        positive("serve.max_tokens", self.max_tokens)
        at_most("serve.max_tokens", self.max_tokens, MAX_TOKENS, "above any model's context")
        positive("serve.max_pending", self.max_pending)
        if self.kv_bits is not None:
            choose("serve.kv_bits", self.kv_bits, KV_BITS)
        choose("serve.kv_group_size", self.kv_group_size, KV_GROUPS)


@dataclass
class PipelineCfg:
    # Commands run in order in one run directory (see mlxbun/pipeline.py).
    steps: list[str] = field(default_factory=list)
    # Minutes the whole run may take, > 0 (null: no limit). A tune step gets what the steps before
    # it left (its tune.max_minutes lowered to that, never below MIN_TUNE_MINUTES): fewer steps per
    # block, never a skipped step.
    max_minutes: float | None = None

    def __post_init__(self) -> None:
        positive("pipeline.max_minutes", self.max_minutes)
