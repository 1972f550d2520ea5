"""Dispatchers: where a layer's routed experts run, and how its tokens get there and back.

The layer builds one when it is built, from its world size and `exchange=`, and then never asks
which it has. Every dispatcher has one interface:

    plan = dispatcher.plan(routing)                 # rows in expert order and, across ranks, the exchange
    y_TD = dispatcher(x, plan, routing.weight_TK, alongside)   # dispatch -> experts -> combine

`y_TD[t]` is the sum over token t's slots of weight * expert(x[t]). The experts are called through
the layer's `experts_call` (`fmoe.expert_calls`: lean or plain, decided when the experts are set).
`alongside` (a `SharedTerm`) is the layer's work that needs nothing of the exchange (the shared
experts): with `overlap="shared"` an exchange runs it while its dispatch travels, and in the backward
autograd runs its gradient while the rows' gradients travel back; else the layer runs it afterwards.
Both orders compute the same tensors, so the outputs and gradients are bit-identical.

- `OneRank`: the experts are all here; the call is the experts' on the tokens.
- `SlotExchange` (exchange="slot"): one row per (token, expert) slot travels to the expert's rank
  and back (`fmoe.distributed.exchange`), optionally through FasterMoE's smart schedule.
- `DedupExchange` (exchange="rank" / "node"): a token travels once per destination rank, or once
  per node and then per rank inside it (`fmoe.distributed.dedup`); bounded with `sync_free=True`.

Across ranks, FasterMoE's shadowing (`Shadowing`: hot experts' parameters pulled and computed
where the tokens are) and its smart schedule are properties of the dispatcher, fixed when it is built.
"""
import contextlib
from typing import Callable, Optional

import torch
from torch.utils._pytree import tree_map

from fmoe import kernels
from fmoe.autocast import autocast_dtype
from fmoe.distributed import dedup, exchange, fp8_exchange
from fmoe.distributed.pipeline import chunked_plan, pipeline_chunks_for, pipelined_exchange
from fmoe.distributed.schedule import scheduled_experts
from fmoe.distributed.shadow import BufferPool, ShadowPull
from fmoe.experts import GroupedExperts
from fmoe.kernels import deferred
from fmoe.gates.base import Routing
from fmoe.gates.load_state import in_recompute
from fmoe.routing import RoutingPlan
from fmoe.shared_experts import NO_SHARED_TERM, SharedTerm

OVERLAP_MODES = ("auto", "none", "shared", "pipeline")


def resolve_overlap(overlap, world_size: int, exchange_kind: str = "slot", num_expert: int = 1) -> str:
    """`overlap=` as the layer runs it. "auto" across ranks: "pipeline" for the slot exchange with two
    or more experts a rank (the exchange chunked by experts and pipelined with their GEMMs, the shared
    experts alongside: exact, and it pays whenever the exchange takes time), else "shared" (the shared
    experts while the dispatch travels; the rank and node exchanges in chunks are equal only to
    rounding, so they are "pipeline" when asked for by name); on one rank "none" (nothing travels)."""
    if overlap not in OVERLAP_MODES:
        raise ValueError(f"overlap must be one of {OVERLAP_MODES}, got {overlap!r}")
    if overlap == "auto":
        if world_size == 1:
            return "none"
        return "pipeline" if exchange_kind == "slot" and num_expert > 1 else "shared"
    return overlap


def sharded_by_fsdp(module) -> bool:
    """`module` is FSDP2's and its parameters are sharded over more than one rank."""
    state = getattr(module, "_get_fsdp_state", None)
    if state is None:
        return False
    group = state()._fsdp_param_group
    return group is not None and group.mesh_info.shard_mesh_size > 1


class Shadowing:
    """FasterMoE's shadowing of hot experts: the policy that picks them each step (`plan`) and
    the pull of their parameters (`pull`), through buffers kept from step to step."""

    def __init__(self, layer, policy):
        self.layer, self.policy = layer, policy
        self.buffers = BufferPool()

    def pull(self, plan: RoutingPlan, fold: bool) -> Optional[ShadowPull]:
        """Start pulling this step's shadowed experts (None when the policy chose none). `fold`: this
        rank's own experts run through the pull (`ShadowPull.run_local`)."""
        if plan.shadow is None:
            return None
        layer = self.layer
        return ShadowPull(layer.experts, plan.shadow, layer.num_expert, layer.moe_group, self.policy.overlap,
                          fold=fold, pool=self.buffers)


class OneRank:
    """All experts on this rank: no exchange."""

    shadowing = None
    schedule_group_size = None

    def __init__(self, layer):
        self.layer = layer

    def plan(self, routing: Routing) -> RoutingPlan:
        return RoutingPlan.build(routing.expert_idx_TK, self.layer.tot_expert)

    def __call__(self, x, plan: RoutingPlan, weight_TK: torch.Tensor, alongside: SharedTerm = NO_SHARED_TERM):
        return self.layer.experts_call.tokens(x, plan, weight_TK)


class Exchange(OneRank):
    """Across the ranks of the layer's `moe_group`: the exchange's plan, agreed with the other ranks."""

    def __init__(self, layer, exchange_kind: str, shadowing: Optional[Shadowing] = None,
                 schedule_group_size: Optional[int] = None, bound: Optional[int] = None, node_group=None):
        super().__init__(layer)
        self.exchange_kind, self.shadowing = exchange_kind, shadowing
        self.schedule_group_size = schedule_group_size      # FasterMoE's smart schedule: its group size
        # sync_free: rows to each rank; the node exchange's `NodeGroup` (held, not its process group: a
        # deep copy of the layer shares it)
        self.bound, self.node_group = bound, node_group
        # overlap="shared": the combine is started, the layer's work alongside runs, then it is waited for
        # (the dispatch waited for as it starts); "pipeline" too, and the exchange goes in
        # chunks (fmoe.distributed.pipeline)
        self.overlap_shared = layer.overlap in ("shared", "pipeline")
        self.pipeline = layer.overlap == "pipeline"

    def start_combine(self, y_RD, plan: RoutingPlan) -> exchange.InFlight:
        if self.overlap_shared:
            return exchange.start_combine(y_RD, plan)
        return exchange.InFlight(exchange.combine(y_RD, plan))

    def start_dispatch(self, x_ND, plan: RoutingPlan, kind: str = "dispatch") -> exchange.InFlight:
        if self.overlap_shared:
            return exchange.start_dispatch(x_ND, plan, kind)
        return exchange.InFlight(exchange.dispatch(x_ND, plan, kind))

    def travelling(self, alongside: SharedTerm):
        """An exchange is started: under overlap="shared" the work alongside runs now, while it travels.
        The combine where the dispatch and combine are the layer's own (the dispatch where the combine's
        gradient is not: FP8): autograd then runs the work's backward while the output gradients travel
        out, as it takes what was made last first; during the dispatch it would wait for them first."""
        if self.overlap_shared:
            alongside.run()

    def meanwhile(self, alongside: SharedTerm) -> Optional[Callable[[], None]]:
        """What runs while the first rows travel (None: nothing; the exchange then runs in line): the
        work alongside, as the layer runs it outside the exchange (not bounded by its sync-free block)."""
        if not self.overlap_shared or alongside.empty:
            return None
        if torch.compiler.is_compiling():       # traced: every op keeps its counts on the device anyway
            return alongside.run

        def run_as_outside():
            with kernels.forced_sync_free(False):
                alongside.run()
        return run_as_outside

    def plan(self, routing: Routing) -> RoutingPlan:
        layer = self.layer
        if layer.traffic is not None and not in_recompute():
            layer.traffic.reset()
        with self.sync_free():
            return RoutingPlan.build(routing.expert_idx_TK, layer.tot_expert, layer.world_size, layer.moe_group,
                                     self.shadowing and self.shadowing.policy, exchange=self.exchange_kind,
                                     ranks_per_node=layer.ranks_per_node, traffic=layer.traffic, bound=self.bound,
                                     node_group=self.node_group and self.node_group.group)

    def sync_free(self):
        """Bounded: no host read anywhere in the step (compiled, it is sync-free anyway)."""
        forced = self.bound is not None and not torch.compiler.is_compiling()
        return kernels.forced_sync_free() if forced else contextlib.nullcontext()

    def weight_grads_deferral(self) -> Optional[deferred.DeferredWeightGrads]:
        """Under an overlapping mode, the lean experts' weight gradients wait for the backward's exchange to
        start and compute while it travels (`fmoe.kernels.deferred`); made before the dispatch starts. None
        where that cannot be: traced, no gradient, experts FSDP2 shards (its post-backward reduces each
        module's gradients as its inputs' are done), under torch.autocast (the MLP gets cast weights, not
        the aliases), experts not the layer's own stacked lean MLP."""
        experts = self.layer.experts
        if not (self.overlap_shared and self.layer.defer_weight_grads and self.layer.experts_call.weighs_rows
                and deferrable_weights(experts)):
            return None
        return deferred.DeferredWeightGrads((experts.w1_eDF, experts.w2_eFD))

    def defer_shared_weight_grads(self, alongside: SharedTerm):
        """Under an overlapping mode, the shared experts' weight gradients (fmoe's own lean MLPs) wait: for a
        wait that would idle, else the routed experts' input gradients (`fmoe.kernels.deferred`, late).
        Called before the exchange starts."""
        if self.overlap_shared and self.layer.defer_weight_grads:
            alongside.defer_weight_grads(deferrable_weights)

    @property
    def fp8_rows(self):
        """The FP8 recipe the rows to the experts travel in (the experts' `fp8=`), None: their dtype."""
        return getattr(self.layer.experts, "fp8", None)

    def check_input(self, x):
        """Shadowing and the smart schedule run the experts on one tensor of rows, through their own forward."""
        if (self.shadowing is not None or self.schedule_group_size is not None) and not isinstance(x, torch.Tensor):
            raise ValueError("shadow / schedule need a single input tensor and the default expert_fn")


class SlotExchange(Exchange):
    """One row per (token, expert) slot to the expert's rank and back."""

    def __call__(self, x, plan: RoutingPlan, weight_TK: torch.Tensor, alongside: SharedTerm = NO_SHARED_TERM):
        self.check_input(x)
        backend, call = self.layer.backend, self.layer.experts_call
        x_ND = tree_map(lambda t: kernels.permute(t, plan, backend), x)
        if call.weighs_rows and plan.shadow is None and self.schedule_group_size is None:
            # The permuted rows only travel; the received ones are the experts' input, kept once.
            weight_N = weight_TK.reshape(-1).index_select(0, plan.slot_N)
            self.defer_shared_weight_grads(alongside)
            with deferred.deferring(self.weight_grads_deferral()):
                if self.pipelining(x_ND):
                    y_ND = self.pipelined(x_ND, plan, weight_N, call.rows, alongside)
                    return kernels.sum_rows(y_ND, plan, backend).to(autocast_dtype(x) or x.dtype)
                rows = self.start_dispatch(x_ND, plan)
                weights = self.start_dispatch(weight_N[:, None], plan, "routing")
                x_RD, weight_R = rows.wait(), weights.wait()[:, 0]
                y_ND = self.start_combine(call.rows(x_RD, plan.local_counts_e, weight_R), plan)
                self.travelling(alongside)
                y_ND = y_ND.wait()
            return kernels.sum_rows(y_ND, plan, backend).to(autocast_dtype(x) or x.dtype)
        y_ND = self.layer.experts_call.checked(self.run_rows(x_ND, plan, alongside))
        return tree_map(lambda t: kernels.unpermute(t, plan, weight_TK, backend), y_ND)

    def pipelining(self, x_ND) -> bool:
        """overlap="pipeline" chunks this exchange: eager (traced, the exchange runs as "shared"), one
        tensor of rows, nothing shadowed or scheduled (the callers check those), experts that FSDP2
        does not shard (each chunk's call would gather their parameters again)."""
        return (self.pipeline and isinstance(x_ND, torch.Tensor) and not torch.compiler.is_compiling()
                and not sharded_by_fsdp(self.layer.experts))

    def pipelined(self, x_ND, plan: RoutingPlan, weight_N, experts, alongside: SharedTerm):
        """The exchange in chunks of local experts, as many as the performance model picks and the ranks
        agree on (FP8 rows with fp8=)."""
        chunks = pipeline_chunks_for(self.layer, x_ND)
        return pipelined_exchange(x_ND, weight_N, plan.exchange, chunked_plan(plan.exchange, plan.counts_E, chunks),
                                  experts, None if alongside.empty else alongside.run, self.fp8_rows)

    def run_rows(self, x_ND, plan: RoutingPlan, alongside: SharedTerm = NO_SHARED_TERM):
        """Rows in expert order -> the experts' outputs in the same order, wherever the experts live."""
        call = self.layer.experts_call
        if not isinstance(x_ND, torch.Tensor):
            y_RD = call.rows(tree_map(lambda t: exchange.dispatch(t, plan), x_ND), plan.local_counts_e)
            return tree_map(lambda y: exchange.combine(y, plan), y_RD)
        x_sent, x_home = x_ND.split([x_ND.shape[0] - plan.num_shadow_rows, plan.num_shadow_rows])
        # The pull starts first, so it travels while the other rows are dispatched and computed.
        pull = self.shadowing and self.shadowing.pull(plan, fold=self.schedule_group_size is None)
        if self.schedule_group_size is not None:
            y_sent = scheduled_experts(self.layer.experts, x_sent, plan.exchange, self.schedule_group_size)
        elif pull is None and self.pipelining(x_sent):
            y_sent = self.pipelined(x_sent, plan, None, lambda x_RD, counts_e, _: call.rows(x_RD, counts_e), alongside)
        elif pull is None and self.fp8_rows is not None:
            # FP8 rows out while the work alongside runs (in line where the exchange is traced), output
            # gradients out as FP8 too
            if self.overlap_shared and not torch.compiler.is_compiling():
                rows = exchange.start_dispatch(x_sent, plan, codec=fp8_exchange.FP8Codec(self.fp8_rows))
                self.travelling(alongside)
                x_RD = rows.wait()
            else:
                x_RD = fp8_exchange.dispatch(x_sent, plan, self.fp8_rows)
            y_sent = fp8_exchange.combine(call.rows(x_RD, plan.local_counts_e), plan, self.fp8_rows)
        else:
            x_RD = self.start_dispatch(x_sent, plan).wait()
            y_sent = self.start_combine((pull.run_local if pull else call.rows)(x_RD, plan.local_counts_e), plan)
            self.travelling(alongside)
            y_sent = y_sent.wait()
        return y_sent if pull is None else torch.cat([y_sent, pull.forward(x_home)])


class DedupExchange(Exchange):
    """A token once per destination rank ("rank"), or once per node and then per rank inside it ("node")."""

    def __call__(self, x, plan: RoutingPlan, weight_TK: torch.Tensor, alongside: SharedTerm = NO_SHARED_TERM):
        self.check_input(x)
        call, scheduled = self.layer.experts_call, self.schedule_group_size is not None
        if scheduled and self.layer.fp32_combine and x.dtype != torch.float32:
            raise ValueError(f"schedule=True with exchange='rank' sends the routing weights in the rows' dtype "
                             f"({x.dtype}): it cannot keep fp32_combine=True's fp32 weights; use fp32 input")
        # The pull starts first, so it travels while the other rows are dispatched and computed.
        pull = self.shadowing and self.shadowing.pull(plan, fold=not scheduled)
        run_here = None if pull is None or scheduled else pull.run_local
        schedule = (self.schedule_group_size, list(self.layer.experts.parameters())) if scheduled else None
        chunks = self.hop_chunks(x) if pull is None and not scheduled else 1
        if self.bound is None and not scheduled:
            self.defer_shared_weight_grads(alongside)
        with self.sync_free():
            y_TD = dedup.run_hop(plan.dedup, x, weight_TK, lambda x_QD, local, w_QK: call.tokens(x_QD, local, w_QK,
                                                                                                   run_here),
                                 self.layer.backend, schedule, self.meanwhile(alongside),
                                 None if scheduled else self.fp8_rows, chunks)
        if pull is None:
            return y_TD
        return y_TD + call.tokens(x, plan.home, weight_TK, lambda x_SD, counts_S: pull.forward(x_SD))

    def hop_chunks(self, x) -> int:
        """overlap="pipeline": the chunks the last hop goes in (1: not chunked), agreed by the ranks. Eager,
        one tensor, not bounded (sync-free), experts that FSDP2 does not shard; the callers exclude
        shadowing and the smart schedule. As many as the slot exchange's model picks for the token's slots."""
        if not (self.pipeline and isinstance(x, torch.Tensor) and self.bound is None
                and not torch.compiler.is_compiling() and not sharded_by_fsdp(self.layer.experts)):
            return 1
        return pipeline_chunks_for(self.layer, x.new_empty(x.shape[0] * self.layer.top_k, 0))


def deferrable_weights(experts) -> bool:
    """Whether a stacked lean MLP's weight-gradient GEMMs may wait for an exchange (`fmoe.kernels.deferred`):
    eager, gradients on, the MLP lean, not under torch.autocast (it would get cast weights, not the
    aliases), its weights trained and not sharded by FSDP2 (whose post-backward reduces each module's
    gradients as its inputs' are done)."""
    return (torch.is_grad_enabled() and not torch.compiler.is_compiling() and isinstance(experts, GroupedExperts)
            and experts.lean and autocast_dtype(experts.w1_eDF) is None and experts.w1_eDF.requires_grad
            and experts.w2_eFD.requires_grad and not sharded_by_fsdp(experts))


def make_dispatcher(layer, shadow_policy, schedule: bool):
    """The layer's dispatcher, from its world size, exchange, shadowing, schedule and sync-free bound."""
    if layer.world_size == 1:
        return OneRank(layer)
    shadowing = Shadowing(layer, shadow_policy) if shadow_policy is not None else None
    kind = SlotExchange if layer.exchange == "slot" else DedupExchange
    return kind(layer, layer.exchange, shadowing, layer.schedule_group_size if schedule else None,
                layer.max_tokens_per_rank if layer.sync_free else None,
                layer.node_group)
