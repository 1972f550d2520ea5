"""The lean expert MLP's forward and backward, written once over either backend's grouped GEMMs.

Rows are read from x through `rows_N` inside the first GEMM (forward and weight gradient), so
no permuted copy of x exists past the GEMM's own transient on the torch path and none at all on
Triton. Each row's output is scaled by its routing weight here, so the combine is a plain sum and
the weight's gradient comes from the activation's gradient and the activation:
dL/dw_r = <dy_r, act(h_r) @ w2_e + b2_e> = <dy_r @ w2_e^T, act(h_r)> + <dy_r, b2_e>,
with dy_r @ w2_e^T computed for the activation's gradient anyway: no N x D output is kept.

With impl "torch" (CPU eager, counts read on the host) the same arithmetic runs one expert's
segment at a time: its rows stay in cache between the GEMMs, and the backward's transients are
one expert's rows wide instead of all N rows.

`routed_forward` / `routed_backward` add the combine on one rank: y[t] = sum_k weight[t, k] *
mlp(x[t]) straight to tokens. On Triton they are the fused kernels of `triton_lean` (no glue
between the GEMMs); on torch, the MLP above unweighted and a weighted gather-sum.
"""
import torch

from fmoe.kernels.bodies import run_impl
from fmoe.kernels.torch_ops import activation_vjp, expert_of_rows


def hidden(impl, x_XD, rows_N, counts_e, w1_eDF, b1_eF):
    """The pre-activation h[r] = x[rows[r]] @ w1[e] + b1[e] (zero past the experts' segments)."""
    return run_impl(impl, "grouped_mm_rows", x_XD, w1_eDF, counts_e, rows_N, b1_eF)


def weighted_dtype(x_dtype: torch.dtype) -> torch.dtype:
    """Half-precision rows are weighted in fp32 and returned so: the per-token sum then rounds
    once, as the weighted combine of the other path does."""
    return torch.promote_types(x_dtype, torch.float32)


def forward(impl, x_XD, rows_N, counts_e, weight_N, activation, w1_eDF, w2_eFD, b1_eF, b2_eD):
    if impl == "torch":
        return forward_by_expert(x_XD, rows_N, counts_e, weight_N, activation, w1_eDF, w2_eFD, b1_eF, b2_eD)
    h_NF = hidden(impl, x_XD, rows_N, counts_e, w1_eDF, b1_eF)
    a_NF = activation_vjp(h_NF, activation)[0]
    y_ND = run_impl(impl, "grouped_mm_rows", a_NF, w2_eFD, counts_e, None, b2_eD)
    if weight_N is not None:
        y_ND = y_ND.to(weighted_dtype(y_ND.dtype)).mul_(weight_N[:, None])
    return y_ND, h_NF


def backward(impl, dy_ND, x_XD, rows_N, row_of_slot_TK, counts_e, weight_N, activation,
             w1_eDF, w2_eFD, b1_eF, b2_eD, h_NF):
    """(dx, d weight_N or None, dw1, dw2, db1 or None, db2 or None); h recomputed when not given."""
    dx, dweight_N, db1, db2, weight_grads = backward_deferring(
        impl, dy_ND, x_XD, rows_N, row_of_slot_TK, counts_e, weight_N, activation, w1_eDF, w2_eFD, b1_eF, b2_eD,
        h_NF, defer=False)
    dw1, dw2 = weight_grads()
    return dx, dweight_N, dw1, dw2, db1, db2


def backward_deferring(impl, dy_ND, x_XD, rows_N, row_of_slot_TK, counts_e, weight_N, activation,
                       w1_eDF, w2_eFD, b1_eF, b2_eD, h_NF, defer: bool = True):
    """(dx, d weight_N or None, db1 or None, db2 or None, weight_grads): the backward with its two weight
    GEMMs left in `weight_grads()` -> (dw1, dw2), to run when the caller chooses (while dx travels: the
    same GEMMs on the same operands as in line). Not `defer`: on the torch path each expert's weight
    GEMMs run in its turn, as `backward` needs."""
    if impl == "torch":
        dx_ND, dweight_N, db1, db2, weight_grads = backward_by_expert(
            dy_ND, x_XD, rows_N, counts_e, weight_N, activation, w1_eDF, w2_eFD, b1_eF, b2_eD, h_NF, defer)
    else:
        dx_ND, dweight_N, db1, db2, weight_grads = backward_grouped(
            impl, dy_ND, x_XD, rows_N, counts_e, weight_N, activation, w1_eDF, w2_eFD, b1_eF, b2_eD, h_NF)
    # Each token's K row gradients summed in k order: deterministic, no scatter.
    dx = dx_ND if rows_N is None else run_impl(impl, "gather_sum", dx_ND, row_of_slot_TK, None)
    return dx, dweight_N, db1, db2, weight_grads


def backward_grouped(impl, dy_ND, x_XD, rows_N, counts_e, weight_N, activation, w1_eDF, w2_eFD, b1_eF, b2_eD,
                     h_NF):
    """The backward over all rows at once, each step one grouped GEMM (Triton, or counts on the device); the
    weight GEMMs left to the returned `weight_grads()`."""
    if h_NF is None:
        h_NF = hidden(impl, x_XD, rows_N, counts_e, w1_eDF, b1_eF)
    a_NF, act_vjp = activation_vjp(h_NF, activation)
    # The gradient of the unweighted activation; rows past the segments come out zero.
    da_NF = run_impl(impl, "grouped_mm_rows", dy_ND.to(x_XD.dtype), w2_eFD.transpose(1, 2), counts_e, None, None)
    dweight_N = None
    if weight_N is not None:
        bias_ND = None
        if b2_eD is not None:
            bias_ND = torch.cat([b2_eD, b2_eD.new_zeros(1, b2_eD.shape[1])]).index_select(
                0, expert_of_rows(counts_e, dy_ND.shape[0]))
        dweight_N = weight_gradient(dy_ND, da_NF, a_NF, bias_ND, weight_N.dtype)
        dy_ND = (dy_ND * weight_N[:, None]).to(x_XD.dtype)
        da_NF.mul_(weight_N.to(da_NF.dtype)[:, None])
    dh_NF = act_vjp(da_NF)
    db1 = db2 = None
    if b1_eF is not None:
        db1 = run_impl(impl, "expert_row_sums", dh_NF, counts_e, b1_eF.dtype)
        db2 = run_impl(impl, "expert_row_sums", dy_ND, counts_e, b2_eD.dtype)
    dx_ND = run_impl(impl, "grouped_mm_rows", dh_NF, w1_eDF.transpose(1, 2), counts_e, None, None)

    def weight_grads():
        return (run_impl(impl, "grouped_mm_weight_grad", x_XD, dh_NF, counts_e, rows_N),
                run_impl(impl, "grouped_mm_weight_grad", a_NF, dy_ND, counts_e, None))
    return dx_ND, dweight_N, db1, db2, weight_grads


def routed_forward(impl, x_TD, token_N, slot_N, row_of_slot_TK, counts_e, weight_TK, activation,
                   w1_eDF, w2_eFD, b1_eF, b2_eD):
    """(y_TD, h_NF): each token's kept slots' expert outputs summed with their routing weights."""
    if impl == "triton":
        return run_impl(impl, "routed_mlp_forward", x_TD, token_N, slot_N, row_of_slot_TK, counts_e, weight_TK,
                        activation, w1_eDF, w2_eFD, b1_eF, b2_eD)
    y_ND, h_NF = forward(impl, x_TD, token_N, counts_e, None, activation, w1_eDF, w2_eFD, b1_eF, b2_eD)
    return run_impl(impl, "gather_sum", y_ND, row_of_slot_TK, weight_TK), h_NF


def routed_backward(impl, dy_TD, x_TD, token_N, slot_N, row_of_slot_TK, counts_e, weight_TK, activation,
                    w1_eDF, w2_eFD, b1_eF, b2_eD, h_NF):
    """(dx, d weight_TK, dw1, dw2, db1 or None, db2 or None); h recomputed when not given."""
    if impl == "triton":
        return run_impl(impl, "routed_mlp_backward", dy_TD, x_TD, token_N, slot_N, row_of_slot_TK, counts_e,
                        weight_TK, activation, w1_eDF, w2_eFD, b1_eF, b2_eD, h_NF)
    # The rows' gradient is the token's, unweighted: the MLP's backward weighs it and gives the weights'.
    weight_N = weight_TK.reshape(-1).index_select(0, slot_N)
    dx, dweight_N, dw1, dw2, db1, db2 = backward(
        impl, run_impl(impl, "permute_rows", dy_TD, token_N), x_TD, token_N, row_of_slot_TK, counts_e, weight_N,
        activation, w1_eDF, w2_eFD, b1_eF, b2_eD, h_NF)
    kept_TK = row_of_slot_TK >= 0
    dweight_TK = torch.where(kept_TK, dweight_N[row_of_slot_TK.clamp_min(0)], 0).to(weight_TK.dtype)
    return dx, dweight_TK, dw1, dw2, db1, db2


def weight_gradient(dy_ND, da_NF, a_NF, bias_ND, dtype):
    """dL/dweight per row: <da, a> (+ <dy, the expert's output bias>), summed in fp32 or wider."""
    acc = torch.promote_types(dy_ND.dtype, torch.float32)
    dweight_N = torch.linalg.vecdot(da_NF.to(acc), a_NF.to(acc))     # no N x F product in memory
    if bias_ND is not None:
        dweight_N += dy_ND.to(acc) @ bias_ND.to(acc) if bias_ND.dim() == 1 else \
            torch.linalg.vecdot(dy_ND.to(acc), bias_ND.to(acc))
    return dweight_N.to(dtype)


def _segments(counts_e):
    start = 0
    for e, n in enumerate(counts_e.tolist()):
        yield e, slice(start, start + n)
        start += n


def _rows_of(x_XD, rows_N, seg):
    return x_XD[seg] if rows_N is None else x_XD.index_select(0, rows_N[seg])


def _first_gemm(x_rows, w1_eDF, b1_eF, e):
    return torch.mm(x_rows, w1_eDF[e]) if b1_eF is None else torch.addmm(b1_eF[e], x_rows, w1_eDF[e])


def forward_by_expert(x_XD, rows_N, counts_e, weight_N, activation, w1_eDF, w2_eFD, b1_eF, b2_eD):
    """(weighted y, pre-activation h), one expert's segment at a time (CPU eager)."""
    N = x_XD.shape[0] if rows_N is None else rows_N.shape[0]
    h_NF = x_XD.new_zeros(N, w1_eDF.shape[2])
    y_ND = x_XD.new_zeros(N, w2_eFD.shape[2], dtype=x_XD.dtype if weight_N is None else weighted_dtype(x_XD.dtype))
    for e, seg in _segments(counts_e):
        h = h_NF[seg]
        if b1_eF is None:
            torch.mm(_rows_of(x_XD, rows_N, seg), w1_eDF[e], out=h)
        else:       # addmm, as the grouped GEMM does: the same rounding in half precision
            torch.addmm(b1_eF[e], _rows_of(x_XD, rows_N, seg), w1_eDF[e], out=h)
        a = activation_vjp(h, activation)[0]
        y = torch.mm(a, w2_eFD[e]) if b2_eD is None else torch.addmm(b2_eD[e], a, w2_eFD[e])
        if weight_N is None:
            y_ND[seg] = y
        else:
            torch.mul(y, weight_N[seg, None], out=y_ND[seg])
    return y_ND, h_NF


def backward_by_expert(dy_ND, x_XD, rows_N, counts_e, weight_N, activation, w1_eDF, w2_eFD, b1_eF, b2_eD, h_NF,
                       defer: bool = False):
    """backward_grouped's arithmetic one expert's segment at a time; h recomputed per segment when not kept.
    In line, each segment's weight GEMMs run in its turn (the transients one segment wide) and
    `weight_grads()` returns them; with `defer`, the operands are kept and `weight_grads()` runs them."""
    dx_ND = x_XD.new_zeros(dy_ND.shape[0], x_XD.shape[1])
    dw1, dw2 = torch.empty_like(w1_eDF), torch.empty_like(w2_eFD)
    operands = []
    db1 = None if b1_eF is None else torch.empty_like(b1_eF)
    db2 = None if b2_eD is None else torch.empty_like(b2_eD)
    dweight_N = None if weight_N is None else weight_N.new_zeros(dy_ND.shape[0])
    for e, seg in _segments(counts_e):
        x_rows = _rows_of(x_XD, rows_N, seg)
        h = _first_gemm(x_rows, w1_eDF, b1_eF, e) if h_NF is None else h_NF[seg]
        a, act_vjp = activation_vjp(h, activation)
        dy = dy_ND[seg]
        da = torch.mm(dy.to(x_XD.dtype), w2_eFD[e].t())
        if weight_N is not None:
            w = weight_N[seg, None]
            dweight_N[seg] = weight_gradient(dy, da, a, None if b2_eD is None else b2_eD[e], weight_N.dtype)
            dy = (dy * w).to(x_XD.dtype)
            da.mul_(w.to(da.dtype))
        dh = act_vjp(da)
        operands.append((e, a, dy, x_rows, dh))
        if not defer:
            _segment_weight_grads(dw1, dw2, *operands.pop())
        torch.mm(dh, w1_eDF[e].t(), out=dx_ND[seg])
        if b1_eF is not None:
            torch.sum(dh, 0, out=db1[e])
            torch.sum(dy, 0, out=db2[e])

    def weight_grads():
        while operands:
            _segment_weight_grads(dw1, dw2, *operands.pop(0))
        return dw1, dw2
    return dx_ND, dweight_N, db1, db2, weight_grads


def _segment_weight_grads(dw1, dw2, e, a, dy, x_rows, dh):
    torch.mm(a.t(), dy, out=dw2[e])
    torch.mm(x_rows.t(), dh, out=dw1[e])
