"""The check before a layer's first exchange: every rank of the expert-parallel group agrees on
every setting that shapes the exchange, or all of them raise the same error.

A mismatch that slips through does not fail cleanly later: different gates issue different
collectives (a hang), different dtypes send different byte counts (a gloo abort).
"""
from datetime import timedelta
from typing import Dict, List

import torch
import torch.distributed as dist

from fmoe.distributed.timeout import collective_timeout
from fmoe.env import env_float

# Gate attributes that legitimately differ between ranks, or are state rather than settings.
_RANK_LOCAL = ("training", "loss", "ep_rank", "node_rank", "rank")

# How many layers each expert-parallel group has checked in this process: a layer's index in
# that order identifies it, so ranks that reach different layers are told so.
_checked_in_group: Dict[tuple, int] = {}


def check_timeout() -> timedelta:
    """FMOE_CHECK_TIMEOUT seconds if set, else the collective timeout."""
    default = collective_timeout().total_seconds()
    return timedelta(seconds=env_float("FMOE_CHECK_TIMEOUT", default))


def group_ranks(group) -> List[int]:
    return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))


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
            f"{timeout.total_seconds():g} s (FMOE_CHECK_TIMEOUT): {err}"
        ) from err


def _setting(value):
    return isinstance(value, (bool, int, float, str, type(None))) or (
        isinstance(value, tuple) and all(_setting(v) for v in value))


def gate_settings(gate) -> dict:
    options = {k: v for k, v in sorted(vars(gate).items())
               if not k.startswith("_") and k not in _RANK_LOCAL and _setting(v)}
    tensors = [(n, tuple(t.shape), str(t.dtype))
               for n, t in list(gate.named_parameters()) + list(gate.named_buffers())]
    return {"gate": type(gate).__name__, "gate options": options, "gate tensors": tensors}


def layer_settings(layer, x: torch.Tensor, index: int) -> dict:
    """What every rank must agree on, as plain values."""
    ranks = group_ranks(layer.moe_group)
    return {
        "layer index": index,
        "layer": type(layer).__name__,
        "num_expert": layer.num_expert,
        "d_model": layer.d_model,
        "top_k": layer.top_k,
        "world_size": layer.world_size,
        "group ranks": ranks,
        "experts": type(layer.experts).__name__,
        "expert tensors": [(n, tuple(p.shape), str(p.dtype)) for n, p in layer.experts.named_parameters()],
        "input dtype": str(x.dtype),
        "shadowing": layer.shadow_policy is not None,
        "schedule": layer.schedule,
        "schedule_group_size": layer.schedule_group_size if layer.schedule else None,
        "exchange": layer.exchange,
        "recompute": layer.recompute,
        "ranks_per_node": layer.ranks_per_node,
        "max_tokens_per_rank (sync_free)": layer.max_tokens_per_rank if layer.sync_free else None,
        **gate_settings(layer.gate),
    }


def check_expert_parallel_config(layer, x: torch.Tensor) -> int:
    """Compare the layer's settings across `layer.moe_group`; returns the layer's index (its place
    in the order this group's layers are first run). Raises on every rank when any differs."""
    group = layer.moe_group
    ranks = group_ranks(group)
    index = _checked_in_group.get(tuple(ranks), 0)
    _checked_in_group[tuple(ranks)] = index + 1
    wait_for_peers(group, f"expert-parallel layer #{index}: the check before the first exchange")
    mine = layer_settings(layer, x, index)
    everyone = [None] * len(ranks)
    dist.all_gather_object(everyone, mine, group=group)
    differ = [k for k in mine if any(other[k] != everyone[0][k] for other in everyone)]
    if differ:
        table = "; ".join(f"rank {r}: " + ", ".join(f"{k}={s[k]!r}" for k in differ) for r, s in zip(ranks, everyone))
        raise ValueError(f"fmoe: the expert-parallel ranks disagree on expert-parallel layer #{index}'s "
                         f"{', '.join(differ)}: {table}")
    return index
