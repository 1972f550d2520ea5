"""The experts implementation "fmoe" for transformers' `ExpertsInterface`.

    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="fmoe")

runs an unconverted model's fused experts on fmoe's kernels (one sort into a RoutingPlan,
permute, two grouped GEMMs, unpermute), reading transformers' own expert tensors in place. It
routes with the model's own router and keeps every expert on every process; for fmoe's expert
parallelism and routing options, `fmoe.hf.convert` the model instead.
"""
import torch

from fmoe import kernels
from fmoe.routing import RoutingPlan

NAME = "fmoe"


def fmoe_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' experts forward contract: tokens [T, D], chosen experts and weights [T, K] -> [T, D]."""
    E = self.num_experts
    # transformers' own expert parallelism marks slots of other ranks' experts with ids >= E: no row.
    expert_idx_TK = torch.where(top_k_index < E, top_k_index, torch.full_like(top_k_index, -1))
    plan = RoutingPlan.build(expert_idx_TK, E)
    x_ND = kernels.permute(hidden_states, plan)
    up = self.gate_up_proj if self.has_gate else self.up_proj
    up_bias = (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias) if self.has_bias else None
    h_NF = kernels.grouped_mm(x_ND, up if self.is_transposed else up.transpose(1, 2), plan.counts_E, up_bias)
    h_NF = self._apply_gate(h_NF) if self.has_gate else self.act_fn(h_NF)
    down = self.down_proj if self.is_transposed else self.down_proj.transpose(1, 2)
    y_ND = kernels.grouped_mm(h_NF, down, plan.counts_E, self.down_proj_bias if self.has_bias else None)
    if self.has_post_expert_norm:
        y_ND = self.post_expert_norm(y_ND)
    return kernels.unpermute(y_ND, plan, top_k_weights.to(y_ND.dtype)).to(hidden_states.dtype)


def register_experts_implementation():
    """Register "fmoe" with transformers' ExpertsInterface (idempotent); False where it has none."""
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError:
        return False
    ExpertsInterface.register(NAME, fmoe_experts_forward)
    return True
