"""One transformers MoE block, forward+backward: fmoe's converted block beside transformers'
own experts implementations ("grouped_mm", its default, and "eager"), same weights, one process.

    python benchmarks/bench_hf.py --out benchmarks/results/hf-cpu.json
    python benchmarks/bench_hf.py --reps 1 --tokens 64 --out /tmp/hf-smoke.json      # a smoke run

Block shapes (d_model 512 by default): Mixtral (8 experts, top-2, F 1024), Qwen3-MoE (64 experts,
top-8, F 256) and DeepSeek-V3 (64 experts in 8 groups, top-8, F 256, one shared expert). The
competitors take turns, one call each per round, so a drift of the machine's speed hits all
alike; each figure is the median over the rounds. Prints milliseconds and fmoe's speed-up over
each; writes the JSON to --out.
"""
import argparse
import copy
import sys
from pathlib import Path

import torch
import transformers
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fmoe.hf  # noqa: E402
from fmoe import cpu_memory  # noqa: E402
from common import machine, time_interleaved  # noqa: E402
from fmoe.hf.families import find_moe_blocks  # noqa: E402
from fmoe.files import write_json  # noqa: E402


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
    fmoe_block = fmoe.hf.convert(holder).block
    eager = copy.deepcopy(block)
    block.experts.config._experts_implementation = "grouped_mm"
    eager.experts.config._experts_implementation = "eager"
    return {"hf_grouped_mm": block, "hf_eager": eager, "fmoe": fmoe_block}


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
                   help="malloc keeps freed blocks (fmoe.cpu_memory), for all competitors alike")
    p.add_argument("--out", required=True, help="JSON file for the results")
    args = p.parse_args(argv)
    if args.keep_freed_memory:
        cpu_memory.keep_freed_memory()
    results = {"machine": machine(), "tokens": args.tokens, "d_model": args.d_model, "reps": args.reps,
               "dtype": "float32", "keep_freed_memory": args.keep_freed_memory, "blocks": {}}
    for family in args.families:
        competitors = blocks(family, args.d_model)
        x = torch.randn(1, args.tokens, args.d_model, requires_grad=True)
        ms = {name: 1e3 * t for name, t in time_interleaved(
            {name: fwd_bwd(b, x) for name, b in competitors.items()}, reps=args.reps).items()}
        ratios = {f"fmoe_vs_{name}": ms[name] / ms["fmoe"] for name in ms if name != "fmoe"}
        results["blocks"][family] = {"ms": ms, "speedup": ratios}
        print(f"{family:12s} " + "  ".join(f"{n} {t:8.2f} ms" for n, t in ms.items()) + "   "
              + "  ".join(f"{n} {r:.2f}x" for n, r in ratios.items()), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, results, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
