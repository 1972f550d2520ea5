"""The Triton bodies of the `fmoe::` ops, under the names `fmoe.kernels.bodies` looks up.

Same signatures and results as `fmoe.kernels.torch_ops`, body for body: the kernels live in
`triton_permute` and `triton_grouped_mm`. Every sum is a gather in a fixed order, so results are
deterministic; counts never travel to the host, so nothing here synchronises with the GPU.
Arguments are checked once, at the seam (`fmoe.kernels.checks`).
"""
from fmoe.kernels.triton_grouped_mm import expert_row_sums, grouped_mm_rows, grouped_mm_weight_grad
from fmoe.kernels.triton_permute import gather_sum, permute_rows, unpermute_backward

__all__ = ["expert_row_sums", "gather_sum", "grouped_mm_rows", "grouped_mm_weight_grad", "permute_rows",
           "unpermute_backward"]
