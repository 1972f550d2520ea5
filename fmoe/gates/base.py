"""What every gate shares: the `Routing` it returns, argument checks, capacity and z-loss."""
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple, Union

import torch
from torch import nn

from fmoe.gates.capacity import drop_over_capacity, expert_capacity

CapacityArg = Optional[Union[float, Tuple[float, float]]]


@dataclass
class Routing:
    """Which experts each token goes to and with what weight.

    `expert_idx_TK` holds global expert ids; a slot dropped by a capacity limit holds -1 and
    weight 0. `num_dropped` counts those slots (a 0-dim tensor, so reading it needs no sync
    until the caller asks).
    """

    expert_idx_TK: torch.Tensor
    weight_TK: torch.Tensor
    aux_loss: torch.Tensor
    num_dropped: torch.Tensor


def check_top_k(top_k, num_expert_total: int) -> int:
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= num_expert_total:
        raise ValueError(
            f"top_k must be an int from 1 to the number of experts ({num_expert_total}), got {top_k!r}"
        )
    return top_k


def check_capacity(capacity: CapacityArg) -> Optional[Tuple[float, float]]:
    """Normalise a capacity argument to (training, evaluation) factors, or None for dropless."""
    if capacity is None:
        return None
    pair = tuple(capacity) if isinstance(capacity, Sequence) else (capacity, capacity)
    if len(pair) != 2 or not all(isinstance(c, (int, float)) and not isinstance(c, bool) and c > 0 for c in pair):
        raise ValueError(
            "capacity must be a positive capacity factor or a (training, evaluation) pair of them, "
            f"got {capacity!r}"
        )
    return float(pair[0]), float(pair[1])


def z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    """Router z-loss (ST-MoE): mean squared log-partition of the router logits."""
    if logits_TE.shape[0] == 0:
        return logits_TE.sum() * 0.0
    return torch.logsumexp(logits_TE.float(), dim=-1).square().mean()


class BaseGate(nn.Module):
    """Base of all gates: `forward(x_TD) -> Routing`.

    Subclasses implement `route(x_TD) -> (expert_idx_TK, weight_TK, score_TK, logits_TE, aux)`
    where `score_TK` ranks slots for capacity drops (higher is kept first). The base adds the
    z-loss, applies the capacity and keeps FastMoE's `set_loss` / `get_loss` / `has_loss`.
    """

    def __init__(
        self,
        d_model: int,
        num_expert: int,
        world_size: int = 1,
        top_k: int = 2,
        capacity: CapacityArg = None,
        z_loss_coef: float = 0.0,
    ):
        super().__init__()
        for name, value in (("d_model", d_model), ("num_expert", num_expert), ("world_size", world_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if z_loss_coef < 0:
            raise ValueError(f"z_loss_coef must be >= 0, got {z_loss_coef!r}")
        self.d_model = d_model
        self.num_expert = num_expert
        self.world_size = world_size
        self.tot_expert = num_expert * world_size
        self.top_k = check_top_k(top_k, self.tot_expert)
        self.capacity = check_capacity(capacity)
        self.z_loss_coef = z_loss_coef
        self.loss = None

    def route(self, x_TD: torch.Tensor):
        raise NotImplementedError

    def forward(self, x_TD: torch.Tensor) -> Routing:
        return self.routing(x_TD)

    def routing(self, x_TD: torch.Tensor) -> Routing:
        """The full routing decision; `FMoE` and every fmoe component call this, never `forward`."""
        expert_idx_TK, weight_TK, score_TK, logits_TE, aux = self.route(x_TD)
        if self.z_loss_coef:
            aux = aux + self.z_loss_coef * z_loss(logits_TE)
        num_dropped = torch.zeros((), dtype=torch.long, device=x_TD.device)
        factor = self.capacity_factor
        if factor is not None:
            cap = expert_capacity(factor, x_TD.shape[0], self.top_k, self.tot_expert)
            expert_idx_TK, weight_TK, num_dropped = drop_over_capacity(
                expert_idx_TK, weight_TK, score_TK, self.tot_expert, cap
            )
        self.set_loss(aux)
        return Routing(expert_idx_TK, weight_TK, aux, num_dropped)

    @property
    def capacity_factor(self) -> Optional[float]:
        if self.capacity is None:
            return None
        return self.capacity[0] if self.training else self.capacity[1]

    # FastMoE's loss interface.
    def set_loss(self, loss):
        self.loss = loss

    def get_loss(self, clear: bool = True):
        loss = self.loss
        if clear:
            self.loss = None
        return loss

    @property
    def has_loss(self) -> bool:
        return self.loss is not None


class LinearRouter(nn.Module):
    """The router projection d_model -> experts; kept in fp32-friendly form for all gates."""

    def __init__(self, d_model: int, tot_expert: int, bias: bool = True):
        super().__init__()
        self.proj = nn.Linear(d_model, tot_expert, bias=bias)

    def forward(self, x_TD):
        return self.proj(x_TD)
