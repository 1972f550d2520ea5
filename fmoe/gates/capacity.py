"""Expert capacity: how many slots an expert may take, and which slots are dropped past it."""
import math

import torch


def expert_capacity(capacity_factor: float, num_tokens: int, top_k: int, tot_expert: int) -> int:
    """Slots one expert may take: ceil(factor * tokens * top_k / experts) (GShard, Switch)."""
    return int(math.ceil(capacity_factor * num_tokens * top_k / tot_expert))


def fastmoe_capacity(capacity_factor: float, num_tokens: int, top_k: int, tot_expert: int) -> int:
    """FastMoE's GShard capacity: ceil(factor * tokens) * top_k // experts (rounds down after)."""
    return int(math.ceil(capacity_factor * num_tokens)) * top_k // tot_expert


CAPACITY_FORMULAS = {"exact": expert_capacity, "fastmoe": fastmoe_capacity}


def count_per_expert(idx_N: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many of `idx_N` (ids in [0, num_experts)) name each expert; unlike `bincount` its size
    is known without reading the ids, so no device-to-host sync."""
    counts_E = torch.zeros(num_experts, dtype=torch.long, device=idx_N.device)
    return counts_E.scatter_add_(0, idx_N.reshape(-1), torch.ones_like(idx_N.reshape(-1)))


def count_live_per_expert(idx_N: torch.Tensor, num_experts: int) -> torch.Tensor:
    """`count_per_expert` of the ids that name an expert (-1 names none)."""
    return count_per_expert(torch.where(idx_N >= 0, idx_N, num_experts), num_experts + 1)[:-1]


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """`inv` with inv[order[i]] = i, by a gather rather than a scatter: Inductor (torch 2.13, grad
    enabled) fused a read of a scattered mask before the scatter, so every slot read as dropped."""
    return torch.argsort(order)


def drop_over_capacity(expert_idx_TK, weight_TK, score_TK, tot_expert: int, capacity: int):
    """Keep each expert's `capacity` highest-scoring slots; drop the rest (index -1, weight 0).

    Deterministic: ties in score are broken by slot order (token-major, then k).
    Returns (expert_idx_TK, weight_TK, num_dropped).
    """
    idx_N = expert_idx_TK.reshape(-1)
    score_N = score_TK.reshape(-1).detach().float()
    live_N = idx_N >= 0
    # Stable sorts: by score descending, then by expert, so each expert's slots end up ranked.
    by_score = torch.sort(-score_N, stable=True).indices
    key = torch.where(live_N, idx_N, tot_expert)[by_score]
    by_expert = torch.sort(key, stable=True).indices
    order = by_score[by_expert]
    sorted_expert = key[by_expert]
    counts = count_per_expert(sorted_expert, tot_expert + 1)
    starts = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.arange(order.numel(), device=order.device) - starts[sorted_expert]
    keep_sorted = (rank_in_expert < capacity) & (sorted_expert < tot_expert)
    keep_N = keep_sorted[inverse_permutation(order)]
    dropped_N = live_N & ~keep_N
    new_idx = torch.where(keep_N, idx_N, torch.full_like(idx_N, -1)).view_as(expert_idx_TK)
    new_weight = torch.where(keep_N.view_as(weight_TK), weight_TK, torch.zeros_like(weight_TK))
    return new_idx, new_weight, dropped_N.sum()
