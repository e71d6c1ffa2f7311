"""Train the small llama and qwen3 fixtures in tests/fixtures/ from offline text, on the CPU.

Run: ``.venv/bin/python scripts/train_fixture.py [--preset llama-text-3m] [--steps 300]``

Presets (``--preset``): ``llama-text-3m`` (4 layers, the first fixture) and ``llama-text-12l``
(12 layers, hidden 256, MLP 384, one KV head, vocabulary 1536, ~5.9M parameters, 11.9 MB; a
corpus of 733K tokens with 16 more stdlib modules). The 12-layer preset's 400 steps (819K tokens
seen, more than the first fixture's 614K) take 9.5 min on a quiet 2-core machine.

``llama-narrow-6l`` (6 layers, hidden 64, MLP 256, vocabulary 4096, tied, 0.66M parameters) and
``llama-narrow-8l`` (8 layers, hidden 64, one KV head, vocabulary 3072, untied, 0.89M) are the
representative fixtures: narrow, 3000 steps of 2,048 tokens (6.1M tokens seen, about 7 per
parameter), high learning rate, no weight decay. On the built-in held-out text, mlx-lm q3 g64 costs
them what it costs real models (FIXTURE.json ``mlx_lm_kl`` records the measured held-out KL; q3
>= 0.2 and q4 >= 0.05 is the bar). Each takes about 35 min on one core of this 2-core machine.
``--lr`` and ``--weight-decay`` default to the preset's.

``qwen3-man-7l`` (qwen3: q/k norms, 4 query heads sharing 2 KV heads, 7 layers, hidden 64, MLP 192,
vocabulary 4096, tied, 0.69M parameters; 2400 steps, 4.9M tokens seen, about 7 per parameter) is
the confirmation fixture: another architecture trained on another domain, Debian's section-8 manual
pages (system administration commands) rendered to text by man-db at 80 columns, so that a default
chosen on the other fixtures is confirmed, never chosen, on it. Its training records mlx-lm's
held-out KL at q3/q4 every ``kl_every`` steps (a preset option), and at the end converts the saved
fixture with ``mlx_lm.convert`` at q2/q3/q4/q6 g64 and records their held-out KL.

The corpus is text that every Debian/Python machine carries: the licence texts in
``/usr/share/common-licenses`` and a fixed list of CPython 3.11 standard-library modules (English
docstrings and comments plus Python code). A byte-level BPE tokenizer (2048 tokens) is trained on
it with ``tokenizers``; a llama (llama-text-3m: 4 layers, hidden 256, ~3.3M parameters, tied
embeddings) is trained with AdamW in float32 and saved in bfloat16 so the fixture stays small::

    tests/fixtures/llama-text-3m/
        config.json  model.safetensors  model.safetensors.index.json
        tokenizer.json  tokenizer_config.json  special_tokens_map.json  FIXTURE.json

FIXTURE.json records the corpus files, their sha256, the settings and the loss curve, so the
weights have real structure (sensitivities differ by layer and module) instead of noise.
"""

from __future__ import annotations

import argparse
import copy
import gzip
import hashlib
import json
import math
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from mlxbun import blas  # noqa: E402

blas.load()

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten, tree_map  # noqa: E402
from mlx_lm.models import llama, qwen3  # noqa: E402

STDLIB = "/usr/lib/python3.11"
MODULES = (
    "textwrap argparse functools pathlib heapq bisect fractions statistics difflib shutil tempfile "
    "csv calendar string random decimal datetime enum dataclasses inspect typing "
    "logging/__init__ json/__init__ collections/__init__"
).split()
EXTRA_MODULES = (
    "ast tokenize pickle subprocess threading socket email/message http/client urllib/parse "
    "unittest/case configparser optparse pprint gettext smtplib imaplib"
).split()
LICENCES = "/usr/share/common-licenses"
MAN8 = "/usr/share/man/man8"
# The page text depends only on the page, man-db and groff: a fixed width and locale, no user settings.
MAN_ENV = {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8", "MANWIDTH": "80"}
HELDOUT = REPO / "mlxbun" / "data" / "heldout.txt"
ARCHS = {"llama": llama, "qwen3": qwen3}
ROLES = {
    "confirmation": "confirms defaults chosen on the other fixtures; never used to choose a default "
    "(a default tuned on it is no longer confirmed by it)"
}
CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 256,
    "intermediate_size": 640,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}
# name -> (config overrides, extra stdlib modules, default steps[, options: lr, weight_decay, corpus,
# kl_every, role]); the held-out tail is always the last 8192 tokens of the corpus (the end of the
# last module or page listed).
PRESETS = {
    "llama-text-3m": ({}, (), 300),
    "llama-text-12l": (
        {
            "num_hidden_layers": 12,
            "intermediate_size": 384,
            "num_key_value_heads": 1,
            "vocab_size": 1536,
        },
        tuple(EXTRA_MODULES),
        400,
    ),
    # Representative fixtures: narrow, many tokens per parameter (3000 steps x 2,048 tokens), high
    # learning rate, no weight decay, so that quantization costs what it costs real models: mlx-lm
    # q3 g64 held-out KL >= 0.2 and q4 g64 >= 0.05 (FIXTURE.json records the measured values).
    "llama-narrow-6l": (
        {
            "hidden_size": 64,
            "intermediate_size": 256,
            "num_hidden_layers": 6,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "vocab_size": 4096,
        },
        tuple(EXTRA_MODULES),
        3000,
        {"lr": 8e-3, "weight_decay": 0.0},
    ),
    "llama-narrow-8l": (
        {
            "hidden_size": 64,
            "intermediate_size": 256,
            "num_hidden_layers": 8,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "vocab_size": 3072,
            "tie_word_embeddings": False,
        },
        tuple(EXTRA_MODULES),
        3000,
        {"lr": 6e-3, "weight_decay": 0.0},
    ),
    # The confirmation fixture: as representative as the narrow ones, but another architecture and
    # another domain than both their corpus and the calibration text.
    "qwen3-man-7l": (
        {
            "model_type": "qwen3",
            "architectures": ["Qwen3ForCausalLM"],
            "hidden_size": 64,
            "intermediate_size": 192,
            "num_hidden_layers": 7,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "vocab_size": 4096,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
        },
        (),
        2400,
        {"lr": 8e-3, "weight_decay": 0.0, "corpus": "man8", "kl_every": 250, "role": "confirmation"},
    ),
}


def corpus_files(extra: tuple[str, ...] = ()) -> list[Path]:
    files = sorted(Path(LICENCES).iterdir())
    files += [Path(STDLIB) / f"{m}.py" for m in (*extra, *MODULES)]
    return [f for f in files if f.is_file()]


def man_pages() -> list[Path]:
    """Section 8's pages, sorted; links and ``.so`` stubs (which only name another page) left out."""
    pages = sorted(f for f in Path(MAN8).iterdir() if f.is_file() and not f.is_symlink())
    return [f for f in pages if not gzip.decompress(f.read_bytes()).lstrip().startswith(b".so ")]


def render_man(page: Path) -> str:
    out = subprocess.run(["man", "-l", "-P", "cat", str(page)], env=MAN_ENV, capture_output=True, check=True)
    return out.stdout.decode("utf-8", errors="replace")


def read_corpus(kind: str, extra: tuple[str, ...]) -> tuple[list[Path], list[str]]:
    """The corpus files and their texts: licences and stdlib modules, or rendered man pages."""
    if kind == "man8":
        files = man_pages()
        return files, [render_man(f) for f in files]
    files = corpus_files(extra)
    return files, [f.read_text(encoding="utf-8", errors="replace") for f in files]


def renderer() -> dict:
    """How the man pages became text, so the corpus can be rebuilt (FIXTURE.json ``renderer``)."""
    versions = {
        t: subprocess.run([t, "--version"], capture_output=True, text=True).stdout.split("\n")[0]
        for t in ("man", "groff")
    }
    return {"command": "man -l -P cat <page>", "env": MAN_ENV, "versions": versions}


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_tokenizer(tok, out: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>", model_max_length=1024
    )
    fast.save_pretrained(str(out))


def batches(ids: np.ndarray, *, seq: int, batch: int, steps: int, seed: int):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        starts = rng.integers(0, len(ids) - seq - 1, size=batch)
        chunk = np.stack([ids[s : s + seq + 1] for s in starts])
        yield mx.array(chunk[:, :-1]), mx.array(chunk[:, 1:])


def train(
    model,
    ids: np.ndarray,
    *,
    steps: int,
    seq: int,
    batch: int,
    lr: float,
    weight_decay: float,
    seed: int,
    probe=None,
    probe_every: int = 0,
) -> tuple[list, list]:
    """The loss curve, and ``[step, *probe()]`` every ``probe_every`` steps when a probe is given."""

    def loss_fn(m, x, y):
        return nn.losses.cross_entropy(m(x), y, reduction="mean")

    warm = max(1, steps // 20)
    sched = optim.join_schedules(
        [optim.linear_schedule(lr / 20, lr, warm), optim.cosine_decay(lr, steps - warm, lr / 20)], [warm]
    )
    opt = optim.AdamW(learning_rate=sched, weight_decay=weight_decay)
    state = [model.state, opt.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step(x, y):
        loss, grads = nn.value_and_grad(model, loss_fn)(model, x, y)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        return loss

    curve, probed, t0 = [], [], time.time()
    for i, (x, y) in enumerate(batches(ids, seq=seq, batch=batch, steps=steps, seed=seed)):
        loss = step(x, y)
        mx.eval(state, loss)
        if i % 10 == 0 or i == steps - 1:
            curve.append([i, round(loss.item(), 4)])
            print(f"step {i:4d}  loss {loss.item():.3f}  {time.time() - t0:6.1f}s", flush=True)
        if probe is not None and (i + 1) % probe_every == 0:
            probed.append([i + 1, *probe()])
            print(f"step {i + 1:4d}  probe {probed[-1][1:]}", flush=True)
    return curve, probed


def bf16_round(model) -> None:
    model.update(tree_map(lambda a: a.astype(mx.bfloat16).astype(mx.float32), model.parameters()))


def mean_kl(ref_logits: mx.array, logits: mx.array) -> float:
    ref = nn.log_softmax(ref_logits.astype(mx.float32), axis=-1)
    lq = nn.log_softmax(logits.astype(mx.float32), axis=-1)
    return round(mx.mean(mx.sum(mx.exp(ref) * (ref - lq), axis=-1)).item(), 4)


def quantized_kl(model, x: mx.array, *, bits: tuple[int, ...], group_size: int = 64) -> list[float]:
    """Held-out KL(model || mlx-lm's ``nn.quantize`` of it) for each bit width, on bf16 weights."""
    ref = copy.deepcopy(model)
    bf16_round(ref)
    ref_logits, kls = ref(x), []
    for b in bits:
        q = copy.deepcopy(ref)
        nn.quantize(q, group_size=group_size, bits=b)
        kls.append(mean_kl(ref_logits, q(x)))
    return kls


def convert_kl(out: Path, x: mx.array, *, bits: tuple[int, ...], group_size: int = 64) -> dict:
    """Held-out KL of ``mlx_lm.convert -q --q-bits b --q-group-size 64`` of the saved fixture."""
    from mlx_lm import convert, load

    ref_logits, kls = load(str(out))[0](x), {}
    with tempfile.TemporaryDirectory() as tmp:
        for b in bits:
            convert(str(out), f"{tmp}/q{b}", quantize=True, q_bits=b, q_group_size=group_size)
            kls[f"q{b}"] = mean_kl(ref_logits, load(f"{tmp}/q{b}")[0](x))
    return kls


def heldout_windows(tok, *, windows: int = 32, seq: int = 128) -> mx.array:
    """The first ``windows * seq`` tokens of mlxbun's held-out text (Alice), one window a row."""
    ids = tok.encode(HELDOUT.read_text(encoding="utf-8")).ids[: windows * seq]
    return mx.array(ids).reshape(windows, seq)


def eval_loss(model, ids: np.ndarray, *, seq: int) -> float:
    n = (len(ids) - 1) // seq
    x = mx.array(ids[: n * seq].reshape(n, seq))
    y = mx.array(ids[1 : n * seq + 1].reshape(n, seq))
    return nn.losses.cross_entropy(model(x), y, reduction="mean").item()


def save(model, out: Path, config: dict) -> None:
    weights = dict(tree_flatten(model.parameters()))
    weights = {k: v.astype(mx.bfloat16) for k, v in sorted(weights.items())}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    total = sum(v.nbytes for v in weights.values())
    index = {
        "metadata": {"total_size": total, "total_parameters": sum(v.size for v in weights.values())},
        "weight_map": {k: "model.safetensors" for k in weights},
    }
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=4) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=4, sort_keys=True) + "\n")


def parse_args() -> tuple[argparse.Namespace, dict]:
    """The command line, with unset knobs taken from the preset; and the preset's options."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-text-3m", choices=sorted(PRESETS))
    ap.add_argument("--out", default=None, help="default: tests/fixtures/<preset>")
    ap.add_argument("--steps", type=int, default=None, help="default: the preset's")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=None, help="default: the preset's, else 3e-3")
    ap.add_argument("--weight-decay", type=float, default=None, help="default: the preset's, else 0.05")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    _, _, steps, *rest = PRESETS[args.preset]
    options = {"lr": 3e-3, "weight_decay": 0.05} | (rest[0] if rest else {})
    args.steps = args.steps or steps
    args.lr = options["lr"] if args.lr is None else args.lr
    args.weight_decay = options["weight_decay"] if args.weight_decay is None else args.weight_decay
    return args, options


def init_model(config: dict, *, seed: int):
    mx.random.seed(seed)
    arch = ARCHS[config["model_type"]]
    model = arch.Model(arch.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    # Scale the residual-output projections down (GPT-2 style) so deep stacks train stably.
    for layer in model.model.layers:
        for lin in (layer.self_attn.o_proj, layer.mlp.down_proj):
            lin.weight = lin.weight / math.sqrt(2 * config["num_hidden_layers"])
    return model


def main() -> None:
    args, options = parse_args()
    overrides, extra, *_ = PRESETS[args.preset]
    config = CONFIG | overrides
    out = Path(args.out or REPO / "tests/fixtures" / args.preset)
    out.mkdir(parents=True, exist_ok=True)

    files, texts = read_corpus(options.get("corpus", "licences+stdlib"), extra)
    tok = train_tokenizer(texts, config["vocab_size"])
    save_tokenizer(tok, out)
    eot = tok.token_to_id("<|endoftext|>")
    ids = np.concatenate([np.array(tok.encode(t).ids + [eot], dtype=np.int32) for t in texts])
    held = ids[-8192:]  # the tail (end of the last stdlib module or page) is held out
    ids = ids[:-8192]
    print(f"corpus: {len(files)} files, {sum(map(len, texts))} chars, {len(ids)} train tokens")

    model = init_model(config, seed=args.seed)
    kl_every = options.get("kl_every", 0)
    x_held = heldout_windows(tok) if kl_every else None
    probe = partial(quantized_kl, model, x_held, bits=(3, 4)) if kl_every else None
    t0 = time.time()
    curve, probed = train(
        model,
        ids,
        steps=args.steps,
        seq=args.seq,
        batch=args.batch,
        lr=args.lr,
        weight_decay=args.weight_decay,
        seed=args.seed,
        probe=probe,
        probe_every=kl_every,
    )
    bf16_round(model)
    held_loss = eval_loss(model, held, seq=args.seq)
    meta = {
        "corpus": [{"file": str(f), "sha256": hashlib.sha256(f.read_bytes()).hexdigest()} for f in files],
        "train_tokens": int(len(ids)),
        "settings": vars(args)
        | {"out": out.name}
        | {k: options[k] for k in ("corpus", "kl_every") if k in options},
        "loss_curve": curve,
        "heldout_loss_bf16": round(held_loss, 4),
        "train_seconds": round(time.time() - t0, 1),
        "script": "scripts/train_fixture.py",
    }
    meta |= extra_meta(options, texts, probed)
    save(model, out, config)
    if kl_every:
        meta["mlx_lm_kl"]["convert"] = convert_kl(out, x_held, bits=(2, 3, 4, 6))
        print(f"mlx-lm convert g64 held-out KL: {meta['mlx_lm_kl']['convert']}")
    # Written last: a fixture directory with FIXTURE.json is complete.
    (out / "FIXTURE.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    print(f"held-out loss (bf16 weights): {held_loss:.3f}; wrote {out}")


def extra_meta(options: dict, texts: list[str], probed: list) -> dict:
    """FIXTURE.json's keys beyond the first fixtures': the corpus's rendering, the KL curve, the role."""
    meta = {}
    if options.get("corpus") == "man8":
        rendered = hashlib.sha256("\0".join(texts).encode()).hexdigest()
        meta |= {"corpus_kind": "man8", "renderer": renderer(), "rendered_sha256": rendered}
    if options.get("kl_every"):
        what = (
            "mean KL(reference || mlx-lm g64) on mlxbun/data/heldout.txt, 32 windows of 128 tokens;"
            f" curve: [step, q3, q4] with nn.quantize every {options['kl_every']} steps;"
            " convert: mlx_lm.convert -q --q-group-size 64 --q-bits b of the saved fixture"
        )
        meta["mlx_lm_kl"] = {"curve": probed, "what": what}
    if "role" in options:
        meta |= {"role": options["role"], "note": ROLES[options["role"]]}
    return meta


if __name__ == "__main__":
    main()
