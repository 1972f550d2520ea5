"""ZeroGate (FastMoE): every slot of every token goes to expert 0 with weight 1/top_k. A test
gate: it exercises the worst imbalance and nothing of the router."""
import torch

from fmoe.gates.base import BaseGate


class ZeroGate(BaseGate):
    """FastMoE's test gate: every slot of every token to expert 0, each with weight 1/top_k; no router."""

    def __init__(self, d_model, num_expert, world_size=1, top_k=2, gate_bias=True):
        # gate_bias is accepted because FMoE passes it to every gate class; there is no router.
        super().__init__(d_model, num_expert, world_size, top_k)

    def route(self, x_TD):
        T = x_TD.shape[0]
        expert_idx_TK = torch.zeros(T, self.top_k, dtype=torch.long, device=x_TD.device)
        if self.replayed_TK is not None:        # no router to choose with: the recorded choice as it is
            expert_idx_TK = self.replayed_TK
        weight_TK = torch.full((T, self.top_k), 1.0 / self.top_k, device=x_TD.device)
        logits_TE = x_TD.new_zeros(T, self.tot_expert)
        aux = x_TD.new_zeros((), dtype=torch.float32)
        return expert_idx_TK, weight_TK, weight_TK, logits_TE, aux
