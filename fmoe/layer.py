"""FMoE: gate -> plan -> permute -> (exchange) -> experts -> (exchange) -> unpermute."""
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from fmoe import kernels
from fmoe.distributed import exchange
from fmoe.distributed.check import check_expert_parallel_config
from fmoe.distributed.schedule import group_size_from_env, schedule_enabled_by_env, scheduled_experts
from fmoe.distributed.shadow import ShadowPull, make_shadow_policy
from fmoe.distributed.timeout import set_current_layer
from fmoe.experts import GroupedExperts, ModuleListExperts
from fmoe.gates import NaiveGate, make_gate
from fmoe.gates.base import accepts_keyword
from fmoe.routing import RoutingPlan


def positive_int(name: str, value, meaning: str = "") -> int:
    """`value` if it is an int >= 1; a bool is refused (True would silently mean 1)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int{meaning}, got {value!r}")
    return value


def check_activation(activation, d_hidden: int):
    """A callable activation must keep the hidden width, or the second GEMM fails far from the cause."""
    if isinstance(activation, str):
        return
    probe = torch.zeros(2, d_hidden)
    out = activation(probe)
    if not isinstance(out, torch.Tensor) or out.shape != probe.shape:
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"activation {activation!r} must keep its input's shape [rows, d_hidden={d_hidden}], "
                         f"it turned (2, {d_hidden}) into {shape}")


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


class FMoE(nn.Module):
    """A Mixture-of-Experts layer with FastMoE's constructor.

    `num_expert` experts live on each of `world_size` ranks. Experts are either `expert` (a
    module class, instantiated per expert as `expert(d_model)`, or a list of classes) or, with
    `d_hidden`, stacked MLP experts that run as grouped GEMMs. `shadow` (True, a ShadowPolicy, or
    FMOE_FASTER_SHADOW_ENABLE=1) turns on FasterMoE's shadowing of hot experts, `schedule` (or
    FMOE_FASTER_SCHEDULE_ENABLE=1) its pipelined exchange in groups of `schedule_group_size`
    ranks (FMOE_FASTER_GROUP_SIZE). Input of any shape
    [..., d_model]; output the same shape. After every forward the layer holds `aux_loss`,
    `num_dropped` and `last_counts_E` (rows each expert received).

    `shared_expert` adds experts every token passes through, computed on every rank beside the
    routed ones (data-parallel parameters, not expert ones): a module, a list of modules, or an
    int (the hidden width of one MLP with the routed experts' activation). With
    `shared_expert_gate=True` their summed output is scaled by sigmoid(x @ w) per token
    (Qwen2-MoE's `shared_expert_gate`, a [1, d_model] linear).
    """

    def __init__(self, num_expert=32, d_model=1024, world_size=1, moe_group=None, top_k=2, gate=NaiveGate,
                 expert=None, gate_hook=None, gate_bias=True, d_hidden=None, activation="gelu",
                 expert_bias=True, gate_kwargs=None, backend: Optional[str] = None, shadow=None,
                 schedule=None, schedule_group_size=None, shared_expert=None, shared_expert_gate=False):
        super().__init__()
        positive_int("d_model", d_model)
        positive_int("num_expert", num_expert, " (experts per rank)")
        if d_hidden is not None:
            positive_int("d_hidden", d_hidden)
        self.world_size = check_world(world_size, moe_group)
        self.moe_group = moe_group
        self.num_expert = num_expert
        self.d_model = d_model
        self.tot_expert = num_expert * self.world_size
        kernels.check_backend(backend)      # a typo here (or in FMOE_BACKEND) fails now, not at the first forward
        self.backend = backend
        gate_kwargs = dict(gate_kwargs or {})
        if isinstance(gate, str) or isinstance(gate, type) and accepts_keyword(gate, "gate_bias"):
            gate_kwargs.setdefault("gate_bias", gate_bias)
        self.gate = make_gate(gate, d_model, num_expert, self.world_size, top_k, **gate_kwargs)
        self.top_k = self.gate.top_k
        if hasattr(self.gate, "ep_rank"):
            self.gate.ep_rank = self.moe_rank       # the topology-aware gate needs to know its node
        if self.gate.tot_expert != self.tot_expert:
            raise ValueError(f"gate routes to {self.gate.tot_expert} experts, the layer has {self.tot_expert}")
        if isinstance(expert, nn.Module):
            self.experts = expert
        elif expert is not None:
            self.experts = ModuleListExperts(expert, num_expert, d_model)
        elif d_hidden is not None:
            self.experts = GroupedExperts(num_expert, d_model, d_hidden, activation, bias=expert_bias, backend=backend)
            check_activation(self.experts.activation, d_hidden)
        else:
            raise ValueError("FMoE needs its experts: pass expert= (a module class) or d_hidden= (stacked MLP experts)")
        mark_expert_parameters(self.experts)
        self.shared_experts = make_shared_experts(shared_expert, d_model, activation, expert_bias)
        if shared_expert_gate and self.shared_experts is None:
            raise ValueError("shared_expert_gate=True needs shared_expert= (a module, a list of them or a d_hidden)")
        self.shared_expert_gate = nn.Linear(d_model, 1, bias=False) if shared_expert_gate else None
        self.schedule = schedule_enabled_by_env() if schedule is None else bool(schedule)
        self.schedule_group_size = positive_int("schedule_group_size",
                                                schedule_group_size if schedule_group_size is not None
                                                else group_size_from_env())
        self.shadow_policy = make_shadow_policy(shadow, d_model, self.experts, num_expert, self.world_size)
        self.gate_hook = gate_hook
        self.aux_loss = None
        self.last_counts_E = None
        self.last_num_dropped = None
        self.layer_index = None        # set by the check with the other ranks, before the first exchange

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
        params = [p for p in self.parameters() if p.is_floating_point()]
        devices = {p.device for p in params}
        if devices and x.device not in devices:
            raise ValueError(f"{self.label}: input is on {x.device}, the layer's parameters on "
                             f"{', '.join(sorted(map(str, devices)))}: move one to the other")
        dtypes = {p.dtype for p in params}
        if dtypes and x.dtype not in dtypes:
            raise ValueError(f"{self.label}: input dtype {x.dtype} does not match the layer's parameters' "
                             f"{', '.join(sorted(map(str, dtypes)))}: cast the input or the layer (layer.to(dtype))")

    @torch.compiler.disable     # talks to the peers through the process group: not traceable, runs eagerly
    def check_with_peers(self, x):
        """Before the first exchange, every rank agrees on the layer; every forward names the layer
        in the collectives' timeout messages."""
        if self.layer_index is None:
            self.layer_index = check_expert_parallel_config(self, x)
        set_current_layer(self.label)

    def check_expert_output(self, y_ND):
        if y_ND.dim() != 2 or y_ND.shape[-1] != self.d_model:
            raise ValueError(f"{self.label}: the experts ({type(self.experts).__name__}) must return rows of width "
                             f"d_model={self.d_model}, they returned shape {tuple(y_ND.shape)}")

    def forward(self, x):
        self.check_input(x)
        if self.world_size > 1:
            self.check_with_peers(x)
        x_TD = x.reshape(-1, self.d_model)
        routing = self.gate.routing(x_TD)
        if self.gate_hook is not None:
            self.gate_hook(routing.expert_idx_TK, routing.weight_TK, None)
        plan = RoutingPlan.build(routing.expert_idx_TK, self.tot_expert, self.world_size, self.moe_group,
                                 self.shadow_policy)
        x_ND = kernels.permute(x_TD, plan, self.backend)
        y_ND = self.run_experts(x_ND, plan)
        self.check_expert_output(y_ND)
        y_TD = kernels.unpermute(y_ND, plan, routing.weight_TK, self.backend)
        if self.shared_experts is not None:
            y_TD = y_TD + self.shared_forward(x_TD)
        self.record(routing, plan)
        return y_TD.reshape(x.shape)

    def shared_forward(self, x_TD):
        """The shared experts' term: their summed output, gated per token when there is a gate."""
        y_TD = sum(expert(x_TD) for expert in self.shared_experts)
        if self.shared_expert_gate is not None:
            y_TD = torch.sigmoid(self.shared_expert_gate(x_TD)) * y_TD
        return y_TD

    def run_experts(self, x_ND, plan: RoutingPlan):
        """Rows in expert order -> expert outputs in the same order, wherever the experts live."""
        if plan.exchange is None:
            return self.experts(x_ND, plan.counts_E)
        x_sent, x_home = x_ND.split([x_ND.shape[0] - plan.num_shadow_rows, plan.num_shadow_rows])
        # The pull starts first, so it travels while the other rows are dispatched and computed.
        pull = None if plan.shadow is None else ShadowPull(self.experts, plan.shadow, self.num_expert,
                                                           self.moe_group, self.shadow_policy.overlap)
        if self.schedule:
            y_sent = scheduled_experts(self.experts, x_sent, plan.exchange, self.schedule_group_size)
        else:
            x_RD = exchange.dispatch(x_sent, plan)
            y_RD = self.experts(x_RD, plan.local_counts_e)
            y_sent = exchange.combine(y_RD, plan)
        if pull is None:
            return y_sent
        return torch.cat([y_sent, pull.forward(x_home)])

    def record(self, routing, plan):
        self.aux_loss = routing.aux_loss
        self.last_counts_E = plan.counts_E.detach()     # rows this rank sent to each expert
        self.last_num_dropped = routing.num_dropped

    @property
    def num_dropped(self) -> int:
        """Slots dropped by the capacity limit in the last forward."""
        return 0 if self.last_num_dropped is None else int(self.last_num_dropped)


def make_shared_experts(shared_expert, d_model: int, activation, bias: bool) -> Optional[nn.ModuleList]:
    """FMoE's `shared_expert` argument as a ModuleList (None when there are none)."""
    if shared_expert is None:
        return None
    if isinstance(shared_expert, nn.Module):
        shared_expert = [shared_expert]
    elif isinstance(shared_expert, int) and not isinstance(shared_expert, bool):
        if shared_expert < 1:
            raise ValueError(f"shared_expert as a d_hidden must be a positive int, got {shared_expert!r}")
        shared_expert = [SharedExpertMLP(d_model, shared_expert, activation, bias)]
    if not isinstance(shared_expert, (list, tuple, nn.ModuleList)) or not shared_expert or \
            not all(isinstance(m, nn.Module) for m in shared_expert):
        raise ValueError("shared_expert must be a module, a non-empty list of modules or a d_hidden int, "
                         f"got {shared_expert!r}")
    return nn.ModuleList(shared_expert)


class SharedExpertMLP(nn.Module):
    """One dense MLP, the routed experts' MLP without the routing (one expert of a GroupedExperts)."""

    def __init__(self, d_model: int, d_hidden: int, activation="gelu", bias: bool = True):
        super().__init__()
        self.mlp = GroupedExperts(1, d_model, d_hidden, activation, bias=bias)

    def forward(self, x_TD):
        return self.mlp.expert_forward(0, x_TD)


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
