"""SwipeGate (FastMoE's SWIPE balancing): each rank can take `capacity` slots in all; slots a
full rank refuses are moved to ranks with room left, so no slot is dropped.

One pass per k (`swipe_once`): every rank learns how many slots every rank sends to every other
(an all-gather of the counts), and all compute the same plan. Receivers accept senders in rank
order until full; the refused slots of each sender, in sender order, fill the ranks that have
room, in rank order, and land on expert `bias` of that rank. A sender keeps its first accepted
slots per target in token order and moves the rest.
"""
import torch
import torch.distributed as dist

from fmoe.gates.base import BaseGate, LinearRouter
from fmoe.gates.distributed_capacity import accepted_first_come, gather_counts, group_size, keep_first


def swipe_plan(sent_WW: torch.Tensor, capacity_W: torch.Tensor):
    """(slots rank i ends up sending to rank j [W, W], capacity left per rank [W])."""
    accepted_WW = accepted_first_come(sent_WW, capacity_W)
    left_W = capacity_W - accepted_WW.sum(0)
    refused_W = (sent_WW - accepted_WW).sum(1)
    if int(refused_W.sum()) > int(left_W.sum()):
        raise ValueError(f"SwipeGate: {int(refused_W.sum())} slots refused but only {int(left_W.sum())} "
                         "places left in the group: the capacity is too small for the batch")
    # Refused slots of sender i take, in rank order, the places left after those of senders < i.
    places_before_W = torch.cumsum(left_W, 0) - left_W
    refused_before_W = torch.cumsum(refused_W, 0) - refused_W
    start_W1, end_W1 = refused_before_W[:, None], (refused_before_W + refused_W)[:, None]
    lo_1W, hi_1W = places_before_W[None], (places_before_W + left_W)[None]
    moved_WW = (torch.minimum(end_W1, hi_1W) - torch.maximum(start_W1, lo_1W)).clamp_min(0)
    return accepted_WW + moved_WW, left_W - moved_WW.sum(0)


class SwipeGate(BaseGate):
    """FastMoE's SWIPE balancing: top-k by the router, then slots that a full rank refuses move to
    ranks with room left, so no slot is dropped (one all-gather of counts per k; a graph break
    under `torch.compile`)."""

    def __init__(self, d_model, num_expert, world_size=1, top_k=2, gate_bias=True, moe_group=None):
        super().__init__(d_model, num_expert, world_size, top_k)
        self.gate = LinearRouter(d_model, self.tot_expert, bias=gate_bias)
        self.moe_group = moe_group

    def swipe_once(self, idx_T: torch.Tensor, capacity, bias: int):
        """Re-route one slot per token so this rank's group capacity holds: (new idx_T, capacity left)."""
        with torch.no_grad():
            group = self.moe_group if self.world_size > 1 else None
            W = group_size(group) if self.world_size > 1 else 1
            if W != self.world_size:
                raise ValueError(f"SwipeGate: world_size={self.world_size} but the group has {W} ranks")
            me = dist.get_rank(group) if W > 1 else 0
            rank_T = torch.div(idx_T, self.num_expert, rounding_mode="floor")
            sent_W = torch.bincount(rank_T, minlength=W)
            capacity = torch.as_tensor(capacity, dtype=torch.long)
            sent_WW = gather_counts(sent_W, group)
            capacity_W = gather_counts(capacity.reshape(1).to(sent_W.device), group)[:, 0]
            final_WW, left_W = swipe_plan(sent_WW, capacity_W)
            mine_W = final_WW[me]
            kept_T = keep_first(rank_T, torch.minimum(mine_W, sent_W))
            room_W = mine_W - torch.bincount(rank_T[kept_T], minlength=W)
            moved_to = torch.repeat_interleave(torch.arange(W, device=idx_T.device), room_W)
            new_idx_T = idx_T.clone()
            new_idx_T[~kept_T] = moved_to * self.num_expert + bias
            return new_idx_T, left_W[me].to(capacity.device).reshape(())

    def route(self, x_TD):
        logits_TE = self.gate(x_TD)
        top_TK, idx_TK = self.choose(logits_TE, self.top_k)
        if self.training and self.replayed_TK is None:     # a replayed choice is kept as it is
            capacity = torch.tensor(x_TD.shape[0] * self.top_k, dtype=torch.long)
            columns = []
            for k in range(self.top_k):
                idx_T, capacity = self.swipe_once(idx_TK[:, k], capacity, k % self.num_expert)
                columns.append(idx_T)
            idx_TK = torch.stack(columns, dim=1)
            top_TK = logits_TE.gather(1, idx_TK)
        weight_TK = torch.softmax(top_TK.float(), dim=-1)
        aux = logits_TE.new_zeros((), dtype=torch.float32)
        return idx_TK, weight_TK, weight_TK, logits_TE, aux
