"""Expert parallelism: one step of the layer at EP=2 (2 processes, gloo) against one process
holding all experts, with the forward broken down step by step.

    python benchmarks/bench_ep.py [--tokens 2048] [--d-model 512] [--d-hidden 2048] [--num-expert 8]

`--tokens` is per rank; the single process runs the whole global batch. Writes
benchmarks/results/ep-<device>.json.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fmoe  # noqa: E402
from common import RoundRobinGate, machine, run_on_ranks, write_json  # noqa: E402
from fmoe import kernels  # noqa: E402
from fmoe.distributed import exchange  # noqa: E402
from fmoe.routing import RoutingPlan  # noqa: E402

STEPS = ("gate", "plan", "permute", "dispatch", "experts", "combine", "unpermute")


def timed_step(layer, x):
    """The layer's forward, one step at a time, then the backward; seconds per step."""
    marks = {}

    def mark(name, start):
        marks[name] = time.perf_counter() - start
        return time.perf_counter()

    t = time.perf_counter()
    routing = layer.gate.routing(x)
    t = mark("gate", t)
    plan = RoutingPlan.build(routing.expert_idx_TK, layer.tot_expert, layer.world_size, layer.moe_group)
    t = mark("plan", t)
    x_ND = kernels.permute(x, plan)
    t = mark("permute", t)
    x_RD = exchange.dispatch(x_ND, plan)
    t = mark("dispatch", t)
    y_RD = layer.experts(x_RD, plan.local_counts_e)
    t = mark("experts", t)
    y_ND = exchange.combine(y_RD, plan)
    t = mark("combine", t)
    y = kernels.unpermute(y_ND, plan, routing.weight_TK)
    t = mark("unpermute", t)
    y.sum().backward()
    mark("backward", t)
    return marks


def measure(layer, x, reps):
    for _ in range(2):
        timed_step(layer, x)
    runs = [timed_step(layer, x) for _ in range(reps)]
    result = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    result["step"] = sum(result.values())
    return result


def build(args, world_size):
    torch.manual_seed(0)
    return fmoe.FMoETransformerMLP(num_expert=args.num_expert // world_size, d_model=args.d_model,
                                   d_hidden=args.d_hidden, top_k=args.top_k, world_size=world_size,
                                   gate=RoundRobinGate)


def ep_worker(rank, world, args):
    layer = build(args, world)
    x = torch.randn(args.tokens, args.d_model, requires_grad=True)
    result = measure(layer, x, args.reps)
    # A step is as slow as its slowest rank.
    slowest = torch.tensor([result[k] for k in result])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return dict(zip(result, slowest.tolist()))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--d-hidden", type=int, default=2048)
    p.add_argument("--num-expert", type=int, default=8, help="experts in all")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    ep_result = run_on_ranks(ep_worker, args.ep, args)
    single = {}
    for threads in (1, args.ep):
        torch.set_num_threads(threads)
        layer = build(args, 1)
        x = torch.randn(args.tokens * args.ep, args.d_model, requires_grad=True)
        single[f"{threads}_threads"] = measure(layer, x, args.reps)
    print(f"one layer step, {args.ep * args.tokens} tokens in all, D={args.d_model} F={args.d_hidden} "
          f"E={args.num_expert} top-{args.top_k}")
    header = ["", f"EP={args.ep} ({args.ep}x1 thread)"] + [f"1 proc, {k.replace('_', ' ')}" for k in single]
    print(f"{header[0]:12s}" + "".join(f"{h:>24s}" for h in header[1:]))
    for key in STEPS + ("backward", "step"):
        cells = [ep_result[key]] + [s[key] for s in single.values()]
        print(f"{key:12s}" + "".join(f"{c * 1e3:21.1f} ms" for c in cells))
    ratios = {f"ep_vs_single_{k}": s["step"] / ep_result["step"] for k, s in single.items()}
    for k, v in ratios.items():
        print(f"EP={args.ep} speed vs one process with {k.split('_')[3]} thread(s): {v:.2f}x")
    path = write_json(f"ep-{'cuda' if torch.cuda.is_available() else 'cpu'}.json",
                      {"config": vars(args), "machine": machine(), "ep": ep_result, "single_process": single,
                       "ratios": ratios})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
