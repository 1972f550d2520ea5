"""A routing trace from transformers' own router logits, for router replay (`fmoe.replay_routing`).

    out = hf_model(ids, output_router_logits=True)              # the rollout, in transformers (any precision)
    trace = fmoe.integrations.hf.trace_from_router_logits(model, out.router_logits)  # `model`: the converted trainer
    with fmoe.replay_routing(model, trace):
        loss = model(ids, labels=ids).loss
"""
from typing import Sequence

import torch
from torch import nn

from fmoe.integrations.hf.block import converted_blocks
from fmoe.replay import RoutingTrace


def trace_from_router_logits(model: nn.Module, router_logits: Sequence[torch.Tensor]) -> RoutingTrace:
    """The experts each converted block of `model` would choose from `router_logits` (one `[tokens,
    experts]` tensor per MoE block, in the order of the model's blocks, as a transformers forward with
    `output_router_logits=True` returns them): the block's gate's choice in evaluation (no noise; PhiMoE's
    best rather than sampled experts), as one forward of each block."""
    blocks = converted_blocks(model)
    if not blocks:
        raise ValueError(f"trace_from_router_logits: {type(model).__name__} has no converted block: "
                         "fmoe.integrations.hf.convert the model first")
    if len(router_logits) != len(blocks):
        raise ValueError(f"trace_from_router_logits: {len(router_logits)} router logits for the model's "
                         f"{len(blocks)} MoE blocks; pass one per block (one forward's)")
    layers = {}
    with torch.no_grad():
        for (name, block), logits in zip(blocks, router_logits):
            gate = block.moe.gate
            logits_TE = logits.reshape(-1, logits.shape[-1])
            if logits_TE.shape[-1] != gate.tot_expert:
                raise ValueError(f"trace_from_router_logits: {name} routes to {gate.tot_expert} experts, its router "
                                 f"logits have {logits_TE.shape[-1]}")
            dtype = gate.gate.proj.weight.dtype
            layers[block.moe.routing_name or f"{name}.moe"] = [gate.select(logits_TE.to(dtype), False)[0].cpu()]
    return RoutingTrace(layers)
