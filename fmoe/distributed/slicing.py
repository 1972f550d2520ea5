"""Tensor-parallel input slicing (FastMoE's `slice_group`): ranks that hold the same input each
route one slice of the batch, and the outputs are gathered back so every rank has the whole batch."""
import torch
import torch.distributed as dist


def _all_gather_rows(x, group):
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=0)


class SliceRows(torch.autograd.Function):
    """This rank's block of rows; the backward gathers every rank's gradient block."""

    @staticmethod
    def forward(ctx, x_TD, group):
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if x_TD.shape[0] % size:
            raise ValueError(f"slice_group: {x_TD.shape[0]} tokens cannot be split evenly over its {size} ranks")
        ctx.group = group
        rows = x_TD.shape[0] // size
        return x_TD[rank * rows:(rank + 1) * rows]

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_rows(grad, ctx.group), None


class GatherRows(torch.autograd.Function):
    """Every rank's block of rows, in rank order; the backward keeps this rank's block."""

    @staticmethod
    def forward(ctx, y_TD, group):
        ctx.group, ctx.rows = group, y_TD.shape[0]
        return _all_gather_rows(y_TD, group)

    @staticmethod
    def backward(ctx, grad):
        rank = dist.get_rank(ctx.group)
        return grad[rank * ctx.rows:(rank + 1) * ctx.rows], None


def slice_rows(x, group):
    return SliceRows.apply(x, group)


def gather_rows(y, group):
    return GatherRows.apply(y, group)
