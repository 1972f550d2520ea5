"""NaiveGate: a linear router and top-k, weights a softmax over the chosen logits (FastMoE)."""
import torch

from fmoe.gates.base import BaseGate, LinearRouter


class NaiveGate(BaseGate):
    def __init__(self, d_model, num_expert, world_size=1, top_k=2, gate_bias=True, capacity=None, z_loss_coef=0.0):
        super().__init__(d_model, num_expert, world_size, top_k, capacity, z_loss_coef)
        self.gate = LinearRouter(d_model, self.tot_expert, bias=gate_bias)

    def route(self, x_TD):
        logits_TE = self.gate(x_TD)
        top_logits_TK, expert_idx_TK = torch.topk(logits_TE, self.top_k, dim=-1)
        weight_TK = torch.softmax(top_logits_TK.float(), dim=-1)
        aux = logits_TE.new_zeros((), dtype=torch.float32)
        return expert_idx_TK, weight_TK, weight_TK, logits_TE, aux
