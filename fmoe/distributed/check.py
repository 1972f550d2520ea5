"""The check before the first exchange: every rank of the expert-parallel group agrees, or all raise."""
import os
from datetime import timedelta

import torch
import torch.distributed as dist

FIELDS = ("num_expert", "d_model", "top_k", "world_size", "group_size", "first_global_rank")


def check_timeout() -> timedelta:
    return timedelta(seconds=float(os.environ.get("FMOE_CHECK_TIMEOUT", "120")))


def wait_for_peers(group, what: str):
    """A barrier that names the missing ranks after a timeout instead of hanging (gloo);
    other backends rely on the process group's own timeout."""
    if dist.get_backend(group) != "gloo":
        dist.barrier(group=group)
        return
    timeout = check_timeout()
    try:
        dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=True)
    except RuntimeError as err:
        raise RuntimeError(
            f"fmoe: {what}: not every rank of the expert-parallel group arrived within "
            f"{timeout.total_seconds():.0f} s (FMOE_CHECK_TIMEOUT): {err}"
        ) from err


def check_expert_parallel_config(layer):
    """All ranks of `layer.moe_group` must agree on experts per rank, d_model, top_k and layout."""
    group = layer.moe_group
    wait_for_peers(group, "expert-parallel check")
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    mine = torch.tensor([layer.num_expert, layer.d_model, layer.top_k, layer.world_size,
                         dist.get_world_size(group), ranks[0]], dtype=torch.long)
    if dist.get_backend(group) == "nccl":
        mine = mine.cuda()
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    rows = [t.cpu().tolist() for t in everyone]
    if any(row != rows[0] for row in rows):
        table = "; ".join(f"rank {r}: " + ", ".join(f"{k}={v}" for k, v in zip(FIELDS, row))
                          for r, row in zip(ranks, rows))
        raise ValueError(f"fmoe: the expert-parallel ranks disagree on the layer's configuration: {table}")
