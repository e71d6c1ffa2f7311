"""Structured-config dataclasses: the types, choices and ranges of every command's arguments.
Why one module: Hydra registers one schema tree, and every command's arguments are read side by side in one visible place.

Hydra composes YAML from ``conf/`` and ``recipes/`` against :class:`Config` (registered in the
ConfigStore as ``mlxbun_schema``), so unknown keys and wrong types fail at compose time. Choices
and ranges are checked in ``__post_init__``, which runs when the CLI turns the composed config
into these dataclasses (``OmegaConf.to_object``). Each error names the key, the value and what is
allowed. Command modules receive the resulting :class:`Config` object: plain dataclasses, no
omegaconf.

Units: a key ending in ``_gb`` is in GiB (2**30 bytes), as mlx-lm's ``5 << 30`` shard ceiling;
``_mb`` is MiB and ``_kib`` KiB. The ``*_bytes`` properties convert.

Rules that span sections (a key ignored because of another, seeds) are in :func:`check_config`.
"""

from __future__ import annotations

import ast
import difflib
import math
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, get_type_hints

from mlxbun.commands import COMMANDS
from mlxbun.errors import InputError
from mlxbun.io.dtypes import OUTPUT_DTYPES
from mlxbun.quant.candidates import METHODS as CANDIDATE_METHODS
from mlxbun.quant.protect import Rule
from mlxbun.quant.rounding import check_method
from mlxbun.quant.spec import (
    ALL_BITS,
    ALL_GROUPS,
    MIXED_RULES,
    MODE_GROUPS,
    MODES,
    check_budget,
    check_mixed,
    spec_for,
)
from mlxbun.synth_arch import ARCHS, SYNTH_DIMS

GIB = 1 << 30
# The widest stored weight (float32): no plan can need more bits per weight.
MAX_BPW = 32
# Statuses a run ends in (RunRecord.status, manifest "status"); "running" until then.
RUN_STATUSES = ("running", "ok", "failed", "interrupted")
# Sizes at most 8 EiB, the most bytes a signed 64-bit count holds (1e300 GiB is no size).
MAX_BYTES = 2**63 - 1
MAX_GB = MAX_BYTES // GIB
# Tokens at most 2^24 (16,777,216), above any model's context.
MAX_TOKENS = 2**24
# Run records `runs` lists at most (sqlite takes a 64-bit LIMIT; no registry holds more).
MAX_RUNS_LIMIT = 10**9


def gib_bytes(value: float | None) -> int | None:
    """``value`` GiB in bytes (None stays None)."""
    return None if value is None else max(1, int(value * GIB))


def choose(key: str, value: Any, allowed: tuple | list) -> None:
    """Raise an InputError unless ``value`` is one of ``allowed``."""
    if value not in allowed:
        shown = ", ".join(str(a) for a in allowed)
        raise InputError(f"{key}={value!r} is not allowed; choose one of {shown}")


def check_strings(cfg: Any, prefix: str = "") -> None:
    """Raise an InputError where a list-of-strings key holds something else (``key=[[a]]``:
    OmegaConf keeps the nested list)."""
    hints = get_type_hints(type(cfg))
    for f in fields(cfg):
        value, key = getattr(cfg, f.name), f"{prefix}{f.name}"
        if is_dataclass(value):
            check_strings(value, key + ".")
        elif hints.get(f.name) == list[str]:
            for item in value or ():
                if not isinstance(item, str):
                    raise InputError(
                        f"{key} has {item!r}, not a string; give {key}=[a,b] (one pair of brackets)"
                    )


def positive(key: str, value: float | int | None, *, allow_zero: bool = False) -> None:
    """Raise an InputError unless ``value`` is None or > 0 (>= 0 with allow_zero)."""
    if value is None:
        return
    bound = ">= 0" if allow_zero else "> 0"
    if isinstance(value, float) and not math.isfinite(value):
        raise InputError(f"{key}={value!r} is out of range; it must be a finite number {bound}")
    if value < 0 or (value == 0 and not allow_zero):
        raise InputError(f"{key}={value!r} is out of range; it must be {bound}")


def not_empty(key: str, value: str | None) -> None:
    """Raise an InputError when a path key is set to an empty string (``quant.out=``): that is no
    path, and taking it as the default location would ignore the setting."""
    if value is not None and not str(value).strip():
        raise InputError(f"{key}={value!r} is empty; give a path, or leave {key} unset for its default")


def gib_key(key: str, value: float | None) -> None:
    """Raise an InputError unless ``value`` GiB is None or a size in (0, MAX_GB]."""
    positive(key, value)
    at_most(key, value, MAX_GB, "8 EiB, the most bytes a 64-bit count holds")


def at_most(key: str, value: float | int | None, limit: float | int, why: str = "") -> None:
    """Raise an InputError when ``value`` is above ``limit`` (``why`` says where it comes from)."""
    if value is not None and value > limit:
        reason = f" ({why})" if why else ""
        raise InputError(f"{key}={value!r} is out of range; it must be at most {limit}{reason}")


def at_least(key: str, value: float | int | None, limit: float | int, why: str = "") -> None:
    """Raise an InputError when ``value`` is below ``limit`` (``why`` says what needs it)."""
    if value is not None and value < limit:
        reason = f" ({why})" if why else ""
        raise InputError(f"{key}={value!r} is out of range; it must be >= {limit}{reason}")


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


def check_outputs(outputs: str | None, *, on_disk: bool = False) -> None:
    """``paths.outputs`` is a directory runs can go under: not empty, not the filesystem root,
    and (``on_disk``) no existing file in the way; InputError naming the value otherwise."""
    allowed = "choose a directory for run outputs, e.g. paths.outputs=outputs"
    if outputs is None or not str(outputs).strip():
        raise InputError(f"paths.outputs={outputs!r} is empty; {allowed}")
    path = Path(outputs).expanduser()
    resolved = path.resolve()
    if resolved == Path(resolved.anchor):
        raise InputError(f"paths.outputs={outputs!r} is the filesystem root; {allowed}")
    blocker = (
        next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None) if on_disk else None
    )
    if blocker is not None:
        raise InputError(f"paths.outputs={outputs!r} is not a directory ({blocker} is a file); {allowed}")


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
    # Named size preset (see mlxbun.synth.PRESETS); explicit dims below override it.
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
    # Planted structure so quantization, rotation and sensitivity have something to find.
    outlier_channels: int = 0
    # Factor applied to the planted outlier channels (finite, > 0).
    outlier_scale: float = 20.0
    # What outlier_scale multiplies: "weights", "activations" or "both" (see mlxbun/synth.py).
    outlier_target: str = "both"
    # Std of noise added to RMSNorm gains.
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
class QuantCfg:
    mode: str = "affine"
    bits: int | None = None
    group_size: int | None = None
    # Per-layer plan file (from `allocate` or hand-written) or an mlx-lm mixed rule (mixed_2_6,
    # mixed_3_4, mixed_3_6, mixed_4_6: the same as quant.mixed).
    plan: str | None = None
    # mlx-lm's mixed rule: mixed_2_6, mixed_3_4, mixed_3_6 or mixed_4_6 (affine; quant.group_size applies).
    mixed: str | None = None
    # dtype of the tensors left unquantized; None follows config.json's torch_dtype (as mlx-lm).
    dtype: str | None = None
    # Output model directory; None writes <run_dir>/model (a re-run resumes a killed one).
    out: str | None = None
    resume: bool = True
    # Modules read, cast and quantized (and sensitivity candidates scored) in parallel; None: one
    # per core this process may use.
    threads: int | None = None
    # How affine weights are rounded: rtn (mx.quantize), clip (range search), gptq or awq.
    method: str = "rtn"
    # Input Hessians (hessians.safetensors, or the command=calibrate run dir holding it): gptq and
    # awq need them; clip weights columns by them. A pipeline's calibrate step sets it.
    hessians: str | None = None

    def __post_init__(self) -> None:
        if self.plan in MIXED_RULES:  # quant.plan=mixed_3_6 names mlx-lm's rule, as quant.mixed does
            if self.mixed is not None:
                raise InputError(
                    f"quant.plan={self.plan!r} and quant.mixed={self.mixed!r} are both set; choose one"
                )
            self.plan, self.mixed = None, self.plan
        spec_for(self.mode, self.bits, self.group_size, key="quant")
        if self.dtype is not None:
            choose("quant.dtype", self.dtype, OUTPUT_DTYPES)
        check_mixed(self.mixed, mode=self.mode, plan=self.plan)
        positive("quant.threads", self.threads)
        for key in ("out", "plan", "hessians"):
            not_empty(f"quant.{key}", getattr(self, key))
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
        at_least(
            "sensitivity.calib.seq_len",
            self.seq_len,
            2,
            "with one token per sample attention sees nothing to mix, and q/k score 0",
        )


@dataclass
class CandidatesCfg:
    # Candidates beyond RTN at sensitivity.bits x sensitivity.group_size, each module's KL scored
    # from its input Hessian (mlxbun/quant/candidates.py): these affine group sizes and rounding
    # methods (rtn, clip, gptq), and microscaling modes (mxfp4, nvfp4, mxfp8). All []: none.
    # The Hessians are quant.hessians (None: captured on sensitivity.calib, cached).
    group_sizes: list[int] = field(default_factory=list)
    methods: list[str] = field(default_factory=list)
    modes: list[str] = field(default_factory=list)
    # Rescale each quantizer's estimates by whole-model probes of a plan at allocate's budget
    # (4.5 bpw when none is set): one quantize + forward per quantizer.
    correct: bool = True

    def __post_init__(self) -> None:
        for g in self.group_sizes:
            choose("sensitivity.candidates.group_sizes", g, MODE_GROUPS["affine"])
        for m in self.methods:
            choose("sensitivity.candidates.methods", m, CANDIDATE_METHODS)
        for m in self.modes:
            choose("sensitivity.candidates.modes", m, tuple(x for x in MODES if x != "affine"))

    @property
    def enabled(self) -> bool:
        return bool(self.group_sizes or self.methods or self.modes)


@dataclass
class SensitivityCfg:
    bits: list[int] = field(default_factory=lambda: [4, 8])
    # None: the mode's default (affine 64, mxfp4 32, nvfp4 16, mxfp8 32).
    group_size: int | None = None
    mode: str = "affine"
    # fisher: estimated from one backward pass + one forward per candidate (mlxbun/quant/fisher.py);
    # exact: every (module, candidate) measured; reference: exact, one forward per sample (slow).
    method: str = "fisher"
    # fisher: fraction of modules (largest first) probed exactly at refine_bits ([] = the middle
    # candidate) on the calibration subset; each module's estimate is scaled to its probe. 0: off.
    refine: float = 0.0
    refine_bits: list[int] = field(default_factory=list)
    batch_size: int = 8
    # Split the work over Hydra multirun jobs: sensitivity.shard=range(0,N) sensitivity.num_shards=N.
    shard: int = 0
    num_shards: int = 1
    calib: CalibCfg = field(default_factory=CalibCfg)
    candidates: CandidatesCfg = field(default_factory=CandidatesCfg)
    # Keep reference log-probs (float64, samples x seq_len x vocab) when they fit this many MiB.
    ref_cache_mb: float = 1024.0
    # Root of the per-group checkpoints (a rerun resumes); None: <paths.cache>/sensitivity.
    work_dir: str | None = None
    # For sensitivity_merge: shard run dirs, sensitivity.json files, or a multirun sweep dir.
    inputs: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        choose("sensitivity.method", self.method, ("fisher", "exact", "reference"))
        if not self.bits:
            raise InputError("sensitivity.bits=[] is empty; give at least one bit width, e.g. [4, 8]")
        for b in self.bits:
            spec_for(self.mode, b, self.group_size, key="sensitivity")
        positive("sensitivity.batch_size", self.batch_size)
        if not 0 <= self.refine <= 1:
            raise InputError(
                f"sensitivity.refine={self.refine} is out of range; give a fraction of modules in [0, 1]"
            )
        for b in self.refine_bits:
            if b not in self.bits:
                raise InputError(
                    f"sensitivity.refine_bits has {b}, not a candidate; choose from sensitivity.bits={list(self.bits)}"
                )
        positive("sensitivity.ref_cache_mb", self.ref_cache_mb, allow_zero=True)
        at_most("sensitivity.ref_cache_mb", self.ref_cache_mb, MAX_BYTES >> 20, "8 EiB")
        positive("sensitivity.num_shards", self.num_shards)
        if not 0 <= self.shard < self.num_shards:
            raise InputError(
                f"sensitivity.shard={self.shard} is out of range; it must be in 0..{self.num_shards - 1}"
                f" for sensitivity.num_shards={self.num_shards}"
            )


@dataclass
class CalibrateCfg:
    # Root of the cached Hessians, one directory per model and calibration (a rerun reuses it);
    # None: <paths.cache>/hessians. The calibration is sensitivity.calib's.
    work_dir: str | None = None

    def __post_init__(self) -> None:
        not_empty("calibrate.work_dir", self.work_dir)


@dataclass
class AllocateCfg:
    # sensitivity.json or the run directory holding it (a pipeline's sensitivity step sets it).
    sensitivity: str | None = None
    # More runs on the same model and calibration (other group sizes or modes): more candidates.
    extra_sensitivity: list[str] = field(default_factory=list)
    # Candidates: measured settings with these bits / group sizes / modes / rounding methods
    # (rtn, clip, gptq: sensitivity.candidates scores them) ([] = any measured).
    bits: list[int] = field(default_factory=list)
    group_sizes: list[int] = field(default_factory=list)
    modes: list[str] = field(default_factory=list)
    methods: list[str] = field(default_factory=list)
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
    # Steps near the knapsack's threshold re-measured in the model quantized as planned, per
    # round; the plan is solved again with those costs (mlxbun/quant/interactions.py). 0: off.
    interactions: int = 16
    interaction_rounds: int = 2
    # Quantize with the plan and measure the mixed model's KL against the reference.
    check: bool = True

    def __post_init__(self) -> None:
        not_empty("allocate.sensitivity", self.sensitivity)
        positive("allocate.budget_bpw", self.budget_bpw)
        positive("allocate.budget_bytes", self.budget_bytes)
        at_most("allocate.budget_bytes", self.budget_bytes, MAX_BYTES, "8 EiB")
        check_budget(self.budget_bpw, self.budget_bytes, required=False)
        # Candidate filters may name any mode's bits and group sizes.
        for b in self.bits:
            choose("allocate.bits", b, ALL_BITS)
        for g in self.group_sizes:
            choose("allocate.group_sizes", g, ALL_GROUPS)
        for m in self.modes:
            choose("allocate.modes", m, MODES)
        for m in self.methods:
            choose("allocate.methods", m, CANDIDATE_METHODS)
        spec_for(self.default_mode, self.default_bits, self.default_group_size, key="allocate.default")
        positive("allocate.max_states", self.max_states)
        positive("allocate.interactions", self.interactions, allow_zero=True)
        positive("allocate.interaction_rounds", self.interaction_rounds)
        for rule in self.protect:
            Rule.parse(rule)


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
    # Target size of one block in KiB (blocks layout).
    block_kib: int = 1024
    # Re-hash every tensor and block on restore.
    verify: bool = True
    # kv_gc: evict least recently used snapshots until the store is under this many GiB.
    cap_gb: float | None = None
    # Tokens kv_generate decodes after the prompt.
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
    # Memory budget in GiB.
    budget_gb: float = 16.0
    # Tokens of KV cache to count.
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
    # Newest runs listed (at most 10^9).
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


@dataclass
class EvalCfg:
    # Models compared with model.name: directories or registry names (anything mlx_lm.load opens).
    candidates: list[str] = field(default_factory=list)
    # A text file to evaluate on; None: the built-in held-out text mlxbun/data/heldout.txt.
    text: str | None = None
    # Tokens evaluated (rounded up to whole windows of seq_len), in disjoint windows drawn by seed.
    tokens: int = 8192
    # Tokens per window (a forward's length; each window scores seq_len - 1 next-token predictions).
    seq_len: int = 512
    # Picks the windows from the text.
    seed: int = 0
    # Reference log-probs kept per token (plus the tail mass), at most the vocabulary; the KL this
    # misses is bounded and reported. None: the whole vocabulary up to 2048 (exact up to there).
    top_k: int | None = None
    # Windows per forward.
    batch_size: int = 4
    # true: evaluate a candidate whose calibration tokens share spans with the text (with a warning).
    allow_overlap: bool = False

    def __post_init__(self) -> None:
        positive("eval.tokens", self.tokens)
        positive("eval.seq_len", self.seq_len)
        at_least("eval.seq_len", self.seq_len, 2, "one token predicts none")
        if self.top_k is not None:
            positive("eval.top_k", self.top_k)
        positive("eval.batch_size", self.batch_size)


@dataclass
class TuneCfg:
    # The unquantized model the quantized one (model.name) was made from: its blocks' outputs are
    # the targets (a path, registry name or org/repo).
    reference: str | None = None
    # Steps of signed gradient descent per decoder block (fewer when tune.max_minutes says so);
    # 0 hands the input on.
    steps: int = 200
    # Each step moves every rounding offset (in grid steps), log scale and bias shift (in scales) by
    # up to this, falling linearly to 0 over the block's steps.
    lr: float = 5.0e-3
    # Windows per step.
    batch_size: int = 8
    # Training windows: calibration documents of other kinds than tune.validation_kinds (the text
    # and seed are sensitivity.calib's).
    samples: int = 64
    # Validation windows, from the documents of tune.validation_kinds: a block is kept, and the
    # model written, only when they improve.
    val_samples: int = 8
    # Tokens per window.
    seq_len: int = 128
    # Document kinds (``### kind`` headers of the calibration text) that only validate; a text with
    # none of them validates on every fourth document.
    validation_kinds: list[str] = field(default_factory=lambda: ["prose", "math"])
    # The minutes tune may take: sets how many steps each block gets, timed after a warm-up step;
    # null: tune.steps each.
    max_minutes: float | None = 60.0
    # Where the tuned model goes (null: <run_dir>/model). A pipeline whose tune step follows
    # quantize writes its final model to quant.out, when that is given, through this key.
    out: str | None = None

    def __post_init__(self) -> None:
        not_empty("tune.reference", self.reference)
        not_empty("tune.out", self.out)
        positive("tune.steps", self.steps, allow_zero=True)
        positive("tune.lr", self.lr)
        at_most("tune.lr", self.lr, 0.5, "a step of more than half a grid step moves codes by whole levels")
        positive("tune.batch_size", self.batch_size)
        positive("tune.samples", self.samples)
        positive("tune.val_samples", self.val_samples)
        positive("tune.seq_len", self.seq_len)
        at_least("tune.seq_len", self.seq_len, 2, "one token predicts none")
        positive("tune.max_minutes", self.max_minutes)
        if not self.validation_kinds:
            raise InputError(
                "tune.validation_kinds is empty; name at least one document kind, e.g. [dialogue]"
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

    def __post_init__(self) -> None:
        positive("serve.port", self.port, allow_zero=True)
        at_most("serve.port", self.port, 65535, "the largest TCP port")
        positive("serve.cache_gb", self.cache_gb, allow_zero=True)
        at_most("serve.cache_gb", self.cache_gb, MAX_GB, "8 EiB")
        positive("serve.max_tokens", self.max_tokens)
        at_most("serve.max_tokens", self.max_tokens, MAX_TOKENS, "above any model's context")
        positive("serve.max_pending", self.max_pending)
        if self.kv_bits is not None:
            choose("serve.kv_bits", self.kv_bits, (2, 3, 4, 5, 6, 8))
        choose("serve.kv_group_size", self.kv_group_size, (32, 64, 128))  # mlx-lm's QuantizedKVCache


@dataclass
class PipelineCfg:
    # Commands run in order in one run directory (see mlxbun/pipeline.py).
    steps: list[str] = field(default_factory=list)


@dataclass
class Config:
    command: CommandCfg = field(default_factory=CommandCfg)
    # Seed recorded in the manifest (commands take their own seeds below).
    seed: int = 0
    # true: print tracebacks with errors.
    verbose: bool = False
    # true: print the result as one JSON document.
    json: bool = False
    # Optimized BLAS for MLX on Linux: "auto" (find one), "off", or a path to a shared library.
    blas: str = "auto"
    # Where MLX computes: "auto" (its default: the GPU where there is one), "cpu" or "gpu".
    device: str = "auto"
    paths: PathsCfg = field(default_factory=PathsCfg)
    io: IoCfg = field(default_factory=IoCfg)
    model: ModelCfg = field(default_factory=ModelCfg)
    synth: SynthCfg = field(default_factory=SynthCfg)
    inspect: InspectCfg = field(default_factory=InspectCfg)
    quant: QuantCfg = field(default_factory=QuantCfg)
    sensitivity: SensitivityCfg = field(default_factory=SensitivityCfg)
    calibrate: CalibrateCfg = field(default_factory=CalibrateCfg)
    allocate: AllocateCfg = field(default_factory=AllocateCfg)
    fold: FoldCfg = field(default_factory=FoldCfg)
    kv: KvCfg = field(default_factory=KvCfg)
    serve: ServeCfg = field(default_factory=ServeCfg)
    registry: RegistryCfg = field(default_factory=RegistryCfg)
    runs: RunsCfg = field(default_factory=RunsCfg)
    pipeline: PipelineCfg = field(default_factory=PipelineCfg)
    eval: EvalCfg = field(default_factory=EvalCfg)
    tune: TuneCfg = field(default_factory=TuneCfg)
    # true: list the chosen command's keys (type, default, comment) instead of running it.
    help: bool = False

    def __post_init__(self) -> None:
        check_config(self)


def check_config(cfg: Config) -> None:
    """Rules that span sections: seeds, keys another key makes meaningless, absolute bounds."""
    seeds = {"seed": cfg.seed, "fold.seed": cfg.fold.seed, "synth.seed": cfg.synth.seed}
    seeds["sensitivity.calib.seed"] = cfg.sensitivity.calib.seed
    seeds["eval.seed"] = cfg.eval.seed
    for key, value in seeds.items():
        positive(key, value, allow_zero=True)
    choose("device", cfg.device, ("auto", "cpu", "gpu"))
    positive("allocate.budget_bpw", cfg.allocate.budget_bpw)
    at_most("allocate.budget_bpw", cfg.allocate.budget_bpw, MAX_BPW, "float32, the widest stored weight")
    q = cfg.quant
    if q.mixed is not None and q.bits is not None:
        raise InputError(
            f"quant.bits={q.bits} is ignored by quant.mixed={q.mixed!r}, which sets the bits of every"
            " layer; drop one of them"
        )
    check_plan_overrides(q, plan=q.plan)


def check_plan_overrides(q: QuantCfg, *, plan: str | None) -> None:
    """A plan sets every layer's mode, bits and group size: refuse the uniform keys beside it."""
    if plan is None:
        return
    for key, value, default in (
        ("bits", q.bits, None),
        ("group_size", q.group_size, None),
        ("mode", q.mode, "affine"),
    ):
        if value != default:
            raise InputError(
                f"quant.{key}={value!r} is ignored by quant.plan={plan!r}, which sets every layer's"
                " mode, bits and group size; drop one of them"
            )


# Keys every command reads: where runs go and are recorded, where models are found.
COMMON_KEYS = (
    "command", "seed", "verbose", "json", "blas", "device", "help", "paths",
    "registry.url", "registry.path", "registry.hub_cache", "registry.paths",
)  # fmt: skip


def reads(command: str, data: dict[str, Any]) -> tuple[str, ...]:
    """The keys and sections ``command`` reads with the composed config ``data`` (a pipeline:
    its steps')."""
    found = list(COMMON_KEYS) + list(_reads(command))
    if command == "pipeline":
        for step in (data.get("pipeline") or {}).get("steps") or ():
            found += _reads(step)
    return tuple(found)


def _reads(command: str) -> tuple[str, ...]:
    return COMMANDS[command].reads if command in COMMANDS else ()


def is_read(key: str, read: tuple[str, ...]) -> bool:
    """Whether dotted ``key`` is one of ``read`` or inside a section of it."""
    return any(key == r or key.startswith(r + ".") for r in read)


def check_unread(data: dict[str, Any], defaults: dict[str, Any], *, given: list[str]) -> None:
    """Refuse a key given on the command line (``given``: Hydra's overrides), set away from its
    default, that the chosen command does not read: it would be silently ignored
    (``command=allocate quant.method=gptq``). Recipes are held to the same rule by a test."""
    command = str((data.get("command") or {}).get("name"))
    if command not in COMMANDS:
        return
    read, keys = reads(command, data), [override_key(o) for o in given]
    for key, value, default in _leaves(data, defaults):
        if value != default and not is_read(key, read) and is_read(key, tuple(keys)):
            raise InputError(
                f"{key}={value!r} is not read by command={command}, so it would be ignored; drop it"
                f" (`python -m mlxbun command={command} help=true` lists the keys it reads)"
            )


def override_key(override: str) -> str:
    """The dotted key of a Hydra override: ``+quant.bits=4`` -> ``quant.bits``."""
    return override.partition("=")[0].lstrip("+~")


def _leaves(data: dict[str, Any], defaults: dict[str, Any], prefix: str = "") -> list[tuple[str, Any, Any]]:
    out = []
    for key, value in data.items():
        default = defaults.get(key) if isinstance(defaults, dict) else None
        if isinstance(value, dict) and isinstance(default, dict):
            out += _leaves(value, default, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", value, default))
    return out


def check_keys(data: dict[str, Any], cls: type = None, prefix: str = "") -> None:
    """Raise an InputError naming the first key of ``data`` that ``cls`` (default Config) lacks.

    Hydra lets ``+key=value`` add keys to a structured config; they would be silently ignored.
    """
    cls = cls or Config
    known = {f.name: f for f in fields(cls)}
    for key, value in data.items():
        if key not in known:
            raise InputError(unknown_key_message(f"{prefix}{key}"))
        sub = _dataclass_type(known[key].type)
        if sub is not None and isinstance(value, dict):
            check_keys(value, sub, f"{prefix}{key}.")


def _dataclass_type(annotation: Any) -> type | None:
    cls = globals().get(annotation) if isinstance(annotation, str) else annotation
    return cls if isinstance(cls, type) and is_dataclass(cls) else None


def all_keys(cls: type = None, prefix: str = "") -> list[str]:
    """Every leaf key of ``cls`` (default Config) as a dotted path, e.g. "quant.bits"."""
    keys = []
    for f in fields(cls or Config):
        sub = _dataclass_type(f.type)
        keys += all_keys(sub, f"{prefix}{f.name}.") if sub else [f"{prefix}{f.name}"]
    return keys


def unknown_key_message(dotted: str) -> str:
    """One line for an unknown key: its full path and the closest known keys."""
    keys = all_keys()
    section, _, leaf = dotted.rpartition(".")
    near = difflib.get_close_matches(dotted, keys, n=1, cutoff=0.6)
    if not near and section:  # a wrong leaf in a right section
        siblings = [k for k in keys if k.rpartition(".")[0] == section]
        near = [k for k in siblings if k.rpartition(".")[2].startswith(leaf)][:1]
        near = near or difflib.get_close_matches(dotted, siblings, n=1, cutoff=0.5)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    return (
        f"unknown config key {dotted!r}{hint} (`python -m mlxbun command=<name> help=true` lists a"
        " command's keys)"
    )


@dataclass(frozen=True)
class KeyDoc:
    """One config key for per-command help: dotted path, type, default, one-line comment."""

    key: str
    type: str
    default: Any
    comment: str


def key_docs(cls: type = None, prefix: str = "") -> list[KeyDoc]:
    """Every leaf key of ``cls`` (default Config) with its type, default and schema comment."""
    cls = cls or Config
    comments = _field_comments().get(cls.__name__, {})
    docs = []
    for f in fields(cls):
        sub = _dataclass_type(f.type)
        if sub is not None:
            docs += key_docs(sub, f"{prefix}{f.name}.")
            continue
        default = f.default_factory() if f.default is MISSING else f.default
        docs.append(KeyDoc(f"{prefix}{f.name}", str(f.type), default, comments.get(f.name, "")))
    return docs


def _field_comments() -> dict[str, dict[str, str]]:
    """Class name -> field -> the comment lines right above the field, joined into one line."""
    source = Path(__file__).read_text()
    lines = source.splitlines()
    found: dict[str, dict[str, str]] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                above, i = [], stmt.lineno - 2
                while i >= 0 and lines[i].strip().startswith("#"):
                    above.insert(0, lines[i].strip().lstrip("#").strip())
                    i -= 1
                found.setdefault(node.name, {})[stmt.target.id] = " ".join(above)
    return found


REPO_ROOT = Path(__file__).resolve().parent.parent


def repo_path(relative: str) -> str:
    """``${repo:tests/fixtures/x}`` in a recipe: a path inside the mlxbun checkout, from any cwd."""
    return str(REPO_ROOT / relative)


def register() -> None:
    """Register :class:`Config` in Hydra's ConfigStore as ``mlxbun_schema``, and ``${repo:...}``."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    ConfigStore.instance().store(name="mlxbun_schema", node=Config)
    OmegaConf.register_new_resolver("repo", repo_path, replace=True)
