"""Expert-parallel exchange: counts first, then rows, with autograd all-to-all and uneven splits.

Rows leave a rank sorted by global expert, so by destination rank. They arrive sorted by source
rank, then by local expert; `recv_order_R` regroups them expert-major for the grouped GEMM and
its inverse puts them back before the return trip. Every all-to-all is waited on with the
collective timeout and names its layer when it gives up.
"""
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

from fmoe.distributed.timeout import current_layer, wait


@dataclass
class ExchangePlan:
    send_splits_W: List[int]        # rows this rank sends to each rank
    recv_splits_W: List[int]        # rows this rank receives from each rank
    local_counts_e: torch.Tensor    # rows each local expert receives, from all ranks
    recv_counts_We: torch.Tensor    # rows from source rank w for local expert j
    recv_order_R: torch.Tensor      # expert-major position -> position in the received buffer
    group: Optional[dist.ProcessGroup]
    layer: str = "an fmoe layer"    # who the exchange belongs to, for timeout messages


def exchange_counts(counts_E: torch.Tensor, world_size: int, group=None) -> torch.Tensor:
    """Everyone tells everyone how many rows it sends to each expert: returns recv_counts_We."""
    send = counts_E.reshape(world_size, -1).contiguous()
    recv = torch.empty_like(send)
    wait(dist.all_to_all_single(recv, send, group=group, async_op=True), f"{current_layer()}: counts all-to-all")
    return recv


def expert_major_order(recv_counts_We: torch.Tensor) -> torch.Tensor:
    """Index that regroups rows received source-major (w, j) into expert-major (j, w) order."""
    W, e = recv_counts_We.shape
    counts = recv_counts_We.reshape(-1)
    starts_We = (torch.cumsum(counts, 0) - counts).view(W, e)
    starts_eW, counts_eW = starts_We.t().reshape(-1), recv_counts_We.t().reshape(-1)
    total = int(counts.sum())
    seg_start = torch.repeat_interleave(starts_eW, counts_eW, output_size=total)
    seg_first_row = torch.repeat_interleave(torch.cumsum(counts_eW, 0) - counts_eW, counts_eW, output_size=total)
    return seg_start + torch.arange(total, device=counts.device) - seg_first_row


def build_exchange_plan(counts_E: torch.Tensor, world_size: int, group=None) -> ExchangePlan:
    recv_counts_We = exchange_counts(counts_E, world_size, group)
    return ExchangePlan(
        send_splits_W=counts_E.reshape(world_size, -1).sum(1).tolist(),
        recv_splits_W=recv_counts_We.sum(1).tolist(),
        local_counts_e=recv_counts_We.sum(0),
        recv_counts_We=recv_counts_We,
        recv_order_R=expert_major_order(recv_counts_We),
        group=group,
        layer=current_layer(),
    )


class AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; the backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group, what):
        ctx.splits, ctx.group, ctx.what = (send_splits, recv_splits), group, what
        out = x.new_empty((sum(recv_splits),) + tuple(x.shape[1:]))
        wait(dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group, async_op=True), what)
        return out

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        back = AllToAll.apply(grad.contiguous(), recv_splits, send_splits, ctx.group, f"{ctx.what} (backward)")
        return back, None, None, None, None


class Reorder(torch.autograd.Function):
    """out = x[order] for a permutation `order`; the backward gathers by the inverse (no scatter-add)."""

    @staticmethod
    def forward(ctx, x, order):
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        ctx.save_for_backward(inverse)
        return x.index_select(0, order)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return Reorder.apply(grad.contiguous(), inverse), None


def dispatch(x_ND: torch.Tensor, plan) -> torch.Tensor:
    """Send rows to their experts' ranks; return the rows this rank's experts take, expert-major.

    `plan` is a RoutingPlan; identity when it has no exchange (one rank).
    """
    plan = plan.exchange
    if plan is None:
        return x_ND
    x_RD = AllToAll.apply(x_ND, plan.send_splits_W, plan.recv_splits_W, plan.group, f"{plan.layer}: dispatch all-to-all")
    return Reorder.apply(x_RD, plan.recv_order_R)


def combine(y_RD: torch.Tensor, plan) -> torch.Tensor:
    """Send expert outputs back to the ranks their rows came from, in the order they left."""
    plan = plan.exchange
    if plan is None:
        return y_RD
    inverse = torch.empty_like(plan.recv_order_R)
    inverse[plan.recv_order_R] = torch.arange(plan.recv_order_R.numel(), device=inverse.device)
    y_RD = Reorder.apply(y_RD, inverse)
    return AllToAll.apply(y_RD, plan.recv_splits_W, plan.send_splits_W, plan.group, f"{plan.layer}: combine all-to-all")
