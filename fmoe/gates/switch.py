"""SwitchGate: top-1 routing with multiplicative jitter, capacity and the Switch balance loss."""
import torch

from fmoe.gates.base import BaseGate, LinearRouter
from fmoe.gates.gshard import balance_loss


class SwitchGate(BaseGate):
    def __init__(self, d_model, num_expert, world_size=1, top_k=1, switch_eps=0.1, capacity=(1.2, 2.4),
                 gate_bias=True, z_loss_coef=0.0, topk=None):
        top_k = topk if topk is not None else top_k
        if top_k != 1:
            raise ValueError(f"top_k must be 1 for SwitchGate, got {top_k!r}")
        if not 0 <= switch_eps < 1:
            raise ValueError(f"switch_eps must be in [0, 1), got {switch_eps!r}")
        super().__init__(d_model, num_expert, world_size, top_k, capacity, z_loss_coef)
        self.gate = LinearRouter(d_model, self.tot_expert, bias=gate_bias)
        self.switch_eps = switch_eps

    def route(self, x_TD):
        if self.training and self.switch_eps > 0:
            jitter_TD = torch.empty_like(x_TD).uniform_(1 - self.switch_eps, 1 + self.switch_eps)
            x_TD = x_TD * jitter_TD
        logits_TE = self.gate(x_TD)
        probs_TE = torch.softmax(logits_TE.float(), dim=-1)
        weight_TK, expert_idx_TK = torch.topk(probs_TE, 1, dim=-1)
        aux = balance_loss(probs_TE, expert_idx_TK[:, 0])
        return expert_idx_TK, weight_TK, weight_TK, logits_TE, aux
