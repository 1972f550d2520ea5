"""GShardGate: top-2 with capacity, random routing of the second expert, GShard balance loss.

FastMoE's semantics by default: the local capacity `ceil(rate * T) * 2 // experts`, each
expert keeping its first slots in token order, and random routing after the capacity (a second
slot may take capacity and then be left unrouted). fmoe's alternatives stay as options:
`capacity_formula="exact"` (ceil(rate * T * 2 / experts)), `drop_by="score"` (keep the best
slots), `random_routing_first=True` (skipped slots take no capacity).
"""
import torch

from fmoe.gates.balance_losses import summed_over
from fmoe.gates.base import check_bool, check_choice
from fmoe.gates.capacity import CAPACITY_FORMULAS, count_live_per_expert
from fmoe.gates.router import RouterGate


def balance_loss(probs_TE: torch.Tensor, top1_E_T: torch.Tensor, partition=None) -> torch.Tensor:
    """E * sum_e(fraction of tokens whose first choice is e (-1: none) * mean router probability of e), over the
    tokens of all ranks of a `partition` (see `balance_losses`).

    Equals 1 when routing is uniform; GShard's l_aux and Switch's balance loss alike.
    """
    T, E = probs_TE.shape
    counts_E, T = summed_over(partition, count_live_per_expert(top1_E_T, E).to(probs_TE.dtype), T)
    if T == 0:
        return probs_TE.sum() * 0.0
    return E * torch.sum(counts_E / T * probs_TE.sum(0) / T)


class GShardGate(RouterGate):
    """RouterGate with top-2 of the logits weighed by a softmax over the two (FastMoE's formula,
    bit for bit), plus the balance loss, capacity and random routing."""

    def __init__(self, d_model, num_expert, world_size=1, top_k=2, capacity=(1.2, 2.4), random_routing=True,
                 gate_bias=True, z_loss_coef=0.0, topk=None, *, capacity_formula="fastmoe", drop_by="order",
                 random_routing_first=False):
        top_k = topk if topk is not None else top_k
        if top_k != 2:
            raise ValueError(f"top_k must be 2 for GShardGate, got {top_k!r}")
        super().__init__(d_model, num_expert, world_size, top_k, softmax_after_topk=True, gate_bias=gate_bias,
                         capacity=capacity, z_loss_coef=z_loss_coef)
        self.random_routing = check_bool("random_routing", random_routing)
        self.capacity_formula = check_choice("capacity_formula", capacity_formula, CAPACITY_FORMULAS)
        self.drop_by = check_choice("drop_by", drop_by, ("order", "score"))
        self.unroute_before_capacity = check_bool("random_routing_first", random_routing_first)

    def route(self, x_TD):
        expert_idx_TK, weight_TK, score_TK, logits_TE, aux = super().route(x_TD)
        aux = aux + balance_loss(torch.softmax(logits_TE, dim=-1), expert_idx_TK[:, 0], self.token_partition)
        return expert_idx_TK, weight_TK, score_TK, logits_TE, aux

    def expert_capacity(self, factor, num_tokens):
        return CAPACITY_FORMULAS[self.capacity_formula](factor, num_tokens, self.top_k, self.tot_expert)

    def unroute(self, expert_idx_TK, weight_TK):
        """In training, keep each live second slot with probability min(1, 2 * its weight)."""
        if not (self.training and self.random_routing):
            return super().unroute(expert_idx_TK, weight_TK)
        rand_T = torch.rand(expert_idx_TK.shape[0], device=weight_TK.device).to(weight_TK.dtype)
        skip_T = (2 * weight_TK[:, 1].detach() < rand_T) & (expert_idx_TK[:, 1] >= 0)
        skip_TK = torch.stack([torch.zeros_like(skip_T), skip_T], dim=1)
        return expert_idx_TK.masked_fill(skip_TK, -1), weight_TK.masked_fill(skip_TK, 0.0), skip_T.sum()
