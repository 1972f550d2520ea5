"""fmoefy: turn the MLPs of a built Megatron-Core model into fmoe MoE layers."""
from typing import Optional

from megatron.core import parallel_state
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.transformer_layer import TransformerLayer
from torch import nn

from fmoe.integrations.megatron.mlp import MegatronMLP, require_parallel_state


def fmoefy(model: nn.Module, num_experts: Optional[int] = None, top_k: int = 2, gate="naive",
           aux_loss_coeff: float = 0.01, ffn_hidden_size: Optional[int] = None,
           gate_kwargs: Optional[dict] = None, fmoe_num_experts: Optional[int] = None,
           hidden_hidden_size: Optional[int] = None, **mlp_params) -> nn.Module:
    """Replace the MLP of every TransformerLayer in `model` by a `MegatronMLP`, in place; returns the model.

    `num_experts` counts experts over all expert-parallel ranks (Megatron's convention);
    FastMoE's `fmoe_num_experts` (per rank) and `hidden_hidden_size` are accepted instead of
    `num_experts` and `ffn_hidden_size`. Experts are spread over Megatron's expert-parallel group.
    The model's TransformerConfig is updated to say it has MoE layers (`num_moe_experts`,
    `moe_router_topk`, `expert_model_parallel_size`, `moe_aux_loss_coeff`), so Megatron's schedules
    scale the balance loss like its own MoE's. Call it before wrapping the model in
    DistributedDataParallel and before building the optimizer.
    """
    if hasattr(model, "ddp_config") or isinstance(model, nn.parallel.DistributedDataParallel):
        raise ValueError("fmoefy: call it on the bare model, before wrapping it in DistributedDataParallel "
                         "and building the optimizer")
    require_parallel_state("fmoefy")
    ep_size = parallel_state.get_expert_model_parallel_world_size()
    if fmoe_num_experts is not None:
        if num_experts is not None and num_experts != fmoe_num_experts * ep_size:
            raise ValueError(f"fmoefy: num_experts={num_experts} and fmoe_num_experts={fmoe_num_experts} (per rank, "
                             f"{ep_size} expert-parallel ranks) disagree; pass one of them")
        num_experts = fmoe_num_experts * ep_size
    if num_experts is None:
        raise ValueError("fmoefy needs num_experts (over all expert-parallel ranks) or fmoe_num_experts (per rank)")
    if hidden_hidden_size is not None:
        if ffn_hidden_size is not None and ffn_hidden_size != hidden_hidden_size:
            raise ValueError(f"fmoefy: ffn_hidden_size={ffn_hidden_size} and hidden_hidden_size={hidden_hidden_size} "
                             "disagree; pass one of them")
        ffn_hidden_size = hidden_hidden_size
    layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]
    if not layers:
        raise ValueError(f"fmoefy found no Megatron-Core TransformerLayer in {type(model).__name__}")
    for layer in layers:
        if isinstance(layer.pre_mlp_layernorm, IdentityOp) and hasattr(layer.mlp, "linear_fc1") and \
                hasattr(layer.mlp.linear_fc1, "layer_norm_weight"):
            raise ValueError("fmoefy: this layer's pre-MLP layernorm is fused into linear_fc1 (Transformer Engine "
                             "spec) and would be lost with the MLP; build the model with get_gpt_layer_local_spec() "
                             "or get_gpt_layer_with_fmoe_spec()")
    config = layers[0].config
    config.num_moe_experts = num_experts
    config.moe_router_topk = top_k
    config.expert_model_parallel_size = ep_size
    config.moe_aux_loss_coeff = aux_loss_coeff
    for layer in layers:
        layer.mlp = MegatronMLP(layer.config, num_experts=num_experts, top_k=top_k, gate=gate, gate_kwargs=gate_kwargs,
                                aux_loss_coeff=aux_loss_coeff, ffn_hidden_size=ffn_hidden_size, **mlp_params)
        layer.mlp.set_layer_number(layer.layer_number)
        layer.is_moe_layer = False      # it names Megatron's own MoELayer, which this layer no longer has
    return model
