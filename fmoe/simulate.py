"""`fmoe simulate`: FasterMoE's performance model over cluster sizes and load distributions.

For each number of GPUs and each distribution of tokens over experts, the modelled step time of
one MoE layer with plain expert parallelism, with shadowing, with the smart schedule, and with
both; printed as a table, written as JSON and plotted.
"""
import argparse
import math
from pathlib import Path
from typing import List

import torch

from fmoe.files import save_figure, write_json
from fmoe.perfmodel import PerfModel

STRATEGIES = ("plain", "shadow", "schedule", "both")


def expert_shares(distribution: str, num_experts: int) -> torch.Tensor:
    """Share of routed slots per expert: `uniform`, `zipf:S` (rank^-S), `hot:P` (expert 0 takes P)."""
    name, _, arg = distribution.partition(":")
    if name == "uniform" and not arg:
        return torch.full((num_experts,), 1.0 / num_experts, dtype=torch.double)
    try:
        value = float(arg)
    except ValueError:
        value = math.nan
    if name == "zipf" and value > 0:
        shares = torch.arange(1, num_experts + 1, dtype=torch.double) ** -value
        return shares / shares.sum()
    if name == "hot" and 0 < value <= 1:
        if num_experts == 1:
            return torch.ones(1, dtype=torch.double)
        shares = torch.full((num_experts,), (1 - value) / (num_experts - 1), dtype=torch.double)
        shares[0] = value
        return shares
    raise ValueError(f"--dist must be uniform, zipf:S (S > 0) or hot:P (0 < P <= 1), got {distribution!r}")


def simulate_one(model: PerfModel, gpus: int, experts_per_gpu: int, tokens_per_gpu: int, top_k: int,
                 distribution: str, group_size: int) -> dict:
    shares_E = expert_shares(distribution, gpus * experts_per_gpu)
    counts_WE = (tokens_per_gpu * top_k * shares_E).expand(gpus, -1)
    steps = math.ceil(gpus / group_size)
    shadowed = model.choose_shadowed(counts_WE)
    shadowed_scheduled = model.choose_shadowed(counts_WE, steps)
    times = {
        "plain": model.layer_time(counts_WE),
        "shadow": model.layer_time(counts_WE, shadowed),
        "schedule": model.layer_time(counts_WE, schedule_steps=steps),
        "both": model.layer_time(counts_WE, shadowed_scheduled, steps),
    }
    return {"gpus": gpus, "distribution": distribution, "seconds": times,
            "speedup": {k: times["plain"] / v for k, v in times.items()},
            "shadowed_experts": len(shadowed), "shadowed_experts_with_schedule": len(shadowed_scheduled)}


def plot(rows: List[dict], distributions: List[str], path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(distributions), figsize=(5 * len(distributions), 4), squeeze=False)
    for ax, dist_name in zip(axes[0], distributions):
        mine = [r for r in rows if r["distribution"] == dist_name]
        # Distinct markers and dashes: strategies that tie (e.g. shadowing under uniform load) stay visible.
        for strategy, style in zip(STRATEGIES, ("o-", "s--", "^:", "x-.")):
            ax.plot([r["gpus"] for r in mine], [r["seconds"][strategy] * 1e3 for r in mine], style, label=strategy)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(dist_name)
        ax.set_xlabel("GPUs")
        ax.set_ylabel("modelled layer step (ms)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    save_figure(path, fig, dpi=110)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser):
    p.add_argument("--gpus", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256, 512, 1024])
    p.add_argument("--gpus-per-node", type=int, default=8, help="the smart schedule's groups never exceed a node")
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--d-hidden", type=int, default=8192)
    p.add_argument("--tokens-per-gpu", type=int, default=4096)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--experts-per-gpu", type=int, default=1)
    p.add_argument("--flops", type=float, default=11.5e12, help="compute throughput per GPU, FLOP/s")
    p.add_argument("--net-bw", type=float, default=50e9 / 8, help="network bandwidth per GPU, bytes/s")
    p.add_argument("--bytes-per-element", type=int, default=2, help="2 for bf16/fp16 activations, 4 for fp32")
    p.add_argument("--group-size", type=int, default=4, help="ranks per step of the smart schedule")
    p.add_argument("--dist", nargs="+", default=["uniform", "zipf:1.2", "hot:0.5"])
    p.add_argument("--out", default="runs/simulate", help="folder for simulate.json and simulate.png")


def run(args) -> List[dict]:
    for name in ("gpus_per_node", "d_model", "d_hidden", "tokens_per_gpu", "top_k", "experts_per_gpu", "group_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if any(g < 1 for g in args.gpus):
        raise ValueError(f"--gpus must be positive, got {args.gpus}")
    model = PerfModel(args.d_model, args.d_hidden, flops=args.flops, net_bandwidth=args.net_bw,
                      bytes_per_element=args.bytes_per_element)
    group = min(args.group_size, args.gpus_per_node)
    rows = [simulate_one(model, g, args.experts_per_gpu, args.tokens_per_gpu, args.top_k, d, group)
            for d in args.dist for g in args.gpus]
    print(f"modelled MoE layer step (ms), d_model {args.d_model}, d_hidden {args.d_hidden}, "
          f"{args.tokens_per_gpu} tokens/GPU, top-{args.top_k}, {args.flops:.3g} FLOP/s, {args.net_bw:.3g} B/s")
    print(f"{'dist':>10s}{'GPUs':>6s}" + "".join(f"{s:>10s}" for s in STRATEGIES) + f"{'shadow x':>10s}{'sched x':>9s}{'both x':>8s}")
    for r in rows:
        t, s = r["seconds"], r["speedup"]
        print(f"{r['distribution']:>10s}{r['gpus']:>6d}" + "".join(f"{t[k] * 1e3:10.2f}" for k in STRATEGIES)
              + f"{s['shadow']:10.2f}{s['schedule']:9.2f}{s['both']:8.2f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "simulate.json", {"config": vars(args), "results": rows}, indent=2)
    plot(rows, args.dist, out / "simulate.png")
    print(f"wrote {out / 'simulate.json'} and {out / 'simulate.png'}")
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(prog="fmoe simulate", description=__doc__)
    add_arguments(p)
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
