"""Torch implementations of the data-movement and grouped-GEMM ops (the CPU path, for good).

All three are autograd functions whose backward is written out, so the Triton path can mirror
them op for op, and so every sum is deterministic: each output row adds its own rows in a fixed
order, never an atomic or an `index_add` of several rows onto one in the forward.
"""
from typing import Optional

import torch

from fmoe.routing import RoutingPlan


def gather_rows_summed(y_ND, row_of_slot_TK, weight_TK=None):
    """out[t] = sum_k weight[t, k] * y[row_of_slot[t, k]], skipping dropped slots (row -1)."""
    T, K = row_of_slot_TK.shape
    N, D = y_ND.shape
    acc_dtype = torch.float32 if y_ND.dtype in (torch.float16, torch.bfloat16) else y_ND.dtype
    if N == 0:
        return y_ND.new_zeros(T, D)
    # A dropped slot reads row 0 and adds nothing: no zero-padded copy of y, no zero-filled output.
    # Fewer rows than slots means some were dropped; only then are the reads masked, so a
    # non-finite row 0 can never leak into another token (0 * inf would be NaN).
    live_TK = row_of_slot_TK >= 0
    has_drops = N < T * K
    rows_TK = row_of_slot_TK.clamp_min(0)
    scale_TK = live_TK.to(acc_dtype) if weight_TK is None else torch.where(live_TK, weight_TK.to(acc_dtype), 0)

    def picked(k):
        rows_TD = y_ND.index_select(0, rows_TK[:, k]).to(acc_dtype)
        return rows_TD.masked_fill_(~live_TK[:, k:k + 1], 0) if has_drops else rows_TD

    out_TD = picked(0).mul_(scale_TK[:, :1])
    for k in range(1, K):
        out_TD.addcmul_(picked(k), scale_TK[:, k:k + 1])
    return out_TD.to(y_ND.dtype)


class Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, token_N, row_of_slot_TK):
        ctx.save_for_backward(row_of_slot_TK)
        return x_TD.index_select(0, token_N)

    @staticmethod
    def backward(ctx, grad_ND):
        (row_of_slot_TK,) = ctx.saved_tensors
        return gather_rows_summed(grad_ND.contiguous(), row_of_slot_TK), None, None


class Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_ND, weight_TK, token_N, slot_N, row_of_slot_TK):
        ctx.save_for_backward(y_ND, weight_TK, token_N, slot_N, row_of_slot_TK)
        return gather_rows_summed(y_ND, row_of_slot_TK, weight_TK)

    @staticmethod
    def backward(ctx, grad_TD):
        y_ND, weight_TK, token_N, slot_N, row_of_slot_TK = ctx.saved_tensors
        grad_ND = grad_TD.contiguous().index_select(0, token_N)     # gathered once for both gradients
        grad_y = grad_w = None
        if ctx.needs_input_grad[0]:
            weight_N = weight_TK.reshape(-1).index_select(0, slot_N).to(grad_ND.dtype)
            grad_y = grad_ND * weight_N[:, None]
        if ctx.needs_input_grad[1]:
            grad_slot_S = torch.zeros(weight_TK.numel(), dtype=torch.float32, device=grad_ND.device)
            dots_N = (grad_ND.float() * y_ND.float()).sum(-1)
            grad_slot_S[slot_N] = dots_N
            grad_w = grad_slot_S.view_as(weight_TK).to(weight_TK.dtype)
        return grad_y, grad_w, None, None, None


def permute(x_TD: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
    return Permute.apply(x_TD, plan.token_N, plan.row_of_slot_TK)


def unpermute(y_ND: torch.Tensor, plan: RoutingPlan, weight_TK: torch.Tensor) -> torch.Tensor:
    return Unpermute.apply(y_ND, weight_TK, plan.token_N, plan.slot_N, plan.row_of_slot_TK)


def _fits_grouped_mm(*tensors) -> bool:
    """torch._grouped_mm wants fp32/bf16 on CPU (bf16 on CUDA from sm90), 16-byte aligned strides."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    for t in tensors:
        allowed = (torch.bfloat16,) if t.is_cuda else (torch.float32, torch.bfloat16)
        if t.dtype not in allowed or t.data_ptr() % 16:
            return False
        if any(s != 1 and (s * t.element_size()) % 16 for s in t.stride()):
            return False
    if tensors[0].is_cuda and torch.cuda.get_device_capability(tensors[0].device) < (9, 0):
        return False
    return True


def _offsets(counts_e):
    return torch.cumsum(counts_e, 0, dtype=torch.int32)


def _mm_rows(x_ND, w_eIO, counts_e, bias_eO=None):
    """y[rows of e] = x[rows of e] @ w[e] (+ bias[e])."""
    if _fits_grouped_mm(x_ND, w_eIO) and (bias_eO is None or x_ND.is_cuda):
        y_NO = torch._grouped_mm(x_ND, w_eIO, offs=_offsets(counts_e))
        if bias_eO is not None:
            y_NO += bias_eO.repeat_interleave(counts_e, dim=0, output_size=y_NO.shape[0])
        return y_NO
    # On the CPU a loop of addmm over contiguous segments is as fast as the grouped GEMM and
    # fuses the bias, which an add over all rows afterwards would cost a full pass for.
    y_NO = x_ND.new_empty(x_ND.shape[0], w_eIO.shape[2])
    start = 0
    for e, n in enumerate(counts_e.tolist()):
        if bias_eO is None:
            torch.matmul(x_ND[start:start + n], w_eIO[e], out=y_NO[start:start + n])
        else:
            torch.addmm(bias_eO[e], x_ND[start:start + n], w_eIO[e], out=y_NO[start:start + n])
        start += n
    return y_NO


def _mm_weight_grad(x_NI, dy_NO, counts_e):
    """dw[e] = x[rows of e]^T @ dy[rows of e]; zero for an expert with no rows."""
    if _fits_grouped_mm(x_NI, dy_NO):
        return torch._grouped_mm(x_NI.t(), dy_NO, offs=_offsets(counts_e))
    dw = x_NI.new_zeros(counts_e.numel(), x_NI.shape[1], dy_NO.shape[1])
    start = 0
    for e, n in enumerate(counts_e.tolist()):
        if n:
            torch.matmul(x_NI[start:start + n].t(), dy_NO[start:start + n], out=dw[e])
        start += n
    return dw


def segment_sum(dy_NO, counts_e):
    """Per-expert sum of rows: the bias gradient."""
    if dy_NO.is_cuda:
        return torch.segment_reduce(dy_NO, "sum", lengths=counts_e, axis=0, unsafe=True)
    # segment_reduce is several times slower than plain row sums on the CPU.
    sums, start = [], 0
    for n in counts_e.tolist():
        sums.append(dy_NO[start:start + n].sum(0))
        start += n
    return torch.stack(sums)


class GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_NI, w_eIO, counts_e, bias_eO):
        ctx.save_for_backward(x_NI, w_eIO, counts_e)
        return _mm_rows(x_NI, w_eIO, counts_e, bias_eO)

    @staticmethod
    def backward(ctx, dy_NO):
        x_NI, w_eIO, counts_e = ctx.saved_tensors
        dy_NO = dy_NO.contiguous()
        needs = ctx.needs_input_grad
        dx = _mm_rows(dy_NO, w_eIO.transpose(1, 2), counts_e) if needs[0] else None
        dw = _mm_weight_grad(x_NI, dy_NO, counts_e) if needs[1] else None
        db = segment_sum(dy_NO, counts_e) if needs[3] else None
        return dx, dw, None, db


def grouped_mm(x_NI: torch.Tensor, w_eIO: torch.Tensor, counts_e: torch.Tensor,
               bias_eO: Optional[torch.Tensor] = None) -> torch.Tensor:
    return GroupedMM.apply(x_NI, w_eIO, counts_e, bias_eO)


def gather_grouped_mm(x_TD: torch.Tensor, token_N: torch.Tensor, w_eIO: torch.Tensor, counts_e: torch.Tensor,
                      row_of_slot_TK: torch.Tensor, bias_eO: Optional[torch.Tensor] = None) -> torch.Tensor:
    """grouped_mm of the rows x_TD[token_N]: here the permuted copy is made, Triton reads in place."""
    return grouped_mm(Permute.apply(x_TD, token_N, row_of_slot_TK), w_eIO, counts_e, bias_eO)


FUSED_MLP_ACTIVATIONS = ("gelu", "relu")


def _activation(h, name):
    return torch.nn.functional.gelu(h) if name == "gelu" else torch.relu(h)


def _activation_backward(grad, h, name):
    if name == "gelu":
        return torch.ops.aten.gelu_backward(grad, h)
    return grad * (h > 0)


class ExpertMLP(torch.autograd.Function):
    """The experts' whole MLP, one expert's segment at a time: addmm -> activation -> addmm.

    On a CPU this keeps each expert's hidden rows in cache between the two GEMMs, and saves only
    the pre-activation (the activation is recomputed in the backward) instead of both.
    """

    @staticmethod
    def forward(ctx, x_ND, counts_e, activation, w1_eDF, w2_eFD, b1_eF, b2_eD):
        N = x_ND.shape[0]
        h_NF = x_ND.new_empty(N, w1_eDF.shape[2])
        y_ND = x_ND.new_empty(N, w2_eFD.shape[2])
        start = 0
        for e, n in enumerate(counts_e.tolist()):
            rows = slice(start, start + n)
            if b1_eF is None:
                torch.mm(x_ND[rows], w1_eDF[e], out=h_NF[rows])
                torch.mm(_activation(h_NF[rows], activation), w2_eFD[e], out=y_ND[rows])
            else:
                torch.addmm(b1_eF[e], x_ND[rows], w1_eDF[e], out=h_NF[rows])
                torch.addmm(b2_eD[e], _activation(h_NF[rows], activation), w2_eFD[e], out=y_ND[rows])
            start += n
        ctx.activation, ctx.has_bias = activation, b1_eF is not None
        ctx.save_for_backward(x_ND, counts_e, w1_eDF, w2_eFD, h_NF)
        return y_ND

    @staticmethod
    def backward(ctx, dy_ND):
        x_ND, counts_e, w1_eDF, w2_eFD, h_NF = ctx.saved_tensors
        dy_ND = dy_ND.contiguous()
        dx_ND = torch.empty_like(x_ND)
        dw1, dw2 = torch.empty_like(w1_eDF), torch.empty_like(w2_eFD)
        db1, db2 = [], []
        start = 0
        for e, n in enumerate(counts_e.tolist()):
            rows = slice(start, start + n)
            h, dy = h_NF[rows], dy_ND[rows]
            torch.mm(_activation(h, ctx.activation).t(), dy, out=dw2[e])
            dh = _activation_backward(dy @ w2_eFD[e].t(), h, ctx.activation)
            torch.mm(x_ND[rows].t(), dh, out=dw1[e])
            torch.mm(dh, w1_eDF[e].t(), out=dx_ND[rows])
            db1.append(dh.sum(0))
            db2.append(dy.sum(0))
            start += n
        if not ctx.has_bias:
            return dx_ND, None, None, dw1, dw2, None, None
        return dx_ND, None, None, dw1, dw2, torch.stack(db1), torch.stack(db2)


def expert_mlp(x_ND, counts_e, activation: str, w1_eDF, w2_eFD, b1_eF=None, b2_eD=None):
    return ExpertMLP.apply(x_ND, counts_e, activation, w1_eDF, w2_eFD, b1_eF, b2_eD)
