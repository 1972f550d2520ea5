"""SwitchGate: top-1 routing with jitter, capacity and the Switch balance loss.

FastMoE's semantics by default: in training U[1-eps, 1+eps] is added to the logits, and each
expert keeps its first slots in token order. `jitter="input"` multiplies the input by
U[1-eps, 1+eps] instead (the Switch Transformer paper, Mixtral); `drop_by="score"` keeps each
expert's best slots.
"""
import torch

from fmoe.gates.base import check_choice, check_float
from fmoe.gates.gshard import balance_loss
from fmoe.gates.router import RouterGate


class SwitchGate(RouterGate):
    """RouterGate with softmax scores and top-1, plus jitter, capacity and the balance loss."""

    def __init__(self, d_model, num_expert, world_size=1, top_k=1, switch_eps=0.1, capacity=(1.2, 2.4),
                 gate_bias=True, z_loss_coef=0.0, topk=None, *, jitter="logits", drop_by="order"):
        top_k = topk if topk is not None else top_k
        if top_k != 1:
            raise ValueError(f"top_k must be 1 for SwitchGate, got {top_k!r}")
        super().__init__(d_model, num_expert, world_size, top_k, gate_bias=gate_bias, capacity=capacity,
                         z_loss_coef=z_loss_coef)
        self.switch_eps = check_float("switch_eps", switch_eps, 0.0, 1.0, high_open=True)
        self.jitter = check_choice("jitter", jitter, ("logits", "input"))
        self.drop_by = check_choice("drop_by", drop_by, ("order", "score"))

    def router_logits(self, x_TD):
        if not (self.training and self.switch_eps > 0):
            return self.gate(x_TD)
        eps = self.switch_eps
        if self.jitter == "input":
            return self.gate(x_TD * torch.empty_like(x_TD).uniform_(1 - eps, 1 + eps))
        logits_TE = self.gate(x_TD)
        # FastMoE's own arithmetic, so that the same RNG state gives bit-equal noise.
        return logits_TE + (torch.rand_like(logits_TE) * 2 * eps + 1.0 - eps)

    def route(self, x_TD):
        expert_idx_TK, weight_TK, score_TK, logits_TE, aux = super().route(x_TD)
        aux = aux + balance_loss(torch.softmax(logits_TE, dim=-1), expert_idx_TK[:, 0], self.token_partition)
        return expert_idx_TK, weight_TK, score_TK, logits_TE, aux
