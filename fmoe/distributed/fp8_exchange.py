"""FP8 rows on the legs that carry rows to the experts (#49), DeepSeek-V3's split.

With `fp8=` the slot exchange sends the token rows out (the forward dispatch) and the output
gradients out (the combine's backward) as e4m3 with their scales, quantised along the row in the
activation tiles of the recipe (`fmoe.kernels.fp8.quantise_activation`: 1 x 128 blockwise, one scale
a row rowwise, 1 x 32 MXFP8): the experts' FP8 GEMMs quantise those rows in the same tiles again,
which gives back the same e4m3 values, so the forward equals the experts computing on the rows
sent in full precision to fp32 rounding. The legs back (the combine, the input gradients) stay in
the rows' dtype. Bytes: a row of D elements travels as D bytes and its scales (4 bytes per 128 or
per row, 1 per 32), against 2 D in bf16.
"""
from typing import List

import torch

from fmoe.distributed.exchange import AllToAll, ExchangePlan, Reorder, inverse_order, issue_all_to_all
from fmoe.kernels import fp8


def send_quantised(x_ND: torch.Tensor, send_splits: List[int], recv_splits: List[int], plan: ExchangePlan,
                   what: str, kind: str, backward: bool, recipe: str) -> torch.Tensor:
    """x's rows to the other ranks as e4m3 and scales; returns the received rows dequantised, in x's dtype."""
    q = fp8.quantise_activation(x_ND, recipe)
    scale = q.scale
    data, data_pending = issue_all_to_all(q.data.view(torch.uint8), send_splits, recv_splits, plan.group,
                                          f"{what} (fp8 rows)", plan.traffic, kind, backward)
    scales, scale_pending = issue_all_to_all(scale.view(torch.uint8) if scale.element_size() == 1 else scale,
                                             send_splits, recv_splits, plan.group, f"{what} (fp8 scales)",
                                             plan.traffic, kind, backward)
    data_pending.wait()
    scale_pending.wait()
    received = fp8.Quantised(data.view(fp8.E4M3), scales.view(scale.dtype), q.block)
    return fp8.dequantise(received).to(x_ND.dtype)


class FP8Dispatch(torch.autograd.Function):
    """Rows out as FP8; their gradients back in the gradients' dtype."""

    @staticmethod
    def forward(ctx, x_ND, plan: ExchangePlan, recipe: str):
        ctx.plan = plan
        return send_quantised(x_ND, plan.send_splits_W, plan.recv_splits_W, plan, f"{plan.layer}: dispatch all-to-all",
                              "dispatch", False, recipe)

    @staticmethod
    def backward(ctx, grad_RD):
        plan = ctx.plan
        back = AllToAll.apply(grad_RD.contiguous(), plan.recv_splits_W, plan.send_splits_W, plan.group,
                              f"{plan.layer}: dispatch all-to-all (backward)", plan.traffic, "dispatch", True)
        return back, None, None


class FP8GradCombine(torch.autograd.Function):
    """Expert outputs back in their dtype; their gradients out to the experts as FP8."""

    @staticmethod
    def forward(ctx, y_RD, plan: ExchangePlan, recipe: str):
        ctx.plan, ctx.recipe = plan, recipe
        out, pending = issue_all_to_all(y_RD, plan.recv_splits_W, plan.send_splits_W, plan.group,
                                        f"{plan.layer}: combine all-to-all", plan.traffic, "combine", False)
        pending.wait()
        return out

    @staticmethod
    def backward(ctx, grad_ND):
        plan = ctx.plan
        return send_quantised(grad_ND.contiguous(), plan.send_splits_W, plan.recv_splits_W, plan,
                              f"{plan.layer}: combine all-to-all (backward)", "combine", True, ctx.recipe), None, None


def dispatch(x_ND: torch.Tensor, plan, recipe: str) -> torch.Tensor:
    """`fmoe.distributed.exchange.dispatch` with the rows travelling as FP8."""
    exchange = plan.exchange
    return Reorder.apply(FP8Dispatch.apply(x_ND, exchange, recipe), exchange.recv_order_R)


def combine(y_RD: torch.Tensor, plan, recipe: str) -> torch.Tensor:
    """`fmoe.distributed.exchange.combine` with the output gradients travelling as FP8."""
    exchange = plan.exchange
    return FP8GradCombine.apply(Reorder.apply(y_RD, inverse_order(exchange.recv_order_R)), exchange, recipe)
