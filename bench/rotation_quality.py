"""Rotation quality: KL to the bf16 reference of 4- and 3-bit uniform quantization, with and without R1.

Run: .venv/bin/python bench/rotation_quality.py [--preset tiny] [--outlier-scale 5] [--samples 8] [--seq-len 128]
         [--fixture tests/fixtures/llama-text-3m] [--out bench/results/rotate.md]

For each model (synthetic llamas without and with planted outlier channels; the trained fixture
when its weights are present):

1. rotate (child process, wall time and peak RSS): ``mlxbun.rotate.command.rotate_model_dir``, seed 0,
   verified against the source.
2. quantize the source and the rotated model at 4 and 3 bits, affine g64, with the anchor
   ``mlx_lm.convert`` (child processes, wall time and peak RSS), so both sides use the same
   quantizer and only the rotation differs.
3. KL(reference ‖ model) in float32, mean over tokens, on ``samples × seq_len`` tokens of the
   built-in calibration text (``mlxbun.quant.calibration``), every model loaded with ``mlx_lm.load``.

Writes ``bench/results/rotate.md``. Timings are noisy: the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

BITS = (4, 3)
GROUP = 64
# Planted outliers: none (control), large activations in 8 residual channels (embedding columns,
# o_proj/down_proj rows), and those plus large input columns of every q/k/v/gate/up.
TARGETS = ("none", "activations", "both")


def run_child(code: str) -> tuple[float, float, str]:
    """Run ``code`` in a fresh Python; (seconds, the child's own peak RSS in MB via wait4, stdout)."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True
        )
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode:
            err.seek(0)
            raise RuntimeError(f"child failed ({proc.returncode}): {err.read()[-2000:]}")
    return time.perf_counter() - t0, usage.ru_maxrss / 1024, out


def rotate_child(src: Path, out: Path) -> dict:
    code = (
        "from mlxbun import blas; blas.load()\n"
        "import json\n"
        "from mlxbun.rotate.command import rotate_model_dir\n"
        f"r = rotate_model_dir({str(src)!r}, {str(out)!r}, seed=0)\n"
        "print(json.dumps(r.verify.to_dict() if r.verify else None))\n"
    )
    seconds, rss, out_text = run_child(code)
    return {"seconds": seconds, "peak_rss_mb": rss, "verify": json.loads(out_text.strip().splitlines()[-1])}


def convert_child(src: Path, out: Path, bits: int) -> dict:
    code = (
        "from mlx_lm import convert\n"
        f"convert({str(src)!r}, mlx_path={str(out)!r}, quantize=True, q_bits={bits}, q_group_size={GROUP})\n"
    )
    seconds, rss, _ = run_child(code)
    return {"seconds": seconds, "peak_rss_mb": rss}


def calibration_tokens(model: Path, samples: int, seq_len: int):
    from mlx_lm import load

    from mlxbun.quant.calibration import load_calibration

    _, tokenizer = load(str(model))
    return load_calibration(tokenizer=tokenizer, samples=samples, seq_len=seq_len, seed=0).tokens


def logprobs(model_dir: Path, tokens) -> list:
    """Log-probabilities per sample (the model computes in its own dtype; see mlxbun.kl)."""
    import mlx.core as mx
    from mlx_lm import load

    from mlxbun.kl import log_probs

    model, _ = load(str(model_dir))
    return [log_probs(model(mx.array(row)[None])[0]) for row in tokens]


def kl(ref: list, cur: list) -> float:
    """Mean over tokens of KL(ref ‖ cur) (float64, mlxbun.kl)."""
    from mlxbun.kl import kl_logp

    total = sum(float(kl_logp(p, q)) * p.shape[0] for p, q in zip(ref, cur, strict=True))
    return total / sum(p.shape[0] for p in ref)


def evaluate(name: str, src: Path, work: Path, samples: int, seq_len: int) -> dict:
    rot = work / f"{name}-rot"
    result = {"model": name, "rotate": rotate_child(src, rot), "kl": {}, "convert": {}}
    tokens = calibration_tokens(src, samples, seq_len)
    ref = logprobs(src, tokens)
    result["kl"]["rotated bf16"] = kl(ref, logprobs(rot, tokens))
    for bits in BITS:
        for label, model in (("plain", src), ("rotated", rot)):
            out = work / f"{name}-{label}-q{bits}"
            result["convert"][f"{label} q{bits}"] = convert_child(model, out, bits)
            result["kl"][f"{label} q{bits}"] = kl(ref, logprobs(out, tokens))
            shutil.rmtree(out)
        print(f"{name}: {bits}-bit KL plain {result['kl'][f'plain q{bits}']:.4f} "
              f"rotated {result['kl'][f'rotated q{bits}']:.4f}", flush=True)  # fmt: skip
    return result


def synth_model(work: Path, preset: str, target: str, scale: float) -> Path:
    from mlxbun.synth.write import synthesize

    channels = 0 if target == "none" else 8
    return synthesize(
        work / f"synth-{preset}-{target}", arch="llama", preset=preset, dtype="bfloat16",
        outlier_channels=channels, outlier_scale=scale, outlier_target="both" if target == "none" else target,
    )  # fmt: skip


def scale_run(work: Path, preset: str, layers: int) -> dict:
    """Rotate a larger synthetic model (256 MiB shards, no verify) beside mlx_lm.convert -q of it."""
    from mlxbun.synth.write import synthesize

    src = synthesize(work / "scale", arch="llama", preset=preset, dtype="bfloat16", num_layers=layers)
    nbytes = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    code = (
        "from mlxbun import blas; blas.load()\n"
        "from mlxbun.rotate.command import rotate_model_dir\n"
        f"rotate_model_dir({str(src)!r}, {str(work / 'scale-rot')!r}, seed=0, shard_bytes=256 << 20, verify=False)\n"
    )
    seconds, rss, _ = run_child(code)
    anchor = convert_child(src, work / "scale-q4", 4)
    return {"preset": preset, "layers": layers, "bytes": nbytes, "rotate": {"seconds": seconds, "peak_rss_mb": rss},
            "convert": anchor}  # fmt: skip


def scale_lines(scale: dict) -> list[str]:
    r, c = scale["rotate"], scale["convert"]
    return [
        "",
        f"Scale: synth llama preset {scale['preset']} with {scale['layers']} layers, "
        f"{scale['bytes'] / 1e9:.2f} GB bf16; rotate with 256 MiB shards, no verify.",
        "",
        "| step | seconds | peak RSS MB | GB/s of bf16 input |",
        "|---|---|---|---|",
        f"| mlxbun rotate (float64 fold) | {r['seconds']:.1f} | {r['peak_rss_mb']:.0f} | "
        f"{scale['bytes'] / r['seconds'] / 1e9:.3f} |",
        f"| anchor: mlx_lm.convert -q 4-bit g64 | {c['seconds']:.1f} | {c['peak_rss_mb']:.0f} | "
        f"{scale['bytes'] / c['seconds'] / 1e9:.3f} |",
        f"| ratio rotate / convert | {r['seconds'] / c['seconds']:.2f} | {r['peak_rss_mb'] / c['peak_rss_mb']:.2f} | |",
    ]


def report(results: list[dict], args: argparse.Namespace, seconds: float, scale: dict | None) -> str:
    flags = f"--preset {args.preset} --samples {args.samples} --seq-len {args.seq_len} --outlier-scale {args.outlier_scale}"
    if args.scale_preset:
        flags += f" --scale-preset {args.scale_preset} --scale-layers {args.scale_layers}"
    flags += " --skip-quality" if args.skip_quality else ""
    lines = [
        "# Rotation quality (R1 fold) — KL to the bf16 reference, uniform affine g64",
        "",
        f"Command: `.venv/bin/python bench/rotation_quality.py {flags}`  ",
        f"Machine: 2-core {platform.machine()} Linux (shared, noisy), mlx {_version('mlx')} CPU, "
        f"mlx-lm {_version('mlx-lm')}. Total {seconds:.0f} s.",
    ]
    if results:
        lines += quality_lines(results, args)
    if scale is not None:
        lines += scale_lines(scale)
    return "\n".join(lines) + "\n"


def quality_lines(results: list[dict], args: argparse.Namespace) -> list[str]:
    lines = [
        "",
        f"Tokens: {args.samples} × {args.seq_len} of the built-in calibration text; KL in float32, mean per "
        "token. Quantizer for both sides: the anchor `mlx_lm.convert` (so only the rotation differs).",
        "",
        "| model | bits | KL plain | KL rotated | ratio rotated/plain | rotation |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        for bits in BITS:
            p, q = r["kl"][f"plain q{bits}"], r["kl"][f"rotated q{bits}"]
            verdict = "lowers KL" if q < p else "raises KL"
            lines.append(f"| {r['model']} | {bits} | {p:.4f} | {q:.4f} | {q / p:.2f} | {verdict} |")
    lines += ["", "| model | rotation alone: KL rotated bf16 | rotate s | rotate peak RSS MB | "
              "convert (plain q4) s | convert peak RSS MB |", "|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        c = r["convert"]["plain q4"]
        lines.append(
            f"| {r['model']} | {r['kl']['rotated bf16']:.2e} | {r['rotate']['seconds']:.1f} | "
            f"{r['rotate']['peak_rss_mb']:.0f} | {c['seconds']:.1f} | {c['peak_rss_mb']:.0f} |"
        )
    return lines


def _version(pkg: str) -> str:
    from importlib.metadata import version

    return version(pkg)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--outlier-scale", type=float, default=5.0)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--fixture", type=Path, default=REPO / "tests" / "fixtures" / "llama-text-3m")
    ap.add_argument("--scale-preset", default=None, help="also time rotate on this synth preset (e.g. 1b)")
    ap.add_argument("--scale-layers", type=int, default=4)
    ap.add_argument("--skip-quality", action="store_true", help="only the scale run (with --scale-preset)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "rotate.md")
    args = ap.parse_args()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rotation-quality-") as tmp:
        work = Path(tmp)
        models = [] if args.skip_quality else [
            (f"synth llama {args.preset}, " + ("no outliers" if t == "none" else f"8 {t} outlier channels ×{args.outlier_scale:g}"),
             synth_model(work, args.preset, t, args.outlier_scale))
            for t in TARGETS
        ]  # fmt: skip
        if (args.fixture / "config.json").is_file() and not args.skip_quality:
            models.append(("trained fixture " + args.fixture.name, args.fixture))
        elif not args.skip_quality:
            print(f"no trained fixture at {args.fixture}; skipped", flush=True)
        results = [evaluate(f"m{i}", src, work, args.samples, args.seq_len) | {"model": name}
                   for i, (name, src) in enumerate(models)]  # fmt: skip
        scale = scale_run(work, args.scale_preset, args.scale_layers) if args.scale_preset else None
    text = report(results, args, time.perf_counter() - t0, scale)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
