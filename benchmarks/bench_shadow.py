"""Shadowing on and off, side by side: 2 ranks (gloo, one thread each), d_model 1024, d_hidden 4096.

    python benchmarks/bench_shadow.py [--tokens 256] [--num-expert 16] [--reps 3]

Two routings: half of all tokens to expert 0 (the rest spread evenly over the other experts),
and uniform. Forward+backward time per step with shadowing off and on (the real policy, its
constants calibrated on this machine), the ratio, and what the performance model predicts for the
same counts; and, to show what the mechanism itself buys, the hottest expert shadowed whatever
the model says. Writes benchmarks/results/shadow-<device>.json.
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
from common import machine, run_on_ranks, write_json  # noqa: E402
from fmoe.distributed.shadow import ShadowPolicy  # noqa: E402
from fmoe.gates.base import BaseGate, LinearRouter  # noqa: E402
from fmoe.perfmodel import PerfModel, calibrate  # noqa: E402


class PresetGate(BaseGate):
    """Top-1 routing fixed by the scenario; weights from a real router so its gradient flows."""

    def __init__(self, d_model, num_expert, world_size=1, top_k=1, hot_share=0.0, **_):
        super().__init__(d_model, num_expert, world_size, 1)
        self.gate = LinearRouter(d_model, self.tot_expert)
        self.hot_share = hot_share

    def route(self, x_TD):
        T, E = x_TD.shape[0], self.tot_expert
        hot = int(round(self.hot_share * T))
        rest = torch.arange(T - hot, device=x_TD.device)
        others = 1 + rest % (E - 1) if hot else rest % E
        idx_TK = torch.cat([torch.zeros(hot, dtype=torch.long, device=x_TD.device), others])[:, None]
        logits_TE = self.gate(x_TD)
        weight_TK = torch.sigmoid(logits_TE.gather(1, idx_TK).float())
        return idx_TK, weight_TK, weight_TK, logits_TE, logits_TE.new_zeros(())


class AlwaysShadowHottest(ShadowPolicy):
    """Shadows the most loaded expert whatever the model says: what the mechanism itself buys."""

    def choose(self, counts_E, world_size, group=None):
        counts_WE = self.gather_counts(counts_E, world_size, group)
        return [int(counts_WE.sum(0).argmax())]


def step_time(layer, x, reps):
    def step():
        layer(x).sum().backward()
    step()
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        step()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def worker(rank, world, args):
    e = args.num_expert // world
    model = calibrate(PerfModel(args.d_model, args.d_hidden), size=512)
    results = {}
    for scenario, hot_share in (("half_to_one_expert", 0.5), ("uniform", 0.0)):
        row = {}
        for shadow in (False, True, "forced"):
            torch.manual_seed(0)
            policy = {False: False, True: ShadowPolicy(model), "forced": AlwaysShadowHottest(model)}[shadow]
            layer = fmoe.FMoETransformerMLP(num_expert=e, d_model=args.d_model, d_hidden=args.d_hidden, top_k=1,
                                            world_size=world, gate=PresetGate, gate_kwargs={"hot_share": hot_share},
                                            shadow=policy)
            x = torch.randn(args.tokens, args.d_model, requires_grad=True)
            row[{False: "shadow_off", True: "shadow_on", "forced": "shadow_forced"}[shadow]] = step_time(layer, x, args.reps)
            if shadow is True:
                counts_WE = policy.gather_counts(layer.last_counts_E, world)
                row["shadowed_experts"] = policy.model.choose_shadowed(counts_WE)
                row["predicted_off"] = model.layer_time(counts_WE)
                row["predicted_on"] = model.layer_time(counts_WE, row["shadowed_experts"])
        row["speedup"] = row["shadow_off"] / row["shadow_on"]
        row["forced_speedup"] = row["shadow_off"] / row["shadow_forced"]
        row["predicted_speedup"] = row["predicted_off"] / row["predicted_on"]
        results[scenario] = row
    return {"results": results, "model": {"flops": model.flops, "net_bandwidth": model.net_bandwidth}}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=256, help="tokens per rank")
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--d-hidden", type=int, default=4096)
    p.add_argument("--num-expert", type=int, default=16, help="experts in all")
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    out = run_on_ranks(worker, 2, args)
    m = out["model"]
    print(f"2 ranks x 1 thread, gloo; {args.tokens} tokens/rank, D={args.d_model} F={args.d_hidden}, "
          f"{args.num_expert} experts, top-1; model: {m['flops'] / 1e9:.0f} GFLOP/s, {m['net_bandwidth'] / 1e9:.2f} GB/s")
    print(f"{'routing':20s}{'off ms':>9s}{'policy ms':>11s}{'speedup':>9s}{'model says':>12s}  shadowed"
          f"{'hottest forced ms':>19s}{'speedup':>9s}")
    for name, r in out["results"].items():
        print(f"{name:20s}{r['shadow_off'] * 1e3:9.1f}{r['shadow_on'] * 1e3:11.1f}{r['speedup']:8.2f}x"
              f"{r['predicted_speedup']:11.2f}x  {str(r['shadowed_experts']):8s}"
              f"{r['shadow_forced'] * 1e3:19.1f}{r['forced_speedup']:8.2f}x")
    path = write_json(f"shadow-{'cuda' if torch.cuda.is_available() else 'cpu'}.json",
                      {"config": vars(args), "machine": machine(), **out})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
