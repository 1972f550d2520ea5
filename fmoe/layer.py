"""FMoE: gate -> plan -> permute -> (exchange) -> experts -> (exchange) -> unpermute."""
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from fmoe import kernels
from fmoe.distributed import exchange
from fmoe.distributed.check import check_expert_parallel_config
from fmoe.distributed.schedule import group_size_from_env, schedule_enabled_by_env, scheduled_experts
from fmoe.distributed.shadow import make_shadow_policy, shadowed_experts_forward
from fmoe.experts import GroupedExperts, ModuleListExperts
from fmoe.gates import NaiveGate, make_gate
from fmoe.routing import RoutingPlan


def check_world(world_size, moe_group) -> int:
    """The expert-parallel world: `world_size` ranks, which must exist when it is above 1."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
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
    """

    def __init__(self, num_expert=32, d_model=1024, world_size=1, moe_group=None, top_k=2, gate=NaiveGate,
                 expert=None, gate_hook=None, gate_bias=True, d_hidden=None, activation="gelu",
                 expert_bias=True, gate_kwargs=None, backend: Optional[str] = None, shadow=None,
                 schedule=None, schedule_group_size=None):
        super().__init__()
        if not isinstance(d_model, int) or d_model < 1:
            raise ValueError(f"d_model must be a positive int, got {d_model!r}")
        if not isinstance(num_expert, int) or num_expert < 1:
            raise ValueError(f"num_expert must be a positive int (experts per rank), got {num_expert!r}")
        self.world_size = check_world(world_size, moe_group)
        self.moe_group = moe_group
        self.num_expert = num_expert
        self.d_model = d_model
        self.tot_expert = num_expert * self.world_size
        self.backend = backend
        gate_kwargs = dict(gate_kwargs or {})
        if isinstance(gate, (str, type)):
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
        else:
            raise ValueError("FMoE needs its experts: pass expert= (a module class) or d_hidden= (stacked MLP experts)")
        mark_expert_parameters(self.experts)
        self.schedule = schedule_enabled_by_env() if schedule is None else bool(schedule)
        self.schedule_group_size = schedule_group_size or group_size_from_env()
        if not isinstance(self.schedule_group_size, int) or self.schedule_group_size < 1:
            raise ValueError(f"schedule_group_size must be a positive int, got {self.schedule_group_size!r}")
        self.shadow_policy = make_shadow_policy(shadow, d_model, d_hidden if expert is None else None,
                                                self.world_size)
        self.gate_hook = gate_hook
        self.aux_loss = None
        self.last_counts_E = None
        self.last_num_dropped = None
        self.checked_with_peers = False

    @property
    def moe_rank(self) -> int:
        """This rank's place in the expert-parallel group: it holds experts
        [moe_rank * num_expert, (moe_rank + 1) * num_expert)."""
        return dist.get_rank(self.moe_group) if self.world_size > 1 else 0

    def check_input(self, x):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"x must be a floating-point tensor, got dtype {x.dtype}")
        if x.dim() < 1 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must have last dimension d_model={self.d_model}, got shape {tuple(x.shape)}")

    def forward(self, x):
        self.check_input(x)
        if self.world_size > 1 and not self.checked_with_peers:
            check_expert_parallel_config(self)
            self.checked_with_peers = True
        x_TD = x.reshape(-1, self.d_model)
        routing = self.gate.routing(x_TD)
        if self.gate_hook is not None:
            self.gate_hook(routing.expert_idx_TK, routing.weight_TK, None)
        plan = RoutingPlan.build(routing.expert_idx_TK, self.tot_expert, self.world_size, self.moe_group,
                                 self.shadow_policy)
        x_ND = kernels.permute(x_TD, plan, self.backend)
        y_ND = self.run_experts(x_ND, plan)
        y_TD = kernels.unpermute(y_ND, plan, routing.weight_TK, self.backend)
        self.record(routing, plan)
        return y_TD if x.dim() == 2 else y_TD.reshape(x.shape).clone()   # not a view: FSDP2 hooks the output

    def run_experts(self, x_ND, plan: RoutingPlan):
        """Rows in expert order -> expert outputs in the same order, wherever the experts live."""
        if plan.exchange is None:
            return self.experts(x_ND, plan.counts_E)
        x_sent, x_home = x_ND.split([x_ND.shape[0] - plan.num_shadow_rows, plan.num_shadow_rows])
        if self.schedule:
            y_sent = scheduled_experts(self.experts, x_sent, plan.exchange, self.schedule_group_size)
        else:
            x_RD = exchange.dispatch(x_sent, plan)
            y_RD = self.experts(x_RD, plan.local_counts_e)
            y_sent = exchange.combine(y_RD, plan)
        if plan.shadow is None:
            return y_sent
        y_home = shadowed_experts_forward(self.experts, x_home, plan.shadow, self.num_expert, self.moe_group)
        return torch.cat([y_sent, y_home])

    def record(self, routing, plan):
        self.aux_loss = routing.aux_loss
        self.last_counts_E = plan.counts_E.detach()     # rows this rank sent to each expert
        self.last_num_dropped = routing.num_dropped

    @property
    def num_dropped(self) -> int:
        """Slots dropped by the capacity limit in the last forward."""
        return 0 if self.last_num_dropped is None else int(self.last_num_dropped)


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
