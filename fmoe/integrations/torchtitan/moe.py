"""A torchtitan MoE module replaced by fmoe's layer, its router and shared experts carried over.

    fmoe.integrations.torchtitan.convert(model)                     # one process
    fmoe.integrations.torchtitan.convert(model, ep_mesh=mesh["ep"])  # expert parallelism

`TorchtitanMoE` is an `FMoE` (fmoe's routing plan, exchanges, overlap, shadowing, statistics and
router replay apply as to any fmoe layer) built from a torchtitan `MoE`:

- the router is fmoe's `RouterGate` with torchtitan's choices (`score_func`, `top_k`, `route_norm`,
  `route_scale`, node-limited groups) over torchtitan's own router projection, computed in float32
  as torchtitan computes it, and its selection steered by torchtitan's `expert_bias_E`;
- the experts are torchtitan's module run by fmoe's kernels (`fmoe.integrations.torchtitan.experts`),
  by default in the layer's dtype (the input's, or torch.autocast's) through fmoe's lean MLP, as every
  fmoe layer: under torchtitan's bf16 mixed precision that is bf16, as torchtitan's experts compute.
  `experts_dtype=torch.bfloat16` casts rows and weights to it around the two GEMMs whatever the model's
  dtype, which is what torchtitan's experts do (a float32 model then trains as torchtitan's does, to the
  bit in the experts), on fmoe's plain (not lean) path;
- the shared experts are torchtitan's `FeedForward`, computed beside the exchange.

Its parameters and buffers keep torchtitan's names (`router.gate.weight`,
`routed_experts.inner_experts.w1_EFD`, `shared_experts.w1.weight`, `expert_bias_E`), so torchtitan's
DCP checkpoints load into either model, torchtitan's initialisation (`init_states`) and parallelize
plans find what they look for, and its optimizer hook for auxiliary-loss-free balancing reads the
layer's `tokens_per_expert_E` and moves its `expert_bias_E` (`load_balance_coeff`), as for its own MoE.
Under the hood fmoe reaches the same modules by its own names (`gate`, `experts`, `shared_experts`):
plain attributes aliasing the registered children, so nothing is held twice.
"""
from typing import Optional

import torch
from torch import nn

from fmoe.gates.base import router_logits
from fmoe.gates.router import RouterGate
from fmoe.kernels.fp8 import check_fp8
from fmoe.integrations.torchtitan.experts import layout_of, local, swap_experts
from fmoe.layer import FMoE

# FMoE options `convert` passes on (the router, the experts and the shared experts are torchtitan's).
MOE_OPTIONS = ("backend", "shadow", "schedule", "schedule_group_size", "recompute", "exchange", "ranks_per_node",
               "sync_free", "max_tokens_per_rank", "overlap", "fp32_combine", "fp8")


class TorchtitanRouterGate(RouterGate):
    """fmoe's RouterGate set as a torchtitan `TokenChoiceTopKRouter` routes: its projection is the router's
    own `gate` Linear (logits in float32, as torchtitan's autocast gives them) and the selection bias is
    the MoE's `expert_bias_E` (read from `bias_holder`, the layer, whose buffer torchtitan's hook moves)."""

    def __init__(self, router: nn.Module, world_size: int):
        E, groups = router.num_experts, router.num_expert_groups
        projection = router.gate
        super().__init__(projection.in_features, E // world_size, world_size, router.top_k,
                         score=router.score_func, norm_topk_prob=bool(router.route_norm),
                         routed_scaling_factor=float(router.route_scale), n_group=groups or 1,
                         topk_group=router.num_limited_groups or 1, group_score="top2_sum",
                         gate_bias=projection.bias is not None)
        self.gate = projection              # torchtitan's Linear: its parameters, its name (router.gate.weight)
        object.__setattr__(self, "bias_holder", None)

    def router_logits(self, x_TD):
        # float32 at least, as torchtitan's autocast gives its router on a GPU
        return router_logits(x_TD, self.gate.weight, self.gate.bias)

    def biased(self, scores_TE):
        bias_E = None if self.bias_holder is None else self.bias_holder.expert_bias_E
        return scores_TE if bias_E is None else scores_TE + local(bias_E).to(scores_TE.dtype)


class TorchtitanMoE(FMoE):
    """fmoe's layer in place of a torchtitan `MoE` (see the module docstring). Made by `convert`."""

    def __init__(self, titan_moe: nn.Module, ep_size: int = 1, moe_group=None, experts_dtype=None, **options):
        check_titan_moe(titan_moe, ep_size, options)
        router, experts = titan_moe.router, titan_moe.routed_experts.inner_experts
        E = router.num_experts
        experts = swap_experts(experts, dtype=experts_dtype, backend=options.get("backend"),
                               recompute=options.get("recompute", "activation"), fp8=options.pop("fp8", None))
        if experts.num_expert != E // ep_size:
            raise ValueError(f"the experts module holds {experts.num_expert} experts here; {E} experts over "
                             f"ep_size={ep_size} ranks leave {E // ep_size} to each (convert shards them)")
        gate = TorchtitanRouterGate(router, ep_size)
        shared = titan_moe.shared_experts
        super().__init__(num_expert=E // ep_size, d_model=experts.d_model, world_size=ep_size, moe_group=moe_group,
                         top_k=router.top_k, gate=gate, expert=experts, shared_expert=shared, **options)
        # torchtitan's names are the registered children; FMoE's are attributes aliasing them.
        for fmoe_name in ("gate", "experts", "shared_experts"):
            self._modules.pop(fmoe_name, None)
        self.router = gate
        self.routed_experts = titan_moe.routed_experts      # holds inner_experts (and torchtitan's dispatcher)
        if shared is not None:
            self.shared_experts = shared
        self.__dict__.update(gate=gate, experts=experts, shared_experts=None if shared is None else [shared])
        self.load_balance_coeff = titan_moe.load_balance_coeff
        if titan_moe.expert_bias_E is None:
            self.expert_bias_E = None
        else:
            self.register_buffer("expert_bias_E", titan_moe.expert_bias_E, persistent=True)
        self.register_buffer("tokens_per_expert_E", titan_moe.tokens_per_expert_E, persistent=False)
        object.__setattr__(gate, "bias_holder", self)
        self.train(titan_moe.training)

    def forward(self, x_BLD):
        out_BLD = super().forward(x_BLD)
        if self.training:       # what torchtitan's MoE counts for its balancing hook: this rank's tokens
            with torch.no_grad():
                local(self.tokens_per_expert_E).add_(local(self.last_counts_E).to(self.tokens_per_expert_E.dtype))
        return out_BLD

    def _init_self_buffers(self, *, buffer_device: Optional[torch.device] = None) -> None:
        """torchtitan's `init_states` resets the balancing buffers through this, as for its MoE."""
        device = buffer_device or self.tokens_per_expert_E.device
        E = self.tot_expert
        self.tokens_per_expert_E = torch.zeros(E, dtype=torch.float32, device=device)
        if self.load_balance_coeff is not None:
            self.expert_bias_E = torch.zeros(E, dtype=torch.float32, device=device)

    def init_states(self, *, buffer_device: Optional[torch.device] = None) -> None:
        """torchtitan's initialisation of the carried-over modules (router, experts, shared experts),
        then the balancing buffers; fmoe's own modules hold no other tensors."""
        for child in (self.router.gate, self.experts, self.shared_experts):
            if child is not None and hasattr(child, "init_states"):
                child.init_states(buffer_device=buffer_device)
        self._init_self_buffers(buffer_device=buffer_device)


def check_titan_moe(titan_moe: nn.Module, ep_size: int, options: dict) -> None:
    """ValueError, naming what, when `titan_moe` cannot become a TorchtitanMoE with these arguments."""
    bad = sorted(set(options) - set(MOE_OPTIONS))
    if bad:
        raise ValueError(f"options {bad} are not taken: torchtitan's router, experts and shared experts carry "
                         f"over; the layer takes {list(MOE_OPTIONS)}")
    check_fp8(options.get("fp8"))
    router = titan_moe.router
    E = router.num_experts
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1 or E % ep_size:
        raise ValueError(f"ep_size={ep_size!r} must be a positive divisor of the {E} experts")
    if getattr(router, "_debug_force_load_balance", False):
        raise ValueError("torchtitan's router has _debug_force_load_balance=True (round-robin routing for "
                         "debugging); fmoe's layer routes by the scores: turn it off, or keep torchtitan's MoE")
    if router.num_expert_groups is not None and router.num_limited_groups is None:
        raise ValueError("torchtitan's router sets num_expert_groups without num_limited_groups")
    experts = titan_moe.routed_experts.inner_experts
    layout_of(experts)
    for name, p in experts.named_parameters(recurse=False):
        if hasattr(p, "device_mesh"):
            sizes = dict(zip(p.device_mesh.mesh_dim_names or (), p.device_mesh.shape))
            if sizes.get("tp", 1) > 1:
                raise ValueError(f"its experts' {name} is split by tensor parallelism (mesh {sizes}); fmoe's layer "
                                 "runs whole experts: convert a model parallelized without tp, or keep torchtitan's MoE")
            if sizes.get("ep", 1) != ep_size:
                raise ValueError(f"its experts' {name} is sharded over an 'ep' mesh dimension of {sizes.get('ep', 1)} "
                                 f"ranks, ep_mesh has {ep_size}")
        elif p.shape[0] not in (E, E // ep_size):
            raise ValueError(f"its experts' {name} holds {p.shape[0]} experts: neither all {E} nor the {E // ep_size} "
                             f"of one of ep_size={ep_size} ranks")


def find_titan_moes(model: nn.Module):
    """(name, module) of each torchtitan MoE module of `model` (fmoe's replacements are not)."""
    from torchtitan.models.common.moe import MoE
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]


def convert(model: nn.Module, ep_mesh=None, experts_dtype=None, **options) -> nn.Module:
    """Every torchtitan MoE module of `model` becomes a `TorchtitanMoE`, in place; returns `model`.

    `ep_mesh`: torchtitan's expert-parallel mesh (`parallel_dims.get_mesh("ep")`), or None for one
    process. Under it each rank computes the experts it holds: the experts' parameters, when they are
    whole, become DTensors sharded over the mesh (Shard(0)), as torchtitan's expert parallelism makes
    them, so that DCP saves and loads them as torchtitan's. `experts_dtype`: see the module docstring.
    `options`: fmoe layer options (MOE_OPTIONS).
    Everything is checked before anything changes."""
    found = find_titan_moes(model)
    if not found:
        raise ValueError(f"convert: {type(model).__name__} holds no torchtitan MoE module")
    ep_size, group = 1, None
    if ep_mesh is not None:
        if ep_mesh.ndim != 1:
            raise ValueError(f"convert: ep_mesh must be a 1-D device mesh (torchtitan's 'ep'), got {ep_mesh.ndim}-D")
        ep_size, group = ep_mesh.size(), ep_mesh.get_group()
    for name, moe in found:
        try:
            check_titan_moe(moe, ep_size, options)
        except ValueError as err:
            raise ValueError(f"convert: {name}: {err}; the model is unchanged") from err
    converted, undo = [], []
    try:
        for name, moe in found:
            experts = moe.routed_experts.inner_experts
            undo.append((experts, experts.__class__, dict(experts._parameters), dict(experts.__dict__)))
            if ep_size > 1:
                shard_experts(experts, ep_mesh, moe.router.num_experts)
            layer = TorchtitanMoE(moe, ep_size, group, experts_dtype, **options)
            layer.routing_name = name
            converted.append((name, layer))
    except Exception:
        for experts, cls, params, attrs in reversed(undo):     # as it was: class, parameters, attributes
            experts.__class__ = cls
            experts.__dict__.clear()
            experts.__dict__.update(attrs)
            experts._parameters.clear()
            experts._parameters.update(params)
        raise
    for name, layer in converted:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer)
    return model


def shard_experts(experts: nn.Module, ep_mesh, num_experts: int) -> None:
    """The experts' whole parameters (all `num_experts`) as DTensors sharded by expert over `ep_mesh`
    (torchtitan's layout under expert parallelism); DTensors, and plain tensors that already hold this rank's
    experts alone (as torchtitan's "spmd_types" backend leaves them), stay as they are."""
    from torch.distributed.tensor import Shard, distribute_tensor
    for name, p in list(experts.named_parameters(recurse=False)):
        if hasattr(p, "to_local") or p.shape[0] != num_experts:
            continue
        experts.register_parameter(name, nn.Parameter(distribute_tensor(p.detach(), ep_mesh, [Shard(0)]),
                                                      requires_grad=p.requires_grad))


def titan_layers(model: nn.Module):
    """(name, TorchtitanMoE) of every converted MoE module."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, TorchtitanMoE)]
