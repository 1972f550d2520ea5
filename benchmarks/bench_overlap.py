"""How much of a slow link each overlap mode hides: gloo ranks on this machine, a simulated link.

    python benchmarks/bench_overlap.py                                   # 2 and 4 ranks, prints a table
    python benchmarks/bench_overlap.py --out benchmarks/results/overlap-cpu.json
    python benchmarks/bench_overlap.py --quick                           # smoke: 2 ranks, few steps

Each rank trains one MoE layer with shared experts (fmoe's FMoETransformerMLP, expert parallel over
the ranks; `--attention-seq S`: after a self-attention block; `--layers N`: N such blocks on a residual
stream) forward+backward, 2048 tokens a rank.
The modes: overlap="none", "shared", "pipeline", "auto" (which is "pipeline" here), FasterMoE's smart
schedule, and the step as two micro-batches interleaved (fmoe.interleave_micro_batches, "auto" inside, which
sends in one chunk there;
its two schedules, "lockstep" and "1f1b") or one after the other in line (the loop, their baseline),
and the deduplicated rank exchange ("none", "shared", "pipeline": its last hop in chunks).
First without a link, overlap="none": the step's compute (and the real, local exchange). The link (`fmoe.distributed.link`) is then set so that the bytes one step carries
on a rank take as long as that step: communication about equal to compute. Every mode then runs
under it, the modes taking turns step by step. For each mode,

    hidden = (none with the link - mode with the link) / (none with the link - none without it)

is the share of the link's time taken off the step (1: all hidden, 0: none); for the interleaved
micro-batches also `hidden_of_the_loop`, the same against the loop of the same two micro-batches
(the link's time of the same work, half-size micro-batches' own cost aside), and for the rank
exchange's rows `hidden_of_its_exchange`, against its own "none" (it moves fewer bytes). Medians of the
slowest rank's step time. Also the largest difference of the mode's outputs and gradients from
"none" (0.0: bit-identical; the two micro-batches sum each half's tokens apart, so rounding), and
each mode's step without the link. Prints a table; writes JSON only to --out.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine  # noqa: E402

import fmoe  # noqa: E402
from fmoe.distributed import link  # noqa: E402
from fmoe.distributed.pipeline import pipeline_chunks_for  # noqa: E402

# What each row runs: the layer's overlap=, whether FasterMoE's smart schedule (one rank a step)
# pipelines the exchange with the experts too (an older, opt-in overlap: equal to rounding, not bitwise),
# and whether the step's tokens run as two micro-batches (half the tokens each, gradients accumulated;
# equal to one batch up to rounding, the tokens' sums split): interleaved by fmoe.interleave_micro_batches
# under its schedule ("1f1b": one's forward beside the other's backward; "lockstep": forwards side by
# side, then backwards), or one after the other ("loop": the same work with nothing interleaved).
MODES = {"none": ("none", False, None), "shared": ("shared", False, None), "pipeline": ("pipeline", False, None),
         "auto": ("auto", False, None), "pipeline, weight grads in line": ("pipeline", False, None),
         "shared+schedule": ("shared", True, None), "two micro-batches": ("auto", False, "lockstep"),
         "two micro-batches, 1f1b": ("auto", False, "1f1b"),
         "two micro-batches, none, loop": ("none", False, "loop"),
         "rank exchange, none": ("none", False, None), "rank exchange, shared": ("shared", False, None),
         "rank exchange, pipeline": ("pipeline", False, None)}
# The rows on the deduplicated rank exchange (fewer bytes than the slot exchange's: their own baseline)
RANK_EXCHANGE = {"rank exchange, none", "rank exchange, shared", "rank exchange, pipeline"}
# The rows whose backward computes the experts' weight gradients in line (layer.defer_weight_grads = False):
# the others send the input gradient first and compute them while it travels (fmoe.kernels.deferred).
IN_LINE_WEIGHT_GRADS = {"pipeline, weight grads in line"}


class Block(torch.nn.Module):
    """The MoE layer, after a self-attention block when `seq` is given (a transformer layer: what
    the other micro-batch computes while one's exchange travels); tokens [N, D] are N / seq sequences."""

    def __init__(self, moe: fmoe.FMoETransformerMLP, d_model: int, seq: int = 0):
        super().__init__()
        self.moe, self.seq = moe, seq
        if seq:
            self.norm = torch.nn.LayerNorm(d_model)
            self.attention = torch.nn.MultiheadAttention(d_model, max(1, d_model // 64), batch_first=True)

    def forward(self, x):
        if self.seq:
            h = self.norm(x).view(-1, self.seq, x.shape[-1])
            x = x + self.attention(h, h, h, need_weights=False)[0].reshape(x.shape)
        return self.moe(x)


class Stack(torch.nn.Module):
    """`--layers` blocks, each added to its input (a residual stream); `moe` is the first block's layer (the
    components are measured on it), `moes` all of them."""

    def __init__(self, blocks):
        super().__init__()
        self.blocks = torch.nn.ModuleList(blocks)

    @property
    def moe(self):
        return self.blocks[0].moe

    @property
    def moes(self):
        return [block.moe for block in self.blocks]

    def forward(self, x):
        if len(self.blocks) == 1:
            return self.blocks[0](x)
        for block in self.blocks:
            x = x + block(x)
        return x


def build(world: int, mode: str, args) -> Stack:
    overlap, schedule, _ = MODES[mode]
    torch.manual_seed(0)
    blocks = []
    for _ in range(args.layers):
        moe = fmoe.FMoETransformerMLP(num_expert=args.experts, world_size=world, d_model=args.d_model,
                                      d_hidden=args.d_hidden, top_k=args.top_k, gate="naive",
                                      shared_expert=args.shared_hidden, overlap=overlap, schedule=schedule,
                                      schedule_group_size=1, exchange="rank" if mode in RANK_EXCHANGE else "slot")
        moe.defer_weight_grads = mode not in IN_LINE_WEIGHT_GRADS
        blocks.append(Block(moe, args.d_model, args.attention_seq))
    return Stack(blocks)


def step(layer, x, probe, micro_batches=None):
    """One forward+backward of the tokens x (as two micro-batches run as `micro_batches` says: "lockstep",
    "1f1b", "loop"; None: one batch): their outputs and x's gradient."""
    x = x.detach().requires_grad_(True)
    if not micro_batches:
        y = layer(x)
        (y * probe).sum().backward()
        return y.detach(), x.grad

    def half(rows):
        y = layer(x[rows])
        (y * probe[rows]).sum().backward()
        return y.detach()
    middle = len(x) // 2
    halves = [slice(0, middle), slice(middle, None)]
    if micro_batches == "loop":
        ys = [half(rows) for rows in halves]
    else:
        ys = fmoe.interleave_micro_batches(layer, half, halves, schedule=micro_batches)
    return torch.cat(ys), x.grad


def slowest(seconds: float) -> float:
    """The step time of the slowest rank: the step is done when every rank is."""
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def timed_steps(layers: dict, x, probe, steps: int, gbps) -> dict:
    """Median step seconds of each layer, the layers taking turns, under the link `gbps` (None: none)."""
    times = {name: [] for name in layers}
    with link.simulated_link(gbps):
        for _ in range(steps):
            for name, layer in layers.items():
                dist.barrier()
                began = time.perf_counter()
                step(layer, x, probe, MODES[name][2])
                times[name].append(slowest(time.perf_counter() - began))
    return {name: statistics.median(t) for name, t in times.items()}


def median_seconds(run, steps: int) -> float:
    """Median seconds of run() on the slowest rank."""
    times = []
    for _ in range(steps):
        dist.barrier()
        began = time.perf_counter()
        run()
        times.append(slowest(time.perf_counter() - began))
    return statistics.median(times)


def components(layer: Stack, x, probe, steps: int) -> dict:
    """Seconds of the step's parts, forward + backward, without a link (what `fmoe simulate --overlap`
    builds its timeline from): the shared experts on the tokens, the routed experts on as many rows
    as the tokens have slots (spread evenly over the local experts), both summed over the layers, and
    the rest of the step."""
    moe = layer.moe

    def shared():
        x_in = x.detach().requires_grad_(True)
        y = sum(expert(x_in) for expert in moe.shared_experts)
        (y * probe).sum().backward()

    rows = x.shape[0] * moe.top_k
    counts = torch.full((moe.num_expert,), rows // moe.num_expert, dtype=torch.int64)
    counts[: rows % moe.num_expert] += 1
    x_rows, probe_rows = x.repeat(moe.top_k, 1), probe.repeat(moe.top_k, 1)
    weights = torch.ones(rows)

    def experts():
        x_in = x_rows.detach().requires_grad_(True)
        (moe.experts(x_in, counts, weights, lean=True) * probe_rows).sum().backward()

    whole = median_seconds(lambda: step(layer, x, probe), steps)
    layers = len(layer.moes)
    parts = {"shared": layers * median_seconds(shared, steps), "experts": layers * median_seconds(experts, steps)}
    layer.zero_grad()
    return {"other": max(whole - parts["shared"] - parts["experts"], 0.0), **parts}


def link_bytes(layer) -> int:
    """Bytes one step carried: what the busiest rank sent to the others, forward and backward."""
    sent = sum(moe.traffic.total() for moe in layer.moes)
    total = torch.tensor([sent], dtype=torch.float64)
    dist.all_reduce(total, op=dist.ReduceOp.MAX)
    return int(total)


def rank_main(rank: int, world: int, store: str, args, out_file: str):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.tokens, args.d_model, generator=g)
    probe = torch.randn(args.tokens, args.d_model, generator=g)
    modes = [mode for mode in MODES if mode in args.modes]
    layers = {mode: build(world, mode, args) for mode in modes}
    reference = step(layers["none"], x, probe)
    grads = {n: p.grad.clone() for n, p in layers["none"].named_parameters()}
    difference = {}
    for mode in modes[1:]:
        out = step(layers[mode], x, probe, MODES[mode][2])
        diffs = [(a - b).abs().max().item() for a, b in zip(out, reference)]
        diffs += [(p.grad - grads[n]).abs().max().item() for n, p in layers[mode].named_parameters()]
        difference[mode] = max(diffs)
    for layer in layers.values():
        layer.zero_grad()
    without_link = timed_steps(layers, x, probe, args.steps, None)
    compute = without_link["none"]
    for moe in layers["none"].moes:
        moe.traffic.reset()
    step(layers["none"], x, probe)
    carried = link_bytes(layers["none"])
    gbps = carried * 8 / (compute * 1e9)            # the link's time for one step's bytes = the step's compute
    parts = components(layers["none"], x, probe, args.steps)
    with link.simulated_link(gbps):                 # what overlap="pipeline" picks under this link
        chunks = pipeline_chunks_for(build(world, "pipeline", args).moe, x.new_empty(args.tokens * args.top_k, 0),
                                     agree=False)
    with_link = timed_steps(layers, x, probe, args.steps, gbps)
    if rank == 0:
        link_seconds = with_link["none"] - compute
        result = {"world": world, "compute_s": compute, "link_gbps": gbps, "link_bytes_per_step": carried,
                  "link_s": link_seconds, "components_s": parts, "pipeline_chunks": chunks, "modes": {}}
        for mode in modes:
            result["modes"][mode] = {
                "overlap": layers[mode].moe.overlap, "schedule": MODES[mode][1], "micro_batches": 2 if MODES[mode][2] else 1,
                "micro_batch_schedule": MODES[mode][2], "exchange": layers[mode].moe.exchange,
                # (the rank exchange computes its experts' weight gradients in line)
                "defer_weight_grads": mode not in IN_LINE_WEIGHT_GRADS | RANK_EXCHANGE and layers[mode].moe.overlap != "none",
                "step_s": with_link[mode], "step_s_without_link": without_link[mode],
                "hidden": (with_link["none"] - with_link[mode]) / link_seconds if link_seconds > 0 else None,
                "max_difference_from_none": difference.get(mode, 0.0)}
            own = "rank exchange, none"
            if mode in RANK_EXCHANGE and own in with_link and mode != own:
                # the rank exchange's link time, in line, and the share hidden of it
                own_link = with_link[own] - without_link[own]
                result["modes"][mode]["hidden_of_its_exchange"] = \
                    (with_link[own] - with_link[mode]) / own_link if own_link > 0 else None
            if MODES[mode][2] in ("1f1b", "lockstep") and "two micro-batches, none, loop" in with_link:
                # the same two micro-batches' link time, run one after the other in line, and the share hidden of it
                loop = "two micro-batches, none, loop"
                loop_link = with_link[loop] - without_link[loop]
                result["modes"][mode]["hidden_of_the_loop"] = \
                    (with_link[loop] - with_link[mode]) / loop_link if loop_link > 0 else None
        with open(out_file, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def run_world(world: int, args) -> dict:
    with tempfile.TemporaryDirectory(prefix="fmoe-bench-overlap-") as folder:
        out_file = os.path.join(folder, "rank0.json")
        mp.spawn(rank_main, args=(world, os.path.join(folder, "store"), args, out_file), nprocs=world, join=True)
        with open(out_file) as f:
            return json.load(f)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--tokens", type=int, default=2048, help="tokens on each rank")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--d-hidden", type=int, default=256, help="each routed expert's hidden width")
    parser.add_argument("--shared-hidden", type=int, default=1024, help="the shared expert's hidden width")
    parser.add_argument("--experts", type=int, default=4, help="experts on each rank")
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--layers", type=int, default=1, help="blocks in the model (each: attention if asked, MoE)")
    parser.add_argument("--attention-seq", type=int, default=0, metavar="S",
                        help="a self-attention block before the MoE layer, over sequences of S tokens (0: none)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES), metavar="MODE",
                        help="the rows to run (\"none\" always runs: the others are measured against it); default: all")
    parser.add_argument("--quick", action="store_true", help="2 ranks, 3 steps, small shapes")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    args.modes = ["none"] + [mode for mode in args.modes if mode != "none"]
    if args.quick:
        args.ranks, args.steps, args.tokens, args.d_model, args.d_hidden, args.shared_hidden = [2], 3, 64, 32, 32, 64
    results = [run_world(world, args) for world in args.ranks]
    print(f"{'ranks':>5} {'mode':>17} {'runs':>7} {'step ms':>8} {'no link':>8} {'hidden':>7} {'max diff':>9}   "
          "(link: Gbit/s, its ms a step; compute ms a step)")
    for r in results:
        for mode, m in r["modes"].items():
            hidden = "" if m["hidden"] is None else f"{m['hidden']:.2f}"
            if m.get("hidden_of_the_loop") is not None:
                hidden += f" ({m['hidden_of_the_loop']:.2f} of the loop's)"
            if m.get("hidden_of_its_exchange") is not None:
                hidden += f" ({m['hidden_of_its_exchange']:.2f} of its own)"
            print(f"{r['world']:>5} {mode:>17} {m['overlap']:>7} {m['step_s'] * 1e3:8.1f} {m['step_s_without_link'] * 1e3:8.1f} {hidden:>7} "
                  f"{m['max_difference_from_none']:9.2g}   ({r['link_gbps']:.3f} Gbit/s, {r['link_s'] * 1e3:.0f} ms; "
                  f"{r['compute_s'] * 1e3:.0f} ms)")
    if args.out:
        report = {"machine": machine(), "command": " ".join(["python benchmarks/bench_overlap.py", *(argv or sys.argv[1:])]),
                  "shape": {k: getattr(args, k) for k in ("tokens", "d_model", "d_hidden", "shared_hidden", "experts",
                                                           "top_k", "steps", "attention_seq", "layers")},
                  "results": results}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
