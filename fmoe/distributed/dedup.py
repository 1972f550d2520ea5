"""The deduplicated exchange: a token travels once per destination rank, or, across nodes, once
per destination node and then once per rank inside it; its experts' weighted outputs are summed
where the experts are, and one row travels back.

A *hop* is one such all-to-all, planned with the RoutingPlan (`fmoe.routing.Hop`,
`build_dedup_plan`) and run here. Its sent rows are (token, destination) pairs: a RoutingPlan over
the tokens whose "experts" are the destination ranks (`pairs`), so `kernels.permute` lays the rows
out by destination and `kernels.sum_rows` adds the rows that come back, each the adjoint of the
other. With every row go the token's K expert ids (-1 for the slots going elsewhere) and its K
routing weights (0 there). The receiving rank treats its received rows as tokens routed by those
ids: the rank exchange's last hop runs its local experts on them (a one-rank RoutingPlan over
its experts, `local`); the node exchange's first hop reaches one rank of each destination node
(the one with the sender's local index), which runs the rank hop inside its node (`inner`).

Everything above is agreed at plan time (the splits and ids cross in two small all-to-alls);
only the rows and the weights travel in the forward, and their gradients in the backward, so
the routing weights' gradients reach the gate.

*Bounded* hops (a layer's `sync_free=True`) read nothing on the host: every rank sends each rank
exactly `bound` rows (`max_tokens_per_rank`; padding where fewer, ids -1), through the
functional collectives, which torch.compile traces. A (token, destination) pair past the bound
is not sent: its slots add nothing, and the number of such pairs, summed over the ranks, is the
hop's `overflow` (a device tensor, equal on every rank) that the layer reports.
"""
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
from torch.utils._pytree import tree_map

from fmoe import kernels
from fmoe.distributed import link
from fmoe.distributed.exchange import AllToAll, InFlight, functional_group, row_bytes, start_all_to_all
from fmoe.distributed.fp8_exchange import FP8Codec, FP8GradSendBack, FP8Send
from fmoe.routing import Hop, RoutingPlan


def start_send(hop: Hop, x, what: str, kind: str, fp8: Optional[str] = None) -> InFlight:
    """x's rows out along the hop (its rows back, in the backward), started: `wait()` has them. `fp8`: the
    rows travel as FP8 in this recipe (not on a bounded hop)."""
    if hop.bound is None:
        codec = None if fp8 is None else FP8Codec(fp8)
        return start_all_to_all(x, hop.send_splits_W, hop.recv_splits_W, hop.group, what, hop.traffic, kind, codec)
    if hop.traffic is not None:        # fixed sizes: the backward's are known now
        hop.traffic.add(kind, False, hop.send_splits_W, row_bytes(x))
        if x.requires_grad:
            hop.traffic.add(kind, True, hop.recv_splits_W, row_bytes(x))
    # A functional collective waits when its result is first read. Eager, a Pending stands before that
    # read: a simulated link delays it, and interleaved micro-batches hand the turn on there (the
    # forward's only: the backward's exchange is autograd's own).
    out = fc.all_to_all_single_autograd(x.contiguous(), None, None, functional_group(hop.group))
    return InFlight(out, pending=None if torch.compiler.is_compiling() else link.start(None, what, link.all_to_all_bytes(
        hop.send_splits_W, hop.recv_splits_W, row_bytes(x), dist.get_rank(hop.group))))


def send(hop: Hop, x, what: str, kind: str, fp8: Optional[str] = None):
    """x's rows out along the hop (its rows back, in the backward); with an `fp8` recipe the rows go out as
    e4m3 and scales (`fmoe.distributed.fp8_exchange`), their gradients come back in their dtype."""
    if hop.bound is None:
        if fp8 is not None:
            return FP8Send.apply(x, hop.send_splits_W, hop.recv_splits_W, hop.group, hop.traffic, what, kind, fp8)
        return AllToAll.apply(x, hop.send_splits_W, hop.recv_splits_W, hop.group, what, hop.traffic, kind)
    return start_send(hop, x, what, kind).wait()


def start_send_back(hop: Hop, y, what: str) -> InFlight:
    """`send_back`, started (an unbounded hop, rows in their dtype): `wait()` has them."""
    return start_all_to_all(y, hop.recv_splits_W, hop.send_splits_W, hop.group, what, hop.traffic, "combine")


def send_back(hop: Hop, y, what: str, fp8: Optional[str] = None):
    """The rows that came along the hop back to where they came from (with `fp8`, their gradients go out as FP8)."""
    if hop.bound is not None:
        return send(hop, y, what, "combine")
    if fp8 is not None:
        return FP8GradSendBack.apply(y, hop.recv_splits_W, hop.send_splits_W, hop.group, hop.traffic, what, "combine",
                                     fp8)
    return AllToAll.apply(y, hop.recv_splits_W, hop.send_splits_W, hop.group, what, hop.traffic, "combine")


def run_hop(hop: Hop, x_TD, weight_TK: torch.Tensor, experts: Callable, backend: Optional[str] = None,
            schedule: Optional[tuple] = None, meanwhile: Optional[Callable[[], None]] = None,
            fp8: Optional[str] = None, chunks: int = 1):
    """sum over destinations of the weighted expert outputs for the tokens x_TD (a tensor or a tree
    of them sharing the rows): the rows travel out, `experts(x_QD, local_plan, weight_QK)` runs on
    the last hop's received rows, its output travels back. `schedule`: (group size, the experts'
    parameters) to pipeline a one-hop exchange as FasterMoE's smart schedule does. `meanwhile()` runs
    while the first hop's outputs travel back (FP8, bounded or traced: while its rows travel out). `fp8`: the rows out
    and their output gradients out travel as FP8 in this recipe, on every hop. `chunks` > 1: the last
    hop goes in that many chunks pipelined with the experts (`fmoe.distributed.pipeline.pipelined_hop`;
    the caller passes it only for one tensor of rows, not bounded, eager)."""
    if schedule is not None:
        return scheduled_hop(hop, x_TD, weight_TK, experts, backend, *schedule)
    what = f"{hop.layer}: deduplicated"
    empty = hop.bound is not None and hop.pairs.num_tokens == 0
    if empty:           # a bounded hop's padding, from no token at all
        # zeros, still in the graph: x's gradient is an empty tensor, as on every other path
        x_ND = tree_map(lambda t: t.new_zeros(hop.num_sent, t.shape[1]) + t.sum() * 0, x_TD)
        w_NK = weight_TK.new_zeros(hop.num_sent, weight_TK.shape[1]) + weight_TK.sum() * 0
    else:
        x_ND = tree_map(lambda t: kernels.permute(t, hop.pairs, backend), x_TD)
        w_NK = weight_TK.index_select(0, hop.pairs.token_N).masked_fill(~hop.slot_mask_NK, 0)
    if chunks > 1 and hop.inner is None:    # the caller chunks only where it can (DedupExchange.hop_chunks)
        from fmoe.distributed.pipeline import pipelined_hop     # here: pipeline imports the exchanges this module does
        return kernels.sum_rows(pipelined_hop(hop, x_ND, w_NK, experts, chunks, meanwhile, fp8), hop.pairs, backend)
    # The work alongside runs while the outputs travel back (so its backward while their gradients travel
    # out: autograd takes what was made last first), where they go back as one started all-to-all.
    while_back = (meanwhile is not None and fp8 is None and hop.bound is None and isinstance(x_ND, torch.Tensor)
                  and not torch.compiler.is_compiling())
    if fp8 is not None and isinstance(x_ND, torch.Tensor) and hop.bound is None:
        if meanwhile is None or torch.compiler.is_compiling():
            if meanwhile is not None:
                meanwhile()
            x_QD = send(hop, x_ND, f"{what} dispatch", "dispatch", fp8)
            w_QK = send(hop, w_NK, f"{what} weights", "routing")
        else:       # the FP8 rows travel while the work alongside runs
            rows = start_send(hop, x_ND, f"{what} dispatch", "dispatch", fp8)
            weights = start_send(hop, w_NK, f"{what} weights", "routing")
            meanwhile()
            x_QD, w_QK = rows.wait(), weights.wait()
    elif meanwhile is None:
        x_QD = tree_map(lambda t: send(hop, t, f"{what} dispatch", "dispatch"), x_ND)
        w_QK = send(hop, w_NK, f"{what} weights", "routing")
    else:
        rows = tree_map(lambda t: start_send(hop, t, f"{what} dispatch", "dispatch"), x_ND)
        weights = start_send(hop, w_NK, f"{what} weights", "routing")
        if not while_back:
            meanwhile()
        x_QD, w_QK = tree_map(lambda sent: sent.wait(), rows), weights.wait()
    if hop.inner is not None:
        y_QD = run_hop(hop.inner, x_QD, w_QK, experts, backend, fp8=fp8, chunks=chunks)
    else:
        y_QD = experts(x_QD, hop.local, w_QK)
    if while_back:
        back = start_send_back(hop, y_QD, f"{what} combine")
        meanwhile()
        y_ND = back.wait()
    else:
        y_ND = tree_map(lambda t: send_back(hop, t, f"{what} combine", fp8 if hop.bound is None else None), y_QD)
    if empty:           # no token: the rows only travel back (so their gradients' exchange runs too)
        return tree_map(lambda t: t[:0] * 0, y_ND)
    return tree_map(lambda t: kernels.sum_rows(t, hop.pairs, backend), y_ND)



def scheduled_hop(hop: Hop, x_TD: torch.Tensor, weight_TK: torch.Tensor, experts: Callable, backend, group_size: int,
                  params) -> torch.Tensor:
    """run_hop through the smart schedule (`fmoe.distributed.schedule`): the weights ride as K more
    columns of the rows (in the rows' dtype), each received chunk is fanned out to the experts by
    its own ids."""
    from fmoe.distributed.schedule import scheduled_experts
    if hop.inner is not None or hop.bound is not None:
        raise ValueError("the smart schedule pipelines the rank exchange only (not 'node', not sync_free)")
    D = x_TD.shape[1]
    x_ND = kernels.permute(x_TD, hop.pairs, backend)
    w_NK = weight_TK.index_select(0, hop.pairs.token_N).masked_fill(~hop.slot_mask_NK, 0)
    x_aug = torch.cat([x_ND, w_NK.to(x_ND.dtype)], 1)
    num_local = int(hop.local.counts_E.numel())

    def chunk(x_chunk, rows):
        local = RoutingPlan.build(hop.local_idx_QK.index_select(0, rows.to(hop.local_idx_QK.device)), num_local,
                                  compact=True)
        return experts(x_chunk[:, :D], local, x_chunk[:, D:].to(weight_TK.dtype))

    y_ND = scheduled_experts(chunk, x_aug, hop, group_size, params)
    return kernels.sum_rows(y_ND, hop.pairs, backend)
