"""Micro-batches whose expert exchanges hide behind each other's compute, in your own training loop.

    python examples/overlap_micro_batches.py                       # 2 gloo ranks, a simulated slow link
    python examples/overlap_micro_batches.py --ranks 4 --schedule 1f1b

Each rank trains a small transformer-like stack (self-attention, then an MoE layer whose experts are
spread over the ranks) on a batch of 4 micro-batches, gradients accumulated. `train_step` is the
loop to copy: the same `step(micro_batch)` runs either one micro-batch after the other, or through
`fmoe.interleave_micro_batches`, which runs them two at a time, so one's dispatch and combine
travel while the other computes its attention, its experts or its backward. The example runs both
from the same weights under a simulated link (`fmoe.distributed.link.simulated_link`) and prints
each step's time and whether the two gave the same losses and gradients (they do, bit for bit).
"""
import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import fmoe
from fmoe.distributed.link import simulated_link


class Block(nn.Module):
    """Self-attention over sequences of `seq` tokens, then an MoE layer, each on the residual stream."""

    def __init__(self, d_model: int, world: int, seq: int):
        super().__init__()
        self.seq = seq
        self.norm = nn.LayerNorm(d_model)
        self.attention = nn.MultiheadAttention(d_model, 2, batch_first=True)
        self.moe = fmoe.FMoETransformerMLP(num_expert=2, world_size=world, d_model=d_model, d_hidden=2 * d_model,
                                           top_k=2, shared_expert=2 * d_model)

    def forward(self, x):
        h = self.norm(x).view(-1, self.seq, x.shape[-1])
        x = x + self.attention(h, h, h, need_weights=False)[0].reshape(x.shape)
        return x + self.moe(x)


def train_step(model, optimizer, micro_batches, interleave: bool, schedule: str) -> float:
    """One optimiser step over `micro_batches` (gradient accumulation); returns the summed loss."""
    optimizer.zero_grad()

    def step(batch):                    # one micro-batch: forward and backward, gradients accumulate
        x, target = batch
        loss = nn.functional.mse_loss(model(x), target) + 0.01 * fmoe.collect_aux_loss(model)
        (loss / len(micro_batches)).backward()
        return loss.detach()

    if interleave:
        losses = fmoe.interleave_micro_batches(model, step, micro_batches, schedule=schedule)
    else:
        losses = [step(batch) for batch in micro_batches]
    model.allreduce_params()            # the replicated parameters' gradients, averaged over the ranks
    optimizer.step()
    return float(sum(losses))


def run(rank: int, world: int, store: str, args, results: str):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    g = torch.Generator().manual_seed(rank)

    def pair():
        return torch.randn(args.tokens, args.d_model, generator=g), torch.randn(args.tokens, args.d_model, generator=g)
    batches = [[pair() for _ in range(args.micro_batches)] for _ in range(args.steps)]
    runs = {}
    for interleave in (False, True):
        torch.manual_seed(0)
        model = fmoe.DistributedGroupedDataParallel(nn.Sequential(*[Block(args.d_model, world, args.seq)
                                                                    for _ in range(args.layers)]))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        times, losses = [], []
        with simulated_link(args.gbps, args.latency_us):
            for micro_batches in batches:
                dist.barrier()
                began = time.perf_counter()
                losses.append(train_step(model, optimizer, micro_batches, interleave, args.schedule))
                times.append(time.perf_counter() - began)
        runs[interleave] = (times, losses, [p.detach().clone() for p in model.parameters()])
    (loop_times, loop_losses, loop_params), (times, losses, params) = runs[False], runs[True]
    same = loop_losses == losses and all(torch.equal(a, b) for a, b in zip(loop_params, params))
    if rank == 0:
        # the first step of each includes one-off work (the experts' check with the peers): the rest's median
        median = lambda t: sorted(t[1:])[len(t[1:]) // 2] if len(t) > 1 else t[0]   # noqa: E731
        with open(results, "w") as f:
            f.write(f"{median(loop_times) * 1e3:.1f} {median(times) * 1e3:.1f} {same}\n")
    dist.destroy_process_group()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--schedule", choices=("lockstep", "1f1b"), default="lockstep")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256, help="tokens in each micro-batch on each rank")
    parser.add_argument("--seq", type=int, default=32, help="tokens in each attention sequence")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--gbps", type=float, default=0.05, help="the simulated link's Gbit/s each way")
    parser.add_argument("--latency-us", type=float, default=50.0)
    args = parser.parse_args(argv)
    if args.tokens % args.seq:
        parser.error(f"--tokens ({args.tokens}) must be a multiple of --seq ({args.seq})")
    with tempfile.TemporaryDirectory(prefix="fmoe-overlap-example-") as folder:
        results = os.path.join(folder, "results")
        mp.spawn(run, args=(args.ranks, os.path.join(folder, "store"), args, results), nprocs=args.ranks, join=True)
        loop_ms, interleaved_ms, same = open(results).read().split()
    print(f"{args.ranks} ranks, {args.micro_batches} micro-batches a step, a {args.gbps} Gbit/s link:")
    print(f"  one after the other    {float(loop_ms):8.1f} ms a step")
    print(f"  interleaved ({args.schedule:>8s}) {float(interleaved_ms):8.1f} ms a step "
          f"({float(loop_ms) / float(interleaved_ms):.2f}x)")
    print(f"  the same losses and weights, bit for bit: {same}")
    return same == "True"


if __name__ == "__main__":
    raise SystemExit(0 if main() else 1)
