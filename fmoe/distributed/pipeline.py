"""The exchanges split into chunks and pipelined with the expert GEMMs (overlap="pipeline").

Chunk c carries, from every rank to every rank, the rows for the experts [j0_c, j1_c) of each
rank's local experts. All chunks' dispatches start at once (they queue on the link), the layer's
work alongside (the shared experts) runs, then each chunk's experts run as soon as its rows are
there and its outputs start back while the next chunk computes. In the backward autograd sends
every chunk's output gradients at once and computes each chunk's input gradients as they arrive,
sending them back while the next one computes.

Every expert is in one chunk and sees the same rows in the same order as without chunks (source
rank, then position), so its GEMMs are the same calls: the outputs and gradients equal the
unchunked exchange bit for bit on the torch path (a Triton autotuner may pick another tile for
the chunk's rows: equal to rounding there). Splitting needs the counts on the host, as the slot
exchange's splits already do.

The rank and node exchanges (`pipelined_hop`) split their last hop, the one that reaches the experts'
ranks, into chunks of each destination's rows instead: chunk c carries the c-th share of the (token,
rank) rows to every rank, and each rank runs its experts on every chunk's rows as they arrive. An
expert then sees its rows in several GEMMs, so the outputs and gradients equal the unchunked
exchange to rounding (the weight gradients are sums over the rows, taken chunk by chunk).

The chunk count must be the same on every rank (each chunk is an all-to-all of the group): where
the performance model picks it from this rank's rows, the ranks agree on the largest pick.
"""
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

import torch.distributed as dist

from fmoe.distributed import link
from fmoe.distributed.exchange import ExchangePlan, Reorder, expert_major_order, inverse_order, start_all_to_all
from fmoe.distributed.timeout import current_layer
from fmoe.distributed.fp8_exchange import FP8Codec
from fmoe.env import env_int
from fmoe.perf.perfmodel import PerfModel, pipeline_chunks

NCCL_LATENCY_S = 20e-6      # an all-to-all's fixed cost where no simulated link says otherwise


@dataclass
class Chunk:
    """One chunk's share of the exchange."""
    send_splits: List[int]          # rows to each rank
    recv_splits: List[int]          # rows from each rank
    order_R: torch.Tensor           # expert-major position -> position among its received rows
    counts_e: torch.Tensor          # rows each local expert computes in this chunk (0 outside it)


@dataclass
class ChunkedPlan:
    chunks: List[Chunk]
    send_order_N: torch.Tensor      # the sent rows (expert order) regrouped chunk-major: chunk, rank, expert
    return_order_N: torch.Tensor    # its inverse: the returned rows back in expert order


def expert_bounds(num_local: int, chunks: int) -> List[int]:
    """Chunk c holds the local experts [bounds[c], bounds[c + 1]): as even as can be."""
    return [round(c * num_local / chunks) for c in range(chunks + 1)]


def chunked_plan(exchange: ExchangePlan, sent_counts_E: torch.Tensor, chunks: int) -> ChunkedPlan:
    """The exchange's rows in `chunks` chunks of local experts (at most one chunk an expert)."""
    W, e = exchange.recv_counts_We.shape
    chunks = max(1, min(chunks, e))
    device = exchange.recv_counts_We.device
    send_We, recv_We = sent_counts_E.reshape(W, e).tolist(), exchange.recv_counts_We.tolist()
    starts, total = [], 0
    for w in range(W):
        row_starts = []
        for j in range(e):
            row_starts.append(total)
            total += send_We[w][j]
        starts.append(row_starts + [total])
    bounds = expert_bounds(e, chunks)
    plan, send_order = [], []
    for c in range(chunks):
        j0, j1 = bounds[c], bounds[c + 1]
        for w in range(W):
            send_order.append(torch.arange(starts[w][j0], starts[w][j1]))
        recv_counts_WJ = exchange.recv_counts_We[:, j0:j1]
        counts_e = torch.zeros(e, dtype=recv_counts_WJ.dtype, device=device)
        counts_e[j0:j1] = recv_counts_WJ.sum(0)
        plan.append(Chunk(send_splits=[sum(send_We[w][j0:j1]) for w in range(W)],
                          recv_splits=[sum(recv_We[w][j0:j1]) for w in range(W)],
                          order_R=expert_major_order(recv_counts_WJ), counts_e=counts_e))
    send_order_N = (torch.cat(send_order) if send_order else torch.zeros(0, dtype=torch.long)).to(device)
    return ChunkedPlan(plan, send_order_N, inverse_order(send_order_N))


def pipeline_chunks_for(layer, x_ND: torch.Tensor, agree: bool = True) -> int:
    """The chunk count fmoe's performance model picks for the layer's rows (FMOE_FASTER_GLBPLC_* set
    its throughput and bandwidth; a simulated link its bandwidth and latency), or FMOE_PIPELINE_CHUNKS;
    at most the local experts. `agree`: the ranks of the layer's group agree on the model's picks, each
    taking the largest (ranks with other row counts may pick otherwise); every rank must call it then."""
    forced = env_int("FMOE_PIPELINE_CHUNKS", 0)
    if forced < 0:
        raise ValueError(f"FMOE_PIPELINE_CHUNKS must be an int >= 1 (0 or unset: the performance model's), "
                         f"got {forced}")
    if forced:
        return min(forced, layer.num_expert)
    d_hidden = getattr(layer.experts, "d_hidden", None) or layer.d_model
    model = PerfModel.from_env(layer.d_model, d_hidden, x_ND.element_size())
    simulated = link.active_link()
    if simulated is None:
        chunks = pipeline_chunks(model, x_ND.shape[0], layer.num_expert, NCCL_LATENCY_S)
    else:
        chunks = pipeline_chunks(model, x_ND.shape[0], layer.num_expert, simulated.latency_us * 1e-6,
                                 simulated.gbps * 1e9 / 8)
    return agreed_chunks(chunks, layer.moe_group) if agree else chunks


def agreed_chunks(chunks: int, group) -> int:
    """The largest of the ranks' chunk counts (one small all-reduce): every rank issues as many all-to-alls."""
    picks = torch.tensor([chunks], dtype=torch.int64)
    link.complete(dist.all_reduce(picks, op=dist.ReduceOp.MAX, group=group, async_op=True),
                  f"{current_layer()}: pipeline chunks all-reduce",
                  link.all_reduce_bytes(picks.element_size(), dist.get_world_size(group)))
    return int(picks)


def pipelined_exchange(x_ND: torch.Tensor, weight_N: Optional[torch.Tensor], exchange: ExchangePlan,
                       chunked: ChunkedPlan, experts: Callable, meanwhile: Optional[Callable[[], None]] = None,
                       fp8: Optional[str] = None):
    """dispatch -> experts -> combine of the rows x_ND (in expert order), chunk by chunk: returns the
    experts' outputs for x_ND's rows, in the same order. `experts(x_RD, counts_e, weight_R)`: the local
    experts on received rows (expert-major); `weight_N`: routing weights travelling with the rows (None:
    none); `meanwhile()` runs once every chunk's combine has started (its backward, autograd taking
    what was made last first, then runs while the output gradients travel out); `fp8`: each chunk's rows out and
    its output gradients out travel as FP8 in this recipe (`fmoe.distributed.fp8_exchange.FP8Codec`)."""
    def codec():
        return None if fp8 is None else FP8Codec(fp8)

    what = f"{exchange.layer}: pipelined"
    sizes = [sum(chunk.send_splits) for chunk in chunked.chunks]
    x_parts = Reorder.apply(x_ND, chunked.send_order_N).split(sizes)
    w_parts = None if weight_N is None else Reorder.apply(weight_N[:, None], chunked.send_order_N).split(sizes)
    started = []
    for c, chunk in enumerate(chunked.chunks):
        rows = start_all_to_all(x_parts[c], chunk.send_splits, chunk.recv_splits, exchange.group,
                                f"{what} dispatch all-to-all", exchange.traffic, "dispatch", codec(), "forward")
        rows.order = chunk.order_R
        weights = None if w_parts is None else start_all_to_all(
            w_parts[c], chunk.send_splits, chunk.recv_splits, exchange.group, f"{what} routing all-to-all",
            exchange.traffic, "routing")
        if weights is not None:
            weights.order = chunk.order_R
        started.append((rows, weights))
    returning = []
    for chunk, (rows, weights) in zip(chunked.chunks, started):
        x_RD = rows.wait()
        y_RD = experts(x_RD, chunk.counts_e, None if weights is None else weights.wait()[:, 0])
        y_back = Reorder.apply(y_RD, inverse_order(chunk.order_R))
        returning.append(start_all_to_all(y_back, chunk.recv_splits, chunk.send_splits, exchange.group,
                                          f"{what} combine all-to-all", exchange.traffic, "combine", codec(),
                                          "backward"))
    if meanwhile is not None:
        meanwhile()
    y_parts = [back.wait() for back in returning]
    return Reorder.apply(torch.cat(y_parts), chunked.return_order_N)


def split_evenly(n: int, chunks: int) -> List[int]:
    """Where n rows split into `chunks` shares as even as can be: share c is [bounds[c], bounds[c + 1])."""
    return [n * c // chunks for c in range(chunks + 1)]


@dataclass
class HopChunks:
    """A hop's rows in chunks: chunk c carries the c-th share of the rows to (and from) every rank."""
    send_splits: List[List[int]]    # per chunk: rows to each rank
    recv_splits: List[List[int]]    # per chunk: rows from each rank
    send_order_N: torch.Tensor      # the sent rows (by destination) regrouped chunk-major: chunk, rank
    received_Q: List[torch.Tensor]  # per chunk: its received rows' places among all the hop's received rows


def hop_chunks(send_splits_W: List[int], recv_splits_W: List[int], chunks: int, device) -> HopChunks:
    """`chunks` chunks of a hop's rows. The sender splits its rows to rank w as the receiver splits
    those it gets from it (both from the same count), so the two sides agree without telling."""
    def blocks(splits):
        starts = [sum(splits[:w]) for w in range(len(splits))]
        return [(start, split_evenly(n, chunks)) for start, n in zip(starts, splits)]
    sent, received = blocks(send_splits_W), blocks(recv_splits_W)
    send_order, received_Q = [], []
    for c in range(chunks):
        send_order += [torch.arange(start + b[c], start + b[c + 1]) for start, b in sent]
        received_Q.append(torch.cat([torch.arange(start + b[c], start + b[c + 1]) for start, b in received]).to(device))
    return HopChunks(send_splits=[[b[c + 1] - b[c] for _, b in sent] for c in range(chunks)],
                     recv_splits=[[b[c + 1] - b[c] for _, b in received] for c in range(chunks)],
                     send_order_N=torch.cat(send_order).to(device), received_Q=received_Q)


def pipelined_hop(hop, x_ND: torch.Tensor, w_NK: torch.Tensor, experts: Callable, chunks: int,
                  meanwhile: Optional[Callable[[], None]] = None, fp8: Optional[str] = None) -> torch.Tensor:
    """The last hop of the rank or node exchange (`fmoe.routing.Hop`) in `chunks` chunks: x_ND's rows
    (grouped by destination rank) and their routing weights w_NK out, `experts(x_QD, local_plan,
    w_QK)` on each chunk's received rows as soon as they are there, the outputs back while the next
    chunk computes; returns the outputs for x_ND's rows, in their order. `meanwhile()` runs once every
    chunk's outputs have started back; `fmoe`'s FP8 rows out and output gradients out with `fp8`."""
    from fmoe.routing import RoutingPlan        # here: fmoe.routing imports the distributed package
    what = f"{hop.layer}: deduplicated, pipelined"
    split = hop_chunks(hop.send_splits_W, hop.recv_splits_W, chunks, x_ND.device)
    sizes = [sum(splits) for splits in split.send_splits]
    x_parts = Reorder.apply(x_ND, split.send_order_N).split(sizes)
    w_parts = Reorder.apply(w_NK, split.send_order_N).split(sizes)
    started = []
    for c in range(chunks):
        rows = start_all_to_all(x_parts[c], split.send_splits[c], split.recv_splits[c], hop.group, f"{what} dispatch",
                                hop.traffic, "dispatch", None if fp8 is None else FP8Codec(fp8), "forward")
        weights = start_all_to_all(w_parts[c], split.send_splits[c], split.recv_splits[c], hop.group,
                                   f"{what} weights", hop.traffic, "routing")
        started.append((rows, weights))
    num_local = int(hop.local.counts_E.numel())
    returning = []
    for c, (rows, weights) in enumerate(started):
        x_QD, w_QK = rows.wait(), weights.wait()
        local = RoutingPlan.build(hop.local_idx_QK.index_select(0, split.received_Q[c]), num_local, compact=True)
        y_QD = experts(x_QD, local, w_QK)
        returning.append(start_all_to_all(y_QD, split.recv_splits[c], split.send_splits[c], hop.group,
                                          f"{what} combine", hop.traffic, "combine",
                                          None if fp8 is None else FP8Codec(fp8), "backward"))
    if meanwhile is not None:
        meanwhile()
    y = torch.cat([back.wait() for back in returning])
    return Reorder.apply(y, inverse_order(split.send_order_N))
