"""The config schema: :class:`Config`, the tree Hydra composes every run's YAML against.

Hydra composes ``conf/`` and ``recipes/`` against :class:`Config` (registered in the ConfigStore
as ``mlxbun_schema``), so unknown keys and wrong types fail at compose time. Choices and ranges are
checked in each section's ``__post_init__`` when the CLI turns the composed config into these
dataclasses (``OmegaConf.to_object``); rules that span sections are :func:`check_config`. Command
modules receive the resulting :class:`Config`: plain dataclasses, no omegaconf. The sections are
:mod:`mlxbun.config.sections` and :mod:`mlxbun.config.quant`; the keys each command reads, and
their help, :mod:`mlxbun.config.keys`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlxbun
from mlxbun.config.checks import MAX_BPW, at_most, choose, positive
from mlxbun.config.quant import (
    AllocateCfg,
    CalibCfg,
    CalibrateCfg,
    CandidatesCfg,
    EvalCfg,
    QuantCfg,
    SensitivityCfg,
    TuneCfg,
)
from mlxbun.config.sections import (
    CommandCfg,
    FoldCfg,
    InspectCfg,
    IoCfg,
    KvCfg,
    ModelCfg,
    PathsCfg,
    PipelineCfg,
    RegistryCfg,
    RegistryFilterCfg,
    RegistryFitCfg,
    RunsCfg,
    ServeCfg,
    SynthCfg,
)
from mlxbun.errors import InputError

__all__ = [
    "AllocateCfg", "CalibCfg", "CalibrateCfg", "CandidatesCfg", "CommandCfg", "Config", "EvalCfg",
    "FoldCfg", "InspectCfg", "IoCfg", "KvCfg", "ModelCfg", "PathsCfg", "PipelineCfg", "QuantCfg",
    "RegistryCfg", "RegistryFilterCfg", "RegistryFitCfg", "RunsCfg", "SensitivityCfg", "ServeCfg",
    "SynthCfg", "TuneCfg", "check_config", "register",
]  # fmt: skip


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


def repo_path(relative: str) -> str:
    """``${repo:tests/fixtures/x}`` in a recipe: a path inside the mlxbun checkout, from any cwd."""
    return str(mlxbun.REPO_ROOT / relative)


def register() -> None:
    """Register :class:`Config` in Hydra's ConfigStore as ``mlxbun_schema``, and ``${repo:...}``."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    ConfigStore.instance().store(name="mlxbun_schema", node=Config)
    OmegaConf.register_new_resolver("repo", repo_path, replace=True)
