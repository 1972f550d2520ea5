"""fmoe layers under DeepSpeed (ZeRO stages 0, 1 and 2).

DeepSpeed treats a parameter as an expert parameter when `param.allreduce is False`; it then
reduces its gradient (and, under ZeRO, partitions its optimizer state) over the
expert-data-parallel group named by `param.group_name` ("ep_size_<M>"), never over the
expert-parallel ranks. Its engine only takes that path for models that hold a DeepSpeed `MoE`
module, so every fmoe layer gets a parameter-free `DeepSpeedExpertMarker` child that stands in
for one.

    deepspeed.init_distributed(dist_backend="gloo")          # or "nccl"
    groups = fmoe.integrations.deepspeed.setup_expert_parallel(ep_size)
    model = build(world_size=ep_size, moe_group=groups.moe_group)   # the fmoe layers
    fmoe.integrations.deepspeed.mark_expert_params(model)
    engine, *_ = deepspeed.initialize(model=model, config=cfg,
                                      model_parameters=fmoe.integrations.deepspeed.moe_param_groups(model))

DeepSpeed's own `engine.save_checkpoint` only knows its own MoE layer's parameter names: save the
model with `fmoe.distributed.checkpoint.save_checkpoint(path, engine.module)` instead.
"""
from typing import Any, Dict, List, Optional, Union

import torch.distributed as dist
from torch import nn

try:
    from deepspeed.moe.layer import MoE as _DeepSpeedMoE
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from deepspeed.utils import groups as ds_groups
except ImportError as err:     # pragma: no cover - depends on the install
    raise ImportError("fmoe.integrations.deepspeed needs DeepSpeed: pip install 'fmoe[deepspeed]'") from err

from fmoe.distributed.groups import ParallelGroups
from fmoe.layer import FMoE

__all__ = ["DeepSpeedExpertMarker", "expert_group_name", "setup_expert_parallel", "mark_expert_params",
           "moe_param_groups"]


def expert_group_name(ep_size: int) -> str:
    """DeepSpeed's name for the expert-parallel / expert-data-parallel groups of size `ep_size`."""
    return f"ep_size_{ep_size}"


def _layer_ep_ranks(layer: FMoE) -> List[int]:
    """The global ranks of the layer's expert-parallel group."""
    if layer.moe_group is not None:
        return dist.get_process_group_ranks(layer.moe_group)
    if layer.world_size > 1:
        return list(range(dist.get_world_size()))
    return [dist.get_rank()] if dist.is_initialized() else [0]


def _fmoe_layout(ep_size: int, world: int, rank: int):
    """fmoe's layout (fmoe.distributed.groups): ep groups of consecutive ranks, edp groups strided."""
    start = rank - rank % ep_size
    return list(range(start, start + ep_size)), list(range(rank % ep_size, world, ep_size))


def setup_expert_parallel(ep_size: int) -> ParallelGroups:
    """Create DeepSpeed's expert-parallel groups for `ep_size` (once) and return them as fmoe's
    ParallelGroups: build the fmoe layers with `world_size=ep_size, moe_group=groups.moe_group`.

    A collective: every rank calls it alike, after `deepspeed.init_distributed(...)`.
    """
    if not dist.is_initialized():
        raise ValueError("setup_expert_parallel needs torch.distributed initialised: "
                         "call deepspeed.init_distributed(dist_backend=...) first")
    world, rank = dist.get_world_size(), dist.get_rank()
    if not isinstance(ep_size, int) or isinstance(ep_size, bool) or ep_size < 1 or world % ep_size:
        raise ValueError(f"ep_size must be a positive divisor of the world size {world}, got {ep_size!r}")
    name = expert_group_name(ep_size)
    if name not in ds_groups._get_expert_parallel_group_dict():
        ds_groups._create_expert_and_data_parallel(ep_size)
    ep_ranks = list(ds_groups._get_expert_parallel_group_ranks(name))
    edp_ranks = list(ds_groups._get_expert_data_parallel_group_ranks(name))
    if (ep_ranks, edp_ranks) != _fmoe_layout(ep_size, world, rank):
        raise ValueError(
            f"DeepSpeed's groups {name} (expert-parallel {ep_ranks}, expert-data-parallel {edp_ranks} on rank "
            f"{rank}) differ from fmoe's layout; leave 'use_data_before_expert_parallel_' off and tensor/pipeline "
            "parallelism unset"
        )
    return ParallelGroups(ep_size=ep_size, dp_size=world // ep_size,
                          moe_group=ds_groups._get_expert_parallel_group(name),
                          expert_dp_group=ds_groups._get_expert_data_parallel_group(name))


class DeepSpeedExpertMarker(_DeepSpeedMoE):
    """Makes DeepSpeed's engine see an fmoe layer as an MoE layer: it holds no parameters and
    computes nothing; it has the attributes the engine reads from its own `MoE`."""

    def __init__(self, num_experts: int, ep_size: int, ep_ranks: List[int]):
        # DeepSpeed's MoE.__init__ would build its own gate and experts; only nn.Module's is wanted.
        nn.Module.__init__(self)
        self.num_experts = num_experts
        self.ep_size = ep_size
        self.num_local_experts = num_experts // ep_size
        self.expert_group_name = expert_group_name(ep_size)
        self.ep_ranks = ep_ranks

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Called by deepspeed.initialize on every rank: DeepSpeed's groups (created here if missing)
        must hold the fmoe layer's ranks."""
        ds_ranks = dist.get_process_group_ranks(setup_expert_parallel(self.ep_size).moe_group)
        if ds_ranks != self.ep_ranks:
            raise ValueError(f"the fmoe layer's moe_group holds ranks {self.ep_ranks}, DeepSpeed's group "
                             f"{self.expert_group_name} holds {ds_ranks}: build the layers with "
                             "moe_group=fmoe.integrations.deepspeed.setup_expert_parallel(ep_size).moe_group")

    def forward(self, *args, **kwargs):
        raise RuntimeError("DeepSpeedExpertMarker only marks an fmoe layer for DeepSpeed; it has no forward")

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, group={self.expert_group_name}"


def mark_expert_params(model: nn.Module) -> int:
    """Give each fmoe layer's expert parameters DeepSpeed's MoE markings (`allreduce = False`,
    `group_name = "ep_size_<world_size>"`) and a DeepSpeedExpertMarker; returns the number of
    layers. Call after building the model, before `deepspeed.initialize`.
    """
    layers = [m for m in model.modules() if isinstance(m, FMoE)]
    if not layers:
        raise ValueError("mark_expert_params: the model has no fmoe layer (FMoE / FMoETransformerMLP)")
    for layer in layers:
        ep_ranks = _layer_ep_ranks(layer)
        name = expert_group_name(layer.world_size)
        for p in layer.experts.parameters():
            p.allreduce = False
            p.group_name = name
        layer.deepspeed_marker = DeepSpeedExpertMarker(layer.tot_expert, layer.world_size, ep_ranks)
    return len(layers)


def moe_param_groups(model: nn.Module, param_groups: Optional[Union[Dict[str, Any], List[Dict[str, Any]]]] = None,
                     **group_options) -> List[Dict[str, Any]]:
    """Optimizer parameter groups with the expert parameters in groups of their own (`moe: True`),
    as ZeRO 1/2 require; pass them as `model_parameters` to deepspeed.initialize or to a torch
    optimizer. By default one group of all trainable parameters with `group_options` (e.g.
    weight_decay); or split the given `param_groups` (each needs a unique "name").
    """
    if not any(getattr(p, "allreduce", True) is False for p in model.parameters()):
        raise ValueError("moe_param_groups: the model has no marked expert parameter; "
                         "call fmoe.integrations.deepspeed.mark_expert_params(model) first")
    if param_groups is None:
        param_groups = [{"name": "params", "params": [p for p in model.parameters() if p.requires_grad],
                         **group_options}]
    elif group_options:
        raise ValueError("moe_param_groups: pass group options inside param_groups, not as keywords, when "
                         "param_groups is given")
    groups = [dict(g) for g in ([param_groups] if isinstance(param_groups, dict) else param_groups)]
    names = [g.get("name") for g in groups]
    if None in names or len(set(names)) != len(names):
        raise ValueError(f"moe_param_groups: every param group needs a unique 'name', got {names}")
    for g in groups:
        g["params"] = list(g["params"])
    return split_params_into_different_moe_groups_for_optimizer(groups)

