"""FasterGate: the topology-aware gate of FasterMoE. At most `outgoing_fraction` of the routed
slots of a rank may go to experts on other nodes; the best-scoring ones keep their choice, the
others are re-routed to the best experts on their own node."""
import math
import os

import torch

from fmoe.gates.base import BaseGate, LinearRouter


class FasterGate(BaseGate):
    def __init__(self, d_model, num_expert, world_size=1, top_k=2, gate_bias=True, capacity=None, z_loss_coef=0.0,
                 gpus_per_node=None, outgoing_fraction=None, ep_rank=None):
        super().__init__(d_model, num_expert, world_size, top_k, capacity, z_loss_coef)
        self.gpus_per_node = int(gpus_per_node if gpus_per_node is not None
                                 else os.environ.get("FMOE_TOPO_GPUS_PER_NODE", 8))
        self.outgoing_fraction = float(outgoing_fraction if outgoing_fraction is not None
                                       else os.environ.get("FMOE_TOPO_OUTGOING_FRACTION", 0.14))
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node (FMOE_TOPO_GPUS_PER_NODE) must be >= 1, got {self.gpus_per_node}")
        if not 0 <= self.outgoing_fraction <= 1:
            raise ValueError(f"outgoing_fraction (FMOE_TOPO_OUTGOING_FRACTION) must be in [0, 1], "
                             f"got {self.outgoing_fraction}")
        on_node = min(self.gpus_per_node, world_size) * num_expert
        if on_node < top_k:
            raise ValueError(f"top_k={top_k} exceeds the {on_node} experts on one node (gpus_per_node * num_expert)")
        self.gate = LinearRouter(d_model, self.tot_expert, bias=gate_bias)
        self.ep_rank = ep_rank or 0       # FMoE sets it to the rank in the expert-parallel group

    def expert_on_my_node_E(self, device) -> torch.Tensor:
        owner_E = torch.arange(self.tot_expert, device=device) // self.num_expert
        return owner_E // self.gpus_per_node == self.ep_rank // self.gpus_per_node

    def route(self, x_TD):
        logits_TE = self.gate(x_TD)
        top_TK, idx_TK = torch.topk(logits_TE, self.top_k, dim=-1)
        on_node_E = self.expert_on_my_node_E(x_TD.device)
        leaving_TK = ~on_node_E[idx_TK]
        limit = math.floor(self.outgoing_fraction * idx_TK.numel())
        if int(leaving_TK.sum()) > limit:
            # Keep the `limit` best-scoring outgoing slots; every token then picks its top-k among
            # its kept outgoing experts and all experts of its own node.
            leaving_scores = torch.where(leaving_TK, top_TK.detach().float(), torch.tensor(-math.inf)).reshape(-1)
            kept = torch.topk(leaving_scores, limit).indices if limit else leaving_scores.new_zeros(0, dtype=torch.long)
            allowed_TE = on_node_E.expand_as(logits_TE).clone()
            allowed_TE[kept // self.top_k, idx_TK.reshape(-1)[kept]] = True
            top_TK, idx_TK = torch.topk(logits_TE.masked_fill(~allowed_TE, -math.inf), self.top_k, dim=-1)
        weight_TK = torch.softmax(top_TK.float(), dim=-1)
        aux = logits_TE.new_zeros((), dtype=torch.float32)
        return idx_TK, weight_TK, weight_TK, logits_TE, aux
