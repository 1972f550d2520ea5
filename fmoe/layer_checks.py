"""The layer's constructor arguments, checked: each bad value named with what was expected."""
import torch
import torch.distributed as dist
from torch import nn

from fmoe.gates import BaseGate


def positive_int(name: str, value, meaning: str = "") -> int:
    """`value` if it is an int >= 1; a bool is refused (True would silently mean 1)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int{meaning}, got {value!r}")
    return value


def check_activation(activation, width_in: int, d_hidden: int):
    """A callable activation must map the first GEMM's width (d_hidden, or 2 * d_hidden for a gated
    one) to d_hidden, or the second GEMM fails far from the cause."""
    if isinstance(activation, str):
        return
    probe = torch.zeros(2, width_in)
    out = activation(probe)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, d_hidden):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"activation {activation!r} must turn the first projection's rows [rows, {width_in}] "
                         f"into [rows, d_hidden={d_hidden}], it turned (2, {width_in}) into {shape}")


def check_world(world_size, moe_group) -> int:
    """The expert-parallel world: `world_size` ranks, which must exist when it is above 1."""
    positive_int("world_size", world_size)
    if world_size > 1 or moe_group is not None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                f"world_size={world_size} (or a moe_group) needs torch.distributed initialised first: "
                "call torch.distributed.init_process_group(...) before building the layer"
            )
        group_size = dist.get_world_size(moe_group)
        if world_size > 1 and world_size != group_size:
            raise ValueError(f"world_size={world_size} must equal the size of moe_group (or the world), {group_size}")
        world_size = group_size
    return world_size


def floating_parameters(module: nn.Module):
    """The module's floating-point parameters, walked without `named_modules` (its memo set stops
    Dynamo before torch 2.5)."""
    for p in module._parameters.values():
        if p is not None and p.is_floating_point():
            yield p
    for child in module._modules.values():
        if child is not None:
            yield from floating_parameters(child)


def check_sync_free(sync_free, max_tokens_per_rank, exchange: str, shadow_policy, schedule: bool = False):
    """(sync_free, max_tokens_per_rank) checked: the sync-free exchange is a bounded rank or node one."""
    if not isinstance(sync_free, bool):
        raise ValueError(f"sync_free must be a bool, got {sync_free!r}")
    if not sync_free:
        if max_tokens_per_rank is not None:
            raise ValueError("max_tokens_per_rank bounds the sync-free exchange: pass sync_free=True with it")
        return False, None
    positive_int("max_tokens_per_rank", max_tokens_per_rank,
                 " (sync_free=True: the rows each rank sends each rank, the same on every rank)")
    if exchange == "slot":
        raise ValueError("sync_free=True needs exchange='rank' or 'node' (the bounded deduplicated exchange), "
                         "got exchange='slot'")
    if shadow_policy is not None:
        raise ValueError("sync_free=True cannot shadow: the shadowing policy chooses experts on the host")
    if schedule:
        raise ValueError("sync_free=True does not run under the smart schedule, whose pipeline reads the splits")
    return True, max_tokens_per_rank


def is_plain_module_gate(gate) -> bool:
    return isinstance(gate, type) and issubclass(gate, nn.Module) and not issubclass(gate, BaseGate)


def resolve_num_expert(num_expert, expert) -> int:
    """Experts per rank: FastMoE's `expert=[A, B, ...]` gives the count; otherwise 32 by default."""
    if isinstance(expert, (list, tuple)):
        if num_expert is not None and num_expert != len(expert):
            raise ValueError(f"num_expert={num_expert} but expert lists {len(expert)} expert classes")
        num_expert = len(expert)
    num_expert = 32 if num_expert is None else num_expert
    if not isinstance(num_expert, int) or num_expert < 1:
        raise ValueError(f"num_expert must be a positive int (experts per rank), got {num_expert!r}")
    return num_expert


def resolve_slice_group(mp_group, slice_group):
    """FastMoE's `mp_group` is the older name of `slice_group`; one group of size 1 is no slicing."""
    if mp_group is not None and slice_group is not None and mp_group is not slice_group:
        raise ValueError("pass slice_group or its old name mp_group, not both")
    group = slice_group if slice_group is not None else mp_group
    if group is None:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("slice_group needs torch.distributed initialised first")
    return group if dist.get_world_size(group) > 1 else None


def check_mask(mask, mask_dict):
    if (mask is None) != (mask_dict is None):
        raise ValueError("mask and mask_dict go together: pass both (FastMoE ignores one alone) or neither")
    if mask is None:
        return None, None
    if not isinstance(mask, torch.Tensor) or mask.is_floating_point():
        raise TypeError(f"mask must be an integer tensor with one entry per token, got {mask!r}")
    if not isinstance(mask_dict, dict) or not all(isinstance(v, torch.Tensor) for v in mask_dict.values()):
        raise TypeError("mask_dict must map mask values to tensors (the output of a masked token)")
    if 0 in mask_dict:
        raise ValueError("mask_dict cannot hold 0: mask 0 marks the tokens that are routed")
    return mask, mask_dict