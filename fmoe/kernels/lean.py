"""The lean expert MLP's forward and backward, written once over either backend's grouped GEMMs.

Rows are read from x through `rows_N` inside the first GEMM (forward and weight gradient), so
no permuted copy of x exists past the GEMM's own transient on the torch path and none at all on
Triton. Each row's output is scaled by its routing weight here, so the combine is a plain sum and
the weight's gradient comes from the activation's gradient and the activation:
dL/dw_r = <dy_r, act(h_r) @ w2_e + b2_e> = <dy_r @ w2_e^T, act(h_r)> + <dy_r, b2_e>,
with dy_r @ w2_e^T computed for the activation's gradient anyway: no N x D output is kept.
"""
import torch

from fmoe.kernels.bodies import run_impl
from fmoe.kernels.torch_ops import activation_vjp, expert_of_rows


def hidden(impl, x_XD, rows_N, counts_e, w1_eDF, b1_eF):
    """The pre-activation h[r] = x[rows[r]] @ w1[e] + b1[e] (zero past the experts' segments)."""
    return run_impl(impl, "grouped_mm_rows", x_XD, w1_eDF, counts_e, rows_N, b1_eF)


def forward(impl, x_XD, rows_N, counts_e, weight_N, activation, w1_eDF, w2_eFD, b1_eF, b2_eD):
    h_NF = hidden(impl, x_XD, rows_N, counts_e, w1_eDF, b1_eF)
    a_NF = activation_vjp(h_NF, activation)[0]
    y_ND = run_impl(impl, "grouped_mm_rows", a_NF, w2_eFD, counts_e, None, b2_eD)
    if weight_N is not None:
        # Half-precision rows are weighted in fp32 and returned so: the per-token sum then rounds
        # once, as the weighted combine of the other path does.
        y_ND = y_ND.to(torch.promote_types(y_ND.dtype, torch.float32)).mul_(weight_N[:, None])
    return y_ND, h_NF


def backward(impl, dy_ND, x_XD, rows_N, row_of_slot_TK, counts_e, weight_N, activation,
             w1_eDF, w2_eFD, b1_eF, b2_eD, h_NF):
    """(dx, d weight_N or None, dw1, dw2, db1 or None, db2 or None); h recomputed when not given."""
    if h_NF is None:
        h_NF = hidden(impl, x_XD, rows_N, counts_e, w1_eDF, b1_eF)
    a_NF, act_vjp = activation_vjp(h_NF, activation)
    # The gradient of the unweighted activation; rows past the segments come out zero.
    da_NF = run_impl(impl, "grouped_mm_rows", dy_ND.to(x_XD.dtype), w2_eFD.transpose(1, 2), counts_e, None, None)
    dweight_N = None
    if weight_N is not None:
        acc = dy_ND.dtype       # fp32 or wider: the weighted rows were returned so
        dweight_N = (da_NF.to(acc) * a_NF.to(acc)).sum(-1)
        if b2_eD is not None:
            bias_ND = torch.cat([b2_eD, b2_eD.new_zeros(1, b2_eD.shape[1])]).index_select(
                0, expert_of_rows(counts_e, dy_ND.shape[0]))
            dweight_N += (dy_ND.to(acc) * bias_ND.to(acc)).sum(-1)
        dweight_N = dweight_N.to(weight_N.dtype)
        dy_ND = (dy_ND * weight_N[:, None]).to(x_XD.dtype)
        da_NF.mul_(weight_N.to(da_NF.dtype)[:, None])
    dw2 = run_impl(impl, "grouped_mm_weight_grad", a_NF, dy_ND, counts_e, None)
    dh_NF = act_vjp(da_NF)
    dw1 = run_impl(impl, "grouped_mm_weight_grad", x_XD, dh_NF, counts_e, rows_N)
    db1 = db2 = None
    if b1_eF is not None:
        db1 = run_impl(impl, "expert_row_sums", dh_NF, counts_e, b1_eF.dtype)
        db2 = run_impl(impl, "expert_row_sums", dy_ND, counts_e, b2_eD.dtype)
    dx_ND = run_impl(impl, "grouped_mm_rows", dh_NF, w1_eDF.transpose(1, 2), counts_e, None, None)
    # Each token's K row gradients summed in k order: deterministic, no scatter.
    dx = dx_ND if rows_N is None else run_impl(impl, "gather_sum", dx_ND, row_of_slot_TK, None)
    return dx, dweight_N, dw1, dw2, db1, db2
