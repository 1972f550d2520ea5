"""The published load-balancing losses, as plain functions of one layer's router output.

    switch    transformers' load_balancing_loss_func (Switch Transformer):
              E * sum_e (top-k slots of softmax(logits) on e / T) * mean_t softmax(logits)[t, e]
    sequence  DeepSeek-V3's sequence-wise loss (Megatron-Core's "seq_aux_loss"), per sequence of S tokens:
              f_e = E / (K S) * tokens of the sequence choosing e,  P_e = mean_t s'[t, e],
              loss = sum_e f_e P_e, averaged over the sequences
    global    the global-batch loss (Qwen3; Megatron-Core's "global_aux_loss"): E * sum_e f_e P_e with
              f_e the fraction of top-k slots on e counted over the whole global batch (every
              data-parallel rank, every micro-batch of the step so far) and P_e this rank's mean s'

With a `partition` (a process group whose ranks each hold a part of the same tokens: Megatron's
tensor-parallel ranks under sequence parallelism), the counts are summed over it and every mean
is over all its tokens, so the losses of its ranks add up to the loss of the whole batch (the
ranks' router gradients are summed, as Megatron-Core's own losses are under sequence parallelism).

s' are the normalised scores Megatron-Core uses for its losses: softmax(logits) for a softmax
router, sigmoid(logits) divided by their sum over the experts for a sigmoid one; "chosen" for
the sequence and global losses is the top-k of s' (no selection bias, no group limit).
"""
from typing import Optional

import torch
import torch.distributed as dist

from fmoe.gates.capacity import count_live_per_expert

AUX_LOSSES = ("switch", "sequence", "global")


def normalised_scores(logits_TE: torch.Tensor, score: str) -> torch.Tensor:
    if score == "softmax":
        return torch.softmax(logits_TE, dim=-1)
    scores_TE = torch.sigmoid(logits_TE)
    return scores_TE / (scores_TE.sum(-1, keepdim=True) + 1e-20)


def summed_over(partition: Optional[dist.ProcessGroup], counts: torch.Tensor, num_tokens: int):
    """(counts, num_tokens) summed over the ranks of `partition` (unchanged without one)."""
    if partition is None or dist.get_world_size(partition) == 1:
        return counts, num_tokens
    both = torch.cat([counts.detach().reshape(-1).to(torch.float64),
                      torch.tensor([num_tokens], dtype=torch.float64, device=counts.device)])
    dist.all_reduce(both, group=partition)
    return both[:-1].view(counts.shape).to(counts.dtype), int(both[-1].item())


def switch_loss(logits_TE: torch.Tensor, top_k: int, partition: Optional[dist.ProcessGroup] = None,
                chosen_TK: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`chosen_TK`: the experts to count (-1: none) instead of the top-k of the softmax (router replay)."""
    T, E = logits_TE.shape
    probs_TE = torch.softmax(logits_TE, dim=-1)
    chosen_TK = torch.topk(probs_TE, top_k, dim=-1).indices if chosen_TK is None else chosen_TK
    tokens_E = count_live_per_expert(chosen_TK, E).to(probs_TE.dtype)
    tokens_E, T = summed_over(partition, tokens_E, T)
    if T == 0:
        return logits_TE.sum() * 0.0
    return E * torch.sum(tokens_E / T * probs_TE.sum(0) / T)


def sequence_loss(scores_SBE: torch.Tensor, top_k: int, partition: Optional[dist.ProcessGroup] = None,
                  chosen_SBK: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`scores_SBE`: normalised scores of B sequences of S tokens, laid [S, B, E] (with a `partition`,
    each rank's S tokens of the same B sequences); `chosen_SBK` the experts to count (-1: none) instead
    of the top-k of the scores."""
    S, B, E = scores_SBE.shape
    chosen_SBK = torch.topk(scores_SBE.detach(), top_k, dim=-1).indices if chosen_SBK is None else chosen_SBK
    chosen_BN = chosen_SBK.permute(1, 0, 2).reshape(B, S * top_k)
    tokens_BE = torch.zeros(B, E, dtype=scores_SBE.dtype, device=scores_SBE.device).scatter_add_(
        1, chosen_BN.clamp_min(0), (chosen_BN >= 0).to(scores_SBE.dtype))
    tokens_BE, S = summed_over(partition, tokens_BE, S)
    if S * B == 0:
        return scores_SBE.sum() * 0.0
    f_BE = tokens_BE * (E / (top_k * S))
    P_BE = scores_SBE.sum(0) / S
    return (f_BE * P_BE).sum(-1).mean()


def chosen_counts(scores_TE: torch.Tensor, top_k: int, chosen_TK: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Top-k slots of the normalised scores on each expert (what the global loss counts), or the slots
    of `chosen_TK` (-1: none)."""
    chosen_TK = torch.topk(scores_TE.detach(), top_k, dim=-1).indices if chosen_TK is None else chosen_TK
    return count_live_per_expert(chosen_TK, scores_TE.shape[-1])


def global_loss(scores_TE: torch.Tensor, fraction_E: torch.Tensor,
                partition: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """E * sum_e fraction_E[e] * mean_t scores_TE[t, e], `fraction_E` (slots on e / all slots of the
    global batch) a constant."""
    T, E = scores_TE.shape
    _, T_all = summed_over(partition, scores_TE.new_zeros(0), T)
    if T_all == 0:
        return scores_TE.sum() * 0.0
    return E * torch.sum(fraction_E.to(scores_TE.dtype) * scores_TE.sum(0) / T_all)
