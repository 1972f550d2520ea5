"""FP8 rows on the legs that carry rows to the experts (#49), DeepSeek-V3's split.

With `fp8=` the slot exchange, and each hop of the rank and node exchanges, send the token rows out
(the forward dispatch) and the output gradients out (the combine's backward) as e4m3 with their
scales, quantised along the row in the activation tiles of the recipe (`fmoe.kernels.fp8.quantise_activation`: 1 x 128 blockwise, one scale
a row rowwise, 1 x 32 MXFP8): the experts' FP8 GEMMs quantise those rows in the same tiles again,
which gives back the same e4m3 values, so the forward equals the experts computing on the rows
sent in full precision to fp32 rounding. The legs back (the combine, the input gradients) stay in
the rows' dtype. Bytes: a row of D elements travels as D bytes and its scales (4 bytes per 128 or
per row, 1 per 32), against 2 D in bf16. A node exchange's second hop quantises rows the first
dequantised: the same tiles give back the same e4m3 values (their block's largest maps to the same scale).
"""
from typing import List

import torch

from fmoe.distributed.exchange import AllToAll, Reorder, inverse_order, issue_all_to_all
from fmoe.kernels import fp8


def send_quantised(x_ND: torch.Tensor, send_splits: List[int], recv_splits: List[int], group, traffic, what: str,
                   kind: str, backward: bool, recipe: str) -> torch.Tensor:
    """x's rows to the other ranks as e4m3 and scales; returns the received rows dequantised, in x's dtype."""
    codec = FP8Codec(recipe)
    sent = [issue_all_to_all(part, send_splits, recv_splits, group, f"{what} (fp8 {name})", traffic, kind, backward)
            for name, part in zip(("rows", "scales"), codec.encode(x_ND))]
    for _, pending in sent:
        pending.wait()
    return codec.decode([received for received, _ in sent], x_ND)


class FP8Codec:
    """A leg's rows as the tensors that travel for them (e4m3 data as bytes, and the scales) and back: what an
    asynchronous exchange (`fmoe.distributed.exchange.Flight`) sends for an FP8 leg."""

    def __init__(self, recipe: str):
        self.recipe = fp8.check_fp8(recipe)

    def encode(self, x_ND: torch.Tensor) -> list:
        q = fp8.quantise_rows(x_ND, self.recipe, triton=fp8.fused_quantiser_applies(x_ND))
        self.block, self.scale_dtype = q.block, q.scale.dtype
        scale = q.scale.view(torch.uint8) if q.scale.element_size() == 1 else q.scale
        return [q.data.view(torch.uint8), scale]

    def decode(self, received: list, like: torch.Tensor) -> torch.Tensor:
        data, scale = received
        q = fp8.Quantised(data.view(fp8.E4M3), scale.view(self.scale_dtype), self.block)
        return fp8.dequantise(q).to(like.dtype)


class FP8Send(torch.autograd.Function):
    """Rows out (send_splits out, recv_splits in) as FP8; their gradients back in the gradients' dtype."""

    @staticmethod
    def forward(ctx, x_ND, send_splits, recv_splits, group, traffic, what: str, kind: str, recipe: str):
        ctx.splits, ctx.group, ctx.traffic, ctx.what, ctx.kind = (send_splits, recv_splits), group, traffic, what, kind
        return send_quantised(x_ND, send_splits, recv_splits, group, traffic, what, kind, False, recipe)

    @staticmethod
    def backward(ctx, grad_RD):
        send_splits, recv_splits = ctx.splits
        back = AllToAll.apply(grad_RD.contiguous(), recv_splits, send_splits, ctx.group, f"{ctx.what} (backward)",
                              ctx.traffic, ctx.kind, True)
        return back, None, None, None, None, None, None, None


class FP8GradSendBack(torch.autograd.Function):
    """Expert outputs back (send_splits out, recv_splits in) in their dtype; their gradients out to the experts
    as FP8."""

    @staticmethod
    def forward(ctx, y_RD, send_splits, recv_splits, group, traffic, what: str, kind: str, recipe: str):
        ctx.splits, ctx.group, ctx.traffic, ctx.what, ctx.kind = (send_splits, recv_splits), group, traffic, what, kind
        ctx.recipe = recipe
        out, pending = issue_all_to_all(y_RD, send_splits, recv_splits, group, what, traffic, kind, False)
        pending.wait()
        return out

    @staticmethod
    def backward(ctx, grad_ND):
        send_splits, recv_splits = ctx.splits
        back = send_quantised(grad_ND.contiguous(), recv_splits, send_splits, ctx.group, ctx.traffic,
                              f"{ctx.what} (backward)", ctx.kind, True, ctx.recipe)
        return back, None, None, None, None, None, None, None


def dispatch(x_ND: torch.Tensor, plan, recipe: str) -> torch.Tensor:
    """`fmoe.distributed.exchange.dispatch` with the rows travelling as FP8."""
    ex = plan.exchange
    received = FP8Send.apply(x_ND, ex.send_splits_W, ex.recv_splits_W, ex.group, ex.traffic,
                             f"{ex.layer}: dispatch all-to-all", "dispatch", recipe)
    return Reorder.apply(received, ex.recv_order_R)


def combine(y_RD: torch.Tensor, plan, recipe: str) -> torch.Tensor:
    """`fmoe.distributed.exchange.combine` with the output gradients travelling as FP8."""
    ex = plan.exchange
    back = Reorder.apply(y_RD, inverse_order(ex.recv_order_R))
    return FP8GradSendBack.apply(back, ex.recv_splits_W, ex.send_splits_W, ex.group, ex.traffic,
                                 f"{ex.layer}: combine all-to-all", "combine", recipe)
