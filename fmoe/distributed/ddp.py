"""Gradient synchronisation for models with expert parameters.

Each rank's loss is the mean over its own batch. For training to equal one process on the global
batch, every gradient is the sum over ranks divided by the world size: shared parameters are
all-reduced over the world; expert parameters already hold the sum over their expert-parallel
group (the backward exchange brought it) and are all-reduced over the ranks holding the same
experts only, never over the expert-parallel ranks.
"""
import contextlib
import functools
import warnings
import weakref
from collections import defaultdict
from typing import Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from fmoe.distributed.groups import ParallelGroups
from fmoe.distributed.timeout import wait


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
        wait(dist.all_reduce(flat, group=group, async_op=True), f"expert gradients' all-reduce ({dtype})")
        flat /= divisor
        for g, synced in zip(same, _unflatten_dense_tensors(flat, same)):
            g.copy_(synced)


def _broadcast_params(params: List[torch.Tensor], group):
    if not params:
        return
    src = dist.get_global_rank(group, 0) if group is not None else 0
    for p in params:
        wait(dist.broadcast(p.data, src=src, group=group, async_op=True), "parameter broadcast")


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
        # each rank holds different experts
        wait(dist.all_reduce(expert_sq, group=moe_group, async_op=True), "clip_grad_norm_: all-reduce of the norm")
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


# The bucket of expert parameters of expert-parallel layers, under fmoe's scaling (`groups=`).
SHARDED_EXPERTS = "sharded experts"


class DistributedGroupedDataParallel(nn.Module):
    """FastMoE's DistributedGroupedDataParallel: parameters are bucketed by their `dp_comm` tag
    (untagged ones count as "dp") and dtype; after backward, `allreduce_params()` (or
    `auto_allreduce=True`) all-reduces each bucket over its tag's group and divides it by that
    group's size. Groups come from the `<tag>_group` keywords (FastMoE's `dp_group`,
    `gate_group`, `moe_group`, `world_group`, or any other tag); "dp", "gate", "moe" and "world"
    default to the whole world, and a tag with no group ("none", the experts of an
    expert-parallel layer) is left alone. With `need_sync` the buckets are broadcast from each
    group's first rank at construction, so replicas start equal.

    `groups=make_groups(ep_size)` (or `expert_dp_group=`) selects fmoe's scaling, under which
    training equals one process on the global batch: the experts of expert-parallel layers
    (whatever their tag) are all-reduced over the ranks holding the same experts and divided by the
    world size, and those of single-rank layers (replicated everywhere) averaged over the world.

    Gradient accumulation, as with torch's DDP: run the forward and backward of every micro-batch
    but the last inside `with model.no_sync():`, so that `auto_allreduce` reduces once, after the
    last backward; or call `allreduce_params()` once after the last micro-batch. Reducing after
    every micro-batch gives the same gradients, with more communication: a gradient that was
    reduced comes through a later reduction unchanged, and only what was added since is reduced.
    """

    def __init__(self, module: nn.Module, auto_allreduce: bool = False, need_sync: bool = True,
                 groups: Optional[ParallelGroups] = None, **comm_groups):
        super().__init__()
        if not dist.is_initialized():
            raise ValueError("DistributedGroupedDataParallel needs torch.distributed initialised first")
        unknown = sorted(k for k in comm_groups if not k.endswith("_group"))
        if unknown:
            raise TypeError(f"DistributedGroupedDataParallel got unexpected keyword arguments {unknown}: "
                            "process groups are passed as <dp_comm tag>_group=... (dp_group, gate_group, "
                            "moe_group, world_group, expert_dp_group)")
        self.module = module
        self.comms: Dict[str, Optional[dist.ProcessGroup]] = {k[:-len("_group")]: g for k, g in comm_groups.items()}
        if groups is not None:
            self.comms.setdefault("moe", groups.moe_group)
            self.comms.setdefault("expert_dp", groups.expert_dp_group)
        for tag in ("dp", "gate", "moe", "world"):
            self.comms.setdefault(tag, None)        # None: the default (whole-world) group
        self.fmoe_scaling = "expert_dp" in self.comms
        self.auto_allreduce = auto_allreduce
        self.require_backward_grad_sync = True      # torch DDP's name; False inside no_sync()
        self._reduce_queued = False
        # (parameter, its reduced gradient, that gradient's version, carry) from the last reduction
        self._reduced: List[Tuple[nn.Parameter, weakref.ref, int, float]] = []
        if not self.fmoe_scaling:
            _warn_unsynced_replicas(module)
        if need_sync:
            self.broadcast_params()

    def _tag(self, p: nn.Parameter, sharded: set) -> str:
        tag = getattr(p, "dp_comm", "dp")
        if self.fmoe_scaling and id(p) in sharded:
            return SHARDED_EXPERTS          # whatever the tag: no other rank of the world holds them all
        if self.fmoe_scaling and tag == "none" and is_expert_param(p):
            return "world"                  # a replicated layer's experts
        return tag

    def _group_of(self, tag: str):
        return self.comms["expert_dp" if tag == SHARDED_EXPERTS else tag]

    def buckets(self, with_grad: bool) -> Dict[Tuple[str, torch.dtype], List[nn.Parameter]]:
        """(tag, dtype) -> parameters reduced together; tags without a group are left out."""
        sharded = _sharded_expert_params(self.module)
        out = defaultdict(list)
        for p in self.module.parameters():
            if with_grad and (not p.requires_grad or p.grad is None):
                continue
            tag = self._tag(p, sharded)
            if tag == SHARDED_EXPERTS or tag in self.comms:
                out[(tag, p.dtype)].append(p)
        return out

    @torch.no_grad()
    def broadcast_params(self):
        for (tag, dtype), params in self.buckets(with_grad=False).items():
            group = self._group_of(tag)
            src = dist.get_global_rank(group, 0) if group is not None else 0
            data = [p.data for p in params]
            flat = _flatten_dense_tensors(data)
            wait(dist.broadcast(flat, src=src, group=group, async_op=True),
                 f"DistributedGroupedDataParallel: broadcast of the {tag!r} parameters ({dtype})")
            for d, synced in zip(data, _unflatten_dense_tensors(flat, data)):
                d.copy_(synced)

    @torch.no_grad()
    def allreduce_params(self, no_scale: bool = False, reduce_after: bool = False, fp32_allreduce: bool = False):
        """All-reduce every bucket's gradients over its group, divided by the group's size (the
        world's for fmoe's sharded experts): before the reduction, or after it with
        `reduce_after`; not at all with `no_scale`. `fp32_allreduce` reduces lower precisions in fp32.
        `no_sync()` does not apply here: a call always reduces."""
        self._reduce_queued = False
        self._carry_reduced()
        for (tag, dtype), params in self.buckets(with_grad=True).items():
            group = self._group_of(tag)
            group_size = dist.get_world_size(group)
            divisor = dist.get_world_size() if tag == SHARDED_EXPERTS else group_size
            grads = [p.grad for p in params]
            flat = _flatten_dense_tensors(grads)
            if fp32_allreduce and dtype != torch.float32:
                flat = flat.float()
            if not no_scale and not reduce_after:
                flat /= divisor
            wait(dist.all_reduce(flat, group=group, async_op=True),
                 f"DistributedGroupedDataParallel: all-reduce of the {tag!r} gradients ({dtype})")
            if not no_scale and reduce_after:
                flat /= divisor
            for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                g.copy_(synced)
            # A reduced gradient is equal over the group; multiplied by `carry`, the same reduction
            # gives it back, so a later one reduces only what is added to it (accumulation).
            carry = (1 if no_scale else divisor) / group_size
            if carry != 1:
                self._reduced.extend((p, weakref.ref(p.grad), p.grad._version, carry) for p in params)

    allreduce_gradients = allreduce_params      # FastMoE's other name for it

    @torch.no_grad()
    def _carry_reduced(self):
        """Scale the gradients the last reduction left, untouched since, by their carry: called
        before anything is added to them (a backward starts) or they are reduced again."""
        for p, reduced, version, carry in self._reduced:
            if p.grad is not None and p.grad is reduced() and p.grad._version == version:
                p.grad.mul_(carry)
        self._reduced = []

    @contextlib.contextmanager
    def no_sync(self):
        """torch DDP's `no_sync`: the backward of a forward run inside it leaves the gradients to
        accumulate locally; with `auto_allreduce`, the first backward of a forward run outside it
        reduces everything accumulated."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def forward(self, *args, **kwargs):
        out = self.module(*args, **kwargs)
        if torch.is_grad_enabled():
            # Decided at the forward, as torch's DDP does.
            reduce = self.auto_allreduce and self.require_backward_grad_sync
            for t in _tensors(out):
                if t.requires_grad:
                    t.register_hook(functools.partial(self._backward_reached_output, reduce))
        return out

    def _backward_reached_output(self, reduce: bool, grad):
        # No gradient of the module's parameters is accumulated before the backward reaches an output.
        self._carry_reduced()
        if reduce and not self._reduce_queued:
            self._reduce_queued = True      # once per backward, after every gradient is accumulated
            torch.autograd.Variable._execution_engine.queue_callback(self.allreduce_params)
        return grad


def _sharded_expert_params(module: nn.Module) -> set:
    """ids of the expert parameters of FMoE layers spread over several ranks."""
    from fmoe.layer import FMoE
    return {id(p) for m in module.modules() if isinstance(m, FMoE) and m.world_size > 1
            for p in m.experts.parameters()}


def _warn_unsynced_replicas(module: nn.Module):
    """Experts of single-rank layers are replicas on every rank; tagged "none", FastMoE's scheme
    never synchronises them and the replicas drift apart."""
    if dist.get_world_size() == 1:
        return
    sharded = _sharded_expert_params(module)
    names = [n for n, p in module.named_parameters()
             if getattr(p, "dp_comm", "dp") == "none" and is_expert_param(p) and id(p) not in sharded]
    if names:
        warnings.warn(
            f"DistributedGroupedDataParallel: {len(names)} expert parameters ({names[0]}, ...) belong to layers with "
            "world_size=1, so every rank holds a replica, but they are tagged dp_comm='none' and will not be "
            "synchronised: build the layer with expert_dp_comm='dp', or pass groups=make_groups(ep_size)",
            stacklevel=3)


def _tensors(out) -> Iterable[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (list, tuple)):
        for o in out:
            yield from _tensors(o)
    elif isinstance(out, dict):
        for o in out.values():
            yield from _tensors(o)
