"""torch.autocast as fmoe's layers see it: the dtype the experts' GEMMs run in, and where it is off."""
import contextlib
from typing import Optional

import torch

# The dtypes autocast casts; it leaves float64 alone, for nn.Linear too.
CASTS = (torch.float32, torch.float16, torch.bfloat16)



def _autocast_device_types() -> frozenset:
    """The device types autocast knows, asked once at import: Dynamo traces the question
    (`torch._C._is_autocast_available`) only from torch 2.12 on."""
    names = {"cpu", "cuda", "xpu", "mps", "hpu", "mtia", "maia", "xla", "ipu",
             torch._C._get_privateuse1_backend_name()}
    known = set()
    for name in names:
        try:
            if torch.amp.is_autocast_available(name):
                known.add(name)
        except RuntimeError:        # a device type this torch does not know
            pass
    return frozenset(known)


AUTOCAST_DEVICE_TYPES = _autocast_device_types()


def autocast_available(device_type: str) -> bool:
    if device_type in AUTOCAST_DEVICE_TYPES:
        return True
    # A backend registered after import; compiled code sees only the ones known at import.
    return not torch.compiler.is_compiling() and torch.amp.is_autocast_available(device_type)


def autocast_enabled(device_type: str) -> bool:
    return autocast_available(device_type) and torch.is_autocast_enabled(device_type)


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
