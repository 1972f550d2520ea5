"""DCGate (FastMoE's distributed-capacity gate): GShard-like top-2 where each expert's capacity,
ceil(rate * tokens per rank), holds for the tokens of all ranks together, filled first-come."""
import math

import torch

from fmoe.gates.base import BaseGate, LinearRouter
from fmoe.gates.capacity import count_live_per_expert
from fmoe.gates.distributed_capacity import limit_by_capacity


class DCGate(BaseGate):
    """FastMoE's distributed-capacity gate: GShard-like top-2 whose per-expert capacity,
    ceil(rate * tokens per rank), holds for the tokens of all ranks of `moe_group` together,
    filled first-come; `topk` must be 2."""

    per_micro_batch_attrs = BaseGate.per_micro_batch_attrs + ("capacity_drops",)

    def __init__(self, d_model, num_expert, world_size=1, topk=2, capacity=(1.2, 2.4), random_routing=True,
                 gate_bias=True, moe_group=None):
        if topk != 2:
            raise ValueError(f"topk must be 2 for DCGate, got {topk!r}")
        super().__init__(d_model, num_expert, world_size, topk, capacity)
        self.gate = LinearRouter(d_model, self.tot_expert, bias=gate_bias)
        self.random_routing = random_routing
        self.moe_group = moe_group

    @property
    def capacity_factor(self):
        return None     # the capacity is applied in route(), over the whole group

    def routing(self, x_TD):
        routing = super().routing(x_TD)
        routing.num_dropped = routing.num_dropped + self.capacity_drops
        return routing

    def route(self, x_TD):
        logits_TE = self.gate(x_TD)
        top_TK, idx_TK = self.choose(logits_TE, 2)
        weight_TK = torch.softmax(top_TK.float(), dim=-1)
        T = x_TD.shape[0]
        c_E = count_live_per_expert(idx_TK[:, 0], self.tot_expert).float() / max(T, 1)
        m_E = torch.softmax(logits_TE.float(), dim=-1).mean(0)
        aux = torch.mean(c_E * m_E) * self.num_expert ** 2
        if self.replayed_TK is not None:        # a replayed slot is never dropped
            self.capacity_drops = torch.zeros((), dtype=torch.long, device=x_TD.device)
            return idx_TK, weight_TK, weight_TK, logits_TE, aux
        rate = self.capacity[0] if self.training else self.capacity[1]
        _, _, kept_TK = limit_by_capacity(idx_TK, self.num_expert, self.world_size, math.ceil(rate * T),
                                          self.moe_group)
        self.capacity_drops = (kept_TK < 0).sum()
        return kept_TK, weight_TK.masked_fill(kept_TK < 0, 0.0), weight_TK, logits_TE, aux

    def unroute(self, expert_idx_TK, weight_TK):
        """Random routing after the capacity, as FastMoE: the second slot is kept with
        probability min(1, 2 * its weight)."""
        if not (self.training and self.random_routing):
            return super().unroute(expert_idx_TK, weight_TK)
        T = expert_idx_TK.shape[0]
        skip_T = (2 * weight_TK[:, 1].detach() < torch.rand(T, device=weight_TK.device)) & (expert_idx_TK[:, 1] >= 0)
        skip_TK = torch.stack([torch.zeros_like(skip_T), skip_T], dim=1)
        return expert_idx_TK.masked_fill(skip_TK, -1), weight_TK.masked_fill(skip_TK, 0.0), skip_T.sum()
