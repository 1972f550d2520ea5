"""GShardGate: top-2 with capacity, random routing of the second expert, GShard balance loss."""
import torch

from fmoe.gates.base import BaseGate, LinearRouter


def balance_loss(probs_TE: torch.Tensor, top1_E_T: torch.Tensor) -> torch.Tensor:
    """E * sum_e(fraction of tokens whose first choice is e * mean router probability of e).

    Equals 1 when routing is uniform; GShard's l_aux and Switch's balance loss alike.
    """
    T, E = probs_TE.shape
    if T == 0:
        return probs_TE.sum() * 0.0
    fraction_E = torch.bincount(top1_E_T, minlength=E).float() / T
    return E * torch.sum(fraction_E * probs_TE.float().mean(0))


class GShardGate(BaseGate):
    def __init__(self, d_model, num_expert, world_size=1, top_k=2, capacity=(1.2, 2.4), random_routing=True,
                 gate_bias=True, z_loss_coef=0.0, topk=None):
        top_k = topk if topk is not None else top_k
        if top_k != 2:
            raise ValueError(f"top_k must be 2 for GShardGate, got {top_k!r}")
        super().__init__(d_model, num_expert, world_size, top_k, capacity, z_loss_coef)
        self.gate = LinearRouter(d_model, self.tot_expert, bias=gate_bias)
        self.random_routing = random_routing

    def route(self, x_TD):
        logits_TE = self.gate(x_TD)
        probs_TE = torch.softmax(logits_TE.float(), dim=-1)
        top_probs_TK, expert_idx_TK = torch.topk(probs_TE, 2, dim=-1)
        weight_TK = top_probs_TK / top_probs_TK.sum(-1, keepdim=True)
        aux = balance_loss(probs_TE, expert_idx_TK[:, 0])
        if self.training and self.random_routing:
            # The second expert is kept with probability min(1, 2 * its normalised weight).
            skip_T = 2 * weight_TK[:, 1].detach() < torch.rand_like(weight_TK[:, 1])
            skip_TK = torch.stack([torch.zeros_like(skip_T), skip_T], dim=1)
            expert_idx_TK = expert_idx_TK.masked_fill(skip_TK, -1)
            weight_TK = weight_TK.masked_fill(skip_TK, 0.0)
        return expert_idx_TK, weight_TK, weight_TK, logits_TE, aux
