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
    # from its input Hessian (mlxbun/quant/sensitivity/candidates.py): these affine group sizes and rounding
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
    # fisher: estimated from one backward pass + one forward per candidate (mlxbun/quant/sensitivity/fisher.py);
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
    # Knapsack DP states before option sizes get rounded up (see mlxbun/quant/allocate/knapsack.py).
    max_states: int = 65536
    # Steps near the knapsack's threshold re-measured in the model quantized as planned, per
    # round; the plan is solved again with those costs (mlxbun/quant/allocate/interactions.py). 0: off.
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
    # Reference log-probs kept per token (plus the tail mass); the KL this misses is bounded and reported.
    top_k: int = 1024
    # Windows per forward.
    batch_size: int = 4
    # true: evaluate a candidate whose calibration tokens share spans with the text (with a warning).
    allow_overlap: bool = False

    def __post_init__(self) -> None:
        positive("eval.tokens", self.tokens)
        positive("eval.seq_len", self.seq_len)
        at_least("eval.seq_len", self.seq_len, 2, "one token predicts none")
        positive("eval.top_k", self.top_k)
        positive("eval.batch_size", self.batch_size)


CODES_LR_RATIO = 1.0e4  # tune.codes_lr / tune.lr at most: the offsets' multiplier stays finite in float32


@dataclass
class TuneCfg:
    # The unquantized model the quantized one (model.name) was made from: its next-token
    # distributions are the target (a path, registry name or org/repo).
    reference: str | None = None
    # Passes over the calibration windows in each phase (scales, then codes); 0 hands the input on.
    epochs: int = 8
    # Adam's step after one epoch of warm-up, then decayed to 0 on a cosine. Scales and biases move
    # in units of the quantization grid, so one rate suits every bit width.
    lr: float = 3.0e-3
    # The second phase's step for the codes (learned rounding): each code's offset moves by about
    # this many grid steps a step, and the code moves to the next level once its offset passes one
    # half; 0: the codes stay (no second phase). On the 8-layer fixture 3e-3 and 6e-3 lowered the
    # held-out KL of a 5-bit plan by 12% and 18% more than the scales alone, and 9e-3 moved too
    # many codes at once (no epoch beat the first phase's).
    codes_lr: float = 6.0e-3
    # Windows per step.
    batch_size: int = 4
    # Calibration windows (the text and seed are sensitivity.calib's); the last eighth validate.
    samples: int = 128
    # Tokens per calibration window.
    seq_len: int = 128
    # Stop after this many epochs without a new best validation KL (0: run every epoch, the
    # default: a 6-bit plan's best came at epoch 7 after five epochs without one).
    patience: int = 0
    # Hand the input on untrained when its validation KL (nats per token) is below this: a plan
    # that close to its reference has nothing measurable left to gain (0: always train).
    min_kl: float = 1.0e-3
    # Hand the input on untrained when the epochs would take longer than this, at the speed of the
    # first validation pass (tune.json records the prediction); null: no limit.
    max_minutes: float | None = 60.0

    def __post_init__(self) -> None:
        not_empty("tune.reference", self.reference)
        positive("tune.epochs", self.epochs, allow_zero=True)
        positive("tune.lr", self.lr)
        positive("tune.codes_lr", self.codes_lr, allow_zero=True)
        at_most(
            "tune.codes_lr", self.codes_lr, 1.0, "grid steps a step: more moves codes by whole levels at once"
        )
        # the codes' offsets move at codes_lr / lr times the scales' step (one Adam for both)
        at_least(
            "tune.lr",
            self.lr,
            self.codes_lr / CODES_LR_RATIO,
            f"tune.codes_lr={self.codes_lr:g} / {CODES_LR_RATIO:g}",
        )
        positive("tune.batch_size", self.batch_size)
        positive("tune.samples", self.samples)
        at_least("tune.samples", self.samples, 3, "2 are validation")
        positive("tune.seq_len", self.seq_len)
        at_least("tune.seq_len", self.seq_len, 2, "one token predicts none")
        positive("tune.patience", self.patience, allow_zero=True)
        positive("tune.min_kl", self.min_kl, allow_zero=True)
        positive("tune.max_minutes", self.max_minutes)
