"""BalancedGate: auxiliary-loss-free load balancing (DeepSeek-V3).

Each expert has a bias added to its score for *selection only*; after every training forward
the bias of an overloaded expert falls and that of an underloaded one rises by
`bias_update_speed` (the load summed over all ranks when distributed). Gate weights come from the unbiased scores, so no gradient is bent
toward balance and no auxiliary loss is needed.
"""
import torch
import torch.distributed as dist

from fmoe.gates.base import BaseGate, LinearRouter


class BalancedGate(BaseGate):
    def __init__(self, d_model, num_expert, world_size=1, top_k=2, gate_bias=False, capacity=None,
                 z_loss_coef=0.0, bias_update_speed=1e-3):
        super().__init__(d_model, num_expert, world_size, top_k, capacity, z_loss_coef)
        if bias_update_speed < 0:
            raise ValueError(f"bias_update_speed must be >= 0, got {bias_update_speed!r}")
        self.gate = LinearRouter(d_model, self.tot_expert, bias=gate_bias)
        self.bias_update_speed = bias_update_speed
        self.register_buffer("expert_bias_E", torch.zeros(self.tot_expert))

    def route(self, x_TD):
        logits_TE = self.gate(x_TD)
        scores_TE = torch.sigmoid(logits_TE.float())
        _, expert_idx_TK = torch.topk(scores_TE.detach() + self.expert_bias_E, self.top_k, dim=-1)
        chosen_TK = scores_TE.gather(1, expert_idx_TK)
        weight_TK = chosen_TK / chosen_TK.sum(-1, keepdim=True).clamp_min(1e-20)
        if self.training and x_TD.shape[0] > 0:
            self.update_bias(torch.bincount(expert_idx_TK.reshape(-1), minlength=self.tot_expert))
        aux = logits_TE.new_zeros((), dtype=torch.float32)
        return expert_idx_TK, weight_TK, chosen_TK, logits_TE, aux

    @torch.no_grad()
    def update_bias(self, load_E: torch.Tensor):
        load_E = load_E.float()
        if dist.is_available() and dist.is_initialized():
            # The gate is replicated on every rank: steer it by the global load, so all copies agree.
            dist.all_reduce(load_E)
        self.expert_bias_E += self.bias_update_speed * torch.sign(load_E.mean() - load_E)
