"""Triton implementations of `permute`, `unpermute`, `grouped_mm` and `gather_grouped_mm`.

Same signatures and results as `fmoe.kernels.torch_ops`, op for op and gradient for gradient:
each is an `fmoe::` custom op (`fmoe.kernels.ops`, impl "triton") whose forward and backward run
the kernels of `triton_permute` and `triton_grouped_mm`, re-exported here for it. Every sum is a
gather in a fixed order, so results are deterministic. Counts never travel to the host, so no op
here synchronises with the GPU. The functions below check their arguments, then call the op.
"""
from typing import Optional

import torch

from fmoe.kernels import ops
from fmoe.kernels import triton_grouped_mm, triton_grouped_mm_tma
from fmoe.kernels.triton_grouped_mm import expert_row_sums, grouped_mm_weight_grad  # noqa: F401
from fmoe.kernels.triton_permute import gather_sum, permute_rows, unpermute_backward  # noqa: F401
from fmoe.routing import RoutingPlan

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_float(name: str, t: torch.Tensor, dim: int):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dim:
        raise ValueError(f"{name} must have {dim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")


def _check_index(name: str, t: torch.Tensor, shape, device: torch.device):
    """An int32/int64 tensor on `device` whose shape matches `shape` (None: any size)."""
    if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be an int32 or int64 tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    if t.dim() != len(shape) or any(want is not None and got != want for got, want in zip(t.shape, shape)):
        wanted = tuple("any" if want is None else want for want in shape)
        raise ValueError(f"{name} must have shape {wanted}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device} like the data, got {t.device}")


def _check_plan(plan: RoutingPlan, num_tokens: int, device: torch.device):
    if plan.num_tokens != num_tokens:
        raise ValueError(f"plan routes {plan.num_tokens} tokens, the input has {num_tokens}")
    _check_index("plan.token_N", plan.token_N, (plan.num_rows,), device)
    _check_index("plan.slot_N", plan.slot_N, (plan.num_rows,), device)
    _check_index("plan.row_of_slot_TK", plan.row_of_slot_TK, (plan.num_tokens, plan.top_k), device)


def _check_grouped_mm(x_name: str, x: torch.Tensor, w_eIO: torch.Tensor, counts_e: torch.Tensor, bias_eO):
    _check_float(x_name, x, 2)
    _check_float("w_eIO", w_eIO, 3)
    if w_eIO.dtype != x.dtype:
        raise TypeError(f"w_eIO must have {x_name}'s dtype {x.dtype}, got {w_eIO.dtype}")
    if w_eIO.device != x.device:
        raise ValueError(f"w_eIO must be on {x.device} like {x_name}, got {w_eIO.device}")
    if w_eIO.shape[1] != x.shape[1]:
        raise ValueError(f"w_eIO must have {x_name}'s width {x.shape[1]} as dim 1, got shape {tuple(w_eIO.shape)}")
    _check_index("counts_e", counts_e, (w_eIO.shape[0],), x.device)
    if bias_eO is not None:
        _check_float("bias_eO", bias_eO, 2)
        if tuple(bias_eO.shape) != (w_eIO.shape[0], w_eIO.shape[2]):
            raise ValueError(f"bias_eO must have shape {(w_eIO.shape[0], w_eIO.shape[2])}, got {tuple(bias_eO.shape)}")
        if bias_eO.dtype != x.dtype or bias_eO.device != x.device:
            raise TypeError(f"bias_eO must be {x.dtype} on {x.device} like {x_name}, "
                            f"got {bias_eO.dtype} on {bias_eO.device}")


def grouped_mm_rows(x_XI, w_eIO, counts_e, rows_N=None, bias_eO=None):
    """y[r] = x[rows_N[r]] @ w[e] (+ bias_eO[e]): the TMA kernel under FMOE_TRITON_TMA=1 where it
    applies (sm_90 and later, operands the copy engine takes), the plain kernel otherwise."""
    if triton_grouped_mm_tma.tma_enabled():
        triton_grouped_mm._check_kernel_device(x_XI)
        if triton_grouped_mm_tma.tma_applies(x_XI, w_eIO, rows_N, bias_eO):
            return triton_grouped_mm_tma.grouped_mm_rows_tma(x_XI, w_eIO, counts_e, rows_N, bias_eO)
    return triton_grouped_mm.grouped_mm_rows(x_XI, w_eIO, counts_e, rows_N, bias_eO)


def permute(x_TD: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
    _check_float("x_TD", x_TD, 2)
    _check_plan(plan, x_TD.shape[0], x_TD.device)
    return ops.permute(x_TD, plan.token_N, plan.row_of_slot_TK, "triton")


def unpermute(y_ND: torch.Tensor, plan: RoutingPlan, weight_TK: torch.Tensor) -> torch.Tensor:
    _check_float("y_ND", y_ND, 2)
    if y_ND.shape[0] != plan.num_rows:
        raise ValueError(f"y_ND must have plan.num_rows={plan.num_rows} rows, got shape {tuple(y_ND.shape)}")
    _check_plan(plan, plan.num_tokens, y_ND.device)
    _check_float("weight_TK", weight_TK, 2)
    if tuple(weight_TK.shape) != (plan.num_tokens, plan.top_k):
        raise ValueError(f"weight_TK must have shape {(plan.num_tokens, plan.top_k)}, got {tuple(weight_TK.shape)}")
    if weight_TK.device != y_ND.device:
        raise ValueError(f"weight_TK must be on {y_ND.device} like y_ND, got {weight_TK.device}")
    return ops.unpermute(y_ND, weight_TK, plan.token_N, plan.slot_N, plan.row_of_slot_TK, "triton")


def grouped_mm(x_NI: torch.Tensor, w_eIO: torch.Tensor, counts_e: torch.Tensor,
               bias_eO: Optional[torch.Tensor] = None) -> torch.Tensor:
    _check_grouped_mm("x_NI", x_NI, w_eIO, counts_e, bias_eO)
    return ops.grouped_mm(x_NI, w_eIO, counts_e, bias_eO, "triton")


def gather_grouped_mm(x_TD: torch.Tensor, token_N: torch.Tensor, w_eIO: torch.Tensor, counts_e: torch.Tensor,
                      row_of_slot_TK: torch.Tensor, bias_eO: Optional[torch.Tensor] = None) -> torch.Tensor:
    _check_grouped_mm("x_TD", x_TD, w_eIO, counts_e, bias_eO)
    _check_index("token_N", token_N, (None,), x_TD.device)
    _check_index("row_of_slot_TK", row_of_slot_TK, (x_TD.shape[0], None), x_TD.device)
    return ops.gather_grouped_mm(x_TD, token_N, w_eIO, counts_e, row_of_slot_TK, bias_eO, "triton")
