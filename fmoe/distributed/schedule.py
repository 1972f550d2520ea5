"""FasterMoE's smart schedule: the exchange split by groups of ranks and pipelined.

Step s talks to the ranks at offsets [s*g, (s+1)*g) around the ring: rows go to rank + o and
come from rank - o. While the rows of step s+1 travel (asynchronous point-to-point), the experts
compute the rows of step s, whose outputs then travel back while step s+1 computes. The backward
runs the same pipeline on the gradients. Outputs and gradients equal the plain exchange.

The rank exchange (`fmoe.distributed.dedup`) pipelines the same way: its rows (one per token
and rank, the routing weights riding along as extra columns) are computed source by source,
each chunk fanned out to the experts by the ids it came with.
"""
from typing import List, Optional

import torch
import torch.distributed as dist

from fmoe.distributed.exchange import ExchangePlan, expert_major_order
from fmoe.distributed.link import Pending, all_to_all_bytes, start
from fmoe.env import env_flag, env_int

DISPATCH, COMBINE, GRAD_OUT, GRAD_IN = 0, 1, 2, 3      # message tags, one per direction of travel


def schedule_enabled_by_env() -> bool:
    return env_flag("FMOE_FASTER_SCHEDULE_ENABLE")


def group_size_from_env() -> int:
    return env_int("FMOE_FASTER_GROUP_SIZE", 4)


def _offsets(split_sizes: List[int]) -> List[int]:
    out, total = [], 0
    for n in split_sizes:
        out.append(total)
        total += n
    return out


class _Ring:
    """Who talks to whom at each step, and where their rows sit in the send and receive buffers."""

    def __init__(self, plan: ExchangePlan, group_size: int):
        self.group = plan.group
        self.world = len(plan.send_splits_W)
        self.rank = dist.get_rank(self.group)
        g = max(1, min(group_size, self.world))
        self.steps = [list(range(s, min(s + g, self.world))) for s in range(0, self.world, g)]
        self.send_splits, self.recv_splits = plan.send_splits_W, plan.recv_splits_W
        self.send_offsets, self.recv_offsets = _offsets(self.send_splits), _offsets(self.recv_splits)
        self.recv_counts_We = getattr(plan, "recv_counts_We", None)    # None: the rank exchange's hop

    def peer(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank

    def sources(self, step: int) -> List[int]:
        return [(self.rank - o) % self.world for o in self.steps[step]]

    def dests(self, step: int) -> List[int]:
        return [(self.rank + o) % self.world for o in self.steps[step]]

    def post(self, step, outgoing, out_offsets, out_splits, out_peers, incoming, in_offsets, in_splits,
             in_peers, tag) -> Pending:
        """Asynchronous sends of outgoing[rows for each out peer] and receives into incoming."""
        works, sent, received = [], [0] * self.world, [0] * self.world
        for dst, src in zip(out_peers, in_peers):
            if dst == self.rank:
                n = out_splits[dst]
                incoming[in_offsets[src]:in_offsets[src] + n] = outgoing[out_offsets[dst]:out_offsets[dst] + n]
                continue
            if in_splits[src]:
                works.append(dist.irecv(incoming[in_offsets[src]:in_offsets[src] + in_splits[src]],
                                        src=self.peer(src), group=self.group, tag=tag))
                received[src] = in_splits[src]
            if out_splits[dst]:
                works.append(dist.isend(outgoing[out_offsets[dst]:out_offsets[dst] + out_splits[dst]].contiguous(),
                                        dst=self.peer(dst), group=self.group, tag=tag))
                sent[dst] = out_splits[dst]
        row = outgoing.shape[1:].numel() * outgoing.element_size()
        return start(works, "the smart schedule's point-to-point exchange",
                     all_to_all_bytes(sent, received, row, self.rank))

    def chunk_rows(self, step: int) -> torch.Tensor:
        """Positions in the receive buffer of the rows computed at `step`, in expert-major order
        (the rank exchange's: as received, its experts' fan-out sorts them)."""
        sources = self.sources(step)
        ranges = [torch.arange(self.recv_offsets[s], self.recv_offsets[s] + self.recv_splits[s]) for s in sources]
        source_major = torch.cat(ranges) if ranges else torch.zeros(0, dtype=torch.long)
        if self.recv_counts_We is None:
            return source_major
        return source_major[expert_major_order(self.recv_counts_We[sources].cpu())]

    def chunk_arg(self, step: int, rows: torch.Tensor) -> torch.Tensor:
        """What the experts take beside the chunk's rows: rows per local expert, or (the rank
        exchange) the rows' positions in the receive buffer."""
        if self.recv_counts_We is None:
            return rows
        return self.recv_counts_We[self.sources(step)].sum(0)


def _wait(pendings):
    for pending in pendings if isinstance(pendings, list) else [pendings]:
        pending.wait()


class ScheduledExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_sent, plan: ExchangePlan, experts, group_size: int, *params):
        ring = _Ring(plan, group_size)
        D = x_sent.shape[1]
        received = x_sent.new_empty(sum(ring.recv_splits), D)
        y_sent = None
        chunks, combine_works = [], []
        inflight = ring.post(0, x_sent, ring.send_offsets, ring.send_splits, ring.dests(0), received,
                             ring.recv_offsets, ring.recv_splits, ring.sources(0), DISPATCH)
        outputs = None
        for step in range(len(ring.steps)):
            _wait(inflight)
            if step + 1 < len(ring.steps):
                inflight = ring.post(step + 1, x_sent, ring.send_offsets, ring.send_splits, ring.dests(step + 1),
                                     received, ring.recv_offsets, ring.recv_splits, ring.sources(step + 1), DISPATCH)
            rows = ring.chunk_rows(step)
            with torch.enable_grad():
                x_chunk = received.index_select(0, rows).detach().requires_grad_(x_sent.requires_grad)
                y_chunk = experts(x_chunk, ring.chunk_arg(step, rows))
            chunks.append((rows, x_chunk, y_chunk))
            if outputs is None:
                outputs = y_chunk.new_empty(received.shape[0], y_chunk.shape[1])
                y_sent = y_chunk.new_empty(x_sent.shape[0], y_chunk.shape[1])
            outputs[rows] = y_chunk.detach()
            combine_works.append(ring.post(step, outputs, ring.recv_offsets, ring.recv_splits, ring.sources(step),
                                       y_sent, ring.send_offsets, ring.send_splits, ring.dests(step), COMBINE))
        _wait(combine_works)
        ctx.ring, ctx.chunks, ctx.params = ring, chunks, params
        ctx.out_width = y_sent.shape[1]
        return y_sent

    @staticmethod
    def backward(ctx, grad_y_sent):
        ring, chunks, params = ctx.ring, ctx.chunks, ctx.params
        grad_y_sent = grad_y_sent.contiguous()
        grad_outputs = grad_y_sent.new_empty(sum(ring.recv_splits), ctx.out_width)
        grad_received = None
        grad_x_sent = None
        param_grads = [None] * len(params)
        return_works = []
        inflight = ring.post(0, grad_y_sent, ring.send_offsets, ring.send_splits, ring.dests(0), grad_outputs,
                             ring.recv_offsets, ring.recv_splits, ring.sources(0), GRAD_OUT)
        for step, (rows, x_chunk, y_chunk) in enumerate(chunks):
            _wait(inflight)
            if step + 1 < len(chunks):
                inflight = ring.post(step + 1, grad_y_sent, ring.send_offsets, ring.send_splits, ring.dests(step + 1),
                                     grad_outputs, ring.recv_offsets, ring.recv_splits, ring.sources(step + 1),
                                     GRAD_OUT)
            inputs = ([x_chunk] if x_chunk.requires_grad else []) + list(params)
            with torch.enable_grad():
                grads = torch.autograd.grad(y_chunk, inputs, grad_outputs.index_select(0, rows), allow_unused=True)
            if x_chunk.requires_grad:
                grad_x_chunk, grads = grads[0], grads[1:]
                if grad_received is None:
                    grad_received = grad_x_chunk.new_empty(grad_outputs.shape[0], grad_x_chunk.shape[1])
                    grad_x_sent = grad_x_chunk.new_empty(grad_y_sent.shape[0], grad_x_chunk.shape[1])
                grad_received[rows] = grad_x_chunk
                return_works.append(ring.post(step, grad_received, ring.recv_offsets, ring.recv_splits,
                                              ring.sources(step), grad_x_sent, ring.send_offsets, ring.send_splits,
                                              ring.dests(step), GRAD_IN))
            for i, g in enumerate(grads):
                if g is not None:
                    param_grads[i] = g if param_grads[i] is None else param_grads[i] + g
        _wait(return_works)
        ctx.chunks = None
        return (grad_x_sent, None, None, None, *param_grads)


def scheduled_experts(experts, x_sent: torch.Tensor, plan: ExchangePlan, group_size: Optional[int] = None,
                      params=None):
    """dispatch -> experts -> combine as one pipelined step; same result as doing them in turn.
    `experts(x_chunk, counts_e)` (or, for a rank exchange's hop, `experts(x_chunk, rows)`);
    `params`: the parameters it uses (default: `experts.parameters()`)."""
    group_size = group_size or group_size_from_env()
    if group_size < 1:
        raise ValueError(f"group_size (or FMOE_FASTER_GROUP_SIZE) must be >= 1, got {group_size}")
    params = [p for p in (experts.parameters() if params is None else params) if p.requires_grad]
    return ScheduledExperts.apply(x_sent, plan, experts, group_size, *params)
