"""Activation memory per recompute mode beside a dense FFN and the anchors' formulas (not a test).

Saved bytes per token (fmoe.memory, exact), the peak of a forward + backward, ratios to the floor
(x, pre-activation, scores, routing integers), and fwd+bwd time of each mode as a ratio to
recompute="none". Expert shapes of the named models with the token count scaled to fit a CPU.
JSON only where --out says.

    python benchmarks/bench_memory.py --tokens 256 --out benchmarks/results/memory-cpu.json
"""
import argparse
import json
import platform
import time

import torch
from torch import nn

import fmoe
from fmoe.memory import peak_bytes, saved_bytes

# (name, d_model, expert hidden, experts, top-k), the published expert shapes, scaled by --scale.
SHAPES = [("qwen3-30b-a3b", 2048, 768, 128, 8), ("mixtral-8x7b", 4096, 14336, 8, 2),
          ("deepseek-v3", 7168, 2048, 256, 8), ("olmoe", 2048, 1024, 64, 8)]
MODES = ("activation", "experts", "none")


def anchors(d, n, K):
    """The anchors' bf16 bytes per token (REFERENCE.md), SwiGLU experts."""
    return {"sonicmoe_liger": 2 * d + 4 * K * n, "scattermoe": 2 * d + 2 * K * d + 8 * K * n,
            "megatron": 2 * d + 2 * K * d + 6 * K * n, "megablocks_hf_grouped_mm": 2 * d + 4 * K * d + 8 * K * n,
            "torchtitan": 2 * d + 6 * K * d + 8 * K * n}


def fwd_bwd_seconds(module, x, reps):
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    best = float("inf")
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        module(x).sum().backward()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def measure(name, d, n, E, K, tokens, reps, device="cpu", dtype=torch.float32, backend=None):
    """One shape's row: every recompute mode and a dense FFN, on `device` in `dtype` (peak from
    torch.cuda.max_memory_allocated on a GPU, from the profiler's allocations on a CPU)."""
    x = torch.randn(tokens, d, requires_grad=True, device=device, dtype=dtype)
    size = x.element_size()
    floor = size * d + size * K * 2 * n + 4 * K + 8 * 4 * K      # x, pre-activation, fp32 scores, ints
    row = {"shape": name, "d_model": d, "d_hidden": n, "experts": E, "top_k": K, "tokens": tokens,
           "floor_bytes_per_token": floor, "anchors_bf16_bytes_per_token": anchors(d, n, K), "modes": {}}
    for mode in MODES:
        torch.manual_seed(0)
        layer = fmoe.FMoETransformerMLP(num_expert=E, d_model=d, d_hidden=n, top_k=K, activation="swiglu",
                                        recompute=mode, backend=backend).to(device, dtype)
        saved = saved_bytes(layer, x).nbytes / tokens
        peak = peak_bytes(lambda: layer(x).sum().backward(), x.device) / tokens
        row["modes"][mode] = {"saved_bytes_per_token": saved, "ratio_to_floor": saved / floor,
                              "peak_bytes_per_token": peak, "seconds": fwd_bwd_seconds(layer, x, reps)}
    dense = nn.Sequential(nn.Linear(d, K * n), nn.GELU(), nn.Linear(K * n, d)).to(device, dtype)  # equal FLOPs
    row["dense_ffn"] = {"saved_bytes_per_token": saved_bytes(dense, x).nbytes / tokens,
                        "seconds": fwd_bwd_seconds(dense, x, reps)}
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--scale", type=int, default=8, help="divide d_model, the hidden width and the experts by this")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", help="write the results here as JSON (nothing is written without it)")
    args = parser.parse_args()
    rows = []
    for name, d, n, E, K in SHAPES:
        d, n, E = d // args.scale, n // args.scale, max(E // args.scale, K)
        row = measure(name, d, n, E, K, args.tokens, args.reps)
        modes, none = row["modes"], row["modes"]["none"]["seconds"]
        print(f"{name:15s} d {d} n {n} E {E} K {K}: saved bytes/token "
              + ", ".join(f"{m} {v['saved_bytes_per_token']:.0f} ({v['ratio_to_floor']:.2f}x floor, "
                          f"peak {v['peak_bytes_per_token']:.0f}, time {v['seconds'] / none:.2f}x none)"
                          for m, v in modes.items())
              + f"; dense FFN {row['dense_ffn']['saved_bytes_per_token']:.0f}")
        rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": platform.processor() or platform.machine(), "torch": torch.__version__,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
