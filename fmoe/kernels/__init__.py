"""The kernel seam: `permute`, `unpermute`, `grouped_mm`, each with a torch and a Triton backend.

Triton is chosen for CUDA tensors when it imports, torch elsewhere; `backend=` or the
environment variable `FMOE_BACKEND=torch|triton` force one.
"""
import os
from typing import Optional

import torch

from fmoe.kernels import torch_ops
from fmoe.routing import RoutingPlan

BACKENDS = ("torch", "triton")


def triton_available() -> bool:
    try:
        from fmoe.kernels import triton_ops  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(tensor: torch.Tensor, backend: Optional[str] = None) -> str:
    choice = backend or os.environ.get("FMOE_BACKEND") or None
    if choice is not None:
        if choice not in BACKENDS:
            raise ValueError(f"backend (or FMOE_BACKEND) must be one of {BACKENDS}, got {choice!r}")
        if choice == "triton" and not triton_available():
            raise ValueError("backend='triton' was asked for but fmoe.kernels.triton_ops cannot be imported")
        return choice
    return "triton" if tensor.is_cuda and triton_available() else "torch"


def _ops(tensor, backend):
    if resolve_backend(tensor, backend) == "triton":
        from fmoe.kernels import triton_ops
        return triton_ops
    return torch_ops


def permute(x_TD: torch.Tensor, plan: RoutingPlan, backend: Optional[str] = None) -> torch.Tensor:
    """Rows of `x_TD` in expert order: row n is token `plan.token_N[n]`."""
    return _ops(x_TD, backend).permute(x_TD, plan)


def unpermute(y_ND: torch.Tensor, plan: RoutingPlan, weight_TK: torch.Tensor,
              backend: Optional[str] = None) -> torch.Tensor:
    """out[t] = sum over k of weight[t, k] * y[row of slot (t, k)], dropped slots adding 0."""
    return _ops(y_ND, backend).unpermute(y_ND, plan, weight_TK)


def grouped_mm(x_NI: torch.Tensor, w_eIO: torch.Tensor, counts_e: torch.Tensor,
               backend: Optional[str] = None) -> torch.Tensor:
    """Rows sorted by expert, `counts_e[e]` of them for expert e: y = x_seg @ w_eIO[e]."""
    return _ops(x_NI, backend).grouped_mm(x_NI, w_eIO, counts_e)
