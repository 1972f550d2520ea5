"""Argument checks of the kernel seam (`fmoe.kernels`), the one place they live for both backends.

A wrong shape, dtype or device fails here, naming the argument, before any op runs: the torch
and Triton bodies behind the `fmoe::` ops trust their inputs.
"""
import torch

from fmoe.routing import RoutingPlan

# What each backend computes in: Triton's kernels take the GPU's floating types, the torch path
# also float64 (gradcheck).
FLOAT_DTYPES = {
    "triton": (torch.float32, torch.float16, torch.bfloat16),
    "torch": (torch.float64, torch.float32, torch.float16, torch.bfloat16),
}
INDEX_DTYPES = (torch.int32, torch.int64)


def check_float(name: str, t, dim: int, backend: str):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dim:
        raise ValueError(f"{name} must have {dim} dimensions, got shape {tuple(t.shape)}")
    allowed = FLOAT_DTYPES[backend]
    if t.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise TypeError(f"{name} must be one of {names} on the {backend} backend, got {t.dtype}")


def check_index(name: str, t, shape, device: torch.device):
    """An int32/int64 tensor on `device` whose shape matches `shape` (None: any size)."""
    if not isinstance(t, torch.Tensor) or t.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be an int32 or int64 tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    if t.dim() != len(shape) or any(want is not None and got != want for got, want in zip(t.shape, shape)):
        wanted = tuple("any" if want is None else want for want in shape)
        raise ValueError(f"{name} must have shape {wanted}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device} like the data, got {t.device}")


def check_plan(plan: RoutingPlan, num_tokens: int, device: torch.device):
    if not isinstance(plan, RoutingPlan):
        raise TypeError(f"plan must be a fmoe.routing.RoutingPlan, got {type(plan).__name__}")
    if plan.num_tokens != num_tokens:
        raise ValueError(f"plan routes {plan.num_tokens} tokens, the input has {num_tokens}")
    check_index("plan.token_N", plan.token_N, (plan.num_rows,), device)
    check_index("plan.slot_N", plan.slot_N, (plan.num_rows,), device)
    check_index("plan.row_of_slot_TK", plan.row_of_slot_TK, (plan.num_tokens, plan.top_k), device)


def check_rows(name: str, y_ND, plan: RoutingPlan, backend: str):
    """Rows in the plan's expert order: one per routed row."""
    check_float(name, y_ND, 2, backend)
    if y_ND.shape[0] != plan.num_rows:
        raise ValueError(f"{name} must have plan.num_rows={plan.num_rows} rows, got shape {tuple(y_ND.shape)}")
    check_plan(plan, plan.num_tokens, y_ND.device)


def check_routing_weight(weight_TK, plan: RoutingPlan, device: torch.device, backend: str):
    check_float("weight_TK", weight_TK, 2, backend)
    if tuple(weight_TK.shape) != (plan.num_tokens, plan.top_k):
        raise ValueError(f"weight_TK must have shape {(plan.num_tokens, plan.top_k)}, got {tuple(weight_TK.shape)}")
    if weight_TK.device != device:
        raise ValueError(f"weight_TK must be on {device} like the rows, got {weight_TK.device}")


def check_weights(x_name: str, x, w_eIO, counts_e, bias_eO, backend: str, w_name: str = "w_eIO",
                  bias_name: str = "bias_eO"):
    """A grouped GEMM's operands: x [rows, I], w [e, I, O] in x's dtype and device, counts [e], bias [e, O]."""
    check_float(x_name, x, 2, backend)
    check_float(w_name, w_eIO, 3, backend)
    if w_eIO.dtype != x.dtype:
        raise TypeError(f"{w_name} must have {x_name}'s dtype {x.dtype}, got {w_eIO.dtype}")
    if w_eIO.device != x.device:
        raise ValueError(f"{w_name} must be on {x.device} like {x_name}, got {w_eIO.device}")
    if w_eIO.shape[1] != x.shape[1]:
        raise ValueError(f"{w_name} must have {x_name}'s width {x.shape[1]} as dim 1, got shape {tuple(w_eIO.shape)}")
    check_index("counts_e", counts_e, (w_eIO.shape[0],), x.device)
    if bias_eO is not None:
        check_float(bias_name, bias_eO, 2, backend)
        if tuple(bias_eO.shape) != (w_eIO.shape[0], w_eIO.shape[2]):
            raise ValueError(f"{bias_name} must have shape {(w_eIO.shape[0], w_eIO.shape[2])}, "
                             f"got {tuple(bias_eO.shape)}")
        if bias_eO.dtype != x.dtype or bias_eO.device != x.device:
            raise TypeError(f"{bias_name} must be {x.dtype} on {x.device} like {x_name}, "
                            f"got {bias_eO.dtype} on {bias_eO.device}")
