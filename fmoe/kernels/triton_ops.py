"""The Triton bodies of the `fmoe::` ops, under the names `fmoe.kernels.bodies` looks up.

Same signatures and results as `fmoe.kernels.torch_ops`, body for body: the kernels live in
`triton_permute`, `triton_grouped_mm` and, on Hopper with FMOE_TRITON_TMA=1, `triton_grouped_mm_tma`.
Every sum is a gather in a fixed order, so results are deterministic; counts never travel to the
host, so nothing here synchronises with the GPU. Arguments are checked once, at the seam
(`fmoe.kernels.checks`).
"""
from fmoe.kernels import triton_grouped_mm, triton_grouped_mm_tma, triton_interpreter
from fmoe.kernels.triton_grouped_mm import expert_row_sums, grouped_mm_weight_grad
from fmoe.kernels.triton_permute import gather_sum, permute_rows, unpermute_backward

if triton_grouped_mm.interpreting():
    triton_interpreter.check_interpreter()

__all__ = ["expert_row_sums", "gather_sum", "grouped_mm_rows", "grouped_mm_weight_grad", "permute_rows",
           "unpermute_backward"]


def grouped_mm_rows(x_XI, w_eIO, counts_e, rows_N=None, bias_eO=None):
    """y[r] = x[rows_N[r]] @ w[e] (+ bias_eO[e]): the TMA kernel under FMOE_TRITON_TMA=1 where it
    applies (sm_90 and later, operands the copy engine takes), the plain kernel otherwise."""
    if triton_grouped_mm_tma.tma_enabled():
        triton_grouped_mm._check_kernel_device(x_XI)
        if triton_grouped_mm_tma.tma_applies(x_XI, w_eIO, rows_N, bias_eO):
            return triton_grouped_mm_tma.grouped_mm_rows_tma(x_XI, w_eIO, counts_e, rows_N, bias_eO)
    return triton_grouped_mm.grouped_mm_rows(x_XI, w_eIO, counts_e, rows_N, bias_eO)
