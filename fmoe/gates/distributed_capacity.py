"""Capacity decided over the whole expert-parallel group (FastMoE's `limit_by_capacity` and
SWIPE). Every rank gathers everyone's counts and computes the same decision; slots are taken
first-come: ranks in order, then this rank's slots in token order."""
import torch
import torch.distributed as dist

from fmoe.gates.capacity import count_live_per_expert, inverse_permutation


def group_size(group) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def gather_counts(counts_X: torch.Tensor, group) -> torch.Tensor:
    """counts_WX: every rank's counts (rank-major); one row on a single process."""
    W = group_size(group)
    if W == 1:
        return counts_X[None]
    everyone = [torch.empty_like(counts_X) for _ in range(W)]
    dist.all_gather(everyone, counts_X.contiguous(), group=group)
    return torch.stack(everyone)


def accepted_first_come(counts_WX: torch.Tensor, capacity_X: torch.Tensor) -> torch.Tensor:
    """How many of each rank's slots each target accepts, taking ranks in order until full."""
    before_WX = torch.cumsum(counts_WX, 0) - counts_WX
    return torch.minimum(counts_WX, (capacity_X[None] - before_WX).clamp_min(0))


def keep_first(target_S: torch.Tensor, allowed_X: torch.Tensor) -> torch.Tensor:
    """A mask over slots: the first allowed_X[x] slots of each target x (in slot order); -1 never."""
    live_S = target_S >= 0
    target = target_S.clamp_min(0)
    order = torch.sort(torch.where(live_S, target, allowed_X.numel()), stable=True).indices
    sorted_target = target[order]
    counts = count_live_per_expert(target_S, allowed_X.numel())
    starts = torch.cumsum(counts, 0) - counts
    rank_in_target = torch.arange(order.numel(), device=order.device) - starts[sorted_target]
    keep = (rank_in_target < allowed_X[sorted_target])[inverse_permutation(order)]
    return keep & live_S


def limit_by_capacity(topk_idx, num_expert: int, world_size: int, capacity: int, group=None):
    """FastMoE's helper: each expert takes at most `capacity` slots from the whole group.
    Returns (this rank's accepted slots per expert, the same for every rank [W, E], pruned idx)."""
    idx_S = topk_idx.reshape(-1)
    tot = num_expert * world_size
    counts_E = count_live_per_expert(idx_S, tot)
    counts_WE = gather_counts(counts_E, group if world_size > 1 else None)
    accepted_WE = accepted_first_come(counts_WE, torch.full_like(counts_E, capacity))
    me = dist.get_rank(group) if counts_WE.shape[0] > 1 else 0
    keep_S = keep_first(idx_S, accepted_WE[me])
    pruned = torch.where(keep_S, idx_S, torch.full_like(idx_S, -1)).view_as(topk_idx)
    return accepted_WE[me], accepted_WE, pruned
