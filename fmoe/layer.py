"""FMoE: input -> route -> plan -> dispatch -> experts -> combine -> shared experts -> restore.

The layer holds its parts and runs them in that order; each is chosen when the layer is built:
the gate (`fmoe.gates`), the dispatcher (`fmoe.dispatch`: one rank, or an exchange across
ranks), the experts' call (`fmoe.expert_calls`: lean or plain) and the input's adapters
(`fmoe.tokens`: FastMoE's trees, slices and masks).
"""
import warnings
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from fmoe import kernels
from fmoe.autocast import autocast_dtype
from fmoe.dispatch import make_dispatcher, resolve_overlap
from fmoe.distributed.check import check_expert_parallel_config
from fmoe.distributed.exchange import Traffic, ranks_per_node_of
from fmoe.distributed.groups import NodeGroup
from fmoe.distributed.schedule import group_size_from_env, schedule_enabled_by_env
from fmoe.distributed.shadow import make_shadow_policy
from fmoe.distributed.timeout import set_current_layer
from fmoe.expert_calls import experts_call
from fmoe.experts import GroupedExperts, ModuleListExperts, check_recompute, expert_shapes, is_gated, resolve_activation
from fmoe.fastmoe.state import rename_router, stack_experts
from fmoe.gates import BaseGate, NaiveGate, make_gate
from fmoe.gates.base import Routing, accepts_keyword, routing_from_fastmoe_gate
from fmoe.last_forward import ForgetsLastForward
from fmoe.layer_checks import (check_activation, check_fits, check_fp8_experts, check_mask, check_sync_free,
                               check_world, is_plain_module_gate, positive_int, resolve_num_expert,
                               resolve_slice_group, router_tensors)
from fmoe.routing import RoutingPlan, check_exchange
from fmoe.shared_experts import SharedTerm, make_shared_experts
from fmoe.observe.stats import RoutingTally
from fmoe.tokens import NO_MASK, TokenMask, TokenRows

__all__ = ["FMoE", "collect_aux_loss", "mark_expert_parameters", "check_world", "positive_int"]


class FMoE(ForgetsLastForward, nn.Module):
    """A Mixture-of-Experts layer with FastMoE's constructor.

    `num_expert` experts (default 32) live on each of `world_size` ranks. Experts are either
    `expert` (a module class, instantiated per expert as `expert(d_model)`, or a list of classes,
    whose length is then `num_expert`), with `d_hidden`, stacked MLP experts that run as grouped
    GEMMs, or, as in FastMoE's fused pattern, a module assigned to `self.experts` after
    construction and called as `experts(x, fwd_expert_count)`. `expert_fn(x, fwd_expert_count)`
    is the seam around the local experts; a subclass may override it.
    `shadow` (True, a ShadowPolicy, or
    FMOE_FASTER_SHADOW_ENABLE=1) turns on FasterMoE's shadowing of hot experts, `schedule` (or
    FMOE_FASTER_SCHEDULE_ENABLE=1) its pipelined exchange in groups of `schedule_group_size`
    ranks (FMOE_FASTER_GROUP_SIZE). Input: a tensor [..., d_model], or (FastMoE's multi-input
    experts) any tree of tensors sharing the leading dims, which the gate and experts then
    receive whole. Output: the same structure. `slice_group` (FastMoE's `mp_group`): the ranks
    of that group hold the same input; each routes one slice of the tokens and the outputs are
    gathered. `mask` / `mask_dict`: tokens whose mask is 0 are routed; a token with mask k gets
    `mask_dict[k]` from each of its top-k slots instead. After every forward the layer holds
    `aux_loss`, `num_dropped` and `last_counts_E` (rows each expert received), and `routing_stats`
    (load, drops, router entropy: see `fmoe.observe.stats`) describes that forward.

    `shared_expert` adds experts every token passes through, computed on every rank beside the
    routed ones (data-parallel parameters, not expert ones): a module, a list of modules, or an
    int (the hidden width of one MLP with the routed experts' activation). With
    `shared_expert_gate=True` their summed output is scaled by sigmoid(x @ w) per token
    (Qwen2-MoE's `shared_expert_gate`, a [1, d_model] linear).

    `fp8` ("blockwise", "rowwise", "mxfp8"; None: off) runs the stacked experts' GEMMs with FP8
    operands (`GroupedExperts`, docs/fp8.md); the master weights keep their dtype.

    `overlap` hides communication behind compute across ranks: "shared" runs the shared experts
    while the dispatch travels (and their backward while the rows' gradients travel back),
    "pipeline" also splits the slot exchange into chunks of experts pipelined with their GEMMs, and the
    rank and node exchanges' last hop into chunks of rows (`fmoe.distributed.pipeline`), "none" waits
    for every exchange in line, "auto" (the default) is "pipeline" for the slot exchange with two or
    more experts a rank, else "shared"; every mode gives bit-identical outputs and gradients
    (`fmoe.dispatch`), but for the rank and node exchanges in chunks (to rounding).

    Routing runs in fp32; for an fp16 / bf16 input the combine weights are rounded to the input's
    dtype first, as FastMoE's gates return them and transformers' MoE blocks cast them.
    `fp32_combine=True` keeps them fp32 (a little closer to the exact sum, no longer bit-equal to those).
    Under torch.autocast the layer is as nn.Linear there: the experts' GEMMs (and the shared
    experts') run in the autocast dtype, which is the output's and the one the combine weights are
    rounded to; fmoe's gates still route in fp32; the parameters' gradients keep their dtype.
    """

    def __init__(self, num_expert=None, d_model=1024, world_size=1, mp_group=None, slice_group=None,
                 moe_group=None, top_k=2, gate=NaiveGate, expert=None, gate_hook=None, mask=None, mask_dict=None,
                 gate_bias=True, d_hidden=None, activation="gelu", expert_bias=True, gate_kwargs=None,
                 backend: Optional[str] = None, shadow=None, schedule=None, schedule_group_size=None,
                 shared_expert=None, shared_expert_gate=False, fp32_combine=False, recompute="activation",
                 exchange="slot", ranks_per_node=None, sync_free=False, max_tokens_per_rank=None, overlap="auto",
                 fp8=None):
        super().__init__()
        self.recompute = check_recompute(recompute)
        check_fp8_experts(fp8, expert, d_hidden, sync_free)
        positive_int("d_model", d_model)
        if not isinstance(fp32_combine, bool):
            raise ValueError(f"fp32_combine must be a bool, got {fp32_combine!r}")
        self.fp32_combine = fp32_combine
        num_expert = resolve_num_expert(num_expert, expert)
        if d_hidden is not None:
            positive_int("d_hidden", d_hidden)
        self.world_size = check_world(world_size, moe_group)
        self.moe_group = moe_group
        self.slice_group = resolve_slice_group(mp_group, slice_group)
        self.num_expert = num_expert
        self.d_model = d_model
        self.tot_expert = num_expert * self.world_size
        kernels.check_backend(backend)      # a typo here (or in FMOE_BACKEND) fails now, not at the first forward
        self.backend = backend
        gate_kwargs = dict(gate_kwargs or {})
        if gate_kwargs.get("max_nodes") is not None:     # node-limited routing: the gate's nodes are the layer's
            gate_kwargs.setdefault("ranks_per_node", ranks_per_node_of(self.world_size, ranks_per_node))
        if isinstance(gate, str) or isinstance(gate, type) and accepts_keyword(gate, "gate_bias"):
            gate_kwargs.setdefault("gate_bias", gate_bias)
        check_weights_fit(self, gate, gate_kwargs.get("gate_bias", gate_bias), expert, d_hidden, activation,
                          expert_bias)
        if is_plain_module_gate(gate):
            # FastMoE accepts any module class built as gate(d_model, num_expert, world_size, top_k)
            # whose forward returns (topk_idx, topk_val).
            self.gate = gate(d_model, num_expert, self.world_size, top_k, **gate_kwargs)
            self.gate.tot_expert = getattr(self.gate, "tot_expert", self.tot_expert)
            self.gate.top_k = getattr(self.gate, "top_k", top_k)
        else:
            self.gate = make_gate(gate, d_model, num_expert, self.world_size, top_k, **gate_kwargs)
        self.top_k = self.gate.top_k
        if hasattr(self.gate, "ep_rank"):
            self.gate.ep_rank = self.moe_rank       # the topology-aware gate needs to know its node
        if hasattr(self.gate, "moe_group"):
            self.gate.moe_group = moe_group         # gates that decide capacity over the group
        if self.gate.tot_expert != self.tot_expert:
            raise ValueError(f"gate routes to {self.gate.tot_expert} experts, the layer has {self.tot_expert}")
        if isinstance(expert, nn.Module):
            self.experts = expert
        elif expert is not None:
            self.experts = ModuleListExperts(expert, num_expert, d_model)
        elif d_hidden is not None:
            self.experts = GroupedExperts(num_expert, d_model, d_hidden, activation, bias=expert_bias, backend=backend,
                                          recompute=recompute, fp8=fp8)
            check_activation(self.experts.activation, self.experts.w1_eDF.shape[-1], d_hidden)
        else:
            self.experts = None     # FastMoE's fused pattern: the subclass assigns self.experts
        self.mask, self.mask_dict = check_mask(mask, mask_dict)
        self.shared_experts = make_shared_experts(shared_expert, d_model, activation, expert_bias, recompute)
        if shared_expert_gate and self.shared_experts is None:
            raise ValueError("shared_expert_gate=True needs shared_expert= (a module, a list of them or a d_hidden)")
        self.shared_expert_gate = nn.Linear(d_model, 1, bias=False) if shared_expert_gate else None
        self.schedule = schedule_enabled_by_env() if schedule is None else bool(schedule)
        self.schedule_group_size = positive_int("schedule_group_size",
                                                schedule_group_size if schedule_group_size is not None
                                                else group_size_from_env())
        shadow_policy = make_shadow_policy(shadow, d_model, self.experts, num_expert, self.world_size)
        if (shadow_policy is not None or self.schedule and self.world_size > 1) and self.has_own_expert_fn:
            raise ValueError("shadow / schedule need a single input tensor and the default expert_fn")
        self.exchange = check_exchange(exchange)
        if self.exchange == "node" and self.schedule:
            raise ValueError("exchange='node' does not run under the smart schedule (schedule=True or "
                             "FMOE_FASTER_SCHEDULE_ENABLE=1), which pipelines one exchange over the ranks: "
                             "pass exchange='rank' or 'slot'")
        self.ranks_per_node = ranks_per_node_of(self.world_size, ranks_per_node, whole_nodes=self.exchange == "node")
        self.traffic = None if self.world_size == 1 else Traffic(self.moe_rank, self.ranks_per_node)
        self.sync_free, self.max_tokens_per_rank = check_sync_free(sync_free, max_tokens_per_rank, self.exchange,
                                                                   shadow_policy, self.schedule)
        self.last_overflow = None       # sync_free: (token, rank) pairs past the bound in the last forward
        # The bounded node exchange pads its hop inside a node to every rank of it: a node's own group.
        self.node_group = (NodeGroup(moe_group, self.ranks_per_node)
                           if self.sync_free and self.exchange == "node" and self.ranks_per_node < self.world_size
                           else None)
        self.gate_hook = gate_hook
        self.aux_loss = None
        self.last_counts_E = None
        self.last_num_dropped = None
        self.last_num_unrouted = None
        self.layer_index = None        # set by the check with the other ranks, before the first exchange
        self.routing_name = None       # the layer's name in a routing trace, when not its qualified name (fmoe.replay)
        self.sequence_first = False    # a 3-D input is [batch, seq, d_model]; Megatron's is [seq, batch, d_model]
        # The parts each forward runs, chosen now (the experts' call again when experts are assigned).
        self.token_rows = TokenRows(self)
        self.token_mask = NO_MASK if self.mask is None else TokenMask(self.mask, self.mask_dict)
        self.overlap = resolve_overlap(overlap, self.world_size, self.exchange, self.num_expert)
        # Under an overlapping mode the backward sends the experts' input gradient first and computes their
        # weight gradients while it travels (fmoe.kernels.deferred); False computes them in line.
        self.defer_weight_grads = True
        self.dispatcher = make_dispatcher(self, shadow_policy, self.schedule)
        self.experts_call = experts_call(self, self.has_own_expert_fn)

    last_forward_attrs = ("aux_loss",)
    # What a forward leaves for its own step: interleaved micro-batches keep one each (fmoe.distributed.interleave)
    per_micro_batch_attrs = ("aux_loss", "last_overflow", "last_counts_E", "last_num_dropped", "last_num_unrouted",
                             "traffic")

    def __setattr__(self, name, value):
        if name == "experts" and isinstance(value, nn.Module):
            mark_expert_parameters(value)       # also for experts assigned after construction
        if name == "gate":      # fmoe's gates route; FastMoE's module gates return (index, score)
            self.__dict__["gate_routing"] = (routing_of_gate if isinstance(value, BaseGate)
                                             else routing_from_fastmoe_gate)
            if isinstance(value, BaseGate):
                value.hold_fp32()       # made under a bf16 default dtype: its routing math stays fp32
        super().__setattr__(name, value)
        if name in ("experts", "fp32_combine") and "experts_call" in self.__dict__:
            self.experts_call = experts_call(self, self.has_own_expert_fn)    # lean or plain, for these experts

    @property
    def has_own_expert_fn(self) -> bool:
        """A subclass overrides `expert_fn` (FastMoE's seam): the experts then run through it, as rows."""
        return type(self).expert_fn is not FMoE.expert_fn

    @property
    def shadow_policy(self):
        """FasterMoE's shadowing policy (None: no shadowing), which the dispatcher asks each step."""
        shadowing = self.dispatcher.shadowing
        return None if shadowing is None else shadowing.policy

    @shadow_policy.setter
    def shadow_policy(self, policy):
        self.dispatcher = make_dispatcher(self, policy, self.schedule)

    @property
    def shadow_buffers(self):
        """Shadowing's flat buffers, kept from step to step (None without shadowing)."""
        shadowing = self.dispatcher.shadowing
        return None if shadowing is None else shadowing.buffers

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        rename_router(state_dict, prefix, self.gate.state_dict().keys())
        if isinstance(self.experts, GroupedExperts):
            stack_experts(state_dict, prefix + "experts.", self.num_expert)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @property
    def moe_rank(self) -> int:
        """This rank's place in the expert-parallel group: it holds experts
        [moe_rank * num_expert, (moe_rank + 1) * num_expert)."""
        return dist.get_rank(self.moe_group) if self.world_size > 1 else 0

    @property
    def label(self) -> str:
        """How messages name this layer."""
        where = f"expert-parallel layer #{self.layer_index} " if self.layer_index is not None else ""
        return f"{where}{type(self).__name__}(num_expert={self.num_expert}, d_model={self.d_model})"

    @torch.compiler.disable     # talks to the peers through the process group: not traceable, runs eagerly
    def check_with_peers(self, x):
        """Before the first exchange, every rank agrees on the layer; every forward names the layer
        in the collectives' timeout messages."""
        if self.layer_index is None:
            self.layer_index = check_expert_parallel_config(self, x)
        set_current_layer(self.label)

    def mark_parallel_comm(self, expert_dp_comm="none"):
        """FastMoE's data-parallel tags: experts reduced over `expert_dp_comm`, the gate over "gate"."""
        for p in self.experts.parameters():
            p.dp_comm = expert_dp_comm
        for p in self.gate.parameters():
            p.dp_comm = "gate"

    def forward(self, moe_inp):
        """The diagram: input -> route -> plan -> dispatch -> experts -> combine -> shared experts -> restore."""
        x, x_TD, restore = self.token_rows.enter(moe_inp)     # rows [T, D] (FastMoE: a tree), sliced
        routing = self.token_mask.route(self.route(x, x_TD), x_TD)
        plan = self.dispatcher.plan(routing)
        shared = SharedTerm(x, x_TD, self.shared_experts, self.shared_expert_gate)
        y_TD = self.dispatcher(x, plan, routing.weight_TK, shared)      # dispatch -> experts -> combine
        y_TD = shared.add_to(self.token_mask.add(y_TD, x_TD, routing.weight_TK))
        self.record(routing, plan)
        return restore(y_TD)

    def route(self, x, x_TD) -> Routing:
        """The gate's routing (FastMoE's module gates and `gate_hook` too), its combine weights
        rounded to the experts' dtype."""
        routing = self.gate_routing(self.gate, x)
        expert_dtype = autocast_dtype(x_TD) or x_TD.dtype        # what the experts return
        if not self.fp32_combine and expert_dtype in (torch.float16, torch.bfloat16):
            rounded_TK = routing.weight_TK.to(expert_dtype).to(routing.weight_TK.dtype)
            routing = routing.with_slots(weight_TK=rounded_TK)
        if self.gate_hook is not None:
            self.gate_hook(routing.expert_idx_TK, routing.weight_TK, None)
        return routing

    def expert_fn(self, x_RD, fwd_expert_count):
        """The local experts on rows in expert order; `fwd_expert_count` rows for each."""
        return self.experts(x_RD, fwd_expert_count)

    @property
    def traffic_bytes(self) -> dict:
        """Bytes this rank sent to other ranks in the last forward and its backward (so far):
        `[kind][pass][locality]`, kind "dispatch" (token rows out), "combine" (expert outputs
        back) or "routing" (counts, expert ids, routing weights), pass "forward" / "backward",
        locality "intra_node" / "inter_node" (nodes of `ranks_per_node` ranks). {} on one rank."""
        return {} if self.traffic is None else {k: {p: dict(by_loc) for p, by_loc in by_pass.items()}
                                                for k, by_pass in self.traffic.bytes.items()}

    def record(self, routing: Routing, plan: RoutingPlan):
        self.aux_loss = routing.aux_loss
        if plan.dedup is not None:
            self.last_overflow = plan.dedup.overflow
        self.last_counts_E = plan.counts_E.detach()     # rows this rank sent to each expert
        self.last_num_dropped = routing.num_dropped
        self.last_num_unrouted = routing.num_unrouted

    @property
    def routing_tally(self) -> Optional[RoutingTally]:
        """The last forward's routing on this rank, as sums (None before the first forward)."""
        if self.last_counts_E is None:
            return None
        return RoutingTally.of_forward(self.last_counts_E, self.last_num_dropped, self.last_num_unrouted,
                                       getattr(self.gate, "last_logits_TE", None))

    @property
    def routing_stats(self) -> dict:
        """The last forward's routing statistics on this rank as tensors, computed when read
        ({} before the first forward; keys and meaning in `fmoe.observe.stats`)."""
        tally = self.routing_tally
        return {} if tally is None else tally.stats()

    @property
    def num_overflowed(self) -> int:
        """sync_free: the (token, rank) pairs that did not fit `max_tokens_per_rank` in the last
        forward, summed over the ranks (the same on every rank); their slots added nothing. Reading
        it waits for the device; a warning says so when it is not 0."""
        if self.last_overflow is None:
            return 0
        n = int(self.last_overflow)
        if n:
            warnings.warn(f"{self.label}: {n} (token, rank) pairs over all ranks exceeded max_tokens_per_rank="
                          f"{self.max_tokens_per_rank} in the last forward and were dropped (raise the bound)")
        return n

    @property
    def num_dropped(self) -> int:
        """Slots dropped by the capacity limit in the last forward."""
        return 0 if self.last_num_dropped is None else int(self.last_num_dropped)


def check_weights_fit(layer: FMoE, gate, gate_bias, expert, d_hidden, activation, expert_bias):
    """The router and the stacked experts `layer` is about to make, refused before either is made
    when they cannot be (`fmoe.layer_checks.check_fits`)."""
    tensors = router_tensors(gate, layer.d_model, layer.tot_expert, gate_bias)
    if expert is None and d_hidden is not None:
        gated = is_gated(resolve_activation(activation))
        tensors += [(name, shape, 1) for name, shape in
                    expert_shapes(layer.num_expert, layer.d_model, d_hidden, gated, expert_bias).items()]
    hidden = "" if d_hidden is None else f", d_hidden={d_hidden}"
    check_fits(f"{type(layer).__name__}(num_expert={layer.num_expert}, d_model={layer.d_model}{hidden})",
               "the layer's weights need", tensors)


def routing_of_gate(gate: BaseGate, x) -> Routing:
    return gate.routing(x)


def mark_expert_parameters(module: nn.Module):
    """Tag expert parameters (FastMoE's `dp_comm = "none"`): they are not data-parallel replicas."""
    for p in module.parameters():
        p.dp_comm = "none"
        p.is_moe_expert = True


def collect_aux_loss(model: nn.Module, clear: bool = False) -> torch.Tensor:
    """The sum of every FMoE layer's auxiliary loss from its last forward (0 if none)."""
    total = None
    for module in model.modules():
        if isinstance(module, FMoE) and module.aux_loss is not None:
            total = module.aux_loss if total is None else total + module.aux_loss
            if clear:
                module.aux_loss = None
    if total is None:
        p = next(model.parameters(), None)
        return torch.zeros((), device=p.device if p is not None else None)
    return total
