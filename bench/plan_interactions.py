"""Where two plans of the same size differ: each decision's KL by the sum the allocator minimizes,
and measured in the whole quantized model.

Run (after ``bench/sensitivity_methods.py --work W``, on its plans and sensitivities):

    .venv/bin/python bench/plan_interactions.py --work W/llama-text-3m --size 1448216
        [--base exact] [--other fisher] [--samples 24] [--seq-len 512]

The allocator minimizes the summed per-module KL, each module measured (exact) or estimated with
the rest of the model at full precision. For every module where ``--other``'s plan differs from
``--base``'s, the script prints the change of that sum by the reference sensitivities (``--base``'s
``sensitivity.json``), and the change of the whole model's KL on the calibration set when that one
decision of ``--other`` is put into ``--base``'s plan (quantized for real). Then both plans' KL on
the calibration set and on the held-out text of the sensitivity bench.

A decision whose measured change is several times its summed change is one where modules interact
(errors that compound through later quantized layers): neither method's numbers see it.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--work", type=Path, required=True, help="a fixture's directory of a sensitivity bench run"
    )
    ap.add_argument(
        "--size", type=int, required=True, help="the plans' byte budget (their file names end in it)"
    )
    ap.add_argument("--base", default="exact")
    ap.add_argument("--other", default="fisher")
    ap.add_argument("--samples", type=int, default=24)
    ap.add_argument("--seq-len", type=int, default=512)
    args = ap.parse_args()

    from mlxbun import blas

    blas.load()
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from sensitivity_methods import Evaluator, held_out_tokens, module_kls

    from mlxbun.quant.calibration import load_calibration
    from mlxbun.quant.quantize.command import quantize_model_dir

    doc = json.loads((args.work / args.base / "sensitivity.json").read_text())
    model = Path(REPO / "tests" / "fixtures" / args.work.name)
    calib = doc["calibration"]
    tokens = load_calibration(
        tokenizer=load_tokenizer(model), path=None, samples=calib["samples"], seq_len=calib["seq_len"],
        seed=calib["seed"],
    ).tokens  # fmt: skip
    on_calib = Evaluator(model, tokens)
    scratch = tempfile.TemporaryDirectory(prefix="plan-interactions-")
    held = held_out_tokens(model, Path(scratch.name), samples=args.samples, seq_len=args.seq_len)
    on_held = Evaluator(model, held)
    kl = module_kls(args.work, args.base)
    base = json.loads((args.work / "plans" / f"{args.base}_{args.size}.json").read_text())
    other = json.loads((args.work / "plans" / f"{args.other}_{args.size}.json").read_text())

    def measure(plan: dict, ev: list) -> list[float]:
        d = Path(tempfile.mkdtemp())
        (d / "plan.json").write_text(json.dumps(plan))
        res = quantize_model_dir(
            model, d / "m", dtype="bfloat16", partial_root=d / "partial", plan=d / "plan.json"
        )
        return [e.kl(res.out) for e in ev]

    (b0,) = measure(base, [on_calib])
    print(f"{args.base} plan at {args.size:,} bytes; calibration {calib['samples']} x {calib['seq_len']}")
    print("| module | bits | summed KL change | measured KL change | measured / summed |")
    print("|---|---|---|---|---|")
    for path, choice in other["choices"].items():
        was, now = base["choices"][path]["bits"], choice["bits"]
        if was == now or path not in kl:
            continue
        plan = copy.deepcopy(base)
        plan["choices"][path], plan["layers"][path] = choice, other["layers"][path]
        (b1,) = measure(plan, [on_calib])
        summed = kl[path][str(now)] - kl[path][str(was)]
        print(f"| {path} | {was} -> {now} | {summed:+.2e} | {b1 - b0:+.2e} | {(b1 - b0) / summed:.2f} |")
    for name, plan in ((args.base, base), (args.other, other)):
        c, h = measure(plan, [on_calib, on_held])
        summed = sum(kl[p][str(ch["bits"])] for p, ch in plan["choices"].items())
        print(f"{name}: summed {summed:.5f}, calibration {c:.5f}, held-out {h:.5f}")
    scratch.cleanup()


if __name__ == "__main__":
    main()
