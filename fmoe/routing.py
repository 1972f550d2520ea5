"""RoutingPlan: everything data movement needs, derived once per forward from the routing."""
from dataclasses import dataclass
from typing import Optional

import torch

from fmoe.distributed.exchange import ExchangePlan, build_exchange_plan


@dataclass
class RoutingPlan:
    """Rows in expert order and the maps back to token slots.

    A *slot* is one (token, k) pair, numbered `t * K + k`; a *row* is a kept slot placed in
    expert order (stable: token order within an expert). Dropped slots (expert -1) get no row.
    """

    num_tokens: int
    top_k: int
    num_rows: int
    slot_N: torch.Tensor            # slot of each row
    token_N: torch.Tensor           # token of each row
    row_of_slot_TK: torch.Tensor    # row of each slot, -1 where the slot was dropped
    counts_E: torch.Tensor          # rows per expert (global ids)
    exchange: Optional[ExchangePlan] = None   # splits and order across ranks; None on one rank

    @property
    def local_counts_e(self) -> torch.Tensor:
        """Rows each expert of this rank computes (from every rank)."""
        return self.counts_E if self.exchange is None else self.exchange.local_counts_e

    @classmethod
    def build(cls, expert_idx_TK: torch.Tensor, num_experts: int, world_size: int = 1,
              group=None) -> "RoutingPlan":
        """Sort slots by expert; with `world_size` > 1, also agree on the exchange with the other ranks."""
        T, K = expert_idx_TK.shape
        idx_S = expert_idx_TK.reshape(-1)
        # Dropped slots sort last under key `num_experts` and are cut off.
        key_S = torch.where(idx_S >= 0, idx_S, torch.full_like(idx_S, num_experts))
        order_S = torch.sort(key_S, stable=True).indices
        counts_E = torch.bincount(key_S, minlength=num_experts + 1)[:num_experts]
        num_rows = int(counts_E.sum()) if idx_S.numel() else 0
        slot_N = order_S[:num_rows]
        row_of_slot_S = torch.full_like(idx_S, -1)
        row_of_slot_S[slot_N] = torch.arange(num_rows, device=idx_S.device)
        return cls(
            num_tokens=T,
            top_k=K,
            num_rows=num_rows,
            slot_N=slot_N,
            token_N=torch.div(slot_N, K, rounding_mode="floor"),
            row_of_slot_TK=row_of_slot_S.view(T, K),
            counts_E=counts_E,
            exchange=build_exchange_plan(counts_E, world_size, group) if world_size > 1 else None,
        )
