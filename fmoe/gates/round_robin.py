"""A perfectly balanced gate for timing: the benchmarks' baseline routing and the perf model's calibration."""
import torch

from fmoe.gates.base import BaseGate, LinearRouter


class RoundRobinGate(BaseGate):
    """Perfectly balanced routing (slot t*K+k to expert (t*K+k) % E), weights from a real router."""

    def __init__(self, d_model, num_expert, world_size=1, top_k=2, **_):
        super().__init__(d_model, num_expert, world_size, top_k)
        self.gate = LinearRouter(d_model, self.tot_expert)

    def route(self, x_TD):
        T = x_TD.shape[0]
        logits_TE = self.gate(x_TD)
        idx_TK = (torch.arange(T * self.top_k, device=x_TD.device) % self.tot_expert).view(T, self.top_k)
        weight_TK = torch.softmax(logits_TE.gather(1, idx_TK).float(), -1)
        return idx_TK, weight_TK, weight_TK, logits_TE, logits_TE.new_zeros(())
