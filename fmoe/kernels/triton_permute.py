"""Triton kernels that move rows between token order and expert order.

Every sum is a gather: each output row adds its own K rows in k order, in fp32, so results are
deterministic and no atomics are needed. Dropped slots (row -1) add nothing.
"""
import torch
import triton
import triton.language as tl

from fmoe.kernels.triton_grouped_mm import _check_kernel_device


@triton.jit(do_not_specialize=["N"])
def _permute_kernel(x_ptr, token_ptr, out_ptr, N, D, stride_xt, stride_xd, stride_on, stride_od,
                    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[n] = x[token[n]]."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_ok = rows < N
    mask = row_ok[:, None] & (cols < D)[None, :]
    tokens = tl.load(token_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    vals = tl.load(x_ptr + tokens[:, None] * stride_xt + cols[None, :] * stride_xd, mask=mask)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_on + cols[None, :] * stride_od, vals, mask=mask)


@triton.jit(do_not_specialize=["T"])
def _gather_sum_kernel(y_ptr, row_of_slot_ptr, weight_ptr, out_ptr, T, K, D,
                       stride_yn, stride_yd, stride_ot, stride_od,
                       HAS_WEIGHT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[t] = sum over k, in order, of weight[t, k] * y[row_of_slot[t, k]] (contiguous T x K maps)."""
    tokens = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    token_ok = tokens < T
    col_ok = cols < D
    acc = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
    for k in range(0, K):
        slots = tokens.to(tl.int64) * K + k
        rows = tl.load(row_of_slot_ptr + slots, mask=token_ok, other=-1).to(tl.int64)
        kept = rows >= 0
        vals = tl.load(y_ptr + rows[:, None] * stride_yn + cols[None, :] * stride_yd,
                       mask=kept[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            w = tl.load(weight_ptr + slots, mask=kept, other=0.0).to(tl.float32)
            vals = vals * w[:, None]
        acc += vals
    out_ptrs = out_ptr + tokens[:, None].to(tl.int64) * stride_ot + cols[None, :] * stride_od
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=token_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["N"])
def _unpermute_backward_kernel(grad_ptr, y_ptr, weight_ptr, token_ptr, slot_ptr, grad_y_ptr, grad_w_ptr,
                               N, D, stride_gt, stride_gd, stride_yn, stride_yd, stride_dyn, stride_dyd,
                               NEED_GRAD_Y: tl.constexpr, NEED_GRAD_W: tl.constexpr,
                               BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """For each row n of slot s, token t: grad_y[n] = grad[t] * weight[s]; grad_w[s] = grad[t] . y[n].

    Each slot has at most one row, so grad_w is written, never accumulated; dropped slots keep
    the zero the caller filled in.
    """
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < N
    tokens = tl.load(token_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    slots = tl.load(slot_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    # The torch path rounds the weight to the gradient's dtype before multiplying; so does this.
    w = tl.load(weight_ptr + slots, mask=row_ok, other=0.0).to(grad_y_ptr.dtype.element_ty).to(tl.float32)
    dot = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for d in range(0, D, BLOCK_D):
        cols = d + tl.arange(0, BLOCK_D)
        mask = row_ok[:, None] & (cols < D)[None, :]
        g = tl.load(grad_ptr + tokens[:, None] * stride_gt + cols[None, :] * stride_gd,
                    mask=mask, other=0.0).to(tl.float32)
        if NEED_GRAD_Y:
            tl.store(grad_y_ptr + rows[:, None].to(tl.int64) * stride_dyn + cols[None, :] * stride_dyd,
                     (g * w[:, None]).to(grad_y_ptr.dtype.element_ty), mask=mask)
        if NEED_GRAD_W:
            y = tl.load(y_ptr + rows[:, None].to(tl.int64) * stride_yn + cols[None, :] * stride_yd,
                        mask=mask, other=0.0).to(tl.float32)
            dot += tl.sum(g * y, axis=1)
    if NEED_GRAD_W:
        tl.store(grad_w_ptr + slots, dot.to(grad_w_ptr.dtype.element_ty), mask=row_ok)


def _blocks(D: int):
    """(BLOCK_R, BLOCK_D): up to 512 columns, about 4096 elements a program."""
    block_d = min(triton.next_power_of_2(max(D, 1)), 512)
    return max(4096 // block_d, 1), block_d


def permute_launch(x_TD, token_N, out_ND):
    """(kernel, args, constexprs) of the launch that fills out_ND; `fmoe.kernels.aot` compiles the same."""
    N, D = out_ND.shape
    block_r, block_d = _blocks(D)
    return _permute_kernel, (x_TD, token_N, out_ND, N, D, *x_TD.stride(), *out_ND.stride()), \
        dict(BLOCK_R=block_r, BLOCK_D=block_d)


def permute_rows(x_TD, token_N):
    """x_TD's rows in the order of token_N."""
    _check_kernel_device(x_TD)
    N, D = token_N.shape[0], x_TD.shape[1]
    out_ND = x_TD.new_empty(N, D)
    if out_ND.numel() == 0:
        return out_ND
    kernel, args, constexprs = permute_launch(x_TD, token_N, out_ND)
    kernel[(triton.cdiv(N, constexprs["BLOCK_R"]), triton.cdiv(D, constexprs["BLOCK_D"]))](*args, **constexprs)
    return out_ND


def gather_sum_launch(y_ND, row_of_slot_TK, weight_TK, out_TD):
    """(kernel, args, constexprs) of the launch that fills out_TD (contiguous maps; weight_TK may be None)."""
    T, K = row_of_slot_TK.shape
    D = y_ND.shape[1]
    block_r, block_d = _blocks(D)
    weight_arg = row_of_slot_TK if weight_TK is None else weight_TK    # an unread stand-in
    args = (y_ND, row_of_slot_TK, weight_arg, out_TD, T, K, D, *y_ND.stride(), *out_TD.stride())
    return _gather_sum_kernel, args, dict(HAS_WEIGHT=weight_TK is not None, BLOCK_R=block_r, BLOCK_D=block_d)


def gather_sum(y_ND, row_of_slot_TK, weight_TK=None):
    """out[t] = sum_k weight[t, k] * y[row_of_slot[t, k]] in fp32, skipping dropped slots; y's dtype."""
    _check_kernel_device(y_ND)
    T, K = row_of_slot_TK.shape
    D = y_ND.shape[1]
    out_TD = y_ND.new_empty(T, D)
    if out_TD.numel() == 0:
        return out_TD
    if y_ND.shape[0] == 0 or K == 0:
        return out_TD.zero_()
    weight_TK = None if weight_TK is None else weight_TK.contiguous()
    kernel, args, constexprs = gather_sum_launch(y_ND, row_of_slot_TK.contiguous(), weight_TK, out_TD)
    kernel[(triton.cdiv(T, constexprs["BLOCK_R"]), triton.cdiv(D, constexprs["BLOCK_D"]))](*args, **constexprs)
    return out_TD


def unpermute_backward_launch(grad_TD, y_ND, weight_TK, token_N, slot_N, grad_y, grad_w):
    """(kernel, args, constexprs) of the launch that fills grad_y and grad_w (either may be None)."""
    N, D = y_ND.shape
    block_r, block_d = _blocks(D)
    grad_y_arg = grad_TD if grad_y is None else grad_y      # unread stand-ins for a gradient not needed
    args = (grad_TD, y_ND, weight_TK, token_N, slot_N, grad_y_arg, weight_TK if grad_w is None else grad_w,
            N, D, *grad_TD.stride(), *y_ND.stride(), *grad_y_arg.stride())
    return _unpermute_backward_kernel, args, dict(NEED_GRAD_Y=grad_y is not None, NEED_GRAD_W=grad_w is not None,
                                                  BLOCK_R=block_r, BLOCK_D=block_d)


def unpermute_backward(grad_TD, y_ND, weight_TK, token_N, slot_N, need_grad_y: bool = True, need_grad_w: bool = True):
    """(grad of y_ND or None, grad of weight_TK or None) of the weighted gather-sum."""
    _check_kernel_device(grad_TD)
    N, D = y_ND.shape
    grad_y = grad_TD.new_empty(N, D) if need_grad_y else None
    grad_w = torch.zeros_like(weight_TK, memory_format=torch.contiguous_format) if need_grad_w else None
    if N == 0 or not (need_grad_y or need_grad_w):
        return grad_y, grad_w
    kernel, args, constexprs = unpermute_backward_launch(grad_TD, y_ND, weight_TK.contiguous(), token_N, slot_N,
                                                         grad_y, grad_w)
    kernel[(triton.cdiv(N, constexprs["BLOCK_R"]),)](*args, **constexprs)
    return grad_y, grad_w
