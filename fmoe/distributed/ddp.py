"""Gradient synchronisation for models with expert parameters.

Each rank's loss is the mean over its own batch. For training to equal one process on the global
batch, every gradient is the sum over ranks divided by the world size: shared parameters are
all-reduced over the world; expert parameters already hold the sum over their expert-parallel
group (the backward exchange brought it) and are all-reduced over the ranks holding the same
experts only, never over the expert-parallel ranks.
"""
from typing import Iterable, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from fmoe.distributed.groups import ParallelGroups


def is_expert_param(p: torch.Tensor) -> bool:
    return getattr(p, "is_moe_expert", False)


def _allreduce_grads(params: List[nn.Parameter], group, divisor: int):
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    # One collective per dtype, over a flat buffer.
    for dtype in {g.dtype for g in grads}:
        same = [g for g in grads if g.dtype == dtype]
        flat = _flatten_dense_tensors(same)
        dist.all_reduce(flat, group=group)
        flat /= divisor
        for g, synced in zip(same, _unflatten_dense_tensors(flat, same)):
            g.copy_(synced)


def _broadcast_params(params: List[torch.Tensor], group):
    if not params:
        return
    src = dist.get_global_rank(group, 0) if group is not None else 0
    for p in params:
        dist.broadcast(p.data, src=src, group=group)


def sync_expert_gradients(model: nn.Module, expert_dp_group=None, world_size: Optional[int] = None):
    """Reduce expert gradients over the ranks holding the same experts, scaled by 1/world."""
    experts = [p for p in model.parameters() if is_expert_param(p)]
    world = world_size or dist.get_world_size()
    if expert_dp_group is None:
        for p in experts:
            if p.grad is not None:
                p.grad /= world
        return
    _allreduce_grads(experts, expert_dp_group, world)


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, moe_group=None) -> torch.Tensor:
    """Clip by the norm of the whole model's gradient, experts of every rank included, after the
    gradients are synced: every rank gets the same factor, so replicas stay equal."""
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return torch.zeros(())
    shared_sq = torch.zeros((), device=params[0].grad.device)
    expert_sq = torch.zeros((), device=params[0].grad.device)
    for p in params:
        if is_expert_param(p):
            expert_sq += p.grad.float().square().sum()
        else:
            shared_sq += p.grad.float().square().sum()
    if dist.is_initialized():
        dist.all_reduce(expert_sq, group=moe_group)     # each rank holds different experts
    total = (shared_sq + expert_sq).sqrt()
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for p in params:
        p.grad.mul_(scale)
    return total


def ignore_expert_parameters_in_ddp(model: nn.Module) -> List[str]:
    """Tell torch's DistributedDataParallel to leave expert parameters alone; call before wrapping.

    After each backward, call `sync_expert_gradients(model, groups.expert_dp_group)`.
    """
    names = [n for n, p in model.named_parameters() if is_expert_param(p)]
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)
    return names


class DistributedGroupedDataParallel(nn.Module):
    """FastMoE's DistributedGroupedDataParallel: call `allreduce_params()` after backward
    (or pass auto_allreduce=True). Parameters are broadcast at construction so ranks start equal.
    """

    def __init__(self, module: nn.Module, auto_allreduce: bool = False, need_sync: bool = True,
                 groups: Optional[ParallelGroups] = None, world_group=None, expert_dp_group=None, **_fastmoe_groups):
        super().__init__()
        if not dist.is_initialized():
            raise ValueError("DistributedGroupedDataParallel needs torch.distributed initialised first")
        self.module = module
        self.world_group = world_group
        self.expert_dp_group = groups.expert_dp_group if groups is not None else expert_dp_group
        self.auto_allreduce = auto_allreduce
        if need_sync:
            self.broadcast_params()

    def shared_params(self) -> List[nn.Parameter]:
        return [p for p in self.module.parameters() if not is_expert_param(p)]

    def expert_params(self) -> List[nn.Parameter]:
        return [p for p in self.module.parameters() if is_expert_param(p)]

    @torch.no_grad()
    def broadcast_params(self):
        _broadcast_params(self.shared_params(), self.world_group)
        if self.expert_dp_group is not None:
            _broadcast_params(self.expert_params(), self.expert_dp_group)

    @torch.no_grad()
    def allreduce_params(self):
        world = dist.get_world_size(self.world_group)
        _allreduce_grads(self.shared_params(), self.world_group, world)
        sync_expert_gradients(self.module, self.expert_dp_group, world)

    def forward(self, *args, **kwargs):
        out = self.module(*args, **kwargs)
        if self.auto_allreduce and torch.is_grad_enabled():
            first = next((t for t in _tensors(out) if t.requires_grad), None)
            if first is not None:
                first.register_hook(self._queue_allreduce)
        return out

    def _queue_allreduce(self, grad):
        torch.autograd.Variable._execution_engine.queue_callback(self.allreduce_params)
        return grad


def _tensors(out) -> Iterable[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (list, tuple)):
        for o in out:
            yield from _tensors(o)
    elif isinstance(out, dict):
        for o in out.values():
            yield from _tensors(o)
