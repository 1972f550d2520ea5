"""How a layer calls its experts: lean or plain, decided once when the experts are set.

A dispatcher (`fmoe.dispatch`) hands the experts either tokens routed by a one-rank plan
(`tokens`: the weighted sum of their experts' outputs per token) or rows already in expert order
(`rows`: each row's expert output, weighted by `weight_R` when the call weighs rows).

- `LeanCall`: stacked experts (`GroupedExperts`) with a known activation and recompute other than
  "none". On tokens, one op does gather, MLP and weighted combine (`fmoe.kernels.routed_mlp`); on
  rows, the lean MLP weighs each row (`fmoe.kernels.weighted_mlp`). The backward keeps x, the
  pre-activation and the routing.
- `GatherFp8Call`: stacked experts with `fp8=`: on tokens, the gather fused into the first GEMM's FP8
  quantisation (`fmoe.kernels.fp8_gather_grouped_mm`), then the plain combine; on rows, plain.
- `PlainCall`: everything else (user modules, an overridden `expert_fn`, `fp32_combine=True`,
  recompute="none", FastMoE's trees): rows permuted into expert order, `expert_fn`, rows summed
  back with their weights.
"""
import torch
from torch.utils._pytree import tree_map

from fmoe import kernels
from fmoe.autocast import autocast_dtype
from fmoe.experts import GroupedExperts


class PlainCall:
    """The layer's `expert_fn` on rows in expert order; the weights applied in the combine."""

    weighs_rows = False

    def __init__(self, layer, own_expert_fn: bool = False):
        self.layer, self.own_expert_fn = layer, own_expert_fn

    def tokens(self, x_TD, plan, weight_TK, run=None):
        """sum over k of weight_TK[t, k] * expert(x_TD[t]) for a one-rank `plan`, the experts run by
        `run(x_ND, counts_e)` (default: `rows`; shadowing passes pulled experts)."""
        backend = self.layer.backend
        x_ND = tree_map(lambda t: kernels.permute(t, plan, backend), x_TD)
        y_ND = self.checked((run or self.rows)(x_ND, plan.counts_E))
        return tree_map(lambda t: kernels.unpermute(t, plan, weight_TK, backend), y_ND)

    def rows(self, x_RD, counts_e, weight_R=None):
        """The experts' output for rows in expert order, `counts_e` rows for each local expert: through
        the layer's own `expert_fn` where a subclass has one (FastMoE's seam), else the experts'."""
        layer = self.layer
        return layer.expert_fn(x_RD, counts_e) if self.own_expert_fn else layer.experts(x_RD, counts_e)

    def checked(self, y_ND):
        """The experts' output, refused unless it is rows of width d_model (a tree passes as it is)."""
        layer = self.layer
        if isinstance(y_ND, torch.Tensor) and (y_ND.dim() != 2 or y_ND.shape[-1] != layer.d_model):
            raise ValueError(f"{layer.label}: the experts ({type(layer.experts).__name__}) must return rows of width "
                             f"d_model={layer.d_model}, they returned shape {tuple(y_ND.shape)}")
        return y_ND


class LeanCall(PlainCall):
    """Stacked experts' lean MLP, the routing weights applied inside it."""

    weighs_rows = True

    def tokens(self, x_TD, plan, weight_TK, run=None):
        if run is not None:         # pulled (shadowed) parameters run as they are
            return super().tokens(x_TD, plan, weight_TK, run)
        y_TD = self.layer.experts(x_TD, None, lean=True, plan=plan, weight_TK=weight_TK)
        return y_TD.to(autocast_dtype(x_TD) or x_TD.dtype)

    def rows(self, x_RD, counts_e, weight_R=None):
        return self.layer.experts(x_RD, counts_e, weight_R, lean=True)


class GatherFp8Call(PlainCall):
    """Stacked FP8 experts: on tokens, the permute's gather runs inside the first GEMM's quantiser, so the
    rows reach the experts as FP8 and no permuted copy exists; the plain weighted combine after."""

    def tokens(self, x_TD, plan, weight_TK, run=None):
        if run is not None or not isinstance(x_TD, torch.Tensor):     # pulled (shadowed) parameters, trees
            return super().tokens(x_TD, plan, weight_TK, run)
        y_ND = self.checked(self.layer.experts(x_TD, plan.counts_E, rows_N=plan.token_N,
                                               row_of_slot_TK=plan.row_of_slot_TK))
        return kernels.unpermute(y_ND, plan, weight_TK, self.layer.backend)


def experts_call(layer, own_expert_fn: bool) -> PlainCall:
    """Lean where the layer's experts are stacked MLPs it may weigh inside: their own forward, no
    `expert_fn` of the layer's own (`own_expert_fn`), a known activation, recompute other than
    "none", no `fp32_combine`."""
    experts = layer.experts
    stacked = (isinstance(experts, GroupedExperts) and type(experts).forward is GroupedExperts.forward
               and not own_expert_fn)
    if stacked and experts.lean and not layer.fp32_combine:
        return LeanCall(layer)
    if stacked and experts.fp8 is not None:
        return GatherFp8Call(layer)
    return PlainCall(layer, own_expert_fn)
