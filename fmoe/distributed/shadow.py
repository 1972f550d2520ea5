"""Dynamic shadowing of hot experts (FasterMoE), parameter-server style.

The owner rank of an expert is its server. When the policy judges experts hot, every rank
*pulls* their parameters (a broadcast from the owner), computes its own rows for them at home,
and in the backward *pushes* the gradients back (a reduction to the owner), whose optimizer
then applies them as if the rows had travelled. Outputs and gradients equal the unshadowed layer.
"""
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

from fmoe.env import env_flag
from fmoe.perfmodel import PerfModel


def shadow_enabled_by_env() -> bool:
    return env_flag("FMOE_FASTER_SHADOW_ENABLE")


@dataclass
class ShadowPlan:
    experts_S: List[int]            # global ids of the shadowed experts, in the order rows are laid out
    counts_S: torch.Tensor          # this rank's rows for each of them

    @property
    def num_rows(self) -> int:
        return int(self.counts_S.sum()) if self.experts_S else 0


class ShadowPolicy:
    """Chooses the experts to shadow each step from every rank's per-expert counts (same on all ranks)."""

    def __init__(self, model: PerfModel):
        self.model = model

    def gather_counts(self, counts_E: torch.Tensor, world_size: int, group=None) -> torch.Tensor:
        """counts_WE: rows each rank routes to each expert."""
        everyone = [torch.empty_like(counts_E) for _ in range(world_size)]
        dist.all_gather(everyone, counts_E.contiguous(), group=group)
        return torch.stack(everyone).cpu()

    def choose(self, counts_E: torch.Tensor, world_size: int, group=None) -> List[int]:
        return self.model.choose_shadowed(self.gather_counts(counts_E, world_size, group))


class PullExpert(torch.autograd.Function):
    """Forward: the owner broadcasts expert `local_index` of its stacked parameter (pull).
    Backward: the gradients of all ranks are summed onto the owner's slice (push)."""

    @staticmethod
    def forward(ctx, param_eXY, local_index: int, owner: int, group):
        ctx.local_index, ctx.owner, ctx.group = local_index, owner, group
        ctx.is_owner = dist.get_rank(group) == owner
        ctx.param_shape = param_eXY.shape
        if ctx.is_owner:
            buf = param_eXY[local_index].detach().clone()
        else:
            buf = param_eXY.new_empty(param_eXY.shape[1:])
        dist.broadcast(buf, src=_global_rank(group, owner), group=group)
        return buf

    @staticmethod
    def backward(ctx, grad_XY):
        grad_XY = grad_XY.contiguous().clone()
        dist.reduce(grad_XY, dst=_global_rank(ctx.group, ctx.owner), group=ctx.group)
        if not ctx.is_owner:
            return None, None, None, None
        grad_eXY = grad_XY.new_zeros(ctx.param_shape)
        grad_eXY[ctx.local_index] = grad_XY
        return grad_eXY, None, None, None


def _global_rank(group, rank: int) -> int:
    return dist.get_global_rank(group, rank) if group is not None else rank


def pull_experts(experts, experts_S: List[int], num_expert: int, group=None) -> dict:
    """The shadowed experts' parameters, stacked in `experts_S` order, differentiable back to the owners."""
    pulled = {}
    for name, param in experts.named_parameters():
        pulled[name] = torch.stack([PullExpert.apply(param, e % num_expert, e // num_expert, group)
                                    for e in experts_S])
    return pulled


def shadowed_experts_forward(experts, x_SD: torch.Tensor, plan: ShadowPlan, num_expert: int,
                             group=None) -> torch.Tensor:
    """This rank's rows for the shadowed experts, computed at home with pulled parameters."""
    weights = pull_experts(experts, plan.experts_S, num_expert, group)
    return experts.run(x_SD, plan.counts_S, **weights)


def make_shadow_policy(shadow, d_model: int, d_hidden: Optional[int], world_size: int) -> Optional[ShadowPolicy]:
    """`shadow`: None (FMOE_FASTER_SHADOW_ENABLE decides), a bool, or a ShadowPolicy."""
    if isinstance(shadow, ShadowPolicy):
        return shadow
    enabled = shadow_enabled_by_env() if shadow is None else bool(shadow)
    if not enabled or world_size == 1:
        return None
    if d_hidden is None:
        raise ValueError("shadow=True needs stacked MLP experts (d_hidden=...), not a user expert class")
    return ShadowPolicy(PerfModel.from_env(d_model, d_hidden))
