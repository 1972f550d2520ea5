"""torch.autocast as fmoe's layers see it: the dtype the experts' GEMMs run in, and where it is off."""
import contextlib
from typing import Optional

import torch

# The dtypes autocast casts; it leaves float64 alone, for nn.Linear too.
CASTS = (torch.float32, torch.float16, torch.bfloat16)


def autocast_enabled(device_type: str) -> bool:
    return torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def autocast_dtype(x: torch.Tensor) -> Optional[torch.dtype]:
    """The dtype torch.autocast runs a GEMM on `x` in now, or None (autocast off on x's device, or
    x of a dtype it leaves alone)."""
    if x.dtype not in CASTS or not autocast_enabled(x.device.type):
        return None
    return torch.get_autocast_dtype(x.device.type)


def autocast_off(x: torch.Tensor):
    """A context with autocast off on x's device."""
    if autocast_enabled(x.device.type):
        return torch.autocast(x.device.type, enabled=False)
    return contextlib.nullcontext()
