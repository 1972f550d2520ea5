"""How far each FP8 recipe moves the layer from fp32 (#49; not a test, not a timing).

One FMoETransformerMLP (d_model 1024, d_hidden 512, 8 experts, top-2, 2048 tokens by default) runs a
forward and a backward in fp32 and again with fp8="blockwise", "rowwise" and "mxfp8" (the same
weights, input and output gradient); per recipe the relative errors ||fp8 - fp32|| / ||fp32|| of the
output, the input gradient and each weight's gradient, for gelu and swiglu experts. Prints a table;
writes JSON where --out says.

    python benchmarks/bench_fp8_accuracy.py --out benchmarks/results/fp8-accuracy-cpu.json
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, write_json_atomic  # noqa: E402

import fmoe  # noqa: E402
from fmoe.kernels.fp8 import RECIPES  # noqa: E402

GRADIENTS = ("experts.w1_eDF", "experts.w2_eFD", "experts.b1_eF", "gate.gate.proj.weight")


def run(args, activation, recipe):
    """Output, input gradient and parameter gradients of one forward + backward."""
    torch.manual_seed(args.seed)
    layer = fmoe.FMoETransformerMLP(num_expert=args.experts, d_model=args.d_model, d_hidden=args.d_hidden,
                                    top_k=args.top_k, activation=activation, fp8=recipe)
    g = torch.Generator().manual_seed(args.seed + 1)
    x = torch.randn(args.tokens, args.d_model, generator=g).requires_grad_(True)
    probe = torch.randn(args.tokens, args.d_model, generator=g)
    y = layer(x)
    (y * probe).sum().backward()
    params = dict(layer.named_parameters())
    return {"output": y.detach(), "input_grad": x.grad, **{name: params[name].grad for name in GRADIENTS}}


def relative_errors(got: dict, ref: dict) -> dict:
    return {k: ((got[k] - ref[k]).norm() / ref[k].norm()).item() for k in ref}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the JSON here")
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--d-hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    results = {}
    for activation in ("gelu", "swiglu"):
        ref = run(args, activation, None)
        results[activation] = {recipe: relative_errors(run(args, activation, recipe), ref) for recipe in RECIPES}
    columns = list(next(iter(results["gelu"].values())))
    print(f"{'activation':<10} {'recipe':<10} " + " ".join(f"{c:>22}" for c in columns))
    for activation, by_recipe in results.items():
        for recipe, errors in by_recipe.items():
            print(f"{activation:<10} {recipe:<10} " + " ".join(f"{errors[c]:>22.4f}" for c in columns))
    if args.out is not None:
        shape = {k: getattr(args, k) for k in ("d_model", "d_hidden", "experts", "top_k", "tokens", "seed")}
        write_json_atomic(args.out, {"what": "relative error against fp32, ||fp8 - fp32|| / ||fp32||",
                                     "shape": shape, "machine": machine(), "errors": results}, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
