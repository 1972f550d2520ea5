"""FasterGate: the topology-aware gate of FasterMoE, with FastMoE's semantics.

Tokens whose first choice is an expert on another node are *outgoing*. When there are at least
`int(outgoing_fraction * T)` of them, every token takes its top-k among the experts of its own
node, except the `int(outgoing_fraction * T)` outgoing tokens with the highest first-choice
logits, which put their first choice back in their last slot. Weights are a softmax over the
chosen logits. No value is read back to the host: both outcomes are computed and one is kept.
"""
import math
import os

import torch

from fmoe.gates.base import check_float, check_int, slot_values
from fmoe.gates.router import RouterGate


def topology_option(name: str, value, env: str, default, parse, check):
    """An explicit value, else the environment variable `env` (named in any error), else `default`."""
    if value is not None:
        return check(name, value)
    raw = os.environ.get(env)
    if raw is None:
        return default
    try:
        return check(name, parse(raw))
    except ValueError as err:
        raise ValueError(f"environment variable {env}={raw!r} is invalid: {err}") from None


class FasterGate(RouterGate):
    """`FasterGate(d_model, num_expert, world_size, node_rank)` as FastMoE's. `node_rank` None:
    the node of `ep_rank` (FMoE sets it to this rank's place in the expert-parallel group)."""

    def __init__(self, d_model, num_expert, world_size=1, node_rank=None, gate_bias=True, *, top_k=2,
                 capacity=None, z_loss_coef=0.0, gpus_per_node=None, outgoing_fraction=None, ep_rank=None):
        super().__init__(d_model, num_expert, world_size, top_k, softmax_after_topk=True, gate_bias=gate_bias,
                         capacity=capacity, z_loss_coef=z_loss_coef)
        self.gpus_per_node = topology_option("gpus_per_node", gpus_per_node, "FMOE_TOPO_GPUS_PER_NODE", 8,
                                             int, check_int)
        self.outgoing_fraction = topology_option("outgoing_fraction", outgoing_fraction,
                                                 "FMOE_TOPO_OUTGOING_FRACTION", 0.14, float,
                                                 lambda n, v: check_float(n, v, 0.0, 1.0))
        on_node = min(self.gpus_per_node, world_size) * num_expert
        if on_node < self.top_k:
            raise ValueError(f"top_k={top_k} exceeds the {on_node} experts on one node (gpus_per_node * num_expert)")
        self.node_rank = None if node_rank is None else check_int("node_rank", node_rank, low=0)
        self.ep_rank = 0 if ep_rank is None else check_int("ep_rank", ep_rank, low=0)

    def expert_on_my_node_E(self, device) -> torch.Tensor:
        node = self.ep_rank // self.gpus_per_node if self.node_rank is None else self.node_rank
        owner_E = torch.arange(self.tot_expert, device=device) // self.num_expert
        return owner_E // self.gpus_per_node == node

    def route(self, x_TD):
        logits_TE = self.router_logits(x_TD)
        K = self.top_k
        top_TK, idx_TK = self.choose(logits_TE, K)
        if self.replayed_TK is None:
            idx_TK = self.cap_outgoing(x_TD, logits_TE, top_TK, idx_TK)
        weight_TK = torch.softmax(slot_values(logits_TE, idx_TK, torch.finfo(logits_TE.dtype).min), dim=-1)
        return idx_TK, weight_TK, weight_TK, logits_TE, logits_TE.new_zeros(())

    @torch.no_grad()
    def cap_outgoing(self, x_TD, logits_TE, top_TK, idx_TK):
        """The choice with the outgoing slots capped (see the module docstring)."""
        K = self.top_k
        off_node_E = ~self.expert_on_my_node_E(x_TD.device)
        first_T = idx_TK[:, 0]
        outgoing_T = off_node_E[first_T]
        limit = int(x_TD.shape[0] * self.outgoing_fraction)
        ranked_T = top_TK[:, 0].masked_fill(~outgoing_T, -math.inf)
        kept_T = torch.zeros_like(outgoing_T).scatter(0, torch.topk(ranked_T, limit).indices, True)
        local_idx_TK = torch.topk(logits_TE.masked_fill(off_node_E, -math.inf), K, dim=-1).indices
        last_K = torch.where(kept_T & outgoing_T, first_T, local_idx_TK[:, K - 1])
        capped_idx_TK = torch.cat([local_idx_TK[:, :K - 1], last_K[:, None]], dim=1)
        over_limit = outgoing_T.sum() >= limit
        return torch.where(over_limit, capped_idx_TK, idx_TK)
