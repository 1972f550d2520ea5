"""Forward+backward of one MoE layer beside its competitors, in one process.

    python benchmarks/bench_layer.py            # tokens 2048, d_model 512, d_hidden 2048, 8 experts, top-2

Competitors: fmoe (sorted rows, grouped GEMM), a dense FFN doing the same FLOPs (the ceiling),
and the per-expert masked loop naive PyTorch MoE code uses. Prints throughput and ratios and
writes benchmarks/results/layer-<device>.json.
"""
import argparse
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fmoe  # noqa: E402
from common import RoundRobinGate, machine, time_call, write_json  # noqa: E402
from fmoe.bench.competitors import MaskedLoopMoE  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--d-hidden", type=int, default=2048)
    p.add_argument("--num-expert", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    T, D, F_, E, K = args.tokens, args.d_model, args.d_hidden, args.num_expert, args.top_k
    torch.manual_seed(0)
    layer = fmoe.FMoETransformerMLP(num_expert=E, d_model=D, d_hidden=F_, top_k=K, gate=RoundRobinGate).to(device)
    dense = nn.Sequential(nn.Linear(D, F_), nn.GELU(), nn.Linear(F_, D)).to(device)
    masked = MaskedLoopMoE(layer)
    x = torch.randn(T, D, device=device, requires_grad=True)
    x_dense = torch.randn(T * K, D, device=device, requires_grad=True)    # same FLOPs: T*K rows
    flops = 3 * 2 * (T * K * D * F_ * 2 + T * D * E)                         # fwd + bwd (2x fwd)

    def step(module, inp):
        return lambda: module(inp).sum().backward()

    rows = {}
    for name, fn in (("fmoe", step(layer, x)), ("dense_ffn", step(dense, x_dense)), ("masked_loop", step(masked, x))):
        seconds = time_call(fn, reps=args.reps)
        rows[name] = {"seconds": seconds, "gflops": flops / seconds / 1e9}
    for row in rows.values():
        row["fmoe_speedup"] = row["seconds"] / rows["fmoe"]["seconds"]
    print(f"fwd+bwd, T={T} D={D} F={F_} E={E} top-{K}, {device}, {torch.get_num_threads()} threads")
    print(f"{'':14s}{'ms':>10s}{'GFLOP/s':>10s}{'fmoe is':>12s}")
    for name, row in rows.items():
        print(f"{name:14s}{row['seconds'] * 1e3:10.1f}{row['gflops']:10.1f}{row['fmoe_speedup']:11.2f}x")
    ratios = {"fmoe_vs_dense": rows["dense_ffn"]["seconds"] / rows["fmoe"]["seconds"],
              "fmoe_vs_masked_loop": rows["masked_loop"]["seconds"] / rows["fmoe"]["seconds"]}
    print(f"fmoe / dense throughput: {ratios['fmoe_vs_dense']:.2f}  (target >= 0.9)")
    print(f"fmoe / masked loop:      {ratios['fmoe_vs_masked_loop']:.2f}  (target >= 1.5)")
    path = write_json(f"layer-{device}.json", {"config": vars(args), "machine": machine(), "results": rows,
                                               "ratios": ratios})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
