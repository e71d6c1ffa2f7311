"""Every command, declared once: its module, summary, whether it writes a run, what it reads.

The command named ``X`` is the ``run`` of the module this table names for it (``module:function``
when one module holds several commands). cli dispatches from it, help lists it, schema refuses
keys a command does not read by it, and pipeline checks its steps against it. Each command also
has ``conf/command/X.yaml`` (Hydra composes ``command=X`` from it; a test keeps the two in step).

A new command is one entry here, one conf file, and its module's ``run``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import mlxbun
from mlxbun.errors import InputError

CONF_DIR = mlxbun.REPO_ROOT / "conf"

# model.synthetic=true builds the model from the synth section (recipes keep both ready)
MODEL_SECTIONS = ("model", "synth")
# A pipeline step that loads a model needs one of these set, or provided by an earlier step.
MODEL = ("model.name", "model.synthetic")


@dataclass(frozen=True)
class Command:
    """One command.

    ``reads``: config sections or single keys it reads besides config.keys.COMMON_KEYS (a key set away
    from its default that the command does not read is refused; ``help=true`` lists these).
    ``needs``: as a pipeline step, groups of keys of which each needs one set or provided by an
    earlier step. ``provides``: the keys its ``RunResult.provides`` sets for later steps.
    ``readonly``: writes no run directory, manifest or RunRecord.
    """

    target: str
    summary: str
    reads: tuple[str, ...] = ()
    readonly: bool = False
    needs: tuple[tuple[str, ...], ...] = ()
    provides: tuple[str, ...] = ()

    @property
    def module(self) -> str:
        return self.target.partition(":")[0]

    @property
    def function(self) -> str:
        return self.target.partition(":")[2] or "run"


COMMANDS: dict[str, Command] = {
    "help": Command("mlxbun.help", "list the commands and the recipes", readonly=True),
    "pipeline": Command(
        "mlxbun.pipeline", "run several commands in order in one run directory", reads=("pipeline",)
    ),
    "synth": Command(
        "mlxbun.synth.command",
        "write a deterministic random checkpoint of a real architecture",
        reads=("synth", "io"),
        provides=("model.name",),
    ),
    "inspect": Command(
        "mlxbun.inspect",
        "tensors, totals, metadata and quantization of a model",
        reads=("inspect", *MODEL_SECTIONS),
        readonly=True,
        needs=(("inspect.path", *MODEL),),
    ),
    "quantize": Command(
        "mlxbun.quant.quantize.command",
        "stream an HF checkpoint to a quantized MLX model",
        reads=(*MODEL_SECTIONS, "quant", "io"),
        needs=(MODEL,),
        provides=("model.name",),
    ),
    "sensitivity": Command(
        "mlxbun.quant.sensitivity.command",
        "per-layer KL of candidates: fisher, exact or reference",
        # sensitivity.candidates: scored with quant.hessians, probed at allocate's budget in quant.dtype
        reads=(
            *MODEL_SECTIONS,
            "sensitivity",
            "quant.hessians",
            "quant.dtype",
            "allocate.budget_bpw",
            "allocate.budget_bytes",
        ),
        needs=(MODEL,),
        provides=("allocate.sensitivity",),
    ),
    "sensitivity_merge": Command(
        "mlxbun.quant.sensitivity.merge",
        "combine sharded sensitivity runs",
        reads=("sensitivity.inputs",),
        needs=(("sensitivity.inputs",),),
        provides=("allocate.sensitivity",),
    ),
    "calibrate": Command(
        "mlxbun.quant.calibrate",
        "input Hessians of every module on calibration text (cached)",
        reads=(*MODEL_SECTIONS, "calibrate", "sensitivity.calib", "sensitivity.batch_size"),
        needs=(MODEL,),
        provides=("quant.hessians",),
    ),
    "allocate": Command(
        "mlxbun.quant.allocate.command",
        "per-layer bits under a true size budget -> plan.json",
        reads=(
            *MODEL_SECTIONS,
            "allocate",
            "quant.dtype",
            "quant.hessians",
            "io",
            "sensitivity.calib",
            "sensitivity.batch_size",
        ),
        needs=(MODEL, ("allocate.sensitivity",), ("allocate.budget_bpw", "allocate.budget_bytes")),
        provides=("quant.plan",),
    ),
    "tune": Command(
        "mlxbun.quant.tune.command",
        "learned rounding, a block at a time: a quantized model's codes, group scales and biases fit to its reference",
        reads=(*MODEL_SECTIONS, "tune", "io", "sensitivity.calib.path", "sensitivity.calib.seed"),
        needs=(MODEL, ("tune.reference",)),
        provides=("model.name",),
    ),
    "rotate": Command(
        "mlxbun.rotate.command",
        "fold a seeded randomized Hadamard R1 into a checkpoint",
        reads=(*MODEL_SECTIONS, "fold", "io"),
        needs=(MODEL,),
        provides=("model.name",),
    ),
    "eval": Command(
        "mlxbun.eval",
        "KL-divergence statistics of quantized candidates against a reference",
        reads=(*MODEL_SECTIONS, "eval"),
    ),
    "kv_save": Command(
        "mlxbun.kv.commands:save",
        "prefill a prompt and persist its KV cache",
        reads=(*MODEL_SECTIONS, "kv"),
        needs=(MODEL, ("kv.name",), ("kv.prompt", "kv.prompt_file")),
    ),
    "kv_generate": Command(
        "mlxbun.kv.commands:generate",
        "restore the best cached prefix and generate",
        reads=(*MODEL_SECTIONS, "kv"),
        needs=(MODEL, ("kv.prompt", "kv.prompt_file")),
    ),
    "kv_ls": Command("mlxbun.kv.commands:ls", "list stored KV snapshots", reads=("kv.store",), readonly=True),
    "kv_verify": Command(
        "mlxbun.kv.commands:verify",
        "re-hash stored KV snapshots and blocks",
        reads=("kv.store", "kv.name"),
        readonly=True,
    ),
    "kv_gc": Command(
        "mlxbun.kv.gc",
        "plan (and with kv.execute=true free) unreferenced KV blocks",
        reads=("kv.store", "kv.block_kib", "kv.cap_gb", "kv.execute"),
    ),
    "kv_import": Command(
        "mlxbun.kv.import_",
        "verify an mlx_lm cache_prompt file and store it as a snapshot",
        reads=(*MODEL_SECTIONS, "kv"),
    ),
    "kv_export": Command(
        "mlxbun.kv.export",
        "write a stored snapshot as a plain mlx-lm prompt-cache file",
        reads=(*MODEL_SECTIONS, "kv"),
    ),
    "serve": Command(
        "mlxbun.serve",
        "OpenAI- and Anthropic-compatible server: continuous batching, prompt caches kept in the KV store",
        # the store it keeps prompts in; prompts, names and kv_* settings come from its clients
        reads=(*MODEL_SECTIONS, "serve", "kv.store", "kv.block_kib", "kv.layout", "kv.verify", "kv.cap_gb"),
    ),
    "registry_scan": Command(
        "mlxbun.registry.commands:scan", "index the HF cache and local model dirs", reads=("registry",)
    ),
    "registry_ls": Command(
        "mlxbun.registry.commands:ls", "list indexed models with filters", reads=("registry",), readonly=True
    ),
    "registry_resolve": Command(
        "mlxbun.registry.commands:resolve",
        "resolve a fuzzy name to one model",
        reads=(*MODEL_SECTIONS, "registry"),
        readonly=True,
        needs=(MODEL,),
        provides=("model.name",),
    ),
    "registry_fit": Command(
        "mlxbun.registry.commands:fit",
        "does a model fit a memory budget",
        reads=(*MODEL_SECTIONS, "registry"),
        readonly=True,
        needs=(MODEL,),
    ),
    "runs": Command("mlxbun.runs.command", "list recorded runs", reads=("runs", "registry"), readonly=True),
    "verify": Command(
        "mlxbun.runs.verify",
        "re-hash a run's outputs against its manifest",
        reads=("runs",),
        readonly=True,
        needs=(("runs.dir",),),
    ),
}


def resolve(name: str) -> Any:
    """Import command ``name``'s module (only that one) and return its function."""
    command = COMMANDS[name]
    try:
        mod = importlib.import_module(command.module)
    except ModuleNotFoundError as e:
        if e.name and (e.name == command.module or command.module.startswith(e.name + ".")):
            raise InputError(
                f"command={name!r} is not available in mlxbun {mlxbun.__version__}"
                f" (module {command.module} is missing)"
            ) from None
        raise
    return getattr(mod, command.function)
