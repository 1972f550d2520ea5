"""Megatron-Core's TopKRouter options as fmoe's RouterGate: `gate="megatron"` in MegatronMLP.

    spec = get_gpt_layer_with_fmoe_spec(gate="megatron")   # routes as the config's TopKRouter would

Megatron-Core option                      RouterGate
moe_router_topk                           top_k
moe_router_score_function softmax,        softmax_after_topk=True (top-k of the logits, softmax over the k)
  moe_router_pre_softmax=False
moe_router_score_function softmax,        score="softmax" (top-k of the softmax, not renormalised)
  moe_router_pre_softmax=True
moe_router_score_function sigmoid         score="sigmoid", norm_topk_prob=(top_k > 1)
moe_router_num_groups / group_topk        n_group / topk_group; a group scores the sum of its best
                                          top_k // group_topk experts: group_score "top2_sum" (2) or "max" (1)
moe_router_topk_scaling_factor            routed_scaling_factor
moe_router_enable_expert_bias,            selection_bias="updated", bias_update_speed (sign of mean load -
  moe_router_bias_update_rate               load, once per step, load summed over the stage's ranks)
moe_router_load_balancing_type            aux_loss "switch", "sequence", "global" (a list: several), each
  aux_loss / seq_aux_loss / global_aux_loss   with its moe_aux_loss_coeff divided by top_k (Megatron's f_i
                                          counts slots / (T top_k), fmoe's switch slots / T)
moe_z_loss_coeff                          z_loss_coef

Refused, naming the option, where the definitions differ: an "aux_loss" with sigmoid scores
(Megatron normalises the sigmoid scores; fmoe's switch loss reads a softmax), group-limited
routing of the top-k logits (pre_softmax=False), a group score of other than 1 or 2 experts,
sinkhorn balancing, token capacity (moe_expert_capacity_factor), an expert bias with softmax scores.
"""
from megatron.core.transformer.transformer_config import TransformerConfig

AUX_LOSS_NAMES = {"aux_loss": "switch", "seq_aux_loss": "sequence", "global_aux_loss": "global"}


def _listed(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def megatron_router_options(config: TransformerConfig) -> dict:
    """MegatronMLP's `gate`, `gate_kwargs` and `aux_loss_coeff` that route as Megatron-Core's TopKRouter
    built from `config`."""
    top_k = config.moe_router_topk
    score = config.moe_router_score_function
    kwargs = {}
    if score == "softmax":
        if config.moe_router_enable_expert_bias:
            raise ValueError("moe_router_enable_expert_bias: Megatron-Core adds the expert bias with sigmoid scores "
                             "only (moe_router_score_function='sigmoid')")
        if config.moe_router_pre_softmax:
            kwargs.update(score="softmax", norm_topk_prob=False)
        else:
            if config.moe_router_num_groups:
                raise ValueError("moe_router_num_groups with moe_router_pre_softmax=False (groups of logits) has no "
                                 "RouterGate equivalent; set moe_router_pre_softmax=True")
            kwargs.update(softmax_after_topk=True)
    elif score == "sigmoid":
        kwargs.update(score="sigmoid", norm_topk_prob=top_k > 1)
        if config.moe_router_enable_expert_bias:
            kwargs.update(selection_bias="updated", bias_update_speed=config.moe_router_bias_update_rate)
    else:
        raise ValueError(f"moe_router_score_function must be 'softmax' or 'sigmoid', got {score!r}")
    if config.moe_router_num_groups:
        per_group = top_k // config.moe_router_group_topk
        if per_group not in (1, 2):
            raise ValueError(f"moe_router_topk={top_k} // moe_router_group_topk={config.moe_router_group_topk} = "
                             f"{per_group}: a group's score is the sum of its best {per_group} experts; RouterGate "
                             "scores a group by its best 1 ('max') or 2 ('top2_sum')")
        kwargs.update(n_group=config.moe_router_num_groups, topk_group=config.moe_router_group_topk,
                      group_score="top2_sum" if per_group == 2 else "max")
    if config.moe_router_topk_scaling_factor:
        kwargs.update(routed_scaling_factor=config.moe_router_topk_scaling_factor)
    if config.moe_expert_capacity_factor is not None:
        raise ValueError("moe_expert_capacity_factor: Megatron-Core's token dropping is not mapped; leave it None")
    types = _listed(config.moe_router_load_balancing_type)
    coeffs = _listed(config.moe_aux_loss_coeff)
    if len(coeffs) == 1:
        coeffs = coeffs * len(types)
    losses = {}
    for kind, coeff in zip(types, coeffs):
        if kind != "none" and kind not in AUX_LOSS_NAMES:
            raise ValueError(f"moe_router_load_balancing_type={kind!r} has no RouterGate equivalent "
                             f"(mapped: {sorted(AUX_LOSS_NAMES)} and 'none')")
        if kind == "none" or not coeff:
            continue
        if kind == "aux_loss" and score == "sigmoid":
            raise ValueError("moe_router_load_balancing_type='aux_loss' with sigmoid scores: Megatron-Core's loss reads "
                             "the normalised sigmoid scores, fmoe's switch loss a softmax; use 'seq_aux_loss' or "
                             "'global_aux_loss'")
        losses[AUX_LOSS_NAMES[kind]] = coeff / top_k if kind == "aux_loss" else coeff
    if losses:
        kwargs.update(aux_loss=tuple(losses), aux_loss_coef=losses)
    if config.moe_z_loss_coeff:
        kwargs.update(z_loss_coef=config.moe_z_loss_coeff)
    return dict(gate="router", gate_kwargs=kwargs, aux_loss_coeff=1.0)
