"""The bodies behind the `fmoe::` ops: which function computes an op for each `impl`.

"torch" and "torch_sync_free" run `fmoe.kernels.torch_ops` (the latter keeps counts on the
device), "triton" runs the kernels that `fmoe.kernels.triton_ops` names. The op registrations
(`fmoe.kernels.ops`) and the lean MLP (`fmoe.kernels.lean`) look their bodies up here; the bodies
import nothing of the seam, so the imports only go one way: ops -> bodies -> torch_ops / triton_ops.
"""
from fmoe.kernels import torch_ops

IMPLS = ("torch", "torch_sync_free", "triton")

# The torch bodies that choose between the host-count loop and the device-count path.
_TAKES_SYNC_FREE = ("grouped_mm_rows", "grouped_mm_weight_grad", "expert_row_sums", "gather_sum")


def run_impl(impl: str, name: str, *args):
    """Call body `name` of `impl`."""
    if impl == "triton":
        from fmoe.kernels import triton_ops     # Triton may be absent: imported on first use
        return getattr(triton_ops, name)(*args)
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if name in _TAKES_SYNC_FREE:
        return getattr(torch_ops, name)(*args, sync_free=impl == "torch_sync_free")
    return getattr(torch_ops, name)(*args)
