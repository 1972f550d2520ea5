"""A perfectly balanced gate for timing: the benchmarks' baseline routing and the perf model's calibration."""
import torch

from fmoe.gates.base import BaseGate, LinearRouter, slot_values


class RoundRobinGate(BaseGate):
    """Perfectly balanced routing (slot t*K+k to expert (t*K+k) % E), weights from a real router.
    With `first_expert` f, the experts below f get no rows: slot s goes to f + s % (E - f)."""

    def __init__(self, d_model, num_expert, world_size=1, top_k=2, first_expert=0, **_):
        super().__init__(d_model, num_expert, world_size, top_k)
        if not 0 <= first_expert < self.tot_expert:
            raise ValueError(f"RoundRobinGate: first_expert must be in [0, {self.tot_expert}), got {first_expert}")
        self.gate = LinearRouter(d_model, self.tot_expert)
        self.first_expert = first_expert

    def route(self, x_TD):
        T = x_TD.shape[0]
        logits_TE = self.gate(x_TD)
        slots = torch.arange(T * self.top_k, device=x_TD.device)
        idx_TK = (self.first_expert + slots % (self.tot_expert - self.first_expert)).view(T, self.top_k)
        if self.replayed_TK is not None:
            idx_TK = self.replayed_TK
        weight_TK = torch.softmax(slot_values(logits_TE, idx_TK, torch.finfo(logits_TE.dtype).min).float(), -1)
        return idx_TK, weight_TK, weight_TK, logits_TE, logits_TE.new_zeros(())
