"""A gate's tape under router replay (`fmoe.replay`): what it records, or the entries it replays, and
the two custom ops through which a gate's routing reaches it (compiled graphs call them as they run)."""
from collections import deque
from typing import Dict, List

import torch

from fmoe.gates.load_state import in_recompute

TAPES: Dict[int, "Tape"] = {}       # gate.routing_key -> its tape while a record or replay is on


class Tape:
    """One layer's part of a record or a replay: its entries, the next one, and the entries its
    forwards used that a recompute has not replayed yet."""

    def __init__(self, name: str, entries: List[torch.Tensor]):
        self.name = name
        self.entries = entries
        self.cursor = 0
        self.unrecomputed = deque()

    def record(self, expert_idx_TK: torch.Tensor) -> None:
        if not in_recompute():
            self.entries.append(expert_idx_TK.detach().clone())

    def replayed(self, x_TD: torch.Tensor) -> torch.Tensor:
        recompute = in_recompute() and self.unrecomputed
        i = self.unrecomputed[0] if recompute else self.cursor
        if i >= len(self.entries):
            raise ValueError(f"replay_routing: the trace of layer {self.name!r} is exhausted: it holds "
                             f"{len(self.entries)} forwards, this is forward {i + 1}")
        entry = self.entries[i]
        if entry.shape[0] != x_TD.shape[0]:
            raise ValueError(f"replay_routing: layer {self.name!r} routes {x_TD.shape[0]} tokens in forward {i + 1}, "
                             f"the trace recorded {entry.shape[0]} there")
        if recompute:
            self.unrecomputed.popleft()
        else:
            self.cursor += 1
            self.unrecomputed.append(i)
        return entry.to(x_TD.device, torch.long, copy=True)


@torch.library.custom_op("fmoe::recorded_choice", mutates_args=())
def recorded_choice(expert_idx_TK: torch.Tensor, key: int) -> torch.Tensor:
    """`expert_idx_TK`, added to the tape of gate `key` (not in a recompute)."""
    TAPES[key].record(expert_idx_TK)
    return expert_idx_TK.clone()


@recorded_choice.register_fake
def _(expert_idx_TK, key):
    return torch.empty_like(expert_idx_TK)


@torch.library.custom_op("fmoe::replayed_choice", mutates_args=())
def replayed_choice(x_TD: torch.Tensor, key: int, top_k: int) -> torch.Tensor:
    """The recorded experts `[T, K]` of gate `key`'s next forward (a recompute: its forward's)."""
    return TAPES[key].replayed(x_TD)


@replayed_choice.register_fake
def _(x_TD, key, top_k):
    return x_TD.new_empty((x_TD.shape[0], top_k), dtype=torch.long)
