"""FastMoE path `fmoe.gates.utils`: capacity helpers over the whole expert-parallel group."""
import torch

from fmoe.gates.distributed_capacity import keep_first, limit_by_capacity


def prune_gate_by_capacity(topk_idx, local_expert_count, num_expert: int, world_size: int):
    """Mark -1 the slots past each expert's allowed count (slot order), as FastMoE does."""
    idx_S = topk_idx.reshape(-1)
    keep_S = keep_first(idx_S, local_expert_count.to(idx_S.device).long())
    return torch.where(keep_S, idx_S, torch.full_like(idx_S, -1)).view_as(topk_idx)


__all__ = ["limit_by_capacity", "prune_gate_by_capacity"]
