"""GPT layer specs whose MLP is fmoe's MoE."""
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec

from fmoe.integrations.megatron.mlp import MegatronMLP


def fmoe_mlp_spec(**mlp_params) -> ModuleSpec:
    """The spec of `MegatronMLP` with these constructor arguments (gate=..., num_experts=..., ...)."""
    return ModuleSpec(module=MegatronMLP, params=mlp_params)


def get_gpt_layer_with_fmoe_spec(normalization: str = "LayerNorm", qk_layernorm: bool = False,
                                 **mlp_params) -> ModuleSpec:
    """Megatron-Core's local GPT layer (no Transformer Engine, no apex) with `MegatronMLP` as its MLP.

    `mlp_params` go to MegatronMLP (gate, gate_kwargs, num_experts, top_k, aux_loss_coeff, ...);
    what they leave out is read from the TransformerConfig.
    """
    if normalization not in ("LayerNorm", "RMSNorm"):
        raise ValueError(f"normalization must be 'LayerNorm' or 'RMSNorm', got {normalization!r}")
    spec = get_gpt_layer_local_spec(normalization=normalization, qk_layernorm=qk_layernorm)
    spec.submodules.mlp = fmoe_mlp_spec(**mlp_params)
    return spec
