"""The layer's constructor arguments, checked: each bad value named with what was expected."""
import math
import os
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from fmoe.gates import GATES, BaseGate
from fmoe.kernels.fp8 import check_fp8

# Tensors to be made, as (part, shape, count): `count` tensors of `shape`, summed under `part` in messages.
Tensors = List[Tuple[str, Tuple[int, ...], int]]
INDEXABLE_BYTES = 2 ** 63 - 1       # torch counts a tensor's storage in int64 bytes
BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB", "YiB")
ROUTER_GATES = tuple(cls for name, cls in GATES.items() if name != "zero")     # those building a [E, D] router


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


def check_fp8_experts(fp8, expert, d_hidden, sync_free):
    """fp8= names a recipe and goes with stacked experts (d_hidden, no expert=) and no sync_free."""
    if check_fp8(fp8) is None:
        return
    if expert is not None or d_hidden is None:
        raise ValueError(f"fp8={fp8!r} needs the stacked experts (d_hidden=..., no expert=): user expert modules "
                         "run their own GEMMs")
    if sync_free:
        raise ValueError(f"fp8={fp8!r} does not run with sync_free=True: the FP8 emulation reads each expert's "
                         "row count on the host")


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


def format_bytes(n: int) -> str:
    """A byte count for a person: 512 B, 1.5 KiB, 12.0 TiB."""
    power = 0
    while power + 1 < len(BYTE_UNITS) and n >= 1024 ** (power + 1):
        power += 1
    return f"{n} B" if power == 0 else f"{n / 1024 ** power:.1f} {BYTE_UNITS[power]}"


def router_tensors(gate, d_model: int, tot_expert: int, bias: bool) -> Tensors:
    """The router an fmoe gate given by name or class builds, [E, D] (+ [E]); a gate instance is built
    already, and the zero gate or another class may hold anything, so they count nothing."""
    cls = GATES.get(gate.lower()) if isinstance(gate, str) else gate
    if not (isinstance(cls, type) and issubclass(cls, ROUTER_GATES)):
        return []
    return [("router", (tot_expert, d_model), 1)] + ([("router", (tot_expert,), 1)] if bias else [])


def available_ram() -> Optional[int]:
    """Bytes the CPU can still give: MemAvailable plus free swap on Linux, else the physical memory."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return sum(int(fields[key].split()[0]) * 1024 for key in ("MemAvailable", "SwapFree"))
    except (OSError, KeyError, ValueError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def memory_room(device: torch.device) -> Optional[Tuple[int, str]]:
    """(bytes new tensors can take on `device`, those words for a message), None where unknown. A CUDA
    device this process already uses: its free memory and what torch's cache holds unused; one it does
    not use yet: its whole memory (asking for the free memory would open a context on it)."""
    if device.type == "cpu":
        ram = available_ram()
        return None if ram is None else (ram, "free on cpu")
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        cached = torch.cuda.memory_reserved(index)
        if cached:
            return torch.cuda.mem_get_info(index)[0] + cached - torch.cuda.memory_allocated(index), f"free on {device}"
        return torch.cuda.get_device_properties(index).total_memory, f"on {device} in all"
    return None


def check_fits(named: str, what: str, tensors: Tensors, dtype: Optional[torch.dtype] = None,
               device=None, copies: int = 1):
    """Sizes that cannot be allocated, refused before any allocation with a ValueError naming `named`
    (the arguments that set them): a tensor of more bytes than torch can index, or `tensors` (in `dtype`
    on `device`, torch's defaults when None), `copies` times, above the memory `device` has left. The
    meta device holds no memory: there only the first applies. `what` says what needs the bytes."""
    if dtype is None or device is None:
        probe = torch.empty(0)      # where and how a parameter is made now (a torch.device("meta") block too)
        dtype, device = dtype or probe.dtype, device or probe.device
    device = torch.device(device)
    parts = {}
    for part, shape, count in tensors:
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > INDEXABLE_BYTES:
            raise ValueError(f"{named}: {part} {list(shape)} would be {format_bytes(nbytes)}, more than torch can "
                             "index in one tensor (2**63 - 1 bytes)")
        parts[part] = parts.get(part, 0) + nbytes * count
    room = None if device.type == "meta" else memory_room(device)
    total = sum(parts.values())
    if room is None or total * copies <= room[0]:
        return
    listed = ", ".join(f"{part} {format_bytes(n)}" for part, n in sorted(parts.items(), key=lambda kv: -kv[1]))
    need = format_bytes(total) if copies == 1 else f"{copies} x {format_bytes(total)} = {format_bytes(total * copies)}"
    raise ValueError(f"{named}: {what} {need} ({listed}), more than the {format_bytes(room[0])} {room[1]}")
