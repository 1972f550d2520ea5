"""The deduplicated exchange: a token travels once per destination rank, or, across nodes, once
per destination node and then once per rank inside it; its experts' weighted outputs are summed
where the experts are, and one row travels back.

A *hop* is one such all-to-all. Its sent rows are (token, destination) pairs: a RoutingPlan over
the tokens whose "experts" are the destination ranks (`pairs`), so `kernels.permute` lays the rows
out by destination and `kernels.sum_rows` adds the rows that come back, each the adjoint of the
other. With every row go the token's K expert ids (-1 for the slots going elsewhere) and its K
routing weights (0 there). The receiving rank treats its received rows as tokens routed by those
ids: the rank exchange's last hop runs its local experts on them (a one-rank RoutingPlan over
its experts, `local`); the node exchange's first hop reaches one rank of each destination node
(the one with the sender's local index), which runs the rank hop inside its node (`inner`).

Everything above is agreed at plan time (the splits and ids cross in two small all-to-alls);
only the rows and the weights travel in the forward, and their gradients in the backward, so
the routing weights' gradients reach the gate.
"""
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from fmoe import kernels
from fmoe.distributed.exchange import AllToAll, Traffic, ranks_per_node_of, row_bytes
from fmoe.distributed.timeout import current_layer, wait
from fmoe.routing import RoutingPlan

EXCHANGES = ("slot", "rank", "node")


def check_exchange(exchange) -> str:
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
    return exchange


@dataclass
class Hop:
    pairs: RoutingPlan              # rows sent: (token, destination rank) pairs grouped by destination
    send_splits_W: List[int]
    recv_splits_W: List[int]
    slot_mask_NK: torch.Tensor      # which of the token's K slots each sent row serves
    expert_idx_QK: torch.Tensor     # received rows' slots: global expert ids, -1 for the other ranks'
    group: Optional[dist.ProcessGroup]
    layer: str
    traffic: Optional[Traffic]
    inner: Optional["Hop"] = None           # the node exchange's hop inside the destination node
    local: Optional[RoutingPlan] = None     # the last hop: received rows routed to this rank's experts

    @property
    def num_sent(self) -> int:
        return self.pairs.num_rows


def _all_to_all(x, send_splits, recv_splits, group, what):
    out = x.new_empty((sum(recv_splits),) + tuple(x.shape[1:]))
    wait(dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group, async_op=True), what)
    return out


def build_hop(expert_idx_TK: torch.Tensor, dest_of_E: torch.Tensor, group, traffic: Optional[Traffic]) -> Hop:
    """Agree on one hop: token t goes once to each rank dest_of_E[e] for its experts e (-1: none)."""
    world = dist.get_world_size(group)
    T, K = expert_idx_TK.shape
    live_TK = expert_idx_TK >= 0
    dest_TK = torch.where(live_TK, dest_of_E[expert_idx_TK.clamp_min(0)], -1)
    reach_TW = torch.zeros(T, world, dtype=torch.int64, device=expert_idx_TK.device)
    reach_TW.scatter_add_(1, dest_TK.clamp_min(0), live_TK.long())
    dest_TW = torch.where(reach_TW > 0, torch.arange(world, device=reach_TW.device), -1)
    pairs = RoutingPlan.build(dest_TW, world, compact=True)
    dest_N = pairs.slot_N % world
    slot_mask_NK = dest_TK.index_select(0, pairs.token_N) == dest_N[:, None]
    layer = current_layer()
    counts_W = pairs.counts_E
    recv_W = _all_to_all(counts_W, [1] * world, [1] * world, group, f"{layer}: pair counts all-to-all")
    send_splits, recv_splits = counts_W.tolist(), recv_W.tolist()
    idx_NK = torch.where(slot_mask_NK, expert_idx_TK.index_select(0, pairs.token_N), -1)
    idx_QK = _all_to_all(idx_NK, send_splits, recv_splits, group, f"{layer}: expert ids all-to-all")
    if traffic is not None:
        traffic.add("routing", False, [1] * world, row_bytes(counts_W))
        traffic.add("routing", False, send_splits, row_bytes(idx_NK))
    return Hop(pairs, send_splits, recv_splits, slot_mask_NK, idx_QK, group, layer, traffic)


def build_dedup_plan(expert_idx_TK: torch.Tensor, num_expert: int, exchange: str, ranks_per_node: int,
                     group=None, traffic: Optional[Traffic] = None) -> Hop:
    """The hops of the rank (or node) exchange for global expert ids `expert_idx_TK` (-1: stays
    home), `num_expert` experts per rank; every rank of `group` calls it."""
    check_exchange(exchange)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    ranks_per_node = ranks_per_node_of(world, ranks_per_node)
    owner_E = torch.arange(num_expert * world, device=expert_idx_TK.device) // num_expert
    if exchange == "rank":
        hop = build_hop(expert_idx_TK, owner_E, group, traffic)
        inner = hop
    else:
        gateway_E = owner_E // ranks_per_node * ranks_per_node + rank % ranks_per_node
        hop = build_hop(expert_idx_TK, gateway_E, group, traffic)
        hop.inner = inner = build_hop(hop.expert_idx_QK, owner_E, group, traffic)
    local_idx_QK = torch.where(inner.expert_idx_QK >= 0, inner.expert_idx_QK - rank * num_expert, -1)
    inner.local = RoutingPlan.build(local_idx_QK, num_expert, compact=True)
    return hop


def run_hop(hop: Hop, x_TD, weight_TK: torch.Tensor, experts: Callable, backend: Optional[str] = None):
    """sum over destinations of the weighted expert outputs for the tokens x_TD (a tensor or a tree
    of them sharing the rows): the rows travel out, `experts(x_QD, local_plan, weight_QK)` runs on
    the last hop's received rows, its output travels back."""
    what = f"{hop.layer}: deduplicated"
    x_ND = tree_map(lambda t: kernels.permute(t, hop.pairs, backend), x_TD)
    w_NK = weight_TK.index_select(0, hop.pairs.token_N).masked_fill(~hop.slot_mask_NK, 0)
    x_QD = tree_map(lambda t: AllToAll.apply(t, hop.send_splits_W, hop.recv_splits_W, hop.group,
                                             f"{what} dispatch", hop.traffic, "dispatch"), x_ND)
    w_QK = AllToAll.apply(w_NK, hop.send_splits_W, hop.recv_splits_W, hop.group, f"{what} weights",
                          hop.traffic, "routing")
    if hop.inner is not None:
        y_QD = run_hop(hop.inner, x_QD, w_QK, experts, backend)
    else:
        y_QD = experts(x_QD, hop.local, w_QK)
    y_ND = tree_map(lambda t: AllToAll.apply(t, hop.recv_splits_W, hop.send_splits_W, hop.group,
                                             f"{what} combine", hop.traffic, "combine"), y_QD)
    return tree_map(lambda t: kernels.sum_rows(t, hop.pairs, backend), y_ND)

