"""NoisyGate: noisy top-k gating with importance and load losses (Shazeer et al. 2017)."""
import torch
import torch.nn.functional as F
from torch import nn

from fmoe.gates.base import BaseGate


def cv_squared(v_E: torch.Tensor, eps: float = 1e-10) -> torch.Tensor:
    """Squared coefficient of variation, the balance measure of the paper; 0 for one expert."""
    if v_E.numel() <= 1:
        return v_E.sum() * 0.0
    v_E = v_E.float()
    return v_E.var() / (v_E.mean().square() + eps)


class NoisyGate(BaseGate):
    """H(x) = x W_g + N(0,1) * softplus(x W_noise) in training; top-k of H, softmax over them.

    aux_loss = loss_coef * (CV(importance)^2 + CV(load)^2), where importance is each expert's
    summed gate weight and load the smooth estimate of how many tokens it receives.
    """

    def __init__(self, d_model, num_expert, world_size=1, top_k=2, gate_bias=True, capacity=None,
                 z_loss_coef=0.0, noise_epsilon=1e-2, loss_coef=1e-2):
        super().__init__(d_model, num_expert, world_size, top_k, capacity, z_loss_coef)
        self.w_gate = nn.Parameter(torch.empty(d_model, self.tot_expert))
        self.w_noise = nn.Parameter(torch.zeros(d_model, self.tot_expert))
        nn.init.kaiming_uniform_(self.w_gate.T, a=5 ** 0.5)
        self.noise_epsilon = noise_epsilon
        self.loss_coef = loss_coef

    def route(self, x_TD):
        clean_TE = x_TD @ self.w_gate
        noisy = self.training
        if noisy:
            noise_std_TE = F.softplus(x_TD @ self.w_noise) + self.noise_epsilon
            logits_TE = clean_TE + torch.randn_like(clean_TE) * noise_std_TE
        else:
            logits_TE = clean_TE
        k = self.top_k
        n_top = min(k + 1, self.tot_expert)
        top_logits, top_idx = torch.topk(logits_TE, n_top, dim=-1)
        expert_idx_TK = top_idx[:, :k]
        weight_TK = torch.softmax(top_logits[:, :k].float(), dim=-1)
        gates_TE = torch.zeros_like(logits_TE, dtype=weight_TK.dtype).scatter(1, expert_idx_TK, weight_TK)
        importance_E = gates_TE.sum(0)
        if noisy and n_top > k:
            load_E = self._smooth_load(clean_TE, logits_TE, noise_std_TE, top_logits).sum(0)
        else:
            load_E = (gates_TE > 0).sum(0).float()
        aux = self.loss_coef * (cv_squared(importance_E) + cv_squared(load_E))
        return expert_idx_TK, weight_TK, weight_TK, logits_TE, aux

    def _smooth_load(self, clean_TE, noisy_TE, noise_std_TE, top_logits_TK1):
        """P(expert e stays in the top-k when its own noise is re-drawn), per token."""
        k = self.top_k
        threshold_if_in = top_logits_TK1[:, k:k + 1]
        threshold_if_out = top_logits_TK1[:, k - 1:k]
        is_in = noisy_TE > threshold_if_in
        normal = torch.distributions.Normal(0.0, 1.0)
        prob_if_in = normal.cdf((clean_TE - threshold_if_in).float() / noise_std_TE.float())
        prob_if_out = normal.cdf((clean_TE - threshold_if_out).float() / noise_std_TE.float())
        return torch.where(is_in, prob_if_in, prob_if_out)
