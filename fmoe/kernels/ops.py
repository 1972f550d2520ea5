"""The kernel ops as `torch.library` custom ops (namespace `fmoe::`), for both backends.

Each op has a fake implementation (shapes only: what torch.compile traces) and a registered
backward made of further `fmoe::` ops, so a compiled layer traces whole and its backward too.
The last argument, `impl`, names the implementation: "torch" (CPU eager: loops over counts
read on the host), "torch_sync_free" (counts stay on the device) or "triton"; each op runs its
body through `fmoe.kernels.bodies` (bodies run eagerly even under compile: nothing here is
traced). Arguments are checked before, at the seam (`fmoe.kernels`).

About 400 lines, on purpose in one module: each op's forward, fake and backward are registered side by
side, and the backwards call one another's ops, so the op graph reads in one place.
"""
from typing import Optional, Tuple

import torch
from torch import Tensor

from fmoe.kernels import lean, torch_ops
from fmoe.kernels.bodies import IMPLS, run_impl  # noqa: F401  (IMPLS: the impl names, for callers)
from fmoe.kernels.deferred import deferral_of


# permute: rows of x in expert order; backward sums each token's rows back.

@torch.library.custom_op("fmoe::permute", mutates_args=())
def permute(x_TD: Tensor, token_N: Tensor, row_of_slot_TK: Tensor, impl: str) -> Tensor:
    return run_impl(impl, "permute_rows", x_TD, token_N)


@permute.register_fake
def _(x_TD, token_N, row_of_slot_TK, impl):
    return x_TD.new_empty(token_N.shape[0], x_TD.shape[1])


def _permute_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[2])
    ctx.impl = inputs[3]


def _permute_backward(ctx, grad_ND):
    (row_of_slot_TK,) = ctx.saved_tensors
    return gather_sum(grad_ND.contiguous(), row_of_slot_TK, None, ctx.impl), None, None, None


permute.register_autograd(_permute_backward, setup_context=_permute_setup)


@torch.library.custom_op("fmoe::gather_sum", mutates_args=())
def gather_sum(y_ND: Tensor, row_of_slot_TK: Tensor, weight_TK: Optional[Tensor], impl: str) -> Tensor:
    """out[t] = sum_k weight[t, k] * y[row_of_slot[t, k]], dropped slots (row -1) adding nothing."""
    return run_impl(impl, "gather_sum", y_ND, row_of_slot_TK, weight_TK)


@gather_sum.register_fake
def _(y_ND, row_of_slot_TK, weight_TK, impl):
    return y_ND.new_empty(row_of_slot_TK.shape[0], y_ND.shape[1])


# unpermute: the weighted sum of each token's rows.

@torch.library.custom_op("fmoe::unpermute", mutates_args=())
def unpermute(y_ND: Tensor, weight_TK: Tensor, token_N: Tensor, slot_N: Tensor, row_of_slot_TK: Tensor,
              impl: str) -> Tensor:
    return run_impl(impl, "gather_sum", y_ND, row_of_slot_TK, weight_TK)


@unpermute.register_fake
def _(y_ND, weight_TK, token_N, slot_N, row_of_slot_TK, impl):
    return y_ND.new_empty(row_of_slot_TK.shape[0], y_ND.shape[1])


def _unpermute_setup(ctx, inputs, output):
    y_ND, weight_TK, token_N, slot_N, row_of_slot_TK, impl = inputs
    ctx.save_for_backward(y_ND, weight_TK, token_N, slot_N, row_of_slot_TK)
    ctx.impl = impl


def _unpermute_backward_grads(ctx, grad_TD):
    grad_y, grad_w = unpermute_backward(grad_TD.contiguous(), *ctx.saved_tensors, ctx.impl)
    return grad_y, grad_w, None, None, None, None


unpermute.register_autograd(_unpermute_backward_grads, setup_context=_unpermute_setup)


@torch.library.custom_op("fmoe::unpermute_backward", mutates_args=())
def unpermute_backward(grad_TD: Tensor, y_ND: Tensor, weight_TK: Tensor, token_N: Tensor, slot_N: Tensor,
                       row_of_slot_TK: Tensor, impl: str) -> Tuple[Tensor, Tensor]:
    """(grad of y_ND, grad of weight_TK); a dropped slot's weight gets exactly 0."""
    grad_y, grad_w = run_impl(impl, "unpermute_backward", grad_TD, y_ND, weight_TK, token_N, slot_N)
    return grad_y, torch.where(row_of_slot_TK >= 0, grad_w, 0)


@unpermute_backward.register_fake
def _(grad_TD, y_ND, weight_TK, token_N, slot_N, row_of_slot_TK, impl):
    return torch.empty_like(y_ND), torch.empty_like(weight_TK, memory_format=torch.contiguous_format)


# grouped_mm: y = x_seg @ w[e] + bias[e] over each expert's segment of rows.

@torch.library.custom_op("fmoe::grouped_mm", mutates_args=())
def grouped_mm(x_NI: Tensor, w_eIO: Tensor, counts_e: Tensor, bias_eO: Optional[Tensor], impl: str) -> Tensor:
    return run_impl(impl, "grouped_mm_rows", x_NI, w_eIO, counts_e, None, bias_eO)


@grouped_mm.register_fake
def _(x_NI, w_eIO, counts_e, bias_eO, impl):
    return x_NI.new_empty(x_NI.shape[0], w_eIO.shape[2])


def _grouped_mm_setup(ctx, inputs, output):
    x_NI, w_eIO, counts_e, bias_eO, impl = inputs
    ctx.save_for_backward(x_NI, w_eIO, counts_e)
    ctx.impl, ctx.bias_dtype = impl, None if bias_eO is None else bias_eO.dtype


def _grouped_mm_backward(ctx, dy_NO):
    x_NI, w_eIO, counts_e = ctx.saved_tensors
    dy_NO = dy_NO.contiguous()
    needs = ctx.needs_input_grad
    dx = grouped_mm(dy_NO, w_eIO.transpose(1, 2), counts_e, None, ctx.impl) if needs[0] else None
    dw = grouped_mm_weight_grad(x_NI, dy_NO, counts_e, None, ctx.impl) if needs[1] else None
    db = expert_row_sums(dy_NO, counts_e, ctx.bias_dtype, ctx.impl) if needs[3] else None
    return dx, dw, None, db, None


grouped_mm.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


@torch.library.custom_op("fmoe::gather_grouped_mm", mutates_args=())
def gather_grouped_mm(x_TD: Tensor, token_N: Tensor, w_eIO: Tensor, counts_e: Tensor, row_of_slot_TK: Tensor,
                      bias_eO: Optional[Tensor], impl: str) -> Tensor:
    """grouped_mm of the rows x_TD[token_N] (Triton reads them in place)."""
    return run_impl(impl, "grouped_mm_rows", x_TD, w_eIO, counts_e, token_N, bias_eO)


@gather_grouped_mm.register_fake
def _(x_TD, token_N, w_eIO, counts_e, row_of_slot_TK, bias_eO, impl):
    return x_TD.new_empty(token_N.shape[0], w_eIO.shape[2])


def _gather_grouped_mm_setup(ctx, inputs, output):
    x_TD, token_N, w_eIO, counts_e, row_of_slot_TK, bias_eO, impl = inputs
    ctx.save_for_backward(x_TD, token_N, w_eIO, counts_e, row_of_slot_TK)
    ctx.impl, ctx.bias_dtype = impl, None if bias_eO is None else bias_eO.dtype


def _gather_grouped_mm_backward(ctx, dy_NO):
    x_TD, token_N, w_eIO, counts_e, row_of_slot_TK = ctx.saved_tensors
    dy_NO = dy_NO.contiguous()
    needs = ctx.needs_input_grad
    dx = dw = db = None
    if needs[0]:
        dx_ND = grouped_mm(dy_NO, w_eIO.transpose(1, 2), counts_e, None, ctx.impl)
        dx = gather_sum(dx_ND, row_of_slot_TK, None, ctx.impl)
    if needs[2]:
        dw = grouped_mm_weight_grad(x_TD, dy_NO, counts_e, token_N, ctx.impl)
    if needs[5]:
        db = expert_row_sums(dy_NO, counts_e, ctx.bias_dtype, ctx.impl)
    return dx, None, dw, None, None, db, None


gather_grouped_mm.register_autograd(_gather_grouped_mm_backward, setup_context=_gather_grouped_mm_setup)


@torch.library.custom_op("fmoe::grouped_mm_weight_grad", mutates_args=())
def grouped_mm_weight_grad(x_XI: Tensor, dy_NO: Tensor, counts_e: Tensor, rows_N: Optional[Tensor],
                           impl: str) -> Tensor:
    """dw[e] = x[rows of e]^T @ dy[rows of e] (x's rows read through rows_N when given)."""
    return run_impl(impl, "grouped_mm_weight_grad", x_XI, dy_NO, counts_e, rows_N)


@grouped_mm_weight_grad.register_fake
def _(x_XI, dy_NO, counts_e, rows_N, impl):
    return x_XI.new_empty(counts_e.shape[0], x_XI.shape[1], dy_NO.shape[1])


@torch.library.custom_op("fmoe::expert_row_sums", mutates_args=())
def expert_row_sums(dy_NO: Tensor, counts_e: Tensor, dtype: torch.dtype, impl: str) -> Tensor:
    """Per-expert sums of dy's rows (the bias gradient)."""
    return run_impl(impl, "expert_row_sums", dy_NO, counts_e, dtype)


@expert_row_sums.register_fake
def _(dy_NO, counts_e, dtype, impl):
    return dy_NO.new_empty(counts_e.shape[0], dy_NO.shape[1], dtype=dtype)


# The experts' whole MLP fused per expert (torch, CPU eager): returns (y, pre-activation h).

@torch.library.custom_op("fmoe::expert_mlp", mutates_args=())
def expert_mlp_with_hidden(x_ND: Tensor, counts_e: Tensor, activation: str, w1_eDF: Tensor, w2_eFD: Tensor,
                           b1_eF: Optional[Tensor], b2_eD: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    return torch_ops.expert_mlp_forward(x_ND, counts_e, activation, w1_eDF, w2_eFD, b1_eF, b2_eD)


@expert_mlp_with_hidden.register_fake
def _(x_ND, counts_e, activation, w1_eDF, w2_eFD, b1_eF, b2_eD):
    N = x_ND.shape[0]
    return x_ND.new_empty(N, w2_eFD.shape[2]), x_ND.new_empty(N, w1_eDF.shape[2])


def _expert_mlp_setup(ctx, inputs, output):
    x_ND, counts_e, activation, w1_eDF, w2_eFD, b1_eF, b2_eD = inputs
    ctx.save_for_backward(x_ND, counts_e, w1_eDF, w2_eFD, output[1])
    ctx.activation, ctx.has_bias = activation, b1_eF is not None
    # h is returned only to be saved: without this autograd would fill an N x F zero tensor as
    # its gradient on every backward.
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


def _expert_mlp_backward(ctx, dy_ND, _grad_h):
    x_ND, counts_e, w1_eDF, w2_eFD, h_NF = ctx.saved_tensors
    if dy_ND is None:
        dy_ND = torch.zeros(x_ND.shape[0], w2_eFD.shape[2], dtype=x_ND.dtype, device=x_ND.device)
    dx, dw1, dw2, db1, db2 = expert_mlp_backward(dy_ND.contiguous(), x_ND, counts_e, ctx.activation,
                                                 w1_eDF, w2_eFD, h_NF, ctx.has_bias)
    if not ctx.has_bias:
        db1 = db2 = None
    return dx, None, None, dw1, dw2, db1, db2


expert_mlp_with_hidden.register_autograd(_expert_mlp_backward, setup_context=_expert_mlp_setup)


@torch.library.custom_op("fmoe::expert_mlp_backward", mutates_args=())
def expert_mlp_backward(dy_ND: Tensor, x_ND: Tensor, counts_e: Tensor, activation: str, w1_eDF: Tensor,
                        w2_eFD: Tensor, h_NF: Tensor, with_bias: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return torch_ops.expert_mlp_backward(dy_ND, x_ND, counts_e, activation, w1_eDF, w2_eFD, h_NF, with_bias)


@expert_mlp_backward.register_fake
def _(dy_ND, x_ND, counts_e, activation, w1_eDF, w2_eFD, h_NF, with_bias):
    if not with_bias:
        db1, db2 = h_NF.new_empty(0), dy_ND.new_empty(0)
    else:
        db1, db2 = h_NF.new_empty(w1_eDF.shape[0], w1_eDF.shape[2]), dy_ND.new_empty(w2_eFD.shape[0], w2_eFD.shape[2])
    return torch.empty_like(x_ND), torch.empty_like(w1_eDF), torch.empty_like(w2_eFD), db1, db2


def expert_mlp(x_ND, counts_e, activation: str, w1_eDF, w2_eFD, b1_eF=None, b2_eD=None):
    return expert_mlp_with_hidden(x_ND, counts_e, activation, w1_eDF, w2_eFD, b1_eF, b2_eD)[0]


# The lean expert MLP (`fmoe.kernels.lean`): rows read from x through rows_N, outputs scaled by
# their routing weights; saved: x, the routing and, with keep_hidden, the pre-activation.

@torch.library.custom_op("fmoe::weighted_mlp", mutates_args=())
def weighted_mlp(x_XD: Tensor, rows_N: Optional[Tensor], row_of_slot_TK: Optional[Tensor], counts_e: Tensor,
                 weight_N: Optional[Tensor], activation: str, w1_eDF: Tensor, w2_eFD: Tensor,
                 b1_eF: Optional[Tensor], b2_eD: Optional[Tensor], keep_hidden: bool, impl: str) -> Tuple[Tensor, Tensor]:
    return lean.forward(impl, x_XD, rows_N, counts_e, weight_N, activation, w1_eDF, w2_eFD, b1_eF, b2_eD)


@weighted_mlp.register_fake
def _(x_XD, rows_N, row_of_slot_TK, counts_e, weight_N, activation, w1_eDF, w2_eFD, b1_eF, b2_eD, keep_hidden, impl):
    N = x_XD.shape[0] if rows_N is None else rows_N.shape[0]
    y_dtype = x_XD.dtype if weight_N is None else torch.promote_types(x_XD.dtype, torch.float32)
    return x_XD.new_empty(N, w2_eFD.shape[2], dtype=y_dtype), x_XD.new_empty(N, w1_eDF.shape[2])


def _weighted_mlp_setup(ctx, inputs, output):
    x_XD, rows_N, row_of_slot_TK, counts_e, weight_N, activation, w1_eDF, w2_eFD, b1_eF, b2_eD, keep_hidden, impl = inputs
    ctx.save_for_backward(x_XD, rows_N, row_of_slot_TK, counts_e, weight_N, w1_eDF, w2_eFD, b1_eF, b2_eD,
                          output[1] if keep_hidden else None)
    ctx.activation, ctx.impl = activation, impl
    # Weights handed in as a deferral's aliases: their GEMMs run while the input gradient travels.
    ctx.deferral = deferral_of(w1_eDF)
    # h is returned only to be saved: no N x F zero gradient for it on every backward.
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


def _weighted_mlp_backward(ctx, dy_ND, _grad_h):
    x_XD, rows_N, row_of_slot_TK, counts_e, weight_N, w1_eDF, w2_eFD, b1_eF, b2_eD, h_NF = ctx.saved_tensors
    if dy_ND is None:
        return (None,) * 12
    deferral, ctx.deferral = ctx.deferral, None
    if deferral is not None:
        dx, dweight, db1, db2, weight_grads = lean.backward_deferring(
            ctx.impl, dy_ND.contiguous(), x_XD, rows_N, row_of_slot_TK, counts_e, weight_N, ctx.activation,
            w1_eDF, w2_eFD, b1_eF, b2_eD, h_NF)
        deferral.add(weight_grads)
        return (dx, None, None, None, dweight, None, None, None, db1, db2, None, None)
    grads = weighted_mlp_backward(dy_ND.contiguous(), x_XD, rows_N, row_of_slot_TK, counts_e, weight_N,
                                  ctx.activation, w1_eDF, w2_eFD, b1_eF, b2_eD, h_NF, ctx.impl)
    dx, dweight, dw1, dw2, db1, db2 = grads
    return (dx, None, None, None, dweight if weight_N is not None else None, None, dw1, dw2,
            db1 if b1_eF is not None else None, db2 if b2_eD is not None else None, None, None)


weighted_mlp.register_autograd(_weighted_mlp_backward, setup_context=_weighted_mlp_setup)


@torch.library.custom_op("fmoe::weighted_mlp_backward", mutates_args=())
def weighted_mlp_backward(dy_ND: Tensor, x_XD: Tensor, rows_N: Optional[Tensor], row_of_slot_TK: Optional[Tensor],
                          counts_e: Tensor, weight_N: Optional[Tensor], activation: str, w1_eDF: Tensor,
                          w2_eFD: Tensor, b1_eF: Optional[Tensor], b2_eD: Optional[Tensor], h_NF: Optional[Tensor],
                          impl: str) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dx, d weight_N, dw1, dw2, db1, db2); an absent weight or bias gets an empty tensor."""
    grads = lean.backward(impl, dy_ND, x_XD, rows_N, row_of_slot_TK, counts_e, weight_N, activation,
                          w1_eDF, w2_eFD, b1_eF, b2_eD, h_NF)
    return tuple(dy_ND.new_empty(0) if g is None else g for g in grads)


@weighted_mlp_backward.register_fake
def _(dy_ND, x_XD, rows_N, row_of_slot_TK, counts_e, weight_N, activation, w1_eDF, w2_eFD, b1_eF, b2_eD, h_NF, impl):
    dweight = dy_ND.new_empty(0) if weight_N is None else torch.empty_like(weight_N)
    db1 = dy_ND.new_empty(0) if b1_eF is None else torch.empty_like(b1_eF)
    db2 = dy_ND.new_empty(0) if b2_eD is None else torch.empty_like(b2_eD)
    return torch.empty_like(x_XD), dweight, torch.empty_like(w1_eDF), torch.empty_like(w2_eFD), db1, db2


# sum_rows: each token's rows added up, unweighted (the rows came weighted from weighted_mlp).

@torch.library.custom_op("fmoe::sum_rows", mutates_args=())
def sum_rows(y_ND: Tensor, token_N: Tensor, row_of_slot_TK: Tensor, impl: str) -> Tensor:
    return run_impl(impl, "gather_sum", y_ND, row_of_slot_TK, None)


@sum_rows.register_fake
def _(y_ND, token_N, row_of_slot_TK, impl):
    return y_ND.new_empty(row_of_slot_TK.shape[0], y_ND.shape[1])


def _sum_rows_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1], inputs[2])
    ctx.impl = inputs[3]


def _sum_rows_backward(ctx, grad_TD):
    token_N, row_of_slot_TK = ctx.saved_tensors
    return permute(grad_TD.contiguous(), token_N, row_of_slot_TK, ctx.impl), None, None, None


sum_rows.register_autograd(_sum_rows_backward, setup_context=_sum_rows_setup)


# The lean MLP with the combine (one rank): tokens in, tokens out, rows only inside. Saved: x, the
# routing and, with keep_hidden, the pre-activation; on Triton the fused kernels of `triton_lean`.

@torch.library.custom_op("fmoe::routed_mlp", mutates_args=())
def routed_mlp(x_TD: Tensor, token_N: Tensor, slot_N: Tensor, row_of_slot_TK: Tensor, counts_e: Tensor,
               weight_TK: Tensor, activation: str, w1_eDF: Tensor, w2_eFD: Tensor, b1_eF: Optional[Tensor],
               b2_eD: Optional[Tensor], keep_hidden: bool, impl: str) -> Tuple[Tensor, Tensor]:
    return lean.routed_forward(impl, x_TD, token_N, slot_N, row_of_slot_TK, counts_e, weight_TK, activation,
                               w1_eDF, w2_eFD, b1_eF, b2_eD)


@routed_mlp.register_fake
def _(x_TD, token_N, slot_N, row_of_slot_TK, counts_e, weight_TK, activation, w1_eDF, w2_eFD, b1_eF, b2_eD,
      keep_hidden, impl):
    return x_TD.new_empty(x_TD.shape[0], w2_eFD.shape[2]), x_TD.new_empty(token_N.shape[0], w1_eDF.shape[2])


def _routed_mlp_setup(ctx, inputs, output):
    (x_TD, token_N, slot_N, row_of_slot_TK, counts_e, weight_TK, activation, w1_eDF, w2_eFD, b1_eF, b2_eD,
     keep_hidden, impl) = inputs
    ctx.save_for_backward(x_TD, token_N, slot_N, row_of_slot_TK, counts_e, weight_TK, w1_eDF, w2_eFD, b1_eF, b2_eD,
                          output[1] if keep_hidden else None)
    ctx.activation, ctx.impl = activation, impl
    # h is returned only to be saved: no N x F zero gradient for it on every backward.
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


def _routed_mlp_backward(ctx, dy_TD, _grad_h):
    x_TD, token_N, slot_N, row_of_slot_TK, counts_e, weight_TK, w1_eDF, w2_eFD, b1_eF, b2_eD, h_NF = ctx.saved_tensors
    if dy_TD is None:
        return (None,) * 13
    dx, dweight, dw1, dw2, db1, db2 = routed_mlp_backward(
        dy_TD.contiguous(), x_TD, token_N, slot_N, row_of_slot_TK, counts_e, weight_TK, ctx.activation, w1_eDF,
        w2_eFD, b1_eF, b2_eD, h_NF, ctx.impl)
    return (dx, None, None, None, None, dweight, None, dw1, dw2, db1 if b1_eF is not None else None,
            db2 if b2_eD is not None else None, None, None)


routed_mlp.register_autograd(_routed_mlp_backward, setup_context=_routed_mlp_setup)


@torch.library.custom_op("fmoe::routed_mlp_backward", mutates_args=())
def routed_mlp_backward(dy_TD: Tensor, x_TD: Tensor, token_N: Tensor, slot_N: Tensor, row_of_slot_TK: Tensor,
                        counts_e: Tensor, weight_TK: Tensor, activation: str, w1_eDF: Tensor, w2_eFD: Tensor,
                        b1_eF: Optional[Tensor], b2_eD: Optional[Tensor], h_NF: Optional[Tensor],
                        impl: str) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dx, d weight_TK, dw1, dw2, db1, db2); an absent bias gets an empty tensor."""
    grads = lean.routed_backward(impl, dy_TD, x_TD, token_N, slot_N, row_of_slot_TK, counts_e, weight_TK,
                                 activation, w1_eDF, w2_eFD, b1_eF, b2_eD, h_NF)
    return tuple(dy_TD.new_empty(0) if g is None else g for g in grads)


@routed_mlp_backward.register_fake
def _(dy_TD, x_TD, token_N, slot_N, row_of_slot_TK, counts_e, weight_TK, activation, w1_eDF, w2_eFD, b1_eF, b2_eD,
      h_NF, impl):
    db1 = dy_TD.new_empty(0) if b1_eF is None else torch.empty_like(b1_eF)
    db2 = dy_TD.new_empty(0) if b2_eD is None else torch.empty_like(b2_eD)
    return (torch.empty_like(x_TD), torch.empty_like(weight_TK, memory_format=torch.contiguous_format),
            torch.empty_like(w1_eDF), torch.empty_like(w2_eFD), db1, db2)


# The ops above that run only inside a backward: differentiating them is a double backward.

def _refuse_double_backward(qualname: str):
    def backward(ctx, *grads):
        raise RuntimeError(f"{qualname}: double backward (a gradient of a gradient: create_graph=True and then a "
                           "backward through it, gradgradcheck, a gradient penalty) is not supported by fmoe's "
                           "fused ops")
    return backward


for _op in (gather_sum, unpermute_backward, grouped_mm_weight_grad, expert_row_sums, expert_mlp_backward,
            weighted_mlp_backward, routed_mlp_backward):
    _op.register_autograd(_refuse_double_backward(_op._qualname))
