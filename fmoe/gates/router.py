"""RouterGate: routing as composable options; each published MoE family is a named preset.

    logits = x W^T (+ b)                                   router projection, fp32 or higher
    scores = softmax(logits) | sigmoid(logits)
    choice = scores (+ e_score_correction_bias)            the bias steers the choice only
             limited to the best `topk_group` of `n_group` expert groups
    idx    = top-k(choice)
    weight = scores[idx]  (renormalised if norm_topk_prob) * routed_scaling_factor

`softmax_after_topk` instead takes the top-k of the logits and weighs by a softmax over those
k (Mixtral as FastMoE's NaiveGate, gpt-oss, GraniteMoe); `sparsemixer` is PhiMoE's top-2.
"""
import math

import torch
import torch.distributed as dist

from fmoe.gates.base import (BaseGate, LinearRouter, check_bool, check_choice, check_float, check_int,
                             routing_dtype)

SELECTION_BIAS = (None, "frozen", "updated")
GROUP_SCORE = ("top2_sum", "max")


def load_balancing_loss(logits_TE: torch.Tensor, top_k: int) -> torch.Tensor:
    """transformers' `load_balancing_loss_func` (Switch Transformer) over one layer's tokens:
    E * sum_e(fraction of top-k slots on e * mean router probability of e)."""
    T, E = logits_TE.shape
    if T == 0:
        return logits_TE.sum() * 0.0
    probs_TE = torch.softmax(logits_TE, dim=-1)
    chosen_N = torch.topk(probs_TE, top_k, dim=-1).indices.reshape(-1)
    tokens_E = torch.zeros(E, dtype=probs_TE.dtype, device=probs_TE.device).index_add_(
        0, chosen_N, torch.ones_like(chosen_N, dtype=probs_TE.dtype))
    return E * torch.sum(tokens_E / T * probs_TE.mean(0))


class SparseMixerGrad(torch.autograd.Function):
    """PhiMoE's sparsemixer multiplier: forward `weight * midpoint`, backward the Heun
    third-order estimate of the routing gradient with respect to all logits."""

    @staticmethod
    def forward(ctx, logits_TE, weight_T1, chosen_T1, probs_TE, midpoint_T1):
        ctx.save_for_backward(weight_T1, chosen_T1, probs_TE)
        return weight_T1 * midpoint_T1

    @staticmethod
    def backward(ctx, grad_T1):
        weight_T1, chosen_T1, probs_TE = ctx.saved_tensors
        grad_T1 = grad_T1 * weight_T1
        grad_TE = (-grad_T1 * probs_TE).scatter_add(-1, chosen_T1, grad_T1)
        return grad_TE, None, None, None, None


def sparsemixer_top2(logits_TE: torch.Tensor, jitter_eps: float, training: bool):
    """PhiMoE's top-2: each choice among the experts within a relative 2*eps of the best
    remaining logit (Gumbel-sampled in training, the best in evaluation)."""
    chosen, weights = [], []
    remaining_TE = logits_TE
    for _ in range(2):
        with torch.no_grad():
            best_T1, best_idx_T1 = remaining_TE.max(dim=-1, keepdim=True)
            far_TE = (best_T1 - logits_TE) / logits_TE.abs().clamp(min=best_T1) > 2 * jitter_eps
        masked_TE = remaining_TE.masked_fill(far_TE, -math.inf)
        if training:
            gumbel_TE = torch.empty_like(masked_TE).exponential_().log()
            idx_T1 = (masked_TE - gumbel_TE).max(dim=-1)[1].unsqueeze(-1)
        else:
            idx_T1 = best_idx_T1
        probs_TE = torch.softmax(masked_TE, dim=-1)
        weight_T1 = probs_TE.gather(-1, idx_T1)
        if training:
            top_idx_T1 = probs_TE.max(dim=-1, keepdim=True)[1]
            keep_T1 = (idx_T1 == top_idx_T1) | (torch.rand_like(weight_T1) > 0.75)
            midpoint_T1 = torch.where(keep_T1, 1.0, 0.3333).to(probs_TE.dtype)     # PhiMoE's 1/3
            weight_T1 = SparseMixerGrad.apply(logits_TE, weight_T1, idx_T1, probs_TE, midpoint_T1)
        chosen.append(idx_T1)
        weights.append(weight_T1)
        remaining_TE = logits_TE.scatter(-1, idx_T1, -math.inf)
    return torch.cat(weights, dim=-1), torch.cat(chosen, dim=-1)


class RouterGate(BaseGate):
    """One gate core with composable routing options (see the module docstring).

    `selection_bias`: None, "frozen" (a loaded `e_score_correction_bias`, DeepSeek-V3) or
    "updated" (aux-loss-free balancing: after each training forward the bias of an overloaded
    expert falls and an underloaded one rises by `bias_update_speed`, by the load summed over
    all ranks). `aux_loss="switch"` adds `aux_loss_coef` times transformers' load-balancing
    loss of this layer. The last router logits stay in `last_logits_TE` (fp32 or higher).
    """

    keeps_fp32 = True

    def __init__(self, d_model, num_expert, world_size=1, top_k=2, *, score="softmax", softmax_after_topk=False,
                 norm_topk_prob=False, routed_scaling_factor=1.0, n_group=1, topk_group=1, group_score="top2_sum",
                 gate_bias=False, selection_bias=None, bias_update_speed=1e-3, sparsemixer=False, jitter_eps=0.01,
                 aux_loss=None, aux_loss_coef=0.01, capacity=None, z_loss_coef=0.0):
        super().__init__(d_model, num_expert, world_size, top_k, capacity, z_loss_coef)
        self.score = check_choice("score", score, ("softmax", "sigmoid"))
        self.softmax_after_topk = check_bool("softmax_after_topk", softmax_after_topk)
        self.norm_topk_prob = check_bool("norm_topk_prob", norm_topk_prob)
        self.routed_scaling_factor = check_float("routed_scaling_factor", routed_scaling_factor, low=0.0,
                                                 low_open=True)
        self.n_group = check_int("n_group", n_group)
        self.topk_group = check_int("topk_group", topk_group)
        self.group_score = check_choice("group_score", group_score, GROUP_SCORE)
        self.selection_bias = check_choice("selection_bias", selection_bias, SELECTION_BIAS)
        self.bias_update_speed = check_float("bias_update_speed", bias_update_speed)
        self.sparsemixer = check_bool("sparsemixer", sparsemixer)
        self.jitter_eps = check_float("jitter_eps", jitter_eps)
        self.aux_loss = check_choice("aux_loss", aux_loss, (None, "switch"))
        self.aux_loss_coef = check_float("aux_loss_coef", aux_loss_coef)
        E = self.tot_expert
        if E % self.n_group:
            raise ValueError(f"n_group={n_group} must divide the number of experts ({E})")
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group={topk_group} must be at most n_group={n_group}")
        if self.top_k > self.topk_group * (E // self.n_group):
            raise ValueError(f"top_k={top_k} exceeds the {self.topk_group * (E // self.n_group)} experts in "
                             f"topk_group={topk_group} groups of {E // self.n_group}")
        if self.n_group > 1 and self.group_score == "top2_sum" and E // self.n_group < 2:
            raise ValueError("group_score='top2_sum' needs at least 2 experts per group")
        if self.sparsemixer and (self.top_k != 2 or self.score != "softmax" or self.softmax_after_topk
                                 or self.n_group > 1 or self.selection_bias is not None):
            raise ValueError("sparsemixer=True is PhiMoE's top-2 of softmax scores: it needs top_k=2 and no "
                             "softmax_after_topk, grouping or selection_bias")
        if self.softmax_after_topk and (self.norm_topk_prob or self.n_group > 1):
            raise ValueError("softmax_after_topk=True already sums the k weights to 1 and chooses by logits: "
                             "it takes neither norm_topk_prob nor group-limited top-k")
        self.gate = LinearRouter(d_model, E, bias=check_bool("gate_bias", gate_bias))
        if self.selection_bias is not None:
            self.register_buffer("e_score_correction_bias", torch.zeros(E))

    @classmethod
    def from_preset(cls, name: str, d_model, num_expert, world_size=1, top_k=None, **overrides) -> "RouterGate":
        """The router of a published family (`PRESETS`), with any option overridden."""
        if name not in PRESETS:
            raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {name!r}")
        options = dict(PRESETS[name])
        preset_top_k = options.pop("top_k")
        options.update(overrides)
        return cls(d_model, num_expert, world_size, preset_top_k if top_k is None else top_k, **options)

    def route(self, x_TD):
        logits_TE = self.gate(x_TD)
        if self.sparsemixer:
            weight_TK, expert_idx_TK = sparsemixer_top2(logits_TE, self.jitter_eps, self.training)
        elif self.softmax_after_topk:
            top_TK, expert_idx_TK = torch.topk(self.biased(logits_TE), self.top_k, dim=-1)
            if self.selection_bias is not None:
                top_TK = logits_TE.gather(1, expert_idx_TK)
            weight_TK = torch.softmax(top_TK, dim=-1)
        else:
            scores_TE = torch.softmax(logits_TE, -1) if self.score == "softmax" else torch.sigmoid(logits_TE)
            choice_TE = self.limit_to_groups(self.biased(scores_TE.detach()))
            expert_idx_TK = torch.topk(choice_TE, self.top_k, dim=-1).indices
            weight_TK = scores_TE.gather(1, expert_idx_TK)
            if self.norm_topk_prob:
                weight_TK = weight_TK / (weight_TK.sum(-1, keepdim=True) + 1e-20)
        if self.routed_scaling_factor != 1.0:
            weight_TK = weight_TK * self.routed_scaling_factor
        if self.selection_bias == "updated" and self.training:
            self.update_bias(expert_idx_TK)
        aux = logits_TE.new_zeros(())
        if self.aux_loss == "switch":
            aux = aux + self.aux_loss_coef * load_balancing_loss(logits_TE, self.top_k)
        return expert_idx_TK, weight_TK, weight_TK, logits_TE, aux

    def biased(self, scores_TE):
        if self.selection_bias is None:
            return scores_TE
        return scores_TE + self.e_score_correction_bias.to(scores_TE.dtype)

    def limit_to_groups(self, choice_TE):
        """Only the experts of each token's best `topk_group` groups stay eligible."""
        if self.n_group == 1:
            return choice_TE
        T, E = choice_TE.shape
        grouped_TGe = choice_TE.view(T, self.n_group, E // self.n_group)
        if self.group_score == "max":
            group_TG = grouped_TGe.max(dim=-1).values
        else:
            group_TG = grouped_TGe.topk(2, dim=-1).values.sum(dim=-1)
        best_TG = torch.topk(group_TG, self.topk_group, dim=-1).indices
        keep_TG = torch.zeros_like(group_TG, dtype=torch.bool).scatter(1, best_TG, True)
        return grouped_TGe.masked_fill(~keep_TG.unsqueeze(-1), -math.inf).view(T, E)

    @torch.no_grad()
    def update_bias(self, expert_idx_TK):
        """Aux-loss-free steering. Every rank reaches the all-reduce, with or without tokens."""
        load_E = torch.zeros(self.tot_expert, dtype=torch.float32, device=expert_idx_TK.device)
        load_E.index_add_(0, expert_idx_TK.reshape(-1), torch.ones(expert_idx_TK.numel(), device=load_E.device))
        if dist.is_available() and dist.is_initialized():
            # The gate is replicated on every rank: steer it by the global load, so all copies agree.
            dist.all_reduce(load_E)
        bias_E = self.e_score_correction_bias
        bias_E += (self.bias_update_speed * torch.sign(load_E.mean() - load_E)).to(bias_E.dtype)


# Each family's router in transformers 5.24 (`modeling_<family>.py`), as RouterGate options.
# `top_k` is the family config's default; options read from a config (norm_topk_prob,
# routed_scaling_factor, n_group, topk_group, jitter) go in as overrides.
PRESETS = {
    "mixtral": dict(top_k=2, norm_topk_prob=True),
    "qwen2_moe": dict(top_k=4, norm_topk_prob=False),
    "qwen3_moe": dict(top_k=8, norm_topk_prob=False),
    "olmoe": dict(top_k=8, norm_topk_prob=False),
    "deepseek_v2": dict(top_k=6, norm_topk_prob=False, group_score="max"),
    "deepseek_v3": dict(top_k=8, score="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5, n_group=8,
                        topk_group=4, group_score="top2_sum", selection_bias="frozen"),
    "gpt_oss": dict(top_k=4, softmax_after_topk=True, gate_bias=True),
    "granitemoe": dict(top_k=2, softmax_after_topk=True),
    "phimoe": dict(top_k=2, sparsemixer=True, jitter_eps=0.01),
    "dbrx": dict(top_k=1, norm_topk_prob=True),        # moe_normalize_expert_weights=1 (the default)
    "jamba": dict(top_k=2, norm_topk_prob=False),
}
