"""Expert-parallel exchange: counts first, then rows, with autograd all-to-all and uneven splits.

Rows leave a rank sorted by global expert, so by destination rank. They arrive sorted by source
rank, then by local expert; `recv_order_R` regroups them expert-major for the grouped GEMM and
its inverse puts them back before the return trip. Every all-to-all is waited on with the
collective timeout and names its layer when it gives up, and adds the bytes it sends to other
ranks to its layer's `Traffic` (what moved, forward or backward, within or across nodes).
"""
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from fmoe.distributed import link
from fmoe.distributed.timeout import current_layer


KINDS = ("dispatch", "combine", "routing")     # token rows out, expert outputs back, routing metadata
PASSES = ("forward", "backward")
LOCALITIES = ("intra_node", "inter_node")


def ranks_per_node_of(world_size: int, ranks_per_node=None, whole_nodes: bool = True) -> int:
    """Ranks on one node: the argument, else LOCAL_WORLD_SIZE (torchrun sets it), else all of them.
    `whole_nodes`: it must divide the world (the node exchange and node-limited routing lay work on
    whole nodes); without it, it only tells traffic within a node from traffic across."""
    name = "ranks_per_node"
    if ranks_per_node is None:
        env = os.environ.get("LOCAL_WORLD_SIZE")
        if env is None:
            return world_size
        name, ranks_per_node = "LOCAL_WORLD_SIZE", int(env) if env.strip().isdigit() else env
    if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1 \
            or whole_nodes and world_size % min(ranks_per_node, world_size):
        raise ValueError(f"{name} must be a positive int dividing the expert-parallel world size {world_size}, "
                         f"got {ranks_per_node!r}")
    return min(ranks_per_node, world_size)


@dataclass
class Traffic:
    """Bytes this rank sent to other ranks (rows to itself are not traffic), counted as the
    all-to-alls run: `bytes[kind][pass][locality]` with kind in KINDS, pass in PASSES and locality
    in LOCALITIES (rank r is on node r // ranks_per_node, ranks of the exchange's group)."""
    rank: int
    ranks_per_node: int
    bytes: Dict[str, Dict[str, Dict[str, int]]] = field(default_factory=dict)

    def __post_init__(self):
        self.reset()

    def fresh(self) -> "Traffic":
        """A new, empty count for the same rank (an interleaved micro-batch's own)."""
        return Traffic(self.rank, self.ranks_per_node)

    def reset(self):
        self.bytes = {k: {p: {loc: 0 for loc in LOCALITIES} for p in PASSES} for k in KINDS}

    def add(self, kind: str, backward: bool, splits_W: List[int], row_bytes: int):
        counts = self.bytes[kind]["backward" if backward else "forward"]
        node = self.rank // self.ranks_per_node
        for w, rows in enumerate(splits_W):
            if w != self.rank and rows:
                counts["intra_node" if w // self.ranks_per_node == node else "inter_node"] += rows * row_bytes

    def total(self, kind: Optional[str] = None, locality: Optional[str] = None) -> int:
        return sum(n for k, by_pass in self.bytes.items() if kind in (None, k)
                   for by_loc in by_pass.values() for loc, n in by_loc.items() if locality in (None, loc))


def row_bytes(x: torch.Tensor) -> int:
    """Bytes of one row of x (its first dimension counts rows)."""
    return x.shape[1:].numel() * x.element_size()


@dataclass
class ExchangePlan:
    send_splits_W: List[int]        # rows this rank sends to each rank
    recv_splits_W: List[int]        # rows this rank receives from each rank
    local_counts_e: torch.Tensor    # rows each local expert receives, from all ranks
    recv_counts_We: torch.Tensor    # rows from source rank w for local expert j
    recv_order_R: torch.Tensor      # expert-major position -> position in the received buffer
    group: Optional[dist.ProcessGroup]
    layer: str = "an fmoe layer"    # who the exchange belongs to, for timeout messages
    traffic: Optional[Traffic] = None   # where the bytes sent are counted (None: not counted)


def exchange_counts(counts_E: torch.Tensor, world_size: int, group=None, traffic: Optional[Traffic] = None):
    """Everyone tells everyone how many rows it sends to each expert: returns recv_counts_We."""
    send = counts_E.reshape(world_size, -1).contiguous()
    recv = torch.empty_like(send)
    ones = [1] * world_size
    link.complete(dist.all_to_all_single(recv, send, group=group, async_op=True), f"{current_layer()}: counts all-to-all",
                  link.all_to_all_bytes(ones, ones, row_bytes(send), dist.get_rank(group)))
    if traffic is not None:
        traffic.add("routing", False, ones, row_bytes(send))
    return recv


def expert_major_order(recv_counts_We: torch.Tensor) -> torch.Tensor:
    """Index that regroups rows received source-major (w, j) into expert-major (j, w) order."""
    W, e = recv_counts_We.shape
    counts = recv_counts_We.reshape(-1)
    starts_We = (torch.cumsum(counts, 0) - counts).view(W, e)
    starts_eW, counts_eW = starts_We.t().reshape(-1), recv_counts_We.t().reshape(-1)
    total = int(counts.sum())
    seg_start = torch.repeat_interleave(starts_eW, counts_eW, output_size=total)
    seg_first_row = torch.repeat_interleave(torch.cumsum(counts_eW, 0) - counts_eW, counts_eW, output_size=total)
    return seg_start + torch.arange(total, device=counts.device) - seg_first_row


def build_exchange_plan(counts_E: torch.Tensor, world_size: int, group=None,
                        traffic: Optional[Traffic] = None) -> ExchangePlan:
    recv_counts_We = exchange_counts(counts_E, world_size, group, traffic)
    return ExchangePlan(
        send_splits_W=counts_E.reshape(world_size, -1).sum(1).tolist(),
        recv_splits_W=recv_counts_We.sum(1).tolist(),
        local_counts_e=recv_counts_We.sum(0),
        recv_counts_We=recv_counts_We,
        recv_order_R=expert_major_order(recv_counts_We),
        group=group,
        layer=current_layer(),
        traffic=traffic,
    )


def functional_group(group):
    """The group as torch's functional (traceable) collectives take it: None is the world."""
    return dist.group.WORLD if group is None else group


def issue_all_to_all(x, send_splits, recv_splits, group, what: str, traffic: Optional[Traffic], kind: str,
                     backward: bool):
    """(out, its Pending): out being filled by the all-to-all of x's rows (send_splits out, recv_splits
    in), the bytes sent counted in `traffic` as `kind`, forward or backward."""
    out = x.new_empty((sum(recv_splits),) + tuple(x.shape[1:]))
    work = dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group, async_op=True)
    if traffic is not None:
        traffic.add(kind, backward, send_splits, row_bytes(x))
    nbytes = link.all_to_all_bytes(send_splits, recv_splits, row_bytes(x), dist.get_rank(group))
    return out, link.start(work, what, nbytes)


class AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; the backward is the reverse exchange. Both count the
    bytes they send in `traffic` (when given) as `kind`, forward or backward."""

    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group, what, traffic=None, kind="dispatch", backward=False):
        ctx.splits, ctx.group, ctx.what = (send_splits, recv_splits), group, what
        ctx.traffic, ctx.kind = traffic, kind
        out, pending = issue_all_to_all(x, send_splits, recv_splits, group, what, traffic, kind, backward)
        pending.wait()
        return out

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        back = AllToAll.apply(grad.contiguous(), recv_splits, send_splits, ctx.group, f"{ctx.what} (backward)",
                              ctx.traffic, ctx.kind, True)
        return back, None, None, None, None, None, None, None


class Flight:
    """An all-to-all on its way (`started`), and in the backward its gradient's on the way back
    (`returning`): what `_Issue` and `_Arrive`, the two autograd nodes of `start_all_to_all`, share.

    A `codec` (with its `leg`, "forward" or "backward") sends that leg's rows encoded: `codec.encode(x)`
    gives the tensors that travel (FP8 data and scales, `fmoe.distributed.fp8_exchange.FP8Codec`) and
    `codec.decode(received, like)` the rows back, once they are there."""

    def __init__(self, send_splits, recv_splits, group, what: str, traffic: Optional[Traffic], kind: str,
                 codec=None, leg: str = "forward"):
        self.send_splits, self.recv_splits, self.group, self.what = send_splits, recv_splits, group, what
        self.traffic, self.kind = traffic, kind
        self.codec, self.leg = codec, leg
        self.started: Optional[link.Pending] = None
        self.returning: Optional[link.Pending] = None
        self.grad_x: Optional[torch.Tensor] = None      # being filled by the gradient's exchange back
        self.encoded: Optional[list] = None             # an encoded leg's receive buffers, decoded at its wait

    def issue(self, x, send_splits, recv_splits, what: str, backward: bool):
        if self.codec is None or backward != (self.leg == "backward"):
            return issue_all_to_all(x, send_splits, recv_splits, self.group, what, self.traffic, self.kind, backward)
        buffers, pendings = [], []
        for part in self.codec.encode(x):
            received, pending = issue_all_to_all(part, send_splits, recv_splits, self.group, what, self.traffic,
                                                 self.kind, backward)
            buffers.append(received)
            pendings.append(pending)
        self.encoded = buffers
        return x.new_empty((sum(recv_splits),) + tuple(x.shape[1:])), AllPending(pendings)

    def received(self, out: torch.Tensor) -> torch.Tensor:
        """`out` once its exchange is waited for: an encoded leg's rows decoded into it."""
        if self.encoded is not None:
            out.copy_(self.codec.decode(self.encoded, out))
            self.encoded = None
        return out


class AllPending:
    """Several collectives waited for as one (an encoded leg's parts)."""

    def __init__(self, pendings):
        self.pendings = pendings

    def wait(self):
        for pending in self.pendings:
            pending.wait()


class _Issue(torch.autograd.Function):
    """Starts the all-to-all and returns its receive buffer, not yet filled: only `_Arrive` may read it.
    Its backward waits for the gradient's exchange that `_Arrive`'s backward started, and returns what
    it brought (the gradient autograd hands it is the received rows', which `_Arrive` sent back)."""

    @staticmethod
    def forward(ctx, x, flight: Flight):
        ctx.flight = flight
        out, flight.started = flight.issue(x, flight.send_splits, flight.recv_splits, flight.what, False)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        flight, ctx.flight = ctx.flight, None
        if flight.kind != "combine":
            # The rows' (or their routing weights') gradients come back from the experts: what was left
            # for this wait (the shared experts' weight gradients) computes while they travel.
            from fmoe.kernels.deferred import run_late      # here: fmoe.kernels imports link
            run_late()
        flight.returning.wait()
        grad_x, flight.returning, flight.grad_x = flight.received(flight.grad_x), None, None
        return grad_x, None


class _Arrive(torch.autograd.Function):
    """Waits for the all-to-all; its backward starts the gradient's exchange back and hands on its
    buffer, which `_Issue`'s backward waits for: autograd runs what is ready meanwhile."""

    @staticmethod
    def forward(ctx, out, flight: Flight):
        ctx.flight = flight
        flight.started.wait()
        flight.started = None
        return flight.received(out).view_as(out)

    @staticmethod
    def backward(ctx, grad):
        flight, ctx.flight = ctx.flight, None
        flight.grad_x, flight.returning = flight.issue(grad, flight.recv_splits, flight.send_splits,
                                                       f"{flight.what} (backward)", True)
        return grad, None


class InFlight:
    """Rows on their way: `wait()` returns them once they are there (through `_Arrive` when a `flight`
    carries them, after `pending` when one delays them), regrouped by `order` when given."""

    def __init__(self, rows, flight: Optional[Flight] = None, order: Optional[torch.Tensor] = None,
                 pending: Optional[link.Pending] = None):
        self.rows, self.flight, self.order, self.pending = rows, flight, order, pending

    def wait(self) -> torch.Tensor:
        if self.pending is not None:
            self.pending.wait()
        rows = self.rows if self.flight is None else _Arrive.apply(self.rows, self.flight)
        return rows if self.order is None else Reorder.apply(rows, self.order)


def start_all_to_all(x, send_splits, recv_splits, group, what: str, traffic: Optional[Traffic] = None,
                     kind: str = "dispatch", codec=None, leg: str = "forward") -> InFlight:
    """`AllToAll.apply`, started: work done before the handle's `wait()` runs while the rows travel, and
    in the backward the rows' gradients travel back while what autograd has ready runs (traced: in line).
    `codec` / `leg`: that leg's rows travel encoded (see `Flight`); eager only."""
    if torch.compiler.is_compiling():
        if codec is not None:
            raise RuntimeError(f"{what}: an encoded (FP8) exchange runs eagerly, not traced")
        return InFlight(AllToAll.apply(x, send_splits, recv_splits, group, what, traffic, kind))
    flight = Flight(send_splits, recv_splits, group, what, traffic, kind, codec, leg)
    return InFlight(_Issue.apply(x, flight), flight)


def inverse_order(order: torch.Tensor) -> torch.Tensor:
    """The inverse of the permutation `order`: inverse[order[i]] = i."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return inverse


class Reorder(torch.autograd.Function):
    """out = x[order] for a permutation `order`; the backward gathers by the inverse (no scatter-add)."""

    @staticmethod
    def forward(ctx, x, order):
        ctx.save_for_backward(inverse_order(order))
        return x.index_select(0, order)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return Reorder.apply(grad.contiguous(), inverse), None


def dispatch(x_ND: torch.Tensor, plan, kind: str = "dispatch") -> torch.Tensor:
    """Send rows to their experts' ranks; return the rows this rank's experts take, expert-major.

    `plan` is a RoutingPlan; identity when it has no exchange (one rank). `kind`: what the rows
    are counted as (the routing weights travel as "routing").
    """
    plan = plan.exchange
    if plan is None:
        return x_ND
    x_RD = AllToAll.apply(x_ND, plan.send_splits_W, plan.recv_splits_W, plan.group, f"{plan.layer}: dispatch all-to-all",
                          plan.traffic, kind)
    return Reorder.apply(x_RD, plan.recv_order_R)


def start_dispatch(x_ND: torch.Tensor, plan, kind: str = "dispatch", codec=None) -> InFlight:
    """`dispatch`, started: work done before the handle's `wait()` runs while the rows travel, and in the
    backward the rows' gradients travel back while what autograd has ready runs. `codec`: the rows travel
    encoded (FP8), their gradients back in their dtype."""
    exchange_plan = plan.exchange
    if exchange_plan is None:
        return InFlight(x_ND)
    sent = start_all_to_all(x_ND, exchange_plan.send_splits_W, exchange_plan.recv_splits_W, exchange_plan.group,
                            f"{exchange_plan.layer}: dispatch all-to-all", exchange_plan.traffic, kind, codec)
    sent.order = exchange_plan.recv_order_R
    return sent


def start_combine(y_RD: torch.Tensor, plan) -> InFlight:
    """`combine`, started: work done before the handle's `wait()` runs while the outputs travel back, and
    in the backward their gradients travel out while what autograd has ready runs (what ran between the
    start and the wait: its backward goes between the gradients' start and their wait)."""
    exchange_plan = plan.exchange
    if exchange_plan is None:
        return InFlight(y_RD)
    y_RD = Reorder.apply(y_RD, inverse_order(exchange_plan.recv_order_R))
    return start_all_to_all(y_RD, exchange_plan.recv_splits_W, exchange_plan.send_splits_W, exchange_plan.group,
                            f"{exchange_plan.layer}: combine all-to-all", exchange_plan.traffic, "combine")


def combine(y_RD: torch.Tensor, plan) -> torch.Tensor:
    """Send expert outputs back to the ranks their rows came from, in the order they left."""
    plan = plan.exchange
    if plan is None:
        return y_RD
    y_RD = Reorder.apply(y_RD, inverse_order(plan.recv_order_R))
    return AllToAll.apply(y_RD, plan.recv_splits_W, plan.send_splits_W, plan.group, f"{plan.layer}: combine all-to-all",
                          plan.traffic, "combine")
