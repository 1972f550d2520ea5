"""FastMoE path `fmoe.functions`: the routing helpers FastMoE users call, on fmoe's RoutingPlan
and exchange (no CUDA extension: counts, positions and the all-to-all are fmoe's own)."""
from types import SimpleNamespace

import torch
from torch.utils._pytree import tree_map

from fmoe.distributed import exchange
from fmoe.distributed.exchange import ExchangePlan, expert_major_order
from fmoe.distributed.slicing import GatherRows, SliceRows
from fmoe.routing import RoutingPlan

_moe_group = None


def ensure_comm(t, comm=None):
    """FastMoE set up its NCCL communicator here; fmoe uses torch.distributed directly, so this
    only records `comm` (None: the world) as the group the helpers below exchange over."""
    global _moe_group
    _moe_group = comm


def get_moe_group():
    return _moe_group


def _plan(gate, num_expert: int, world_size: int) -> RoutingPlan:
    idx_TK = gate.reshape(gate.shape[0], -1) if gate.dim() > 1 else gate.reshape(-1, 1)
    return RoutingPlan.build(idx_TK.long(), num_expert * world_size, world_size, _moe_group)


def count_by_gate(gate, num_expert: int, world_size: int, require_pos: bool = True):
    """(pos: slots in expert order, local_expert_count [E], global_expert_count [W * e])."""
    with torch.no_grad():
        plan = _plan(gate, num_expert, world_size)
        local_expert_count = plan.counts_E
        if plan.exchange is None:
            global_expert_count = local_expert_count
        else:
            global_expert_count = plan.exchange.recv_counts_We.reshape(-1)
        # One rank's plan gives dropped slots rows too (last, past every expert): FastMoE's pos has kept slots only.
        pos = plan.slot_N[:int(local_expert_count.sum())] if require_pos else None
        return pos, local_expert_count, global_expert_count


def prepare_forward(gate, num_expert: int, world_size: int):
    """(pos, local_expert_count, global_expert_count, fwd_expert_count, fwd_batch_size), counts on the CPU."""
    pos, local_expert_count, global_expert_count = count_by_gate(gate, num_expert, world_size)
    fwd_expert_count = global_expert_count.view(world_size, num_expert).sum(0)
    return (pos, local_expert_count.cpu(), global_expert_count.cpu(), fwd_expert_count.cpu(),
            int(fwd_expert_count.sum()))


def _exchange_from_counts(local_expert_count, global_expert_count, world_size: int):
    lec_WE = torch.as_tensor(local_expert_count).long().view(world_size, -1)
    gec_We = torch.as_tensor(global_expert_count).long().view(world_size, -1)
    return SimpleNamespace(exchange=ExchangePlan(
        send_splits_W=lec_WE.sum(1).tolist(), recv_splits_W=gec_We.sum(1).tolist(),
        local_counts_e=gec_We.sum(0), recv_counts_We=gec_We, recv_order_R=expert_major_order(gec_We),
        group=_moe_group))


class MOEScatter:
    """Rows `inp[pos]`, sent to their experts' ranks: `MOEScatter.apply(inp, pos, lec, gec, fwd_batch_size, world_size)`."""

    @staticmethod
    def apply(inp, pos, local_expert_count, global_expert_count, fwd_batch_size, world_size):
        rows = inp.index_select(0, pos.to(inp.device))
        if world_size == 1:
            return rows
        return exchange.dispatch(rows, _exchange_from_counts(local_expert_count, global_expert_count, world_size))


class MOEGather:
    """Expert outputs brought home and put back at `pos` in a buffer of `local_batch_size` rows
    (rows of dropped slots stay zero)."""

    @staticmethod
    def apply(global_output_buf, pos, local_expert_count, global_expert_count, local_batch_size, world_size):
        rows = global_output_buf
        if world_size > 1:
            rows = exchange.combine(rows, _exchange_from_counts(local_expert_count, global_expert_count, world_size))
        out = rows.new_zeros((local_batch_size,) + tuple(rows.shape[1:]))
        return out.index_copy(0, pos.to(rows.device), rows)


class AllGather:
    """`AllGather.apply(inp, rank, world_size, group)`: every rank's rows, rank order."""

    @staticmethod
    def apply(inp, rank, world_size, group):
        return GatherRows.apply(inp, group)


class Slice:
    """`Slice.apply(inp, rank, world_size, group)`: this rank's block of rows."""

    @staticmethod
    def apply(inp, rank, world_size, group):
        return SliceRows.apply(inp, group)


def general_global_forward(inp, gate, expert_fn, num_expert, world_size, **kwargs):
    """FastMoE's `_fmoe_general_global_forward`: `inp` (a tensor or tree, one row per token) goes
    through `expert_fn(rows, fwd_expert_count)` by the expert ids in `gate` ([T] or [T, K]); the
    result has one row per slot (T * K), unweighted, zero for dropped slots (id -1).
    `kwargs` (FastMoE's `experts=`) are accepted and not needed."""
    plan = _plan(gate, num_expert, world_size)
    kept = int(plan.counts_E.sum())     # a one-rank plan also gives dropped slots rows, last: leave them out
    token_N, slot_N = plan.token_N[:kept], plan.slot_N[:kept]

    def scatter(t):
        return exchange.dispatch(t.index_select(0, token_N), plan)

    y = expert_fn(tree_map(scatter, inp), plan.local_counts_e.cpu())

    def gather(t):
        rows = exchange.combine(t, plan)
        out = rows.new_zeros((plan.num_tokens * plan.top_k,) + tuple(rows.shape[1:]))
        return out.index_copy(0, slot_N, rows)

    return tree_map(gather, y)


__all__ = ["ensure_comm", "get_moe_group", "count_by_gate", "prepare_forward", "MOEScatter", "MOEGather",
           "AllGather", "Slice"]
