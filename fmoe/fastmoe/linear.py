"""FastMoE path `fmoe.linear`: per-expert linear layers on rows sorted by expert."""
import torch

from fmoe import kernels
from fmoe.experts import FMoELinear


class MOELinear:
    """FastMoE's autograd function, as `MOELinear.apply(x, fwd_expert_count, weight[e, out, in], bias)`:
    fmoe's grouped GEMM, which is differentiable itself."""

    @staticmethod
    def apply(inp, fwd_expert_count, weight, bias=None):
        counts = torch.as_tensor(fwd_expert_count, device=inp.device)
        return kernels.grouped_mm(inp, weight.transpose(1, 2), counts, bias)


__all__ = ["FMoELinear", "MOELinear"]
