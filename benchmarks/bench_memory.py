"""Activation memory of fmoe's recompute modes beside HF transformers, DeepSpeed-MoE and a dense FFN (not a test).

For each published expert shape (token count and widths scaled to fit a CPU): the bytes a forward
keeps for its backward (fmoe.observe.memory, exact, parameters left out), the peak of a forward + backward
beyond what was allocated before it (gradients set to None first, as optimizer.zero_grad() does),
the transient part of that peak (peak - saved - the gradients themselves), and the fwd+bwd time, for

- fmoe's FMoETransformerMLP with recompute="activation" (the default), "experts" and "none"
  ("none" is the path fmoe had before the lean layer: permute, experts, weighted unpermute);
- transformers' Qwen3-MoE block with its "eager" experts (a loop over experts) and its
  "grouped_mm" experts;
- DeepSpeed-MoE's `MoE` layer (top-k gating, no token dropped, one rank);
- a dense FFN of the same FLOPs per token;

all SwiGLU experts, fp32, in one process, plus the anchors' bf16 formulas (REFERENCE.md). Prints
ratios to fmoe's floor (x, pre-activation, router scores and routing integers) and time ratios;
JSON only where --out says.

    python benchmarks/bench_memory.py --out /tmp/memory-cpu.json
"""
import argparse
import os
import platform
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fmoe  # noqa: E402
from common import SwiGLU, time_interleaved  # noqa: E402
from fmoe.app.files import write_json  # noqa: E402
from fmoe.observe.memory import peak_bytes, saved_bytes  # noqa: E402

# (name, d_model, expert hidden, experts, top-k): the published expert shapes, scaled by --scale.
SHAPES = [("qwen3-30b-a3b", 2048, 768, 128, 8), ("mixtral-8x7b", 4096, 14336, 8, 2),
          ("deepseek-v3", 7168, 2048, 256, 8), ("olmoe", 2048, 1024, 64, 8)]
MODES = ("activation", "experts", "none")


def anchors(d, n, K):
    """The anchors' bf16 bytes per token (REFERENCE.md), SwiGLU experts."""
    return {"sonicmoe_liger": 2 * d + 4 * K * n, "scattermoe": 2 * d + 2 * K * d + 8 * K * n,
            "megatron": 2 * d + 2 * K * d + 6 * K * n, "megablocks_hf_grouped_mm": 2 * d + 4 * K * d + 8 * K * n,
            "torchtitan": 2 * d + 6 * K * d + 8 * K * n}


def floor_bytes(d, n, K, size=4):
    """fmoe's floor with `size`-byte activations: x, the SwiGLU pre-activation (2n per slot), fp32
    scores (K), the routing integers (K int64 of expert index, four int64 index arrays of K entries)."""
    return size * d + size * K * 2 * n + 4 * K + 8 * 4 * K


class FirstOutput(nn.Module):
    """DeepSpeed's MoE returns (output, aux loss, counts): the output alone, for the measures."""

    def __init__(self, moe):
        super().__init__()
        self.moe = moe

    def forward(self, x):
        return self.moe(x)[0]


def hf_block(d, n, E, K, implementation):
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    config = Qwen3MoeConfig(hidden_size=d, moe_intermediate_size=n, num_experts=E, num_experts_per_tok=K)
    config._experts_implementation = implementation
    block = Qwen3MoeSparseMoeBlock(config)
    for p in block.parameters():      # its expert weights come uninitialised
        nn.init.normal_(p, std=d ** -0.5)
    return block


def deepspeed_moe(d, n, E, K):
    import deepspeed
    import torch.distributed as dist
    from deepspeed.moe.layer import MoE
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29571")
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, rank=0, world_size=1)
    # A capacity of every token at every expert: nothing dropped, as in the others.
    return FirstOutput(MoE(hidden_size=d, expert=SwiGLU(d, n), num_experts=E, ep_size=1, k=K,
                           capacity_factor=float(E), eval_capacity_factor=float(E), drop_tokens=False,
                           use_rts=False))


def competitors(d, n, E, K, skip, backend=None):
    """{name: a builder of the module}, each a [tokens, d] -> [tokens, d] layer of SwiGLU experts."""
    builders = {f"fmoe_{mode}": (lambda mode=mode: fmoe.FMoETransformerMLP(
        num_expert=E, d_model=d, d_hidden=n, top_k=K, activation="swiglu", recompute=mode, backend=backend))
        for mode in MODES}
    builders["hf_eager"] = lambda: hf_block(d, n, E, K, "eager")
    builders["hf_grouped_mm"] = lambda: hf_block(d, n, E, K, "grouped_mm")
    builders["deepspeed_moe"] = lambda: deepspeed_moe(d, n, E, K)
    # Equal FLOPs per token: K experts' SwiGLU MLPs as one.
    builders["dense_ffn"] = lambda: SwiGLU(d, K * n)
    return {name: build for name, build in builders.items() if name not in skip}


def measure(name, d, n, E, K, tokens, reps, skip=(), device="cpu", dtype=torch.float32, backend=None):
    """One shape's row, on `device` in `dtype` (the peak from torch.cuda.max_memory_allocated on a
    GPU, from the profiler's allocations on a CPU); `row["modes"]` is fmoe's layers by recompute mode."""
    x = torch.randn(1, tokens, d, device=device, dtype=dtype)     # [batch, seq, d]: the HF block wants three dims
    floor = floor_bytes(d, n, K, x.element_size())
    row = {"shape": name, "d_model": d, "d_hidden": n, "experts": E, "top_k": K, "tokens": tokens,
           "floor_bytes_per_token": floor, "anchors_bf16_bytes_per_token": anchors(d, n, K), "layers": {}}
    steps = {}
    for label, build in competitors(d, n, E, K, skip, backend).items():
        torch.manual_seed(0)
        try:
            module = build().to(device, dtype)
        except ImportError as err:
            row["layers"][label] = {"error": f"not installed: {err}"}
            continue
        xg = x.clone().requires_grad_(True)
        saved = saved_bytes(module, xg).nbytes / tokens

        def step(module=module, xg=xg):
            module(xg).sum().backward()
        step()      # first call: lazy initialisation and caches out of the peak
        # Gradients set to None before, as optimizer.zero_grad() does: the step allocates them.
        module.zero_grad(set_to_none=True)
        xg.grad = None
        peak = peak_bytes(step, x.device) / tokens
        grads = (sum(p.numel() * p.element_size() for p in module.parameters()) + xg.nbytes) / tokens
        row["layers"][label] = {"saved_bytes_per_token": saved, "ratio_to_floor": saved / floor,
                                "peak_bytes_per_token": peak,
                                # The largest transient beyond the saved set and the gradients themselves.
                                "transient_bytes_per_token": peak - saved - grads}
        steps[label] = step
    seconds = time_interleaved(steps, warmup=1, reps=reps)
    for label, s in seconds.items():
        row["layers"][label]["seconds"] = s
    default = row["layers"]["fmoe_activation"]
    row["ratios"] = {
        "default_saved_vs_floor": default["ratio_to_floor"],
        "saved_vs_default": {k: v["saved_bytes_per_token"] / default["saved_bytes_per_token"]
                             for k, v in row["layers"].items() if "saved_bytes_per_token" in v},
        "peak_vs_default": {k: v["peak_bytes_per_token"] / default["peak_bytes_per_token"]
                            for k, v in row["layers"].items() if "peak_bytes_per_token" in v},
        "transient_vs_default": {k: v["transient_bytes_per_token"] / default["transient_bytes_per_token"]
                                 for k, v in row["layers"].items() if "transient_bytes_per_token" in v},
        # > 1: the default is faster.
        "speed_of_default_vs": {k: v["seconds"] / default["seconds"]
                                for k, v in row["layers"].items() if "seconds" in v},
    }
    row["modes"] = {mode: row["layers"][f"fmoe_{mode}"] for mode in MODES if f"fmoe_{mode}" in row["layers"]}
    return row


def print_row(row):
    print(f"{row['shape']}: d {row['d_model']} n {row['d_hidden']} E {row['experts']} K {row['top_k']}, "
          f"{row['tokens']} tokens; fmoe floor {row['floor_bytes_per_token']} B/token")
    print(f"  {'layer':16s} {'saved B/tok':>12s} {'x floor':>8s} {'peak B/tok':>12s} {'transient':>10s} "
          f"{'fwd+bwd s':>10s} {'default faster':>15s}")
    for label, v in row["layers"].items():
        if "error" in v:
            print(f"  {label:16s} {v['error']}")
            continue
        print(f"  {label:16s} {v['saved_bytes_per_token']:12.0f} {v['ratio_to_floor']:8.2f} "
              f"{v['peak_bytes_per_token']:12.0f} {v['transient_bytes_per_token']:10.0f} {v['seconds']:10.4f} "
              f"{row['ratios']['speed_of_default_vs'][label]:14.2f}x")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--scale", type=int, default=8, help="divide d_model, the hidden width and the experts by this")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--skip", nargs="*", default=[], help="layers to leave out (e.g. deepspeed_moe)")
    parser.add_argument("--shapes", nargs="*", default=[s[0] for s in SHAPES])
    parser.add_argument("--out", help="write the results here as JSON (nothing is written without it)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    rows = []
    for name, d, n, E, K in SHAPES:
        if name not in args.shapes:
            continue
        d, n, E = d // args.scale, n // args.scale, max(E // args.scale, K)
        row = measure(name, d, n, E, K, args.tokens, args.reps, set(args.skip))
        print_row(row)
        rows.append(row)
    if args.out:
        write_json(args.out, {"machine": platform.processor() or platform.machine(), "torch": torch.__version__,
                              "threads": torch.get_num_threads(), "rows": rows})


if __name__ == "__main__":
    main()
