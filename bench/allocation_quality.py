"""Quality at equal bytes: mlxbun's plans against mlx-lm's convert options, GPTQ, AWQ and dynamic_quant.

Run: .venv/bin/python bench/allocation_quality.py [--model tests/fixtures/llama-text-3m ...]
         [--samples 16] [--seq-len 256] [--out bench/results/allocate.md]

For each model (several ``--model`` give one section each):

1. Anchors, each in its own child process (wall time of the whole method, load and save included):
   ``mlx_lm.convert`` at q3, mixed_3_4, mixed_3_6, q4, mixed_4_6, q4 g32, q6;
   ``mlx_lm.quant.gptq.gptq_quantize`` (4-bit g64; its default 6-bit fallback and a 4-bit one);
   ``mlx_lm.quant.awq.awq_quantize`` (3 and 4-bit g64, its default 4-bit g32 embedding);
   ``mlx_lm.quant.dynamic_quant`` (3/4 and 4/5 tiers at their default-style bpw targets).
   The learned quantizers get mlxbun's calibration token matrix directly (offline, same tokens
   as mlxbun's sensitivity).
2. mlxbun's exact sensitivity (child processes) per quantizer method and group size.
3. At the byte size of every anchor (its ``.safetensors`` files on disk): mlxbun's knapsack
   plan for each candidate family, quantized by mlxbun's quantize, size read from disk.
4. KL(reference || quantized) of every model on the calibration tokens and on held-out text
   (CPython modules the fixture was not trained on).

Writes ``bench/results/allocate.md``.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# CPython modules in neither committed fixture's training corpus (their FIXTURE.json lists it;
# held_out_text refuses a model whose corpus holds one of these).
HELD_OUT = ["tarfile", "mailbox", "ftplib", "plistlib", "shlex", "sched", "netrc", "traceback"]
STDLIB = Path("/usr/lib/python3.11")
# Anchors: name -> child-stage spec.
ANCHORS = {
    "mlx-lm q3": "convert:3:64:",
    "mlx-lm mixed_3_4": "convert:3:64:mixed_3_4",
    "mlx-lm mixed_3_6": "convert:3:64:mixed_3_6",
    "mlx-lm q4": "convert:4:64:",
    "mlx-lm mixed_4_6": "convert:4:64:mixed_4_6",
    "mlx-lm q4 g32": "convert:4:32:",
    "mlx-lm q6": "convert:6:64:",
    "mlx-lm gptq 4-bit (fallback 6)": "gptq:4:6",
    "mlx-lm gptq 4-bit (fallback 4)": "gptq:4:4",
    "mlx-lm gptq 4-bit (fallback 6), float32 Hessians": "gptq:4:6:f32",
    "mlx-lm gptq 4-bit (fallback 4), float32 Hessians": "gptq:4:4:f32",
    "mlx-lm awq 3-bit": "awq:3",
    "mlx-lm awq 4-bit": "awq:4",
    "mlx-lm dynamic_quant 3/4 @ 4.0 bpw": "dq:3:4:4.0",
    "mlx-lm dynamic_quant 4/5 @ 5.0 bpw": "dq:4:5:5.0",
}
# Exact KL is measured for RTN at g64 only; every other (bits, group, method) of a module gets
# KL(RTN, bits, g64) x its output error / RTN's output error at (bits, g64), the error being
# trace(dW H dW^T) on the calibration inputs (KL grows linearly with a layer's output error).
EXACT_BITS = [2, 3, 4, 5, 6, 8]
SETTINGS = [(b, 64) for b in EXACT_BITS] + [(b, 32) for b in (2, 3, 4)] + [(b, 128) for b in (3, 4, 6)]
# Microscaling modes (rtn only): (mode, bits, group); their KL = exact KL at (bits, g64) x error ratio.
MX_SETTINGS = [("mxfp4", 4, 32), ("nvfp4", 4, 16), ("mxfp8", 8, 32)]
METHODS = ("rtn", "clip", "gptq")
FAMILIES = {  # label -> (methods, group sizes, microscaling modes, corrected by probes)
    "mlxbun RTN g64": (("rtn",), (64,), (), False),
    "mlxbun all": (METHODS, (32, 64, 128), tuple(m for m, _, _ in MX_SETTINGS), False),
    "mlxbun all, corrected": (METHODS, (32, 64, 128), tuple(m for m, _, _ in MX_SETTINGS), True),
}
PROBE_AT = "mlx-lm q4"  # the anchor whose size the correction probes are measured at


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ------------------------------------------------------------------------------- child stages


def _calibration(model_dir: Path, samples: int, seq_len: int):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from mlxbun.quant.calib import load_calibration

    tok = load_tokenizer(model_dir)
    return load_calibration(tokenizer=tok, samples=samples, seq_len=seq_len, seed=0)


def stage_convert(args: argparse.Namespace, bits: str, group: str, rule: str) -> None:
    from mlx_lm import convert

    convert(
        str(args.model), str(args.dest), quantize=True, q_bits=int(bits), q_group_size=int(group),
        quant_predicate=rule or None,
    )  # fmt: skip


def _load_for_learned(args: argparse.Namespace):
    import mlx.core as mx
    from mlx_lm.utils import load

    model, tok, config = load(str(args.model), return_config=True)
    data = mx.array(_calibration(args.model, args.samples, args.seq_len).tokens)
    mx.random.seed(123)
    return model, tok, config, data


def stage_gptq(args: argparse.Namespace, bits: str, fallback: str, dtype: str = "") -> None:
    """mlx-lm's GPTQ as its command runs it; ``f32``: on a float32 copy (its Hessians accumulate in
    the model's dtype, and in bf16 some came out not positive definite: NaN scales), saved in bf16."""
    import mlx.core as mx
    from mlx_lm.quant.gptq import gptq_quantize
    from mlx_lm.utils import save

    model, tok, config, data = _load_for_learned(args)
    if dtype == "f32":
        model.set_dtype(mx.float32)
    model, config["quantization"] = gptq_quantize(model, data, int(bits), 64, int(fallback), 64)
    if dtype == "f32":
        model.set_dtype(mx.bfloat16)
    save(str(args.dest), str(args.model), model, tok, config)


def stage_awq(args: argparse.Namespace, bits: str) -> None:
    from mlx_lm.quant.awq import AWQ_MODEL_CONFIGS, awq_quantize, update_config
    from mlx_lm.utils import save

    model, tok, config, data = _load_for_learned(args)
    awq_quantize(model, data, AWQ_MODEL_CONFIGS[config["model_type"]], bits=int(bits), group_size=64)
    save(str(args.dest), str(args.model), model, tok, update_config(model, config))


def stage_dq(args: argparse.Namespace, low: str, high: str, target: str) -> None:
    from mlx_lm.quant.dynamic_quant import estimate_sensitivities, estimate_threshold
    from mlx_lm.utils import quantize_model, save

    model, tok, config, data = _load_for_learned(args)
    lo, hi = int(low), int(high)
    sens = dict(estimate_sensitivities(model, data, lo, 64, hi, 64))
    thr = estimate_threshold(model, sens, float(target), lo, 64, hi, 64)

    def predicate(p, m):
        if not hasattr(m, "to_quantized"):
            return False
        return {"bits": hi, "group_size": 64} if sens[p] > thr else True

    model, config = quantize_model(model, config, group_size=64, bits=lo, quant_predicate=predicate)
    save(str(args.dest), str(args.model), model, tok, config)


def stage_sens(args: argparse.Namespace, method: str = "exact") -> None:
    from mlxbun.quant.sensitivity import sensitivity

    sensitivity(
        model_dir=args.model, out_dir=args.dest, work_dir=args.dest / "cache", bits=EXACT_BITS, group_size=64,
        samples=args.samples, seq_len=args.seq_len, batch_size=8, method=method,
    )  # fmt: skip


def stage_errors(args: argparse.Namespace) -> None:
    """Input Hessians on the calibration tokens, then every module's output error per candidate."""
    import mlx.core as mx

    from mlxbun.quant import hessian, rounding
    from mlxbun.quant.probe import load_model, source_dtypes

    model, _, _ = load_model(args.model)
    h = hessian.capture(model, _calibration(args.model, args.samples, args.seq_len).tokens)
    args.dest.mkdir(parents=True, exist_ok=True)
    hessian.save(h, args.dest / "hessians.safetensors", tokens=args.samples * args.seq_len)
    dtypes = source_dtypes(args.model)
    errors: dict[str, dict[str, float]] = {}
    for path, mod in model.named_modules():
        if not hasattr(mod, "to_quantized") or "weight" not in mod:
            continue
        w = mod.weight.astype(getattr(mx, dtypes.get(path, "bfloat16")))
        ref, hm = w.astype(mx.float32), h.get(path)
        for bits, group in SETTINGS:
            if w.shape[-1] % group:
                continue
            for method in METHODS:
                parts = rounding.quantize(w, bits=bits, group_size=group, method=method, hessian=hm)
                dw = mx.dequantize(*parts, group_size=group, bits=bits).astype(mx.float32) - ref
                err = hessian.output_error(dw, hm) if hm is not None else float(mx.sum(dw * dw))
                errors.setdefault(path, {})[f"{method}:{bits}:{group}"] = err
    (args.dest / "errors.json").write_text(json.dumps(errors, indent=1, sort_keys=True))


def stage_mxerrors(args: argparse.Namespace) -> None:
    """Output errors of the microscaling modes and of RTN at the same bits, g64 (their reference)."""
    import mlx.core as mx

    from mlxbun.quant import hessian
    from mlxbun.quant.probe import load_model, source_dtypes

    model, _, _ = load_model(args.model)
    h = hessian.capture(model, _calibration(args.model, args.samples, args.seq_len).tokens)
    dtypes, errors = source_dtypes(args.model), {}
    for path, mod in model.named_modules():
        if not hasattr(mod, "to_quantized") or "weight" not in mod:
            continue
        w = mod.weight.astype(getattr(mx, dtypes.get(path, "bfloat16")))
        ref, hm = w.astype(mx.float32), h.get(path)
        for mode, bits, group in [*MX_SETTINGS, ("affine", 4, 64), ("affine", 8, 64)]:
            if w.shape[-1] % group == 0:
                parts = mx.quantize(w, group, bits, mode=mode)
                dw = mx.dequantize(*parts, group_size=group, bits=bits, mode=mode).astype(mx.float32) - ref
                err = hessian.output_error(dw, hm) if hm is not None else float(mx.sum(dw * dw))
                errors.setdefault(path, {})[f"{mode}:{bits}:{group}"] = err
    args.dest.mkdir(parents=True, exist_ok=True)
    (args.dest / "errors.json").write_text(json.dumps(errors, indent=1, sort_keys=True))


def stage_hessians(args: argparse.Namespace) -> None:
    from mlxbun.quant.calibrate import calibrate

    calibrate(model_dir=args.model, out_dir=args.dest, samples=args.samples, seq_len=args.seq_len)


STAGES = {
    "convert": stage_convert, "gptq": stage_gptq, "awq": stage_awq, "dq": stage_dq, "sens": stage_sens,
    "errors": stage_errors, "mxerrors": stage_mxerrors, "hessians": stage_hessians,
}  # fmt: skip


def child(spec: str, model: Path, dest: Path, args: argparse.Namespace) -> dict:
    """Run one stage in a fresh process; its wall time and peak RSS."""
    cmd = [sys.executable, __file__, "--stage", spec, "--model", str(model), "--dest", str(dest)]
    cmd += ["--samples", str(args.samples), "--seq-len", str(args.seq_len)]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if out.returncode:
        sys.stderr.write(out.stderr[-4000:])
        raise SystemExit(f"stage {spec} failed")
    return {"seconds": seconds, **json.loads(out.stdout.strip().splitlines()[-1])}


# ------------------------------------------------------------------------------- evaluation


class Evaluator:
    """Reference log-probs once per token set; KL of any quantized model directory against them."""

    def __init__(self, model_dir: Path, token_sets: dict) -> None:
        import mlx.core as mx

        from mlxbun.kl import log_probs
        from mlxbun.quant.probe import load_model

        ref, _, _ = load_model(model_dir)
        self.sets = {}
        for name, tokens in token_sets.items():
            batches = [mx.array(tokens[i : i + 8]) for i in range(0, len(tokens), 8)]
            refs = [np.asarray(log_probs(ref(b))) for b in batches]
            self.sets[name] = (batches, refs, len(tokens))

    def kl(self, model_dir: Path, names: tuple[str, ...] = ("calib", "held_out")) -> dict[str, float]:
        from mlxbun.kl import kl_rows
        from mlxbun.quant.probe import load_model

        cur, _, _ = load_model(model_dir)
        out = {}
        for name in names:
            batches, refs, n = self.sets[name]
            rows = [
                np.asarray(kl_rows(r, cur(b)), dtype=np.float64) for b, r in zip(batches, refs, strict=True)
            ]
            out[name] = float(sum(r.sum() for r in rows)) / n
        return out


def held_out_text(work: Path, model: Path) -> Path:
    """The HELD_OUT CPython modules as one text file; refuses a model trained on any of them."""
    record = model / "FIXTURE.json"
    corpus = (
        {Path(c["file"]) for c in json.loads(record.read_text())["corpus"]} if record.is_file() else set()
    )
    files = [STDLIB / f"{m}.py" for m in HELD_OUT]
    seen = sorted(str(f) for f in files if f in corpus)
    if seen:
        raise SystemExit(f"{record}: the held-out text {seen} is in the model's training corpus")
    path = work / "held_out.txt"
    path.write_text("\n\n".join(f.read_text(errors="replace") for f in files))
    return path


def _size(model_dir: Path, parameters: int) -> dict:
    from mlxbun.quant import budget

    size = budget.measure(model_dir, parameters=parameters)
    return {"file_bytes": size.file_bytes, "bpw": size.bpw}


class Fixture:
    """One model: its anchors, sensitivities, evaluator and mlxbun plans."""

    def __init__(self, model: Path, args: argparse.Namespace) -> None:
        from mlx_lm.tokenizer_utils import load as load_tokenizer

        from mlxbun.quant import budget
        from mlxbun.quant.calib import load_calibration

        self.model, self.args = model, args
        self.work = args.work / model.name
        self.work.mkdir(parents=True, exist_ok=True)
        self.source = budget.read_source(model)
        tok = load_tokenizer(model)
        calib = load_calibration(tokenizer=tok, samples=args.samples, seq_len=args.seq_len, seed=0)
        held = load_calibration(
            tokenizer=tok,
            path=held_out_text(self.work, model),
            samples=args.eval_samples,
            seq_len=args.seq_len,
            seed=1,
        )
        # Probes of the objective's corrections are scored on other windows of the calibration text
        # (neither the tokens the estimates saw nor the held-out text).
        check = load_calibration(tokenizer=tok, samples=args.samples, seq_len=args.seq_len, seed=2)
        self.eval = Evaluator(model, {"calib": calib.tokens, "held_out": held.tokens, "check": check.tokens})
        self.n = 0
        self.anchors: dict[str, dict] = {}

    def stage(self, spec: str, name: str) -> tuple[Path, dict]:
        """Run one child stage writing into work/<name> (reused when it finished before)."""
        dest = self.work / name
        record = dest.with_suffix(".stage.json")
        if record.is_file():
            return dest, json.loads(record.read_text())
        shutil.rmtree(dest, ignore_errors=True)
        stats = child(spec, self.model, dest, self.args)
        record.write_text(json.dumps(stats))
        return dest, stats

    def anchor(self, label: str, spec: str) -> dict:
        if label not in self.anchors:
            dest, stats = self.stage(spec, "anchor-" + spec.replace(":", "_"))
            row = {"label": label, "seconds": stats["seconds"], **_size(dest, self.source.parameters)}
            self.anchors[label] = row | self.eval.kl(dest)
        return self.anchors[label]

    def sensitivities(self) -> dict:
        from mlxbun.quant.sensitivity_file import load_sensitivity

        sens_dir, sens_stats = self.stage(f"sens:{self.args.sens_method}", "sens")
        err_dir, err_stats = self.stage("errors", "errors")
        mx_dir, mx_stats = self.stage("mxerrors", "mxerrors")
        self.exact = load_sensitivity(sens_dir / "sensitivity.json")
        self.errors = json.loads((err_dir / "errors.json").read_text())
        self.mxerrors = json.loads((mx_dir / "errors.json").read_text())
        self.hessians = err_dir / "hessians.safetensors"
        self.seconds = {
            "sens": sens_stats["seconds"],
            "errors": err_stats["seconds"] + mx_stats["seconds"],
            "probes": 0.0,
        }
        self.factors: dict[str, float] = {}
        return self.seconds

    def estimated(self, family: str):
        """Per-module KL of every candidate of ``family``: exact RTN KL at (bits, g64) x the
        candidate's output error / RTN's at (bits, g64), the errors on the calibration inputs."""
        from mlxbun.quant.sensitivity_file import LayerSensitivity, Sensitivity
        from mlxbun.quant.spec import QuantSpec

        methods, groups, modes, _ = FAMILIES[family]
        layers = {}
        for path, layer in self.exact.layers.items():
            err, mxe, kl = self.errors[path], self.mxerrors.get(path, {}), {}
            for bits, group in SETTINGS:
                exact, base = layer.kl.get(QuantSpec(bits=bits, group_size=64)), err.get(f"rtn:{bits}:64")
                for method in methods:
                    key = f"{method}:{bits}:{group}"
                    if group in groups and key in err and exact is not None:
                        spec = QuantSpec(bits=bits, group_size=group, method=method)
                        kl[spec] = exact * err[key] / base if base else exact
            for mode, bits, group in MX_SETTINGS:
                exact, base = layer.kl.get(QuantSpec(bits=bits, group_size=64)), mxe.get(f"affine:{bits}:64")
                if mode in modes and f"{mode}:{bits}:{group}" in mxe and exact is not None:
                    kl[QuantSpec(mode=mode)] = exact * mxe[f"{mode}:{bits}:{group}"] / base if base else exact
            layers[path] = LayerSensitivity(path, layer.params, kl)
        e = self.exact
        return Sensitivity(layers, e.model_fingerprint, e.calibration_fingerprint, e.path, e.calibration)

    def quantize(self, plan: dict) -> tuple[Path, float]:
        """Write ``plan`` (plan.json's dict), quantize with it; the model dir and the seconds it took."""
        from mlxbun.io.atomic import atomic_write_json
        from mlxbun.quant.quantize import quantize_model_dir

        self.n += 1
        path = self.work / "plans" / f"{self.n:03d}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, plan)
        out = self.work / "models" / f"{self.n:03d}"
        shutil.rmtree(out, ignore_errors=True)
        t0 = time.perf_counter()
        res = quantize_model_dir(
            self.model, out, dtype="bfloat16", partial_root=self.work / "partial", plan=path,
            hessians=self.hessians,
        )  # fmt: skip
        return res.out, time.perf_counter() - t0

    def correct(self, family: str, limit: int) -> list[dict]:
        """Per-quantizer factors from whole-model probes around the family's plan at ``limit``."""
        from mlxbun.quant.allocate import DEFAULT, allocate
        from mlxbun.quant.check import correction_factors
        from mlxbun.quant.spec import Plan

        t0 = time.perf_counter()
        sens = self.estimated(family)
        plan = allocate(sens, model_dir=self.model, budget_bytes=limit)

        def measure(layers) -> float:
            out, _ = self.quantize(Plan(default=DEFAULT, layers=layers).to_dict())
            return self.eval.kl(out, ("check",))["check"]

        probes = correction_factors(plan.layers, lambda p, s: sens.layers[p].kl.get(s), measure)
        self.factors = {p.key: p.factor for p in probes}
        self.seconds["probes"] = time.perf_counter() - t0
        return [p.to_json() for p in probes]

    def plan(self, family: str, limit: int) -> dict:
        """mlxbun's knapsack for one family at ``limit`` bytes, quantized and measured."""
        from mlxbun.quant.allocate import allocate
        from mlxbun.quant.check import rescaled

        t0 = time.perf_counter()
        exact = family == "mlxbun RTN g64"
        sens = self.exact if exact else self.estimated(family)
        if FAMILIES[family][3]:
            sens = rescaled(sens, self.factors)
        plan = allocate(sens, model_dir=self.model, budget_bytes=limit)
        out, _ = self.quantize(plan.to_json())
        seconds = time.perf_counter() - t0 + self.seconds["sens"]
        seconds += (
            0 if exact else self.seconds["errors"] + (self.seconds["probes"] if FAMILIES[family][3] else 0)
        )
        row = {"label": family, "seconds": seconds, **_size(out, self.source.parameters)}
        assert row["file_bytes"] == plan.size.file_bytes, "predicted size != written size"
        methods: dict[str, int] = {}
        for c in plan.choices.values():
            if c.setting is not None:
                k = f"{c.setting.mode if c.setting.mode != 'affine' else c.setting.method}"
                methods[k] = methods.get(k, 0) + 1
        return row | self.eval.kl(out) | {"predicted_kl_sum": plan.kl_sum, "methods": methods}


def run_fixture(model: Path, args: argparse.Namespace) -> dict:
    fx = Fixture(model, args)
    wanted = [w for w in args.only.split(",") if w]
    anchors = {k: v for k, v in ANCHORS.items() if not wanted or any(v.startswith(w) for w in wanted)}
    anchors = {k: v for k, v in anchors.items() if v not in args.skip.split(",")}
    specs = {"errors": "errors", f"sens:{args.sens_method}": "sens", "mxerrors": "mxerrors"}
    specs |= {spec: "anchor-" + spec.replace(":", "_") for spec in anchors.values()}
    specs = dict(
        sorted(specs.items(), key=lambda kv: not kv[0].startswith(("awq", "errors")))
    )  # longest first
    with ThreadPoolExecutor(args.parallel) as pool:  # every child stage, --parallel at a time
        list(pool.map(lambda kv: fx.stage(*kv), specs.items()))
    if args.stages_only:
        return {}
    stage_secs = fx.sensitivities()
    print(f"{model.name}: stages {stage_secs}", flush=True)
    families = [f for f in FAMILIES if not args.families or f in args.families.split(";")]
    corrected = [f for f in families if FAMILIES[f][3]]
    probes = (
        fx.correct(corrected[0], fx.anchor(PROBE_AT, ANCHORS[PROBE_AT])["file_bytes"]) if corrected else []
    )
    print(f"{model.name}: probes {json.dumps(probes)}", flush=True)
    groups = []
    for label, spec in anchors.items():
        anchor = fx.anchor(label, spec)
        rows = [anchor] + [fx.plan(f, anchor["file_bytes"]) for f in families]
        groups.append(rows)
        print(f"{model.name}: {label} {json.dumps(rows)}", flush=True)
    return {
        "model": str(model),
        "parameters": fx.source.parameters,
        "stage_seconds": fx.seconds,
        "probes": probes,
        "families": families,
        "groups": groups,
    }


def run_uniform(model: Path, args: argparse.Namespace) -> list[str]:
    """Same bits, same bytes: mlx-lm convert q3/q4 against mlxbun's quantize with each method."""
    from mlxbun.quant.quantize import quantize_model_dir

    fx = Fixture(model, args)
    hdir, hstats = fx.stage("hessians", "hessians")
    lines = [f"## {_rel(str(model))}: uniform bits, each method (held-out KL, ratio to mlx-lm)", ""]
    lines += [
        f"Hessians: {hstats['seconds']:.0f} s.",
        "",
        "| bits | mlx-lm | rtn | clip | gptq |",
        "|---|---:|---:|---:|---:|",
    ]
    for bits in (3, 4):
        anchor = fx.anchor(f"mlx-lm q{bits}", f"convert:{bits}:64:")
        cells = []
        for method in ("rtn", "clip", "gptq"):
            kw = {} if method == "rtn" else {"method": method, "hessians": hdir / "hessians.safetensors"}
            out = fx.work / "uniform" / f"{bits}-{method}"
            shutil.rmtree(out, ignore_errors=True)
            t0 = time.perf_counter()
            res = quantize_model_dir(
                model, out, bits=bits, group_size=64, partial_root=fx.work / "partial", **kw
            )
            kl = fx.eval.kl(res.out)["held_out"]
            size = _size(res.out, fx.source.parameters)["file_bytes"]
            cells.append(
                f"{kl:.5f} ({kl / anchor['held_out']:.2f}; {time.perf_counter() - t0:.0f} s; {size} B)"
            )
        lines.append(
            f"| {bits} | {anchor['held_out']:.5f} ({anchor['file_bytes']} B) | " + " | ".join(cells) + " |"
        )
    return lines + [""]


# ------------------------------------------------------------------------------- report


def _rel(p: str) -> str:
    path = Path(p)
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def _fixture_lines(res: dict) -> list[str]:
    fams = res.get("families", list(FAMILIES))
    lines = [f"## {_rel(res['model'])} ({res['parameters'] / 1e6:.2f}M parameters)", ""]
    secs = res["stage_seconds"]
    lines += [
        f"mlxbun stages (wall s): sensitivity (RTN g64, bits {EXACT_BITS}) {secs['sens']:.0f};"
        f" Hessians + output errors of {len(SETTINGS)} settings x {len(METHODS)} methods and"
        f" {len(MX_SETTINGS)} microscaling modes {secs['errors']:.0f}; correction probes {secs['probes']:.0f}.",
        "",
    ]
    head = "| anchor (size of) | bytes | anchor s | anchor KL held-out | " + " | ".join(
        f"{f}: KL held-out (ratio)" for f in fams
    )
    lines += [head + " |", "|---|---:|---:|---:|" + "---:|" * len(fams)]
    for rows in res["groups"]:
        a = rows[0]
        cells = [f"{r['held_out']:.5f} ({r['held_out'] / a['held_out']:.2f})" for r in rows[1:]]
        lines.append(
            f"| {a['label']} | {a['file_bytes']} | {a['seconds']:.0f} | {a['held_out']:.5f} | "
            + " | ".join(cells)
            + " |"
        )
    lines += ["", f"Correction probes (at the size of {PROBE_AT}; KL on other calibration windows):", ""]
    lines += ["| quantizer | modules | predicted KL | measured KL | factor |", "|---|---:|---:|---:|---:|"]
    for p in res.get("probes", []):
        lines.append(
            f"| {p['key']} | {p['modules']} | {p['predicted']:.5f} | {p['measured']:.5f} | {p['factor']:.2f} |"
        )
    lines += ["", "Every row in full (KL on calibration / held-out tokens):", ""]
    lines += [
        "| at size of | method | bytes | bpw | s | KL calib | KL held-out | predicted KL sum | modules by quantizer |"
    ]
    lines += ["|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for rows in res["groups"]:
        for r in rows:
            pred = f"{r['predicted_kl_sum']:.5f}" if "predicted_kl_sum" in r else ""
            used = " ".join(f"{k} {v}" for k, v in sorted(r.get("methods", {}).items()))
            lines.append(
                f"| {rows[0]['label']} | {r['label']} | {r['file_bytes']} | {r['bpw']:.3f} | {r['seconds']:.0f} |"
                f" {r['calib']:.5f} | {r['held_out']:.5f} | {pred} | {used} |"
            )
    return lines + [""]


def report(args: argparse.Namespace, results: list[dict], seconds: float) -> str:
    import mlx.core as mx

    models = " ".join(f"--model {_rel(r['model'])}" for r in results)
    lines = [
        "# Quality at equal bytes (bench/allocation_quality.py)",
        "",
        f"Command: `.venv/bin/python bench/allocation_quality.py {models} --samples {args.samples}"
        f" --seq-len {args.seq_len} --eval-samples {args.eval_samples} --sens-method {args.sens_method}"
        + "".join(f" --{k} {v}" for k, v in (("families", args.families), ("skip", args.skip)) if v)
        + "`  ",
        f"Machine: 2-core x86_64 Linux, mlx {mx.__version__} CPU, shared with other jobs (times are noisy)."
        f" Total {seconds:.0f} s.",
        "",
        "KL = KL(reference || quantized) of next-token distributions, mean over tokens; `calib` = the"
        f" {args.samples} x {args.seq_len} calibration tokens (mlxbun's built-in set) that mlxbun's"
        " sensitivity and mlx-lm's GPTQ/AWQ/dynamic_quant all saw; `held_out` ="
        f" {args.eval_samples} x {args.seq_len} tokens of CPython modules outside the fixtures' training"
        " text. Bytes = the `.safetensors` files on disk. Each mlxbun plan is solved at the anchor's"
        " bytes (never above); ratio = mlxbun held-out KL / anchor held-out KL (below 1: mlxbun"
        " better). `mlxbun RTN g64`: bits only, measured KL; `mlxbun all`: per module any of bits x"
        " group 32/64/128 x rtn/clip/gptq, or mxfp4/nvfp4/mxfp8 (KL estimated from output errors);"
        " `corrected`: the same candidates with each quantizer's estimates rescaled by a whole-model"
        " probe (`mlxbun.quant.check`). Anchor seconds = its whole child process; mlxbun seconds ="
        " its sensitivity + error stages (+ probes) + allocate + quantize.",
        "",
    ]
    for res in results:
        lines += _fixture_lines(res)
    return "\n".join(lines)


def _combine(runs: list[list[dict]]) -> list[dict]:
    order = {label: i for i, label in enumerate(ANCHORS)}
    merged: dict[str, dict] = {}
    for run in runs:
        for res in run:
            into = merged.setdefault(res["model"], {**res, "groups": []})
            into["groups"] += res["groups"]
    for res in merged.values():
        res["groups"].sort(key=lambda rows: order[rows[0]["label"]])
    return list(merged.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, action="append", default=None)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--eval-samples", type=int, default=16, help="held-out windows of --seq-len tokens")
    ap.add_argument("--work", type=Path, default=Path("/tmp/mlxbun-bench-allocate"))
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "allocate.md")
    ap.add_argument("--stage", default=None, help="(internal) run one child stage")
    ap.add_argument("--dest", type=Path, default=None, help="(internal) the child stage's output")
    ap.add_argument(
        "--only",
        default="",
        help="anchors whose spec starts with one of these, e.g. convert:3,gptq (default: all)",
    )
    ap.add_argument("--combine", nargs="*", type=Path, help="report from these results.json files only")
    ap.add_argument("--uniform", action="store_true", help="only uniform q3/q4 per method (no allocation)")
    ap.add_argument("--reuse", action="store_true", help="keep --work: finished stages are reused")
    ap.add_argument(
        "--sens-method", default="exact", choices=("exact", "fisher"), help="mlxbun's sensitivity"
    )
    ap.add_argument("--parallel", type=int, default=2, help="child stages at once")
    ap.add_argument("--stages-only", action="store_true", help="run the child stages, no report")
    ap.add_argument("--families", default="", help="FAMILIES labels separated by ; (default: all)")
    ap.add_argument("--skip", default="", help="anchor specs left out (comma-separated, exact)")
    args = ap.parse_args()
    models = [m.resolve() for m in (args.model or [REPO / "tests" / "fixtures" / "llama-text-3m"])]
    if args.stage:
        args.model = models[0]
        from mlxbun import blas

        blas.load()  # every method's f32 matmuls go through the same BLAS
        kind, *rest = args.stage.split(":")
        STAGES[kind](args, *rest)
        print(json.dumps({"peak_rss_mb": peak_rss_mb()}))
        return
    from mlxbun import blas

    blas.load()
    t0 = time.perf_counter()
    if not args.reuse:
        shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True, exist_ok=True)
    if args.uniform:
        text = "\n".join(line for m in models for line in run_uniform(m, args))
        args.out.write_text(text)
        print(text)
        return
    if args.combine:  # one report from the results.json of runs over parts of the anchors
        results = _combine([json.loads(Path(p).read_text()) for p in args.combine])
    else:
        results = [run_fixture(m, args) for m in models]
        if args.stages_only:
            return
    (args.work / "results.json").write_text(json.dumps(results, indent=1))
    text = report(args, results, time.perf_counter() - t0)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
