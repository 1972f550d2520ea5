"""NoisyGate: noisy top-k gating with importance and load losses (Shazeer et al. 2017)."""
import torch
import torch.nn.functional as F
from torch import nn

from fmoe.autocast import autocast_off
from fmoe.gates.base import BaseGate, check_float, routing_dtype


def cv_squared(v_E: torch.Tensor, eps: float = 1e-10) -> torch.Tensor:
    """Squared coefficient of variation, the balance measure of the paper; 0 for one expert."""
    if v_E.numel() <= 1:
        return v_E.sum() * 0.0
    v_E = v_E.to(routing_dtype(v_E.dtype))
    return v_E.var() / (v_E.mean().square() + eps)


class NoisyGate(BaseGate):
    """H(x) = x W_g + N(0,1) * softplus(x W_noise) in training; top-k of H, softmax over them.

    aux_loss = loss_coef * (CV(importance)^2 + CV(load)^2), where importance is each expert's
    summed gate weight and load the smooth estimate of how many tokens it receives; loss_coef
    is 1 as in FastMoE. `gate_bias` is accepted for FMoE's sake; this gate has no bias.
    """

    keeps_fp32 = True

    def __init__(self, d_model, num_expert, world_size=1, top_k=2, gate_bias=True, capacity=None,
                 z_loss_coef=0.0, noise_epsilon=1e-2, loss_coef=1.0):
        super().__init__(d_model, num_expert, world_size, top_k, capacity, z_loss_coef)
        self.w_gate = nn.Parameter(torch.empty(d_model, self.tot_expert))
        self.w_noise = nn.Parameter(torch.zeros(d_model, self.tot_expert))
        nn.init.kaiming_uniform_(self.w_gate.T, a=5 ** 0.5)
        self.noise_epsilon = check_float("noise_epsilon", noise_epsilon, low=0.0, low_open=True)
        self.loss_coef = check_float("loss_coef", loss_coef)

    def route(self, x_TD):
        dtype = routing_dtype(x_TD.dtype, self.w_gate.dtype)
        x_TD = x_TD.to(dtype)
        noisy = self.training
        with autocast_off(x_TD):        # the logits in fp32 under torch.autocast too
            clean_TE = x_TD @ self.w_gate.to(dtype)
            if noisy:
                noise_std_TE = F.softplus(x_TD @ self.w_noise.to(dtype)) + self.noise_epsilon
                logits_TE = clean_TE + torch.randn_like(clean_TE) * noise_std_TE
            else:
                logits_TE = clean_TE
        k = self.top_k
        # The k + 1-th logit is the load's threshold; a replayed choice is counted as it is.
        n_top = k if self.replayed_TK is not None else min(k + 1, self.tot_expert)
        top_logits, top_idx = self.choose(logits_TE, n_top)
        expert_idx_TK = top_idx[:, :k]
        weight_TK = torch.softmax(top_logits[:, :k], dim=-1)
        gates_TE = torch.zeros_like(logits_TE, dtype=weight_TK.dtype).scatter_add(
            1, expert_idx_TK.clamp_min(0), weight_TK.masked_fill(expert_idx_TK < 0, 0.0))
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
        # The standard normal CDF; unlike torch.distributions it lets a NaN token stay NaN in its own row.
        prob_if_in = torch.special.ndtr((clean_TE - threshold_if_in) / noise_std_TE)
        prob_if_out = torch.special.ndtr((clean_TE - threshold_if_out) / noise_std_TE)
        return torch.where(is_in, prob_if_in, prob_if_out)
