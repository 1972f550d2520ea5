"""RoutingPlan: everything data movement needs, derived once per forward from the routing."""
from dataclasses import dataclass
from typing import Optional

import torch

from fmoe.distributed.exchange import ExchangePlan, Traffic, build_exchange_plan
from fmoe.distributed.shadow import ShadowPlan


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
    dedup: Optional["Hop"] = None             # the rank / node exchange instead (fmoe.distributed.dedup)
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
            from fmoe.distributed.dedup import build_dedup_plan
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
