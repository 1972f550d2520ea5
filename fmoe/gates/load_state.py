"""What a gate needs to keep state that follows the load: knowing a recompute from a forward, and
summing a count over the ranks that hold replicas of the gate, with a bounded wait.

A gate's replicas are the ranks that run copies of it on different tokens: with data or expert
parallelism, every rank of the world ("world", the default). "local" sums nothing (each rank
its own model); a ProcessGroup names them exactly (Megatron: its data x tensor x context group).
"""
import sys

import torch
import torch.distributed as dist

from fmoe.distributed import link
from fmoe.distributed.timeout import collective_timeout

BIAS_UPDATES = ("step", "forward")
BALANCE_GROUPS = ("world", "local")


def in_recompute() -> bool:
    """Whether this forward replays one for the backward (activation checkpointing recomputes
    inside the autograd engine, reentrant or not). A compiled graph never replays Python."""
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1


def trains() -> bool:
    """Whether a training-mode forward trains: its backward can run (grad enabled, or the first
    forward of reentrant checkpointing, which runs under no_grad inside an autograd Function and is
    replayed for the backward) and it is no recompute. A no_grad or inference_mode forward is not."""
    if in_recompute():
        return False
    if torch.is_grad_enabled():
        return True
    if torch.compiler.is_compiling() or torch.is_inference_mode_enabled():
        return False
    frame = sys._getframe(1)
    while frame is not None:        # torch's, Megatron's and DeepSpeed's reentrant checkpoints alike
        if isinstance(frame.f_locals.get("ctx"), torch.autograd.function.FunctionCtx):
            return True
        frame = frame.f_back
    return False


def check_balance_group(group):
    if isinstance(group, str):
        if group not in BALANCE_GROUPS:
            raise ValueError(f"balance_group must be 'world', 'local' or a torch.distributed ProcessGroup, "
                             f"got {group!r}")
        return group
    if dist.is_available() and isinstance(group, dist.ProcessGroup):
        return group
    raise ValueError(f"balance_group must be 'world', 'local' or a torch.distributed ProcessGroup, got {group!r}")


def replica_group(group):
    """The process group to sum over, or None when there is nothing to sum."""
    if isinstance(group, str):
        if group == "local" or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        return dist.group.WORLD
    return group if dist.get_world_size(group) > 1 else None


def reduce_over_replicas(counts: torch.Tensor, group, what: str) -> torch.Tensor:
    """`counts` summed over the gate's replicas (in place), bounded by FMOE_COLLECTIVE_TIMEOUT;
    `what` names the layer(s) in the timeout message."""
    group = replica_group(group)
    if group is None:
        return counts
    if torch.compiler.is_compiling():
        dist.all_reduce(counts, group=group)
        return counts
    world = dist.get_world_size(group)
    link.complete(dist.all_reduce(counts, group=group, async_op=True),
                  f"{what} (an all-reduce of {counts.numel()} load counts over {world} ranks, "
                  f"timeout {collective_timeout().total_seconds():g} s)",
                  link.all_reduce_bytes(counts.numel() * counts.element_size(), world))
    return counts
