"""The experts implementation "fmoe" for transformers' `ExpertsInterface`.

    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="fmoe")

runs an unconverted model's fused experts on fmoe's kernels, reading transformers' own expert
tensors in place: one sort into a RoutingPlan, then, for the activations fmoe's kernels know
(transformers' default gate with SiLU / GELU / ReLU, or a plain GELU / ReLU), the lean MLP with its
combine (`fmoe.kernels.routed_mlp`: on a GPU the fused Triton kernels, nothing of size T*K*D kept
for the backward); for any other (gpt-oss's own gate, a post-expert norm) permute, two grouped
GEMMs and a weighted unpermute. It
routes with the model's own router and keeps every expert on every process; for fmoe's expert
parallelism and routing options, `fmoe.integrations.hf.convert` the model instead.
"""
import warnings

import torch

from fmoe import kernels
from fmoe.experts import glu_act_name
from fmoe.routing import RoutingPlan

NAME = "fmoe"


def fmoe_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' experts forward contract: tokens [T, D], chosen experts and weights [T, K] -> [T, D]."""
    E = self.num_experts
    # Releases before 5.20 set only has_bias and is_transposed (5.0) on the experts: the tensors tell the rest.
    has_gate = getattr(self, "has_gate", hasattr(self, "gate_up_proj"))
    has_bias = getattr(self, "has_bias", False)
    is_transposed = getattr(self, "is_transposed", False)
    # transformers' own expert parallelism marks slots of other ranks' experts with ids >= E: no row.
    expert_idx_TK = torch.where(top_k_index < E, top_k_index, torch.full_like(top_k_index, -1))
    plan = RoutingPlan.build(expert_idx_TK, E)
    up = self.gate_up_proj if has_gate else self.up_proj
    up_bias = (self.gate_up_proj_bias if has_gate else self.up_proj_bias) if has_bias else None
    w1_eDF = up if is_transposed else up.transpose(1, 2)
    down = self.down_proj if is_transposed else self.down_proj.transpose(1, 2)
    spec = fused_spec(self, has_gate)
    if spec is not None:
        return kernels.routed_mlp(hidden_states, plan, top_k_weights, spec, w1_eDF, down, up_bias,
                                  self.down_proj_bias if has_bias else None).to(hidden_states.dtype)
    x_ND = kernels.permute(hidden_states, plan)
    h_NF = kernels.grouped_mm(x_ND, w1_eDF, plan.counts_E, up_bias)
    h_NF = self._apply_gate(h_NF) if has_gate else self.act_fn(h_NF)
    y_ND = kernels.grouped_mm(h_NF, down, plan.counts_E, self.down_proj_bias if has_bias else None)
    if getattr(self, "has_post_expert_norm", False):
        y_ND = self.post_expert_norm(y_ND)
    return kernels.unpermute(y_ND, plan, top_k_weights.to(y_ND.dtype)).to(hidden_states.dtype)


def fused_spec(experts, has_gate: bool):
    """The fused activation spec (`fmoe.experts.fused_activation_spec`) of transformers' experts module,
    or None where fmoe's kernels do not know its activation: a gate of its own (gpt-oss's clamped one),
    a post-expert norm, an activation other than SiLU / GELU / ReLU."""
    if getattr(experts, "has_post_expert_norm", False):
        return None
    act = glu_act_name(getattr(experts, "act_fn", None))
    if not has_gate:
        return act if act in ("gelu", "relu") else None
    try:
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:
        return None
    if act is None or getattr(type(experts), "_apply_gate", None) is not _default_apply_gate:
        return None
    return "swiglu" if act == "silu" else f"glu:{act}:split"      # gate first, then up: chunk(2)


def dbrx_experts_implementation(self, requested_experts):
    """DBRX's experts loop by themselves, never through the ExpertsInterface: asked for "fmoe",
    they say so and run eager instead of ignoring it silently."""
    from transformers import PreTrainedModel
    if requested_experts == NAME:
        warnings.warn("DBRX's experts (transformers' DbrxExperts) do not dispatch through transformers' experts "
                      "implementations, so they cannot use experts_implementation='fmoe' and run eager: "
                      "fmoe.integrations.hf.convert(model) runs them on fmoe's kernels", stacklevel=3)
        requested_experts = "eager"
    return PreTrainedModel.get_correct_experts_implementation(self, requested_experts)


def register_experts_implementation() -> bool:
    """Register "fmoe" with transformers' ExpertsInterface (idempotent); False, registering nothing,
    where transformers has none or refuses names of its users (5.0 takes only its own)."""
    try:
        from transformers import PreTrainedModel
        from transformers.integrations.moe import ExpertsInterface
        from transformers.models.dbrx.modeling_dbrx import DbrxPreTrainedModel
    except ImportError:
        return False
    ExpertsInterface.register(NAME, fmoe_experts_forward)
    try:        # it reads the model only to check "grouped_mm"
        PreTrainedModel.get_correct_experts_implementation(None, NAME)
    except ValueError:
        del ExpertsInterface._global_mapping[NAME]
        return False
    DbrxPreTrainedModel.get_correct_experts_implementation = dbrx_experts_implementation
    return True
