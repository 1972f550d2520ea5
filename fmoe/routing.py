"""RoutingPlan: everything data movement needs, derived once per forward from the routing.

Across ranks the plan holds the exchange agreed with the other ranks: one row per slot
(`fmoe.distributed.exchange`), or the deduplicated exchange's hops (`Hop`, planned here because
a hop's rows are themselves a RoutingPlan, over (token, destination) pairs;
`fmoe.distributed.dedup` runs them).
"""
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc

from fmoe.distributed.exchange import (ExchangePlan, Traffic, build_exchange_plan, functional_group,
                                       ranks_per_node_of, row_bytes)
from fmoe.distributed.shadow import ShadowPlan
from fmoe.distributed import link
from fmoe.distributed.timeout import current_layer

EXCHANGES = ("slot", "rank", "node")


def check_exchange(exchange) -> str:
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
    return exchange


@dataclass
class RoutingPlan:
    """Rows in expert order and the maps back to token slots.

    A *slot* is one (token, k) pair, numbered `t * K + k`; a *row* is a slot placed in expert
    order (stable: token order within an expert). On one rank every slot has a row, so there are
    exactly T*K rows and nothing is read back to the host: the rows of dropped slots (expert -1)
    come last, past every expert's segment, the GEMMs leave them zero and `row_of_slot_TK` marks
    those slots -1 so the combine skips them. Across ranks only kept slots get rows (the exchange
    needs the real number on the host anyway). With shadowed experts, their rows come after the
    rows that travel, in shadow order.
    """

    num_tokens: int
    top_k: int
    num_rows: int
    slot_N: torch.Tensor            # slot of each row
    token_N: torch.Tensor           # token of each row
    row_of_slot_TK: torch.Tensor    # row of each slot, -1 where the slot was dropped
    counts_E: torch.Tensor          # rows per expert (global ids)
    exchange: Optional[ExchangePlan] = None   # splits and order across ranks (one row per slot)
    shadow: Optional[ShadowPlan] = None       # experts computed at home with pulled parameters
    dedup: Optional["Hop"] = None             # the rank / node exchange instead (its first hop)
    home: Optional["RoutingPlan"] = None      # with dedup and shadowing: the shadowed slots, by shadow order

    @property
    def local_counts_e(self) -> torch.Tensor:
        """Rows each expert of this rank computes (from every rank)."""
        return self.counts_E if self.exchange is None else self.exchange.local_counts_e

    @property
    def num_shadow_rows(self) -> int:
        return 0 if self.shadow is None else self.shadow.num_rows

    @property
    def across_ranks(self) -> bool:
        return self.exchange is not None or self.dedup is not None

    @classmethod
    def build(cls, expert_idx_TK: torch.Tensor, num_experts: int, world_size: int = 1,
              group=None, shadow_policy=None, *, compact: bool = False, exchange: str = "slot",
              ranks_per_node: Optional[int] = None, traffic: Optional[Traffic] = None,
              bound: Optional[int] = None, node_group=None) -> "RoutingPlan":
        """Sort slots by expert; with `world_size` > 1, also agree with the other ranks on the
        exchange (`exchange`: "slot", one row per slot, or "rank" / "node", deduplicated, see
        `fmoe.distributed.dedup`) and, given a shadow policy, on the experts to shadow.
        `compact`: on one rank too, rows only for kept slots (reads their number on the host).
        `bound`, `node_group`: the deduplicated exchange's bounded, sync-free hops (`fmoe.distributed.dedup`)."""
        exchange_kind = exchange
        T, K = expert_idx_TK.shape
        idx_S = expert_idx_TK.reshape(-1)
        live_S = idx_S >= 0
        # Counted by a scatter, not bincount: its output size would depend on the values.
        counts_E = torch.zeros(num_experts, dtype=torch.int64, device=idx_S.device)
        counts_E.scatter_add_(0, idx_S.clamp_min(0), live_S.long())
        shadow = None
        # Sort key: the expert id; shadowed experts after all others, dropped slots last.
        key_of_E = torch.arange(num_experts, device=idx_S.device)
        if shadow_policy is not None and world_size > 1:
            experts_S = shadow_policy.choose(counts_E, world_size, group)
            bad = [e for e in experts_S if not isinstance(e, int) or not 0 <= e < num_experts]
            if bad or len(set(experts_S)) != len(experts_S):
                raise ValueError(f"{type(shadow_policy).__name__}.choose returned {list(experts_S)}: expected "
                                 f"distinct expert ids in [0, {num_experts})")
            if experts_S:
                shadowed = torch.tensor(experts_S, device=idx_S.device)
                key_of_E[shadowed] = num_experts + torch.arange(len(experts_S), device=idx_S.device)
                shadow = ShadowPlan(experts_S, counts_E[shadowed])
        key_S = torch.where(live_S, key_of_E[idx_S.clamp_min(0)], torch.full_like(idx_S, 2 * num_experts))
        order_S = torch.sort(key_S, stable=True).indices
        # The deduplicated exchange sends by its own plan: this one's rows stay as on one rank.
        rows_of_all_slots = (world_size == 1 or exchange_kind != "slot") and not compact
        num_rows = idx_S.numel() if rows_of_all_slots else int(counts_E.sum())
        slot_N = order_S[:num_rows]
        row_of_slot_S = torch.full_like(idx_S, -1).scatter_(0, slot_N, torch.arange(num_rows, device=idx_S.device))
        row_of_slot_S = torch.where(live_S, row_of_slot_S, -1)
        exchange = dedup = home = None
        if world_size > 1 and exchange_kind == "slot":
            sent_counts_E = counts_E.clone()
            if shadow is not None:
                sent_counts_E[torch.tensor(shadow.experts_S, device=idx_S.device)] = 0
            exchange = build_exchange_plan(sent_counts_E, world_size, group, traffic)
        elif world_size > 1:
            sent_idx_TK = expert_idx_TK
            if shadow is not None:
                shadow_of_E = key_of_E - num_experts        # position in the shadow order, else < 0
                shadowed_TK = live_S.view(T, K) & (shadow_of_E[expert_idx_TK.clamp_min(0)] >= 0)
                sent_idx_TK = expert_idx_TK.masked_fill(shadowed_TK, -1)
                home_idx_TK = torch.where(shadowed_TK, shadow_of_E[expert_idx_TK.clamp_min(0)], -1)
                home = cls.build(home_idx_TK, len(shadow.experts_S), compact=True)
            dedup = build_dedup_plan(sent_idx_TK, num_experts // world_size, exchange_kind, ranks_per_node,
                                     group, traffic, bound, node_group)
        return cls(
            num_tokens=T,
            top_k=K,
            num_rows=num_rows,
            slot_N=slot_N,
            token_N=torch.div(slot_N, K, rounding_mode="floor"),
            row_of_slot_TK=row_of_slot_S.view(T, K),
            counts_E=counts_E,
            exchange=exchange,
            shadow=shadow,
            dedup=dedup,
            home=home,
        )


@dataclass
class Hop:
    """One all-to-all of the deduplicated exchange, agreed by every rank (`fmoe.distributed.dedup`)."""

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


def _all_to_all(x, send_splits, recv_splits, group, what):
    out = x.new_empty((sum(recv_splits),) + tuple(x.shape[1:]))
    link.complete(dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group, async_op=True),
                  what, link.all_to_all_bytes(send_splits, recv_splits, row_bytes(x), dist.get_rank(group)))
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
