"""Process groups for expert parallelism inside data parallelism.

With world W and expert-parallel size M, ranks form W/M expert-parallel groups of M consecutive
ranks ({0..M-1}, {M..2M-1}, ...); the ranks holding the same experts ({i, i+M, i+2M, ...}) form
the expert-data-parallel groups, over which expert gradients are reduced. The groups carry the
collective timeout (`timeout=`, else FMOE_COLLECTIVE_TIMEOUT), so no collective on them waits forever.
"""
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from fmoe.distributed.timeout import collective_timeout


def global_rank(group, rank: int) -> int:
    """The global rank of `group`'s rank `rank` (the default group: itself)."""
    return dist.get_global_rank(group, rank) if group is not None else rank


@dataclass
class ParallelGroups:
    """The process groups of one rank: `ep_size` expert-parallel ranks x `dp_size` replicas of them."""

    ep_size: int
    dp_size: int
    moe_group: Optional[dist.ProcessGroup]          # this rank's expert-parallel group (FastMoE's moe_group)
    expert_dp_group: Optional[dist.ProcessGroup]    # ranks holding the same experts as this one

    @property
    def world_size(self) -> int:
        return self.ep_size * self.dp_size


def make_groups(ep_size: int, world_size: Optional[int] = None, timeout: Optional[timedelta] = None) -> ParallelGroups:
    """Build the groups on every rank (a collective: all ranks must call it alike)."""
    if not dist.is_initialized():
        raise ValueError("make_groups needs torch.distributed initialised: call init_process_group first")
    world = dist.get_world_size()
    if world_size is not None and world_size != world:
        raise ValueError(f"world_size={world_size} does not match the process group's size {world}")
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1 or world % ep_size:
        raise ValueError(f"ep_size must be a positive divisor of the world size {world}, got {ep_size!r}")
    rank = dist.get_rank()
    timeout = timeout or collective_timeout()
    moe_group = expert_dp_group = None
    # new_group is collective over the whole world: every rank creates every group, in order.
    for start in range(0, world, ep_size):
        group = dist.new_group(list(range(start, start + ep_size)), timeout=timeout)
        if start <= rank < start + ep_size:
            moe_group = group
    for offset in range(ep_size):
        group = dist.new_group(list(range(offset, world, ep_size)), timeout=timeout)
        if rank % ep_size == offset:
            expert_dp_group = group
    return ParallelGroups(ep_size=ep_size, dp_size=world // ep_size, moe_group=moe_group,
                          expert_dp_group=expert_dp_group)


class NodeGroup:
    """This rank's node inside `group` (None: the world): the process group of the `ranks_per_node`
    consecutive ranks of `group` it belongs to, in `.group`. Only those ranks take part in making
    it; a copy of the module holding it shares it (a process group cannot be copied)."""

    def __init__(self, group, ranks_per_node: int):
        rank = dist.get_rank(group)
        first = rank // ranks_per_node * ranks_per_node
        members = [global_rank(group, r) for r in range(first, first + ranks_per_node)]
        self.group = dist.new_group(members, timeout=collective_timeout(), use_local_synchronization=True)

    def __deepcopy__(self, memo):
        return self
