"""FastMoE path `fmoe.fastermoe.schedule`: the forward whose expert function runs one expert
at a time, `expert_fn(rows, fwd_expert_count, expert_index)`.

The outputs and gradients are those of the general forward; the pipelining and the shadowing
(`stored_models`) that FastMoE does here are fmoe's `FMoE(schedule=True, shadow=True)`, which
decide and apply them inside the layer, so this function computes without them.
"""
import torch

from fmoe.fastmoe.functions import general_global_forward


def _fmoe_general_global_forward(inp, gate, expert_fn, num_expert, world_size, experts=None,
                                 stored_models=None, **kwargs):
    def each_expert(x_RD, fwd_expert_count):
        counts = fwd_expert_count.tolist()
        rows = torch.split(x_RD, counts)
        outs = [expert_fn(r, torch.tensor([n]), e) for e, (r, n) in enumerate(zip(rows, counts)) if n]
        return torch.cat(outs) if outs else x_RD

    return general_global_forward(inp, gate, each_expert, num_expert, world_size)
