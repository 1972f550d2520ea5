"""Where each byte goes: every kernel a bf16 MoE layer's forward+backward launches, side by side (not a test).

Counted on the CPU with `fmoe.observe.launches` (Triton kernels in Triton's interpreter, their bytes the
distinct addresses they load and store; torch ops by dispatch, each reading its inputs and writing
its outputs whole), for fmoe's layer in each recompute mode on the Triton path and transformers'
Qwen3-MoE block with its `grouped_mm` experts, at the Qwen3-30B-A3B expert shape with every width
divided by --scale. Prints each layer's table and a summary with ratios to fmoe's default; JSON only
where --out says.

    python benchmarks/bench_launches.py --out /tmp/launches-cpu.json
"""
import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")      # before triton is imported: the kernels run on the CPU
os.environ.setdefault("FMOE_TRITON_AUTOTUNE", "0")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fmoe  # noqa: E402
from bench_memory import hf_block  # noqa: E402
from fmoe.app.files import write_json  # noqa: E402
from fmoe.observe.launches import count_launches  # noqa: E402

MODES = ("activation", "experts", "none")


def layers(d, n, E, K):
    builders = {f"fmoe_{mode}": (lambda mode=mode: fmoe.FMoETransformerMLP(
        num_expert=E, d_model=d, d_hidden=n, top_k=K, activation="swiglu", recompute=mode, backend="triton",
        expert_bias=False)) for mode in MODES}
    builders["hf_grouped_mm"] = lambda: hf_block(d, n, E, K, "grouped_mm")
    return builders


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=int, default=16, help="divide the Qwen3-30B-A3B widths and experts by this")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here")
    args = parser.parse_args(argv)
    d, n, E, K = 2048 // args.scale, 768 // args.scale, max(128 // args.scale, 8), 8
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, args.tokens, d, generator=g).to(torch.bfloat16).requires_grad_(True)
    dy = torch.randn(1, args.tokens, d, generator=g).to(torch.bfloat16)
    rows = {}
    for name, build in layers(d, n, E, K).items():
        torch.manual_seed(0)
        layer = build().to(torch.bfloat16)
        table = count_launches(layer, x, dy)
        print(f"\n== {name} (d={d}, n={n}, E={E}, K={K}, {args.tokens} tokens, bf16) ==")
        print(table.render())
        rows[name] = table.summary() | {"all_launches": len(table.launches)}
    base = rows["fmoe_activation"]
    print(f"\n{'layer':<18}{'launches':>9}{'router':>8}{'glue B/tok':>12}{'kernel B/tok':>14}{'glue x default':>16}")
    for name, row in rows.items():
        per = row["bytes_per_token"]
        glue_ratio = per["glue"] / base["bytes_per_token"]["glue"] if base["bytes_per_token"]["glue"] else float("inf")
        print(f"{name:<18}{row['launches']:>9}{row['router_launches']:>8}{per['glue']:>12.0f}"
              f"{per['triton'] + per['gemm']:>14.0f}{glue_ratio:>16.1f}")
    print("(combine's own bytes per token, forward + backward: 2(K+1)d2 =", 2 * (K + 1) * d * 2, ")")
    if args.out:
        write_json(args.out, {"shape": dict(d=d, n=n, E=E, K=K, tokens=args.tokens, dtype="bfloat16"),
                              "layers": rows, "torch": torch.__version__})
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
