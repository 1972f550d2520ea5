"""Bytes per token of the expert-parallel exchanges, and their gloo step times as information.

    python benchmarks/bench_exchange.py [--out benchmarks/results/exchange-cpu.json] [--ep 2 4 8]
        [--top-k 2 4 8] [--tokens 128] [--d-model 256] [--num-experts 32] [--reps 3]

For each expert-parallel size (gloo processes), top-k and routing (uniform, or Zipf over the
experts), the same tokens and routing go through the layer with `exchange="slot"` (one row per
routed slot out and back: FastMoE's and Megatron's alltoall dispatcher), `"rank"` (one row per
token and distinct destination rank) and, at EP 8 as 2 nodes of 4, `"node"` (across nodes one row
per token and destination node), with and without node-limited routing (`max_nodes=1`). The
bytes are the layer's own counts (`FMoE.traffic_bytes`) summed over the ranks: the rows (token
rows out, expert outputs back, forward and backward) and the routing metadata the deduplicated
exchanges add (split counts, K expert ids and K weights a row, the weights' gradients). The
routing is drawn as a Gumbel top-k sample of the distribution (node-limited: RouterGate's
group-limited top-k with the groups on the nodes). Step times (forward + backward, slowest rank,
median) on gloo over one CPU are information only, not a network measurement.

Nothing is written unless `--out` is given.
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
from common import machine, run_on_ranks  # noqa: E402
from fmoe.app.files import write_json  # noqa: E402
from fmoe.gates import RouterGate  # noqa: E402

NODES_AT_8 = 2          # EP 8 runs as 2 nodes of 4


class SampledGate(RouterGate):
    """RouterGate whose logits are a drawn sample (`sample_TE`) plus nothing of the input (the
    projection still runs, so the weights' gradients have a path back)."""

    sample_TE = None

    def router_logits(self, x_TD):
        return self.gate(x_TD) * 0 + self.sample_TE


def expert_shares(routing: str, num_experts: int, zipf_s: float) -> torch.Tensor:
    if routing == "uniform":
        return torch.full((num_experts,), 1.0 / num_experts)
    ranks = torch.randperm(num_experts, generator=torch.Generator().manual_seed(1)).float()  # hot ones spread
    shares = (ranks + 1) ** -zipf_s
    return shares / shares.sum()


def sampled_logits(routing: str, tokens: int, num_experts: int, zipf_s: float, seed: int) -> torch.Tensor:
    """log share + Gumbel noise: the top-k of it samples k distinct experts from the shares."""
    g = torch.Generator().manual_seed(seed)
    gumbel = -torch.log(-torch.log(torch.rand(tokens, num_experts, generator=g).clamp_min(1e-20)))
    return expert_shares(routing, num_experts, zipf_s).log() + gumbel


def cases(world: int):
    """(exchange, ranks_per_node, max_nodes) variants at this EP size."""
    out = [("slot", None, None), ("rank", None, None)]
    if world == 8:
        per_node = world // NODES_AT_8
        out += [("slot", per_node, None), ("node", per_node, None), ("slot", per_node, 1), ("rank", per_node, 1),
                ("node", per_node, 1)]
    return out


def summed(layer) -> dict:
    """Bytes all ranks sent: rows (dispatch + combine), routing metadata, and rows across nodes."""
    t = layer.traffic_bytes
    mine = torch.tensor([sum(t[k][p][loc] for k in ("dispatch", "combine") for p in t[k] for loc in t[k][p]),
                         sum(t["routing"][p][loc] for p in t["routing"] for loc in t["routing"][p]),
                         sum(t[k][p]["inter_node"] for k in ("dispatch", "combine") for p in t[k])],
                        dtype=torch.float64)
    dist.all_reduce(mine)
    return dict(zip(("rows", "routing", "rows_inter_node"), mine.tolist()))


def step(layer, x, probe):
    out = layer(x)
    (out * probe).sum().backward()


def worker(rank, world, args):
    e = args.num_experts // world
    results = []
    for routing in args.routing:
        for top_k in args.top_k:
            logits = sampled_logits(routing, args.tokens * world, args.num_experts, args.zipf_s, seed=top_k)
            mine = logits[rank * args.tokens:(rank + 1) * args.tokens]
            layers = {}
            for exchange, per_node, max_nodes in cases(world):
                torch.manual_seed(0)
                gate_kwargs = {} if max_nodes is None else {"max_nodes": max_nodes}
                layer = fmoe.FMoETransformerMLP(num_expert=e, d_model=args.d_model, d_hidden=args.d_hidden,
                                                top_k=top_k, world_size=world, gate=SampledGate, exchange=exchange,
                                                ranks_per_node=per_node, gate_kwargs=gate_kwargs)
                layer.gate.sample_TE = mine
                layers[(exchange, per_node, max_nodes)] = layer
            g = torch.Generator().manual_seed(rank)
            x = torch.randn(args.tokens, args.d_model, generator=g, requires_grad=True)
            probe = torch.randn(args.tokens, args.d_model, generator=g)
            times = {key: [] for key in layers}
            for rep in range(args.reps + 1):
                for key, layer in layers.items():
                    dist.barrier()
                    start = time.perf_counter()
                    step(layer, x, probe)
                    slowest = torch.tensor([time.perf_counter() - start])
                    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                    if rep:             # the first round warms up
                        times[key].append(float(slowest))
            for (exchange, per_node, max_nodes), layer in layers.items():
                counted = summed(layer)
                total_tokens = args.tokens * world
                results.append({
                    "ep": world, "routing": routing, "top_k": top_k, "exchange": exchange,
                    "ranks_per_node": per_node or world, "max_nodes": max_nodes,
                    "row_bytes_per_token": counted["rows"] / total_tokens,
                    "routing_bytes_per_token": counted["routing"] / total_tokens,
                    "inter_node_row_bytes_per_token": counted["rows_inter_node"] / total_tokens,
                    "step_s": statistics.median(times[(exchange, per_node, max_nodes)]),
                })
    return results


def with_ratios(rows):
    """Each row against one row per slot on the same EP, routing, top-k, nodes and node limit."""
    def key(r):
        return (r["ep"], r["routing"], r["top_k"], r["ranks_per_node"], r["max_nodes"])
    slot = {key(r): r for r in rows if r["exchange"] == "slot"}
    for r in rows:
        base = slot[key(r)]
        r["rows_vs_slot"] = r["row_bytes_per_token"] / base["row_bytes_per_token"]
        r["all_bytes_vs_slot"] = ((r["row_bytes_per_token"] + r["routing_bytes_per_token"])
                                  / (base["row_bytes_per_token"] + base["routing_bytes_per_token"]))
        inter = base["inter_node_row_bytes_per_token"]
        r["inter_node_rows_vs_slot"] = r["inter_node_row_bytes_per_token"] / inter if inter else None
        r["step_time_vs_slot"] = r["step_s"] / base["step_s"]
    return rows


def print_table(rows, d_model):
    print(f"bytes per token (all ranks, forward + backward; one row = {d_model * 4} B) against one row per slot")
    head = (f"{'EP':>3} {'nodes':>5} {'routing':>8} {'k':>2} {'limit':>5} {'exchange':>8} {'rows B/tok':>11} "
            f"{'x slot':>7} {'+routing':>9} {'inter-node':>10} {'x slot':>7} {'step x slot':>11}")
    print(head)
    for r in rows:
        nodes = r["ep"] // r["ranks_per_node"]
        inter = "" if r["inter_node_rows_vs_slot"] is None else f"{r['inter_node_rows_vs_slot']:.3f}"
        print(f"{r['ep']:>3} {nodes:>5} {r['routing']:>8} {r['top_k']:>2} {str(r['max_nodes'] or '-'):>5} "
              f"{r['exchange']:>8} {r['row_bytes_per_token']:>11.0f} {r['rows_vs_slot']:>7.3f} "
              f"{r['all_bytes_vs_slot']:>9.3f} {r['inter_node_row_bytes_per_token']:>10.0f} {inter:>7} "
              f"{r['step_time_vs_slot']:>11.2f}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here (default: print only)")
    p.add_argument("--ep", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--top-k", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--routing", nargs="+", default=["uniform", "zipf"], choices=["uniform", "zipf"])
    p.add_argument("--zipf-s", type=float, default=1.2, help="Zipf exponent over the experts")
    p.add_argument("--tokens", type=int, default=128, help="tokens per rank")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--d-hidden", type=int, default=256)
    p.add_argument("--num-experts", type=int, default=32, help="experts in all")
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    for world in args.ep:
        if args.num_experts % world:
            p.error(f"--num-experts {args.num_experts} must be a multiple of every --ep, not of {world}")
    if max(args.top_k) > args.num_experts // max(args.ep) * max(args.ep) // NODES_AT_8 and 8 in args.ep:
        p.error("--top-k must fit in one node's experts (node-limited routing at EP 8 keeps a token on one node)")
    rows = []
    for world in args.ep:
        rows += run_on_ranks(worker, world, args)
    rows = with_ratios(rows)
    print_table(rows, args.d_model)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        write_json(args.out, {"config": config, "machine": machine(), "results": rows}, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
