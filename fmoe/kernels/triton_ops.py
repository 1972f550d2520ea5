"""The Triton bodies of the `fmoe::` ops, under the names `fmoe.kernels.bodies` looks up.

Same signatures and results as `fmoe.kernels.torch_ops`, body for body: the kernels live in
`triton_permute`, `triton_grouped_mm`, `triton_lean` (the fused lean MLP) and, on Hopper with
FMOE_TRITON_TMA=1, `triton_grouped_mm_tma`.
Every sum is a gather in a fixed order, so results are deterministic; counts never travel to the
host, so nothing here synchronises with the GPU. Arguments are checked once, at the seam
(`fmoe.kernels.checks`).
"""
from fmoe.kernels import triton_grouped_mm, triton_interpreter
from fmoe.kernels.triton_grouped_mm import expert_row_sums, grouped_mm_weight_grad
from fmoe.kernels.triton_grouped_mm_tma import grouped_mm_rows_best as grouped_mm_rows
from fmoe.kernels.triton_lean import routed_mlp_backward, routed_mlp_forward
from fmoe.kernels.triton_permute import gather_sum, permute_rows, unpermute_backward

if triton_grouped_mm.interpreting():
    triton_interpreter.check_interpreter()

__all__ = ["expert_row_sums", "gather_sum", "grouped_mm_rows", "grouped_mm_weight_grad", "permute_rows",
           "routed_mlp_backward", "routed_mlp_forward", "unpermute_backward"]
