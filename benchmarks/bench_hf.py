"""One transformers MoE block, forward+backward: fmoe's converted block beside transformers'
own experts implementations ("grouped_mm", its default, and "eager"), same weights, one process.

    python benchmarks/bench_hf.py --out benchmarks/results/hf-cpu.json
    python benchmarks/bench_hf.py --reps 1 --tokens 64 --out /tmp/hf-smoke.json      # a smoke run

Block shapes (d_model 512 by default): Mixtral (8 experts, top-2, F 1024), Qwen3-MoE (64 experts,
top-8, F 256) and DeepSeek-V3 (64 experts in 8 groups, top-8, F 256, one shared expert). The
competitors take turns, one call each per round, so a drift of the machine's speed hits all
alike; each figure is the median over the rounds. Beside them, in the same rounds, a step of the
block's GEMMs alone (each expert's six at its routed rows, the router's, the shared expert's, into
buffers allocated beforehand): the floor of any implementation whose GEMMs are torch's, so HF's
time over it is the largest speed-up such an implementation can have here. Prints milliseconds, fmoe's speed-up over each and those bounds;
writes the JSON to --out.
"""
import argparse
import copy
import sys
from pathlib import Path

import torch
import transformers
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fmoe.integrations.hf  # noqa: E402
from fmoe.observe import cpu_memory  # noqa: E402
from common import machine, time_interleaved  # noqa: E402
from fmoe.app.files import write_json  # noqa: E402
from fmoe.integrations.hf.families import find_moe_blocks  # noqa: E402


def block_config(family: str, D: int):
    common = dict(hidden_size=D, num_hidden_layers=1, num_attention_heads=4, vocab_size=64)
    if family == "mixtral":
        return transformers.MixtralConfig(**common, intermediate_size=2 * D, num_local_experts=8,
                                          num_experts_per_tok=2)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, moe_intermediate_size=D // 2, num_experts=64,
                                           num_experts_per_tok=8, norm_topk_prob=True)
    return transformers.DeepseekV3Config(**common, intermediate_size=2 * D, moe_intermediate_size=D // 2,
                                         n_routed_experts=64, num_experts_per_tok=8, n_shared_experts=1,
                                         first_k_dense_replace=0, n_group=8, topk_group=4)


def blocks(family: str, D: int):
    """(hf grouped_mm block, hf eager block, fmoe block), all holding the same random weights."""
    torch.manual_seed(0)
    config = block_config(family, D)
    model = transformers.AutoModelForCausalLM.from_config(config)
    _, block = find_moe_blocks(model)[0]
    with torch.no_grad():
        for name, t in list(block.named_parameters()) + list(block.named_buffers()):
            t.copy_(torch.randn(t.shape) * (0.5 if "gate.weight" in name else 0.02))
    holder = nn.Module()
    holder.config, holder.block = config, copy.deepcopy(block)
    fmoe_block = fmoe.integrations.hf.convert(holder).block
    eager = copy.deepcopy(block)
    block.experts.config._experts_implementation = "grouped_mm"
    eager.experts.config._experts_implementation = "eager"
    return {"hf_grouped_mm": block, "hf_eager": eager, "fmoe": fmoe_block}


def gemm_floor(fmoe_block, config, x):
    """A step of nothing but the block's GEMMs: for every expert (its rows as fmoe routed them,
    and the shared experts over all tokens) the two forward and four backward GEMMs of a gated
    MLP, and the router's three, into buffers allocated beforehand. An implementation running
    these GEMMs through torch cannot be faster: it bounds every speed-up."""
    import fmoe as fmoe_pkg
    layer = next(m for m in fmoe_block.modules() if isinstance(m, fmoe_pkg.FMoE))
    fmoe_block(x)
    counts = [int(c) for c in layer.last_counts_E.tolist()]
    T, D = x.shape[-2], x.shape[-1]
    F = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    shared = getattr(config, "n_shared_experts", 0) or 0
    segments = counts + ([T] if shared else [])
    widths = [F] * len(counts) + ([F * shared] if shared else [])
    num_expert = len(counts)
    gemms = [((T, D), (D, num_expert)), ((D, T), (T, num_expert)), ((T, num_expert), (num_expert, D))]
    for n, f in zip(segments, widths):
        gemms += [((n, D), (D, 2 * f)), ((n, f), (f, D)),              # forward: up+gate, down
                  ((f, n), (n, D)), ((n, D), (D, f)),                  # backward of down: dW, dA
                  ((D, n), (n, 2 * f)), ((n, 2 * f), (2 * f, D))]      # backward of up+gate: dW, dX
    operands = [(torch.randn(a), torch.randn(b), torch.empty(a[0], b[1])) for a, b in gemms]

    def step():
        for a, b, out in operands:
            torch.mm(a, b, out=out)
    return step


def fwd_bwd(block, x):
    def step():
        block.zero_grad(set_to_none=True)
        y = block(x)
        (y[0] if isinstance(y, tuple) else y).sum().backward()
    return step


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--families", nargs="+", default=["mixtral", "qwen3_moe", "deepseek_v3"])
    p.add_argument("--keep-freed-memory", action="store_true",
                   help="malloc keeps freed blocks (fmoe.observe.cpu_memory), for all competitors alike")
    p.add_argument("--out", required=True, help="JSON file for the results")
    args = p.parse_args(argv)
    if args.keep_freed_memory:
        cpu_memory.keep_freed_memory()
    results = {"machine": machine(), "tokens": args.tokens, "d_model": args.d_model, "reps": args.reps,
               "dtype": "float32", "keep_freed_memory": args.keep_freed_memory, "blocks": {}}
    for family in args.families:
        competitors = blocks(family, args.d_model)
        x = torch.randn(1, args.tokens, args.d_model, requires_grad=True)
        steps = {name: fwd_bwd(b, x) for name, b in competitors.items()}
        steps["gemm_floor"] = gemm_floor(competitors["fmoe"], block_config(family, args.d_model), x.detach())
        ms = {name: 1e3 * t for name, t in time_interleaved(steps, reps=args.reps).items()}
        floor = ms.pop("gemm_floor")
        ratios = {f"fmoe_vs_{name}": ms[name] / ms["fmoe"] for name in ms if name != "fmoe"}
        bounds = {f"floor_vs_{name}": ms[name] / floor for name in ms if name != "fmoe"}
        results["blocks"][family] = {"ms": ms, "gemm_floor_ms": floor, "speedup": ratios,
                                     "largest_possible_speedup": bounds}
        print(f"{family:12s} " + "  ".join(f"{n} {t:8.2f} ms" for n, t in ms.items()) + f"  GEMMs alone {floor:8.2f} ms   "
              + "  ".join(f"{n} {r:.2f}x" for n, r in ratios.items())
              + "   (at most: " + ", ".join(f"{n[9:]} {r:.2f}x" for n, r in bounds.items()) + ")", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, results, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
