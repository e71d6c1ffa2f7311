"""The config sections of the quantization commands: quant, sensitivity (with calib and
candidates), calibrate, allocate, eval and tune.

Choices come from :mod:`mlxbun.quant.spec` (mlx-free, like this module); each ``__post_init__``
checks its section when the CLI builds the config.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlxbun.config.checks import MAX_BYTES, at_least, at_most, choose, not_empty, positive
from mlxbun.errors import InputError
from mlxbun.io.dtypes import OUTPUT_DTYPES
from mlxbun.quant.spec import (
    ALL_BITS,
    ALL_GROUPS,
    CANDIDATE_METHODS,
    MIXED_RULES,
    MODE_GROUPS,
    MODES,
    Rule,
    check_budget,
    check_method,
    check_mixed,
    spec_for,
)


@dataclass
class QuantCfg:
    # affine, mxfp4, nvfp4 or mxfp8.
    mode: str = "affine"
    # Bits per weight: affine 2, 3, 4, 5, 6 or 8; mxfp4 and nvfp4 4; mxfp8 8. None: the mode's default.
    bits: int | None = None
    # Weights per scale: affine 32, 64 or 128; mxfp4 and mxfp8 32; nvfp4 16. None: the mode's default.
    group_size: int | None = None
    # A per-layer plan.json (from allocate, or written by hand), or one of mlx-lm's mixed rules
    # (as quant.mixed). Sets every layer's mode, bits and group size.
    plan: str | None = None
    # mlx-lm's mixed rule: mixed_2_6, mixed_3_4, mixed_3_6 or mixed_4_6 (affine; quant.group_size applies).
    mixed: str | None = None
    # dtype of the tensors left unquantized: bfloat16, float16 or float32; None: config.json's torch_dtype.
    dtype: str | None = None
    # Output model directory; None: <run_dir>/model.
    out: str | None = None
    # true: a re-run of the same conversion continues a killed one from its last complete shard.
    resume: bool = True
    # Modules converted (and sensitivity candidates scored) at once, >= 1; None: one per usable core.
    threads: int | None = None
    # How affine weights are rounded: rtn (mx.quantize), clip (range search), gptq or awq.
    method: str = "rtn"
    # Input Hessians (hessians.safetensors, or the command=calibrate run dir holding it): gptq and
    # awq need them, clip weights columns by them. A pipeline's calibrate step sets it.
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
    # "completion"}); None: the built-in set mlxbun/data/calibration.txt.
    path: str | None = None
    # Calibration windows drawn from the text, >= 1.
    samples: int = 24
    # Tokens per window, >= 2.
    seq_len: int = 512
    # Picks the windows, >= 0.
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
    # Candidates beyond RTN at sensitivity.bits, each module's KL scored from its input Hessian
    # (quant.hessians; None: captured on sensitivity.calib, cached): affine group sizes 32, 64, 128.
    # All three lists []: no candidates beyond RTN.
    group_sizes: list[int] = field(default_factory=list)
    # Rounding methods scored: rtn, clip, gptq.
    methods: list[str] = field(default_factory=list)
    # Microscaling modes scored at their one setting: mxfp4, nvfp4, mxfp8.
    modes: list[str] = field(default_factory=list)
    # Rescale each quantizer's estimates by whole-model probes of a plan at allocate's budget (or
    # 4.5 bpw): one quantize and one forward per quantizer.
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
    # Bit widths each module's KL is measured at (the mode's, as quant.bits), at least one.
    bits: list[int] = field(default_factory=lambda: [4, 8])
    # Weights per scale (as quant.group_size); None: the mode's default.
    group_size: int | None = None
    # affine, mxfp4, nvfp4 or mxfp8.
    mode: str = "affine"
    # fisher: estimated from one backward pass and one forward per candidate; exact: every
    # (module, candidate) measured; reference: exact, one full forward per sample (slow).
    method: str = "fisher"
    # fisher: the fraction of modules, in [0, 1], largest first, probed exactly at refine_bits and
    # their estimates scaled to the probe. 0: off.
    refine: float = 0.0
    # The bits refine probes at, from sensitivity.bits; []: the middle candidate.
    refine_bits: list[int] = field(default_factory=list)
    # Calibration windows per forward, >= 1.
    batch_size: int = 8
    # This job's part, 0 .. num_shards - 1, when Hydra multirun splits the work:
    # sensitivity.shard=range(0,N) sensitivity.num_shards=N.
    shard: int = 0
    # Parts the work is split into, >= 1.
    num_shards: int = 1
    calib: CalibCfg = field(default_factory=CalibCfg)
    candidates: CandidatesCfg = field(default_factory=CandidatesCfg)
    # Keep the reference's log-probs (float64, samples x seq_len x vocab) in memory when they fit
    # this many MiB, >= 0; else they are computed again.
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
    # Root of the cached Hessians, one directory per model and calibration (sensitivity.calib's);
    # None: <paths.cache>/hessians.
    work_dir: str | None = None

    def __post_init__(self) -> None:
        not_empty("calibrate.work_dir", self.work_dir)


@dataclass
class AllocateCfg:
    # sensitivity.json or the run directory holding it (a pipeline's sensitivity step sets it).
    sensitivity: str | None = None
    # More sensitivity runs on the same model and calibration (other group sizes or modes): more candidates.
    extra_sensitivity: list[str] = field(default_factory=list)
    # Candidates: the measured settings with these bits ([]: any).
    bits: list[int] = field(default_factory=list)
    # ... these group sizes ([]: any).
    group_sizes: list[int] = field(default_factory=list)
    # ... these modes ([]: any).
    modes: list[str] = field(default_factory=list)
    # ... these rounding methods: rtn, clip, gptq ([]: any).
    methods: list[str] = field(default_factory=list)
    # The budget as bits per weight over every stored tensor, > 0 (set this or budget_bytes).
    budget_bpw: float | None = None
    # The budget as bytes of the .safetensors files, headers included, > 0 (or budget_bpw).
    budget_bytes: int | None = None
    # Bits of the modules the sensitivity did not probe (embeddings, an unprobed head): the plan's default.
    default_bits: int = 4
    # Their group size.
    default_group_size: int = 64
    # Their mode.
    default_mode: str = "affine"
    # "PATTERN:MIN_BITS" rules keeping modules at or above a bit width, e.g. lm_head:6,
    # layers.first.mlp.down_proj:6 (a glob, or dotted components; first and last name blocks).
    protect: list[str] = field(default_factory=list)
    # Knapsack states, >= 1, before option sizes are rounded up (the plan is then near-optimal, with its bound).
    max_states: int = 65536
    # Decisions near the knapsack's threshold re-measured per round in the model quantized as
    # planned, the plan then solved again with those costs, >= 0. 0: off.
    interactions: int = 16
    # Rounds of that, >= 1; a round's plan is kept only when the model's KL is lower.
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
class EvalCfg:
    # Models compared with model.name: directories or registry names (anything mlx_lm.load opens).
    candidates: list[str] = field(default_factory=list)
    # A text file to evaluate on; None: the built-in held-out text mlxbun/data/heldout.txt.
    text: str | None = None
    # Tokens evaluated, >= 1 (rounded up to whole windows of seq_len), in disjoint windows drawn by seed.
    tokens: int = 8192
    # Tokens per window, >= 2 (each window scores seq_len - 1 next-token predictions).
    seq_len: int = 512
    # Picks the windows from the text, >= 0.
    seed: int = 0
    # Reference log-probs kept per token (plus the tail mass), 1 to the vocabulary; the KL this misses
    # is bounded and reported. None: the whole vocabulary up to 2048 (exact up to there).
    top_k: int | None = None
    # Windows per forward, >= 1.
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
    # Steps of signed gradient descent per decoder block, >= 0 (fewer when tune.max_minutes says
    # so); 0 hands the input on. The rate decays over them, so fewer steps also move less
    # (BENCHMARKS.md: how this was chosen).
    steps: int = 400
    # Each step moves every rounding offset (in grid steps), log scale and bias shift (in scales)
    # by up to this, in (0, 0.5], falling linearly to 0 over the block's steps.
    lr: float = 5.0e-3
    # Windows per step, >= 1.
    batch_size: int = 8
    # Training windows, >= 1: calibration documents of other kinds than tune.validation_kinds
    # (the text and seed are sensitivity.calib's).
    samples: int = 64
    # Validation windows, >= 1, from the documents of tune.validation_kinds: a block keeps its best
    # check, and the model is written, only when they improve.
    val_samples: int = 8
    # Tokens per window, >= 2.
    seq_len: int = 128
    # Document kinds (``### kind`` headers of the calibration text) that only validate, at least
    # one; a text with none of them validates on every fourth document.
    validation_kinds: list[str] = field(default_factory=lambda: ["prose", "math"])
    # Minutes tune's blocks and its closing validation KL may take, > 0: sets how many steps each
    # block gets, at the pace timed after a warm-up step, after room for the KL (timed on one of
    # its slices; over fewer tokens when it would take more than half); a step the minutes left
    # cannot hold is not started (the last blocks may keep their input's values). null:
    # tune.steps each.
    max_minutes: float | None = 60.0
    # The tuned model is written only when its validation KL is at least this fraction below the
    # input's (and significantly so), in [0, 0.99]: smaller validation gains did not carry to
    # held-out text.
    min_gain: float = 0.05
    # Where the tuned model goes (null: <run_dir>/model); a pipeline whose tune step follows
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
        positive("tune.min_gain", self.min_gain, allow_zero=True)
        at_most("tune.min_gain", self.min_gain, 0.99, "a gain of the whole KL is none to find")
        if not self.validation_kinds:
            raise InputError("tune.validation_kinds is empty; name at least one document kind, e.g. [prose]")
