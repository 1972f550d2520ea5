"""FMoETransformerMLP (FastMoE's FFN-shaped MoE) and `moefy`, which turns a model's FFNs into it."""
from typing import Callable, Optional

import torch
from torch import nn

from fmoe.experts import FMoELinear, GroupedExperts, resolve_activation
from fmoe.layer import FMoE


class _Expert(nn.Module):
    """FastMoE's fused experts: two FMoELinear (`htoh4`, `h4toh`) around an activation, called
    as `experts(x, fwd_expert_count)`; assign it to `FMoE.experts` (FastMoE's fused pattern)."""

    def __init__(self, num_expert, d_model, d_hidden, activation, rank=0):
        super().__init__()
        self.htoh4 = FMoELinear(num_expert, d_model, d_hidden, bias=True, rank=rank)
        self.h4toh = FMoELinear(num_expert, d_hidden, d_model, bias=True, rank=rank)
        self.activation = activation

    def forward(self, inp, fwd_expert_count):
        return self.h4toh(self.activation(self.htoh4(inp, fwd_expert_count)), fwd_expert_count)


class StackedLinearView(nn.Module):
    """FastMoE's view of one stacked expert projection: `weight` [e, out, in] and `bias` [e, out]
    are views of GroupedExperts' parameters, so FastMoE-style init code (`model.apply` over
    modules named *Linear*, in-place `nn.init` on `m.weight`) reaches the experts. Holds no
    parameter of its own: the state dict and the optimiser see only GroupedExperts'."""

    def __init__(self, experts: GroupedExperts, weight_name: str, bias_name: str):
        super().__init__()
        object.__setattr__(self, "owner", experts)      # not a child module: no cycle in the tree
        self.weight_name, self.bias_name = weight_name, bias_name

    @property
    def weight(self):
        return getattr(self.owner, self.weight_name).transpose(1, 2)

    @property
    def bias(self):
        return getattr(self.owner, self.bias_name)


class FMoETransformerMLP(FMoE):
    """An MoE layer shaped like a Transformer FFN: d_model -> d_hidden -> d_model per expert.
    Its experts are stacked (GroupedExperts); `experts.htoh4` / `experts.h4toh` are FastMoE's
    views of them, and FastMoE's state dicts load (see fmoe/fastmoe_state.py)."""

    def __init__(self, num_expert=32, d_model=1024, d_hidden=4096, activation="gelu", expert_dp_comm="none",
                 expert_rank=0, **kwargs):
        super().__init__(num_expert=num_expert, d_model=d_model, d_hidden=d_hidden, activation=activation, **kwargs)
        self.expert_rank = expert_rank
        self.experts.htoh4 = StackedLinearView(self.experts, "w1_eDF", "b1_eF")
        self.experts.h4toh = StackedLinearView(self.experts, "w2_eFD", "b2_eD")
        self.mark_parallel_comm(expert_dp_comm)


class MoETransformerEncoderLayer(nn.TransformerEncoderLayer):
    """nn.TransformerEncoderLayer whose feed-forward block is the MoE layer `self.moe`."""

    def _ff_block(self, x):
        return self.dropout2(self.moe(x))


class MoETransformerDecoderLayer(nn.TransformerDecoderLayer):
    def _ff_block(self, x):
        return self.dropout3(self.moe(x))


def _dense_ffn_parts(module: nn.Module):
    """(up, gate_or_None, down, activation) of a dense FFN, or None when its shape is not known."""
    if isinstance(module, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
        return module.linear1, None, module.linear2, module.activation
    names = dict(module.named_children())
    for gate, up, down in (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")):
        if all(isinstance(names.get(n), nn.Linear) for n in (gate, up, down)):
            return names[up], names[gate], names[down], "swiglu"
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    acts = [m for m in module.modules() if isinstance(m, (nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid))]
    if len(linears) == 2 and linears[0].in_features == linears[1].out_features and len(acts) == 1:
        return linears[0], None, linears[1], acts[0]
    return None


@torch.no_grad()
def upcycle_experts(moe: FMoE, up: nn.Linear, gate: Optional[nn.Linear], down: nn.Linear):
    """Sparse upcycling: every expert becomes a copy of the dense FFN."""
    experts = moe.experts
    w1 = up.weight.t() if gate is None else torch.cat([gate.weight.t(), up.weight.t()], dim=1)
    experts.w1_eDF.copy_(w1.expand_as(experts.w1_eDF))
    experts.w2_eFD.copy_(down.weight.t().expand_as(experts.w2_eFD))
    if experts.b1_eF is not None:
        b1 = up.bias if gate is None else torch.cat([gate.bias, up.bias])
        experts.b1_eF.copy_(b1.expand_as(experts.b1_eF))
        experts.b2_eD.copy_(down.bias.expand_as(experts.b2_eD))


def moe_from_dense(module: nn.Module, num_expert: int, top_k: int, gate, upcycle: bool, **kwargs) -> FMoETransformerMLP:
    parts = _dense_ffn_parts(module)
    if parts is None:
        raise ValueError(
            f"moefy cannot read the FFN {type(module).__name__}: expected two nn.Linear with one activation "
            "module, gate_proj/up_proj/down_proj, w1/w3/w2, or an nn.Transformer*Layer"
        )
    up, gate_proj, down, activation = parts
    has_bias = up.bias is not None and down.bias is not None and (gate_proj is None or gate_proj.bias is not None)
    moe = FMoETransformerMLP(num_expert=num_expert, d_model=up.in_features, d_hidden=up.out_features,
                             activation=resolve_activation(activation), top_k=top_k, gate=gate,
                             expert_bias=has_bias, **kwargs)
    moe.to(device=up.weight.device, dtype=up.weight.dtype)
    if upcycle:
        upcycle_experts(moe, up, gate_proj, down)
    return moe


def moefy(model: nn.Module, num_expert: int, top_k: int = 2, gate="naive", upcycle: bool = True,
          select: Optional[Callable[[str, nn.Module], bool]] = None, **kwargs) -> nn.Module:
    """Turn the FFN blocks of `model` into MoE layers, in place; returns the model.

    Every nn.TransformerEncoderLayer / DecoderLayer is converted; `select(name, module)`
    picks any other FFN modules (replaced whole). With `upcycle`, each expert starts as a
    copy of the dense FFN, so with a gate whose weights sum to 1 (naive, noisy, gshard,
    balanced) the output is unchanged at the first step.
    """
    chosen = []
    for name, module in model.named_modules():
        is_layer = isinstance(module, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer))
        if is_layer and hasattr(module, "linear1"):
            chosen.append((name, module, True))
        elif select is not None and select(name, module):
            chosen.append((name, module, False))
    if not chosen:
        raise ValueError("moefy found no FFN to convert: pass select=(lambda name, module: ...) to pick them")
    for name, module, is_layer in chosen:
        moe = moe_from_dense(module, num_expert, top_k, gate, upcycle, **kwargs)
        if is_layer:
            del module.linear1, module.linear2
            module.moe = moe
            module.activation_relu_or_gelu = False   # keeps the fused fast path (which needs linear1) off
            module.__class__ = (MoETransformerEncoderLayer if isinstance(module, nn.TransformerEncoderLayer)
                                else MoETransformerDecoderLayer)
        else:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            if parent is model and not parent_name and name == "":
                raise ValueError("moefy: select picked the model itself; pick its FFN submodules")
            setattr(parent, child, moe)
    return model
