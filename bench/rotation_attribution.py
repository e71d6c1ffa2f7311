"""Where rotation's quantization error comes from: KL per quantized part, and gain vs activations.

Run: .venv/bin/python bench/rotation_attribution.py [--model tests/fixtures/llama-text-3m]
         [--samples 8] [--seq-len 128] [--seed 0] [--out bench/results/rotate_attribution.md]

Three versions of one llama-family model that compute the same function:

* plain:    the source. A tied head is evaluated untied (lm_head = the embedding) so that the two
            can be quantized separately; quantizing both gives exactly the tied model's result.
* fold:     every RMSNorm gain folded into the linears after it, norms set to 1 (R1 = I).
* fold+R1:  what ``mlxbun.rotate.command.rotate_model_dir`` writes (seed 0): the fold plus R1.

Each is fake-quantized (``nn.quantize``: affine, group 64, bf16 storage) one part at a time —
embedding, lm_head, attention, MLP, everything — at 4 and 3 bits; the table gives KL(bf16 source ‖
quantized) per token on ``samples × seq_len`` tokens of the built-in calibration text.

Second table, per RMSNorm, from the source's float32 forward on the same tokens: the normalized
input x̂ (before the gain g) and ``ratio = Σ_j g_j²·E[x̂_j²] / (mean(g²)·Σ_j E[x̂_j²])``. A
quantized linear after the norm sees its weight error weighted by g in the source model, but by
x̂ alone once g is folded in and R1 has spread x̂'s large channels over all of them. ratio < 1
(large activations where the gain is small) predicts ~1/ratio more error in those linears.
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from mlxbun import blas  # noqa: E402

blas.load()

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import numpy as np  # noqa: E402

from mlxbun.kl import kl_logp, log_probs  # noqa: E402

GROUP = 64
BITS = (4, 3)
PARTS = {
    "embedding": lambda p: p == "model.embed_tokens",
    "lm_head": lambda p: p == "lm_head",
    "attention": lambda p: ".self_attn." in p,
    "mlp": lambda p: ".mlp." in p,
}
COLUMNS = [(name, (name,)) for name in PARTS] + [("all", tuple(PARTS))]
FOLDS = {"input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj")}  # fmt: skip


def load_dir(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    config = json.loads((path / "config.json").read_text())
    weights: dict[str, np.ndarray] = {}
    for f in sorted(path.glob("*.safetensors")):
        weights |= {k: np.asarray(v.astype(mx.float32)) for k, v in mx.load(str(f)).items()}
    if "lm_head.weight" not in weights:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"].copy()
    return config, weights


def fold_only(config: dict, w: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Fold every RMSNorm gain into the linears that read it (float64), R1 = I."""
    out = dict(w)
    for i in range(config["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        for norm, readers in FOLDS.items():
            g = w[pre + norm + ".weight"].astype(np.float64)
            for r in readers:
                out[pre + r + ".weight"] = (w[pre + r + ".weight"] * g[None, :]).astype(np.float32)
            out[pre + norm + ".weight"] = np.ones_like(g, dtype=np.float32)
    g = w["model.norm.weight"].astype(np.float64)
    out["lm_head.weight"] = (w["lm_head.weight"] * g[None, :]).astype(np.float32)
    out["model.norm.weight"] = np.ones_like(g, dtype=np.float32)
    return out


def build(config: dict, w: dict[str, np.ndarray], dtype=mx.bfloat16) -> nn.Module:
    family = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = family.Model(family.ModelArgs.from_dict(config | {"tie_word_embeddings": False}))
    model.load_weights([(k, mx.array(v).astype(dtype)) for k, v in w.items()])
    mx.eval(model.parameters())
    return model


def logprobs(model: nn.Module, tokens) -> list:
    return [log_probs(model(mx.array(row)[None])[0]) for row in tokens]


def kl(ref: list, cur: list) -> float:
    """Mean over tokens of KL(ref ‖ cur) (float64, mlxbun.kl)."""
    total = sum(float(kl_logp(p, q)) * p.shape[0] for p, q in zip(ref, cur, strict=True))
    return total / sum(p.shape[0] for p in ref)


def quantized(config: dict, w: dict[str, np.ndarray], bits: int, parts: tuple[str, ...]) -> nn.Module:
    model = build(config, w)
    nn.quantize(
        model,
        group_size=GROUP,
        bits=bits,
        class_predicate=lambda p, m: hasattr(m, "to_quantized") and any(PARTS[k](p) for k in parts),
    )
    mx.eval(model.parameters())
    return model


class Recorder(nn.Module):
    """Wraps an RMSNorm and keeps the per-channel sums of its normalized input squared."""

    def __init__(self, inner: nn.Module, eps: float):
        super().__init__()
        self.inner, self.eps = inner, eps
        self.sq: np.ndarray | None = None
        self.count = 0

    def __call__(self, x: mx.array) -> mx.array:
        x32 = x.astype(mx.float32).reshape(-1, x.shape[-1])
        xhat = x32 * mx.rsqrt(mx.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        s = np.asarray(mx.sum(xhat * xhat, axis=0), dtype=np.float64)
        self.sq = s if self.sq is None else self.sq + s
        self.count += xhat.shape[0]
        return self.inner(x)


def gain_alignment(config: dict, w: dict[str, np.ndarray], tokens) -> list[tuple[str, float, float, float]]:
    model = build(config, w, mx.float32)
    eps = config.get("rms_norm_eps", 1e-6)
    recs: dict[str, Recorder] = {}
    for i, layer in enumerate(model.model.layers):
        for norm in FOLDS:
            recs[f"model.layers.{i}.{norm}"] = Recorder(getattr(layer, norm), eps)
            setattr(layer, norm, recs[f"model.layers.{i}.{norm}"])
    recs["model.norm"] = model.model.norm = Recorder(model.model.norm, eps)
    for row in tokens:
        mx.eval(model(mx.array(row)[None]))
    rows = []
    for name, r in recs.items():
        energy = r.sq / r.count
        g2 = w[name + ".weight"].astype(np.float64) ** 2
        rms = np.sqrt(energy)
        rows.append((name, float(rms.max() / np.median(rms)), float(np.corrcoef(rms, np.sqrt(g2))[0, 1]),
                     float((g2 * energy).sum() / (g2.mean() * energy.sum()))))  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=REPO / "tests" / "fixtures" / "llama-text-3m")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0, help="calibration sample seed")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "rotate_attribution.md")
    args = ap.parse_args()
    t0 = time.time()
    from mlx_lm import load

    from mlxbun.quant.calibration import load_calibration
    from mlxbun.rotate.command import rotate_model_dir

    _, tokenizer = load(str(args.model))
    tokens = load_calibration(
        tokenizer=tokenizer, samples=args.samples, seq_len=args.seq_len, seed=args.seed
    ).tokens
    config, plain = load_dir(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        rotate_model_dir(args.model, Path(tmp) / "rot", seed=0)
        rot_config, rotated = load_dir(Path(tmp) / "rot")
    versions = {"plain": (config, plain), "fold (R1 = I)": (config, fold_only(config, plain)),
                "fold + R1 (mlxbun rotate)": (rot_config, rotated)}  # fmt: skip
    ref = logprobs(build(config, plain), tokens)
    lines = [
        "# Rotation attribution: KL per quantized part, gains vs activations",
        "",
        f"Command: `.venv/bin/python bench/rotation_attribution.py --model {args.model.relative_to(REPO)}"
        f" --samples {args.samples} --seq-len {args.seq_len} --seed {args.seed}`  ",
        f"Machine: 2-core x86_64 Linux, Python {platform.python_version()}, mlx {mx.__version__} CPU."
        " Fake quantization: affine, group 64, bf16 storage; KL per token to the bf16 source.",
        "",
        "| version | bits | unquantized (bf16) | " + " | ".join(c for c, _ in COLUMNS) + " |",
        "|---|---|---:|" + "---:|" * len(COLUMNS),
    ]
    for name, (cfg, w) in versions.items():
        base = kl(ref, logprobs(build(cfg, w), tokens))
        for bits in BITS:
            row = [kl(ref, logprobs(quantized(cfg, w, bits, parts), tokens)) for _, parts in COLUMNS]
            lines.append(f"| {name} | {bits} | {base:.5f} | " + " | ".join(f"{v:.4f}" for v in row) + " |")
            print(lines[-1], flush=True)
    lines += [
        "",
        "| RMSNorm | gain min–max | x̂ channel rms max/median | corr(channel rms, gain) | ratio |",
        "|---|---|---:|---:|---:|",
    ]
    for name, spread, corr, ratio in gain_alignment(config, plain, tokens):
        g = plain[name + ".weight"]
        lines.append(f"| {name} | {g.min():.2f}–{g.max():.2f} | {spread:.2f} | {corr:+.2f} | {ratio:.2f} |")
    lines += ["", f"Total {time.time() - t0:.0f} s."]
    text = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
