"""FMoE: gate -> plan -> permute -> (exchange) -> experts -> (exchange) -> unpermute."""
import contextlib
import warnings
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from fmoe import kernels
from fmoe.autocast import autocast_dtype
from fmoe.distributed import dedup, exchange
from fmoe.distributed.check import check_expert_parallel_config
from fmoe.distributed.exchange import Traffic, ranks_per_node_of
from fmoe.distributed.groups import NodeGroup
from fmoe.distributed.schedule import group_size_from_env, schedule_enabled_by_env, scheduled_experts
from fmoe.distributed.shadow import BufferPool, ShadowPull, make_shadow_policy
from fmoe.distributed.slicing import gather_rows, slice_rows
from fmoe.distributed.timeout import set_current_layer
from fmoe.experts import GroupedExperts, ModuleListExperts, check_recompute
from fmoe.fastmoe_state import rename_router, stack_experts
from fmoe.gates import BaseGate, NaiveGate, make_gate
from fmoe.gates.base import Routing, accepts_keyword, routing_from_fastmoe_gate
from fmoe.gates.load_state import in_recompute
from fmoe.last_forward import ForgetsLastForward
from fmoe.routing import RoutingPlan, check_exchange
from fmoe.stats import RoutingTally


def positive_int(name: str, value, meaning: str = "") -> int:
    """`value` if it is an int >= 1; a bool is refused (True would silently mean 1)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int{meaning}, got {value!r}")
    return value


def check_activation(activation, width_in: int, d_hidden: int):
    """A callable activation must map the first GEMM's width (d_hidden, or 2 * d_hidden for a gated
    one) to d_hidden, or the second GEMM fails far from the cause."""
    if isinstance(activation, str):
        return
    probe = torch.zeros(2, width_in)
    out = activation(probe)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, d_hidden):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"activation {activation!r} must turn the first projection's rows [rows, {width_in}] "
                         f"into [rows, d_hidden={d_hidden}], it turned (2, {width_in}) into {shape}")


def check_world(world_size, moe_group) -> int:
    """The expert-parallel world: `world_size` ranks, which must exist when it is above 1."""
    positive_int("world_size", world_size)
    if world_size > 1 or moe_group is not None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                f"world_size={world_size} (or a moe_group) needs torch.distributed initialised first: "
                "call torch.distributed.init_process_group(...) before building the layer"
            )
        group_size = dist.get_world_size(moe_group)
        if world_size > 1 and world_size != group_size:
            raise ValueError(f"world_size={world_size} must equal the size of moe_group (or the world), {group_size}")
        world_size = group_size
    return world_size


def floating_parameters(module: nn.Module):
    """The module's floating-point parameters, walked without `named_modules` (its memo set stops
    Dynamo before torch 2.5)."""
    for p in module._parameters.values():
        if p is not None and p.is_floating_point():
            yield p
    for child in module._modules.values():
        if child is not None:
            yield from floating_parameters(child)


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
    (load, drops, router entropy: see `fmoe.stats`) describes that forward.

    `shared_expert` adds experts every token passes through, computed on every rank beside the
    routed ones (data-parallel parameters, not expert ones): a module, a list of modules, or an
    int (the hidden width of one MLP with the routed experts' activation). With
    `shared_expert_gate=True` their summed output is scaled by sigmoid(x @ w) per token
    (Qwen2-MoE's `shared_expert_gate`, a [1, d_model] linear).

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
                 exchange="slot", ranks_per_node=None, sync_free=False, max_tokens_per_rank=None):
        super().__init__()
        self.recompute = check_recompute(recompute)
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
                                          recompute=recompute)
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
        self.shadow_policy = make_shadow_policy(shadow, d_model, self.experts, num_expert, self.world_size)
        self.shadow_buffers = BufferPool()     # shadowing's flat buffers, kept from step to step
        self.exchange = check_exchange(exchange)
        if self.exchange == "node" and self.schedule:
            raise ValueError("exchange='node' does not run under the smart schedule (schedule=True or "
                             "FMOE_FASTER_SCHEDULE_ENABLE=1), which pipelines one exchange over the ranks: "
                             "pass exchange='rank' or 'slot'")
        self.ranks_per_node = ranks_per_node_of(self.world_size, ranks_per_node, whole_nodes=self.exchange == "node")
        self.traffic = None if self.world_size == 1 else Traffic(self.moe_rank, self.ranks_per_node)
        self.sync_free, self.max_tokens_per_rank = check_sync_free(sync_free, max_tokens_per_rank, self.exchange,
                                                                   self.shadow_policy, self.schedule)
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

    last_forward_attrs = ("aux_loss",)

    def __setattr__(self, name, value):
        if name == "experts" and isinstance(value, nn.Module):
            mark_expert_parameters(value)       # also for experts assigned after construction
        super().__setattr__(name, value)

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

    def check_input(self, x):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{self.label}: x must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"{self.label}: x must be a floating-point tensor, got dtype {x.dtype}")
        if x.dim() < 1 or x.shape[-1] != self.d_model:
            raise ValueError(f"{self.label}: x must have last dimension d_model={self.d_model}, "
                             f"got shape {tuple(x.shape)}")
        params = list(floating_parameters(self))
        devices = {p.device for p in params}
        if devices and x.device not in devices:
            raise ValueError(f"{self.label}: input is on {x.device}, the layer's parameters on "
                             f"{', '.join(sorted(map(str, devices)))}: move one to the other")
        dtypes = {p.dtype for p in params}
        # Under torch.autocast the GEMMs cast their operands, as nn.Linear's do.
        if dtypes and x.dtype not in dtypes and autocast_dtype(x) is None:
            raise ValueError(f"{self.label}: input dtype {x.dtype} does not match the layer's parameters' "
                             f"{', '.join(sorted(map(str, dtypes)))}: cast the input or the layer (layer.to(dtype)), "
                             "or run the model under torch.autocast")

    @torch.compiler.disable     # talks to the peers through the process group: not traceable, runs eagerly
    def check_with_peers(self, x):
        """Before the first exchange, every rank agrees on the layer; every forward names the layer
        in the collectives' timeout messages."""
        if self.layer_index is None:
            self.layer_index = check_expert_parallel_config(self, x)
        set_current_layer(self.label)

    def checked(self, y_ND):
        """The experts' output, refused unless it is rows of width d_model (a tree passes as it is)."""
        if isinstance(y_ND, torch.Tensor) and (y_ND.dim() != 2 or y_ND.shape[-1] != self.d_model):
            raise ValueError(f"{self.label}: the experts ({type(self.experts).__name__}) must return rows of width "
                             f"d_model={self.d_model}, they returned shape {tuple(y_ND.shape)}")
        return y_ND

    def mark_parallel_comm(self, expert_dp_comm="none"):
        """FastMoE's data-parallel tags: experts reduced over `expert_dp_comm`, the gate over "gate"."""
        for p in self.experts.parameters():
            p.dp_comm = expert_dp_comm
        for p in self.gate.parameters():
            p.dp_comm = "gate"

    def leaves_of(self, moe_inp):
        """The input's tensors, checked: floating point, sharing the leading dims; (leaves, spec, lead)."""
        leaves, spec = tree_flatten(moe_inp)
        if not leaves or not all(isinstance(t, torch.Tensor) for t in leaves):
            raise TypeError(f"x must be a torch.Tensor or a tree of them, got {type(moe_inp).__name__}")
        lead = leaves[0].shape[:-1]
        for t in leaves:
            if not t.is_floating_point():
                raise TypeError(f"x must be floating point, got dtype {t.dtype}")
            if t.dim() < 1 or t.shape[:-1] != lead:
                raise ValueError(f"every input tensor must share the leading dims {tuple(lead)}, got {tuple(t.shape)}")
        if isinstance(moe_inp, torch.Tensor) and moe_inp.shape[-1] != self.d_model:
            raise ValueError(f"x must have last dimension d_model={self.d_model}, got shape {tuple(moe_inp.shape)}")
        return leaves, spec, lead

    def forward(self, moe_inp):
        """FastMoE's trees and token slicing wrap the main path: rows in, `moe_rows`, rows out."""
        x, x_TD, restore = self.enter(moe_inp)
        return restore(self.moe_rows(x, x_TD))

    def moe_rows(self, x, x_TD):
        """The diagram: gate -> plan -> permute -> (dispatch) -> experts -> (combine) -> unpermute.

        `x` is the rows [T, D] (or FastMoE's tree of row tensors), `x_TD` its first tensor.
        """
        routing = self.route(x, x_TD)
        if self.traffic is not None and not in_recompute():
            self.traffic.reset()
        forced = self.sync_free and not torch.compiler.is_compiling()     # compiled: sync-free anyway
        with kernels.forced_sync_free() if forced else contextlib.nullcontext():
            plan = self.plan_of(routing)
            if plan.dedup is not None:
                self.last_overflow = plan.dedup.overflow
                y_TD = self.dedup_experts(x, plan, routing.weight_TK)
            elif self.runs_lean(x, plan):
                y_TD = self.lean_experts(x_TD, plan, routing.weight_TK)
            else:
                x_ND = tree_map(lambda t: kernels.permute(t, plan, self.backend), x)
                y_ND = self.checked(self.run_experts(x_ND, plan))
                y_TD = tree_map(lambda t: kernels.unpermute(t, plan, routing.weight_TK, self.backend), y_ND)
        if self.mask_dict is not None:
            y_TD = tree_map(lambda t: self.add_masked(t, x_TD, routing.weight_TK), y_TD)
        if self.shared_experts is not None:
            y_TD = self.add_shared(y_TD, x_TD)
        self.record(routing, plan)
        return y_TD

    def plan_of(self, routing: Routing) -> RoutingPlan:
        """The routing plan of this forward: rows in expert order and, across ranks, the exchange."""
        return RoutingPlan.build(routing.expert_idx_TK, self.tot_expert, self.world_size, self.moe_group,
                                 self.shadow_policy, exchange=self.exchange, ranks_per_node=self.ranks_per_node,
                                 traffic=self.traffic, bound=self.max_tokens_per_rank if self.sync_free else None,
                                 node_group=self.node_group and self.node_group.group)

    def enter(self, moe_inp):
        """Before the main path: the input checked, every tensor as rows [T, *] and, with a
        slice_group, this rank's slice of them. Returns (x, x_TD, restore): the rows (a tree of
        them for a tree input), the first tensor's rows, and `restore`, which undoes all of it for
        the output (slices gathered, leading dims back)."""
        if self.experts is None:
            raise RuntimeError("FMoE was built without experts: pass expert= or d_hidden=, or assign self.experts")
        if isinstance(moe_inp, torch.Tensor):
            self.check_input(moe_inp)
        leaves, spec, lead = self.leaves_of(moe_inp)
        if self.world_size > 1 and not (torch.compiler.is_compiling() and self.layer_index is not None):
            self.check_with_peers(leaves[0])    # once checked, a compiled forward leaves it out (fullgraph)
        rows = [t.reshape(-1, t.shape[-1]) for t in leaves]
        if self.slice_group is not None:
            rows = [slice_rows(t, self.slice_group) for t in rows]
        if hasattr(self.gate, "tokens_layout"):
            self.gate.tokens_layout = (tuple(lead), self.sequence_first)   # where its sequences are

        def restore(y):
            out, out_spec = tree_flatten(y)
            if self.slice_group is not None:
                out = [gather_rows(t, self.slice_group) for t in out]
            # Not a view of the rows: FSDP2 hooks the output.
            return tree_unflatten([t if len(lead) == 1 else t.reshape(*lead, t.shape[-1]).clone() for t in out],
                                  out_spec)
        x = rows[0] if isinstance(moe_inp, torch.Tensor) else tree_unflatten(rows, spec)
        return x, rows[0], restore

    def route(self, x, x_TD) -> Routing:
        """The gate's routing (FastMoE's module gates and `gate_hook` too), its combine weights
        rounded to the experts' dtype; FastMoE's masked tokens get no slot (index -1)."""
        routing = self.gate.routing(x) if isinstance(self.gate, BaseGate) else routing_from_fastmoe_gate(self.gate, x)
        expert_dtype = autocast_dtype(x_TD) or x_TD.dtype        # what the experts return
        if not self.fp32_combine and expert_dtype in (torch.float16, torch.bfloat16):
            rounded_TK = routing.weight_TK.to(expert_dtype).to(routing.weight_TK.dtype)
            routing = routing.with_slots(weight_TK=rounded_TK)
        if self.gate_hook is not None:
            self.gate_hook(routing.expert_idx_TK, routing.weight_TK, None)
        if self.mask_dict is not None:
            masked_TK = routing.expert_idx_TK.masked_fill(self.token_mask(x_TD)[:, None] != 0, -1)
            routing = routing.with_slots(expert_idx_TK=masked_TK)
        return routing

    def token_mask(self, x_TD):
        mask_T = self.mask.reshape(-1).to(x_TD.device)
        if mask_T.shape[0] != x_TD.shape[0]:
            raise ValueError(f"mask has {mask_T.shape[0]} entries, the input {x_TD.shape[0]} tokens")
        return mask_T

    def add_masked(self, y_TD, x_TD, weight_TK):
        """Masked tokens: each of their top-k slots yields mask_dict[k], weighted like an expert's output."""
        mask_T = self.token_mask(x_TD)
        weight_T1 = weight_TK.sum(-1, keepdim=True).to(y_TD.dtype)
        for k, value in self.mask_dict.items():
            picked_T1 = (mask_T == k)[:, None].to(y_TD.dtype)
            y_TD = y_TD + picked_T1 * weight_T1 * value.to(y_TD)
        return y_TD

    def expert_fn(self, x_RD, fwd_expert_count):
        """The local experts on rows in expert order; `fwd_expert_count` rows for each."""
        return self.experts(x_RD, fwd_expert_count)

    def add_shared(self, y_TD, x_TD):
        if not isinstance(y_TD, torch.Tensor):
            raise ValueError("shared_expert needs a single input tensor, not a tree of them")
        return y_TD + self.shared_forward(x_TD)

    def shared_forward(self, x_TD):
        """The shared experts' term: their summed output, gated per token when there is a gate."""
        y_TD = sum(expert(x_TD) for expert in self.shared_experts)
        if self.shared_expert_gate is not None:
            y_TD = torch.sigmoid(self.shared_expert_gate(x_TD)) * y_TD
        return y_TD

    def runs_lean(self, moe_inp, plan: RoutingPlan) -> bool:
        """Whether this forward takes the lean path (`lean_experts`): stacked experts with a known
        activation and recompute other than "none", the default expert_fn, one input tensor, and,
        across ranks, no shadowing or pipelined schedule (those run the rows as they are)."""
        experts = self.experts
        return (isinstance(moe_inp, torch.Tensor) and isinstance(experts, GroupedExperts) and experts.lean
                and type(experts).forward is GroupedExperts.forward and type(self).expert_fn is FMoE.expert_fn
                and not self.fp32_combine
                and (plan.exchange is None or (plan.shadow is None and not self.schedule)))

    def lean_experts(self, x_TD, plan: RoutingPlan, weight_TK):
        """The routed experts' output per token: each row weighted inside the experts' MLP, so the
        backward keeps x, the pre-activation and the routing, nothing of size T*K*D."""
        if plan.exchange is None:       # one op: gather, MLP, weighted combine
            y_TD = self.experts(x_TD, None, lean=True, plan=plan, weight_TK=weight_TK)
            return y_TD.to(autocast_dtype(x_TD) or x_TD.dtype)
        # The permuted rows only travel; the received ones are the experts' input, kept once.
        weight_N = weight_TK.reshape(-1).index_select(0, plan.slot_N)
        x_RD = exchange.dispatch(kernels.permute(x_TD, plan, self.backend), plan)
        weight_R = exchange.dispatch(weight_N[:, None], plan, "routing")[:, 0]
        y_ND = exchange.combine(self.experts(x_RD, plan.local_counts_e, weight_R, lean=True), plan)
        return kernels.sum_rows(y_ND, plan, self.backend).to(autocast_dtype(x_TD) or x_TD.dtype)

    def weighted_experts(self, x_TD, plan: RoutingPlan, weight_TK, run=None):
        """sum over k of weight_TK[t, k] * expert(x_TD[t]) for the experts of a one-rank `plan`,
        run by `run(x_ND, counts_e)` (default: `expert_fn`, lean where it can be)."""
        if run is None and self.runs_lean(x_TD, plan):
            return self.lean_experts(x_TD, plan, weight_TK)
        x_ND = tree_map(lambda t: kernels.permute(t, plan, self.backend), x_TD)
        y_ND = self.checked((run or self.expert_fn)(x_ND, plan.counts_E))
        return tree_map(lambda t: kernels.unpermute(t, plan, weight_TK, self.backend), y_ND)

    def dedup_experts(self, x_TD, plan: RoutingPlan, weight_TK):
        """The routed experts' weighted sum per token over the rank or node exchange
        (`fmoe.distributed.dedup`), plus the shadowed experts', computed at home."""
        if (self.shadow_policy is not None or self.schedule) and (not isinstance(x_TD, torch.Tensor)
                                                                  or type(self).expert_fn is not FMoE.expert_fn):
            raise ValueError("shadow / schedule need a single input tensor and the default expert_fn")
        if self.schedule and self.fp32_combine and x_TD.dtype != torch.float32:
            raise ValueError(f"schedule=True with exchange='rank' sends the routing weights in the rows' dtype "
                             f"({x_TD.dtype}): it cannot keep fp32_combine=True's fp32 weights; use fp32 input")
        # The pull starts first, so it travels while the other rows are dispatched and computed.
        pull = None if plan.shadow is None else ShadowPull(self.experts, plan.shadow, self.num_expert,
                                                           self.moe_group, self.shadow_policy.overlap,
                                                           fold=not self.schedule, pool=self.shadow_buffers)
        run_here = None if pull is None or self.schedule else pull.run_local
        schedule = (self.schedule_group_size, list(self.experts.parameters())) if self.schedule else None
        y_TD = dedup.run_hop(plan.dedup, x_TD, weight_TK,
                             lambda x_QD, local, w_QK: self.weighted_experts(x_QD, local, w_QK, run_here),
                             self.backend, schedule)
        if pull is None:
            return y_TD
        return y_TD + self.weighted_experts(x_TD, plan.home, weight_TK, lambda x_SD, counts_S: pull.forward(x_SD))

    @property
    def traffic_bytes(self) -> dict:
        """Bytes this rank sent to other ranks in the last forward and its backward (so far):
        `[kind][pass][locality]`, kind "dispatch" (token rows out), "combine" (expert outputs
        back) or "routing" (counts, expert ids, routing weights), pass "forward" / "backward",
        locality "intra_node" / "inter_node" (nodes of `ranks_per_node` ranks). {} on one rank."""
        return {} if self.traffic is None else {k: {p: dict(by_loc) for p, by_loc in by_pass.items()}
                                                for k, by_pass in self.traffic.bytes.items()}

    def run_experts(self, x_ND, plan: RoutingPlan):
        """Rows in expert order -> expert outputs in the same order, wherever the experts live."""
        if plan.exchange is None:
            return self.expert_fn(x_ND, plan.counts_E)
        if not isinstance(x_ND, torch.Tensor) or type(self).expert_fn is not FMoE.expert_fn:
            if self.schedule or self.shadow_policy is not None:
                raise ValueError("shadow / schedule need a single input tensor and the default expert_fn")
            y_RD = self.expert_fn(tree_map(lambda x: exchange.dispatch(x, plan), x_ND), plan.local_counts_e)
            return tree_map(lambda y: exchange.combine(y, plan), y_RD)
        x_sent, x_home = x_ND.split([x_ND.shape[0] - plan.num_shadow_rows, plan.num_shadow_rows])
        # The pull starts first, so it travels while the other rows are dispatched and computed.
        pull = None if plan.shadow is None else ShadowPull(self.experts, plan.shadow, self.num_expert,
                                                           self.moe_group, self.shadow_policy.overlap,
                                                           fold=not self.schedule, pool=self.shadow_buffers)
        if self.schedule:
            y_sent = scheduled_experts(self.experts, x_sent, plan.exchange, self.schedule_group_size)
        else:
            x_RD = exchange.dispatch(x_sent, plan)
            y_RD = (pull.run_local if pull is not None else self.expert_fn)(x_RD, plan.local_counts_e)
            y_sent = exchange.combine(y_RD, plan)
        if pull is None:
            return y_sent
        return torch.cat([y_sent, pull.forward(x_home)])

    def record(self, routing, plan):
        self.aux_loss = routing.aux_loss
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
        ({} before the first forward; keys and meaning in `fmoe.stats`)."""
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


def check_sync_free(sync_free, max_tokens_per_rank, exchange: str, shadow_policy, schedule: bool = False):
    """(sync_free, max_tokens_per_rank) checked: the sync-free exchange is a bounded rank or node one."""
    if not isinstance(sync_free, bool):
        raise ValueError(f"sync_free must be a bool, got {sync_free!r}")
    if not sync_free:
        if max_tokens_per_rank is not None:
            raise ValueError("max_tokens_per_rank bounds the sync-free exchange: pass sync_free=True with it")
        return False, None
    positive_int("max_tokens_per_rank", max_tokens_per_rank,
                 " (sync_free=True: the rows each rank sends each rank, the same on every rank)")
    if exchange == "slot":
        raise ValueError("sync_free=True needs exchange='rank' or 'node' (the bounded deduplicated exchange), "
                         "got exchange='slot'")
    if shadow_policy is not None:
        raise ValueError("sync_free=True cannot shadow: the shadowing policy chooses experts on the host")
    if schedule:
        raise ValueError("sync_free=True does not run under the smart schedule, whose pipeline reads the splits")
    return True, max_tokens_per_rank


def make_shared_experts(shared_expert, d_model: int, activation, bias: bool,
                        recompute: str = "activation") -> Optional[nn.ModuleList]:
    """FMoE's `shared_expert` argument as a ModuleList (None when there are none)."""
    if shared_expert is None:
        return None
    if isinstance(shared_expert, nn.Module):
        shared_expert = [shared_expert]
    elif isinstance(shared_expert, int) and not isinstance(shared_expert, bool):
        if shared_expert < 1:
            raise ValueError(f"shared_expert as a d_hidden must be a positive int, got {shared_expert!r}")
        shared_expert = [SharedExpertMLP(d_model, shared_expert, activation, bias, recompute)]
    if not isinstance(shared_expert, (list, tuple, nn.ModuleList)) or not shared_expert or \
            not all(isinstance(m, nn.Module) for m in shared_expert):
        raise ValueError("shared_expert must be a module, a non-empty list of modules or a d_hidden int, "
                         f"got {shared_expert!r}")
    return nn.ModuleList(shared_expert)


class SharedExpertMLP(nn.Module):
    """One dense MLP, the routed experts' MLP without the routing (one expert of a GroupedExperts)."""

    def __init__(self, d_model: int, d_hidden: int, activation="gelu", bias: bool = True,
                 recompute: str = "activation"):
        super().__init__()
        self.mlp = GroupedExperts(1, d_model, d_hidden, activation, bias=bias, recompute=recompute)

    def forward(self, x_TD):
        if not self.mlp.lean:
            return self.mlp.expert_forward(0, x_TD)
        # Every token is one row of the single expert: it keeps x and the pre-activation only.
        return self.mlp(x_TD, torch.full((1,), x_TD.shape[0], dtype=torch.int64, device=x_TD.device), lean=True)


def is_plain_module_gate(gate) -> bool:
    return isinstance(gate, type) and issubclass(gate, nn.Module) and not issubclass(gate, BaseGate)


def resolve_num_expert(num_expert, expert) -> int:
    """Experts per rank: FastMoE's `expert=[A, B, ...]` gives the count; otherwise 32 by default."""
    if isinstance(expert, (list, tuple)):
        if num_expert is not None and num_expert != len(expert):
            raise ValueError(f"num_expert={num_expert} but expert lists {len(expert)} expert classes")
        num_expert = len(expert)
    num_expert = 32 if num_expert is None else num_expert
    if not isinstance(num_expert, int) or num_expert < 1:
        raise ValueError(f"num_expert must be a positive int (experts per rank), got {num_expert!r}")
    return num_expert


def resolve_slice_group(mp_group, slice_group):
    """FastMoE's `mp_group` is the older name of `slice_group`; one group of size 1 is no slicing."""
    if mp_group is not None and slice_group is not None and mp_group is not slice_group:
        raise ValueError("pass slice_group or its old name mp_group, not both")
    group = slice_group if slice_group is not None else mp_group
    if group is None:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("slice_group needs torch.distributed initialised first")
    return group if dist.get_world_size(group) > 1 else None


def check_mask(mask, mask_dict):
    if (mask is None) != (mask_dict is None):
        raise ValueError("mask and mask_dict go together: pass both (FastMoE ignores one alone) or neither")
    if mask is None:
        return None, None
    if not isinstance(mask, torch.Tensor) or mask.is_floating_point():
        raise TypeError(f"mask must be an integer tensor with one entry per token, got {mask!r}")
    if not isinstance(mask_dict, dict) or not all(isinstance(v, torch.Tensor) for v in mask_dict.values()):
        raise TypeError("mask_dict must map mask values to tensors (the output of a masked token)")
    if 0 in mask_dict:
        raise ValueError("mask_dict cannot hold 0: mask 0 marks the tokens that are routed")
    return mask, mask_dict


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
