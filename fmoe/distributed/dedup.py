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

*Bounded* hops (a layer's `sync_free=True`) read nothing on the host: every rank sends each rank
exactly `bound` rows (`max_tokens_per_rank`; padding where fewer, ids -1), through the
functional collectives, which torch.compile traces. A (token, destination) pair past the bound
is not sent: its slots add nothing, and the number of such pairs, summed over the ranks, is the
hop's `overflow` (a device tensor, equal on every rank) that the layer reports.
"""
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
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
    local_idx_QK: Optional[torch.Tensor] = None     # the last hop: received rows' slots as local expert ids
    bound: Optional[int] = None             # bounded hop: rows sent to every rank (splits never read)
    overflow: Optional[torch.Tensor] = None  # bounded hop: pairs past the bound, summed over the ranks

    @property
    def num_sent(self) -> int:
        return self.pairs.num_rows

    def send(self, x, what: str, kind: str):
        if self.bound is None:
            return AllToAll.apply(x, self.send_splits_W, self.recv_splits_W, self.group, what, self.traffic, kind)
        if self.traffic is not None:        # fixed sizes: the backward's are known now
            self.traffic.add(kind, False, self.send_splits_W, row_bytes(x))
            if x.requires_grad:
                self.traffic.add(kind, True, self.recv_splits_W, row_bytes(x))
        return fc.all_to_all_single_autograd(x.contiguous(), None, None, functional_group(self.group))

    def send_back(self, y, what: str):
        return self.send(y, what, "combine") if self.bound is not None else \
            AllToAll.apply(y, self.recv_splits_W, self.send_splits_W, self.group, what, self.traffic, "combine")


def functional_group(group):
    """The group as torch's functional (traceable) collectives take it: None is the world."""
    return dist.group.WORLD if group is None else group


def _all_to_all(x, send_splits, recv_splits, group, what):
    out = x.new_empty((sum(recv_splits),) + tuple(x.shape[1:]))
    wait(dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group, async_op=True), what)
    return out


def destinations(expert_idx_TK: torch.Tensor, dest_of_E: torch.Tensor, world: int):
    """(dest_TK: each slot's destination rank, -1 for none; reach_TW: token t goes to rank w)."""
    live_TK = expert_idx_TK >= 0
    dest_TK = torch.where(live_TK, dest_of_E[expert_idx_TK.clamp_min(0)], -1)
    reach_TW = torch.zeros(expert_idx_TK.shape[0], world, dtype=torch.int64, device=expert_idx_TK.device)
    return dest_TK, reach_TW.scatter_add(1, dest_TK.clamp_min(0), live_TK.long()) > 0


def build_hop(expert_idx_TK: torch.Tensor, dest_of_E: torch.Tensor, group, traffic: Optional[Traffic]) -> Hop:
    """Agree on one hop: token t goes once to each rank dest_of_E[e] for its experts e (-1: none)."""
    world = dist.get_world_size(group)
    dest_TK, reach_TW = destinations(expert_idx_TK, dest_of_E, world)
    dest_TW = torch.where(reach_TW, torch.arange(world, device=reach_TW.device), -1)
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


def build_bounded_hop(expert_idx_TK: torch.Tensor, dest_of_E: torch.Tensor, group, bound: int,
                      traffic: Optional[Traffic], first: int = 0, exchange_world: Optional[int] = None) -> Hop:
    """build_hop's sync-free twin: `bound` rows to every rank of `group`, the first `bound` tokens
    (in token order) that go there; the rest counted in `overflow` (not yet summed over the
    ranks). `group` may be a node: its ranks are the exchange's `first`, `first + 1`, ... of
    `exchange_world` (for the counted bytes), `dest_of_E` numbers them from 0."""
    world = dist.get_world_size(group)
    T, K = expert_idx_TK.shape
    device = expert_idx_TK.device
    dest_TK, reach_TW = destinations(expert_idx_TK, dest_of_E, world)
    place_TW = torch.cumsum(reach_TW.long(), 0) - 1          # the token's place among those going to w
    keep_TW = reach_TW & (place_TW < bound)
    rows = world * bound
    row_of_pair_TW = torch.where(keep_TW, torch.arange(world, device=device) * bound + place_TW, -1)
    target = torch.where(keep_TW, row_of_pair_TW, rows).reshape(-1)     # past the end: not sent
    tokens = torch.arange(T, device=device).repeat_interleave(world)
    token_J = torch.zeros(rows + 1, dtype=torch.int64, device=device).scatter(0, target, tokens)[:rows]
    sent_J = torch.zeros(rows + 1, dtype=torch.bool, device=device).scatter(0, target, keep_TW.reshape(-1))[:rows]
    dest_J = torch.arange(rows, device=device) // bound
    idx_JK = expert_idx_TK.index_select(0, token_J) if T else expert_idx_TK.new_full((rows, K), -1)
    dest_JK = dest_TK.index_select(0, token_J) if T else idx_JK
    slot_mask_JK = sent_J[:, None] & (dest_JK == dest_J[:, None])
    idx_QK = fc.wait_tensor(fc.all_to_all_single(torch.where(slot_mask_JK, idx_JK, -1), None, None, functional_group(group)))
    pairs = RoutingPlan(num_tokens=T, top_k=world, num_rows=rows, slot_N=token_J * world + dest_J, token_N=token_J,
                        row_of_slot_TK=row_of_pair_TW, counts_E=keep_TW.sum(0))
    exchange_world = world if exchange_world is None else exchange_world
    splits = [bound if first <= w < first + world else 0 for w in range(exchange_world)]
    if traffic is not None:
        traffic.add("routing", False, splits, K * idx_JK.element_size())
    overflow = (reach_TW & ~keep_TW).sum()
    return Hop(pairs, splits, splits, slot_mask_JK, idx_QK, group, current_layer(), traffic, bound=bound,
               overflow=overflow)


def build_dedup_plan(expert_idx_TK: torch.Tensor, num_expert: int, exchange: str, ranks_per_node: int,
                     group=None, traffic: Optional[Traffic] = None, bound: Optional[int] = None,
                     node_group=None) -> Hop:
    """The hops of the rank (or node) exchange for global expert ids `expert_idx_TK` (-1: stays
    home), `num_expert` experts per rank; every rank of `group` calls it. `bound`: bounded
    (sync-free) hops of `bound` rows to each rank (the node exchange's inner hop: as many as
    its first hop can bring, so only the first overflows; it runs in `node_group`, this rank's
    node, when given, so its padding stays inside the node)."""
    check_exchange(exchange)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    ranks_per_node = ranks_per_node_of(world, ranks_per_node, whole_nodes=exchange == "node")
    owner_E = torch.arange(num_expert * world, device=expert_idx_TK.device) // num_expert
    if exchange == "rank":
        hop = inner = (build_hop(expert_idx_TK, owner_E, group, traffic) if bound is None else
                       build_bounded_hop(expert_idx_TK, owner_E, group, bound, traffic))
    elif bound is None:
        gateway_E = owner_E // ranks_per_node * ranks_per_node + rank % ranks_per_node
        hop = build_hop(expert_idx_TK, gateway_E, group, traffic)
        hop.inner = inner = build_hop(hop.expert_idx_QK, owner_E, group, traffic)
    else:
        gateway_E = owner_E // ranks_per_node * ranks_per_node + rank % ranks_per_node
        hop = build_bounded_hop(expert_idx_TK, gateway_E, group, bound, traffic)
        first = rank // ranks_per_node * ranks_per_node if node_group is not None else 0
        hop.inner = inner = build_bounded_hop(hop.expert_idx_QK, owner_E - first, node_group or group,
                                              world // ranks_per_node * bound, traffic, first, world)
    inner.local_idx_QK = torch.where(inner.expert_idx_QK >= 0, inner.expert_idx_QK - rank * num_expert, -1)
    inner.local = RoutingPlan.build(inner.local_idx_QK, num_expert, compact=bound is None)
    if bound is not None:
        hop.overflow = fc.wait_tensor(fc.all_reduce(hop.overflow, "sum", functional_group(group)))
    return hop


def run_hop(hop: Hop, x_TD, weight_TK: torch.Tensor, experts: Callable, backend: Optional[str] = None,
            schedule: Optional[tuple] = None):
    """sum over destinations of the weighted expert outputs for the tokens x_TD (a tensor or a tree
    of them sharing the rows): the rows travel out, `experts(x_QD, local_plan, weight_QK)` runs on
    the last hop's received rows, its output travels back. `schedule`: (group size, the experts'
    parameters) to pipeline a one-hop exchange as FasterMoE's smart schedule does."""
    if schedule is not None:
        return scheduled_hop(hop, x_TD, weight_TK, experts, backend, *schedule)
    what = f"{hop.layer}: deduplicated"
    empty = hop.bound is not None and hop.pairs.num_tokens == 0
    if empty:           # a bounded hop's padding, from no token at all
        # zeros, still in the graph: x's gradient is an empty tensor, as on every other path
        x_ND = tree_map(lambda t: t.new_zeros(hop.num_sent, t.shape[1]) + t.sum() * 0, x_TD)
        w_NK = weight_TK.new_zeros(hop.num_sent, weight_TK.shape[1]) + weight_TK.sum() * 0
    else:
        x_ND = tree_map(lambda t: kernels.permute(t, hop.pairs, backend), x_TD)
        w_NK = weight_TK.index_select(0, hop.pairs.token_N).masked_fill(~hop.slot_mask_NK, 0)
    x_QD = tree_map(lambda t: hop.send(t, f"{what} dispatch", "dispatch"), x_ND)
    w_QK = hop.send(w_NK, f"{what} weights", "routing")
    if hop.inner is not None:
        y_QD = run_hop(hop.inner, x_QD, w_QK, experts, backend)
    else:
        y_QD = experts(x_QD, hop.local, w_QK)
    y_ND = tree_map(lambda t: hop.send_back(t, f"{what} combine"), y_QD)
    if empty:           # no token: the rows only travel back (so their gradients' exchange runs too)
        return tree_map(lambda t: t[:0] * 0, y_ND)
    return tree_map(lambda t: kernels.sum_rows(t, hop.pairs, backend), y_ND)



def scheduled_hop(hop: Hop, x_TD: torch.Tensor, weight_TK: torch.Tensor, experts: Callable, backend, group_size: int,
                  params) -> torch.Tensor:
    """run_hop through the smart schedule (`fmoe.distributed.schedule`): the weights ride as K more
    columns of the rows (in the rows' dtype), each received chunk is fanned out to the experts by
    its own ids."""
    from fmoe.distributed.schedule import scheduled_experts
    if hop.inner is not None or hop.bound is not None:
        raise ValueError("the smart schedule pipelines the rank exchange only (not 'node', not sync_free)")
    D = x_TD.shape[1]
    x_ND = kernels.permute(x_TD, hop.pairs, backend)
    w_NK = weight_TK.index_select(0, hop.pairs.token_N).masked_fill(~hop.slot_mask_NK, 0)
    x_aug = torch.cat([x_ND, w_NK.to(x_ND.dtype)], 1)
    num_local = int(hop.local.counts_E.numel())

    def chunk(x_chunk, rows):
        local = RoutingPlan.build(hop.local_idx_QK.index_select(0, rows.to(hop.local_idx_QK.device)), num_local,
                                  compact=True)
        return experts(x_chunk[:, :D], local, x_chunk[:, D:].to(weight_TK.dtype))

    y_ND = scheduled_experts(chunk, x_aug, hop, group_size, params)
    return kernels.sum_rows(y_ND, hop.pairs, backend)
