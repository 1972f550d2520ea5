"""FSDP2 (`fully_shard`) with expert parallelism.

    groups = make_groups(ep_size)
    model = Net(..., world_size=ep_size, moe_group=groups.moe_group)   # FMoE layers inside
    shard_model(model, groups)
    loss.backward(); optimizer.step()      # no other gradient sync

Every FMoE layer's experts are sharded over the ranks that hold the same experts (the
expert-data-parallel group); everything else over all ranks. Gradients follow fmoe's convention
(each rank's loss the mean over its own batch, training equal to one process on the global batch):
shared gradients are averaged over the world by FSDP; an expert gradient already holds the sum
over its expert-parallel group (the backward exchange brought it), so FSDP sums it over the
expert-data-parallel group and divides by the world size.

`save_checkpoint` / `load_checkpoint` write and read the layout of `fmoe.distributed.checkpoint`
(experts by global id), so a checkpoint from a sharded run loads at any expert-parallel size,
sharded or not, and the other way round.
"""
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from fmoe.distributed.checkpoint import PARAM_GROUPS_KEY, _entries, _expert_slices, _state_names
from fmoe.distributed import safe_load
from fmoe.distributed.groups import ParallelGroups
from fmoe.layer import FMoE


def shard_model(model: nn.Module, groups: ParallelGroups, reshard_after_forward: bool = True,
                mp_policy=None) -> nn.Module:
    """`fully_shard` the experts of every FMoE layer over `groups.expert_dp_group` and the rest of
    `model` over the world, in place; returns the model. Build the optimizer afterwards."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("shard_model needs torch.distributed initialised: call init_process_group first")
    if not isinstance(groups, ParallelGroups):
        raise TypeError(f"groups must be fmoe.distributed.groups.ParallelGroups (make_groups), got {type(groups).__name__}")
    world = dist.get_world_size()
    if groups.world_size != world:
        raise ValueError(f"groups span {groups.world_size} ranks (ep_size {groups.ep_size} x dp_size "
                         f"{groups.dp_size}), the world has {world}")
    layers = [m for m in model.modules() if isinstance(m, FMoE)]
    if not layers:
        raise ValueError(f"shard_model found no FMoE layer in {type(model).__name__}")
    for layer in layers:
        if layer.world_size != groups.ep_size:
            raise ValueError(f"an FMoE layer has world_size={layer.world_size}, groups.ep_size is {groups.ep_size}")
        if layer.shadow_policy is not None or layer.schedule:
            # Both read the expert weights outside the experts' forward, where FSDP has not gathered them.
            raise ValueError("shard_model: FasterMoE shadowing and the smart schedule are not supported with FSDP; "
                             "build the layers with shadow=False, schedule=False")
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    world_mesh = DeviceMesh.from_group(dist.group.WORLD, device_type)
    expert_mesh = DeviceMesh.from_group(groups.expert_dp_group, device_type)
    options = {"reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        options["mp_policy"] = mp_policy
    sharded, unsharded = [], set()
    for layer in layers:
        if expert_mesh.size() > 1:
            fully_shard(layer.experts, mesh=expert_mesh, **options)
            sharded.append(layer.experts)
        else:
            # No other rank holds these experts: FSDP2 would skip the reduction, and with it the
            # division, so they stay plain parameters whose gradients are divided here.
            for p in layer.experts.parameters():
                p.register_hook(lambda g: g / world)
                unsharded.add(p)
    fully_shard(model, mesh=world_mesh, ignored_params=unsharded or None, **options)
    for module in sharded + [model]:
        module.set_gradient_divide_factor(float(world))
        if dist.get_backend() == "gloo":
            module.set_force_sum_reduction_for_comms(True)      # gloo has no pre-multiplied sum
    return model


def _local_experts(tensor: torch.Tensor) -> torch.Tensor:
    """An expert tensor with this rank's experts whole (gathered over the expert-data-parallel group)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _tensors(model: nn.Module, optimizer: Optional[torch.optim.Optimizer]):
    """(parameter name, parameter, state name or "param", tensor) for every parameter and optimizer state."""
    for name, p in model.named_parameters():
        yield name, p, "param", p.data
        if optimizer is not None:
            for sname, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    yield name, p, sname, value


def _key(entry: str, sname: str) -> str:
    return f"model/{entry}" if sname == "param" else f"optim/{entry}/{sname}"


def save_checkpoint(path: str, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None):
    """Save a `shard_model` model (and optimizer) from every rank, in fmoe's resharding layout."""
    slices = _expert_slices(model)
    state = {}
    for name, _, sname, tensor in _tensors(model, optimizer):
        whole = _local_experts(tensor) if name in slices else tensor
        for entry, view in _entries(name, whole, slices):
            state[_key(entry, sname)] = view
    for name, buf in model.named_buffers():
        state[f"model/{name}"] = buf
    if optimizer is not None:
        state[PARAM_GROUPS_KEY] = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path, overwrite=True))


def load_checkpoint(path: str, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None):
    """Load any fmoe checkpoint into a `shard_model` model (and its optimizer) at this run's layout.

    Optimizer states are created where the optimizer has none yet (as after `optimizer.step()`)."""
    stored = safe_load.read_metadata(path).state_dict_metadata
    slices = _expert_slices(model)
    if optimizer is not None:
        _create_optimizer_states(model, optimizer, stored, slices)
    target, experts = {}, []
    for name, p, sname, tensor in _tensors(model, optimizer):
        if name not in slices:
            target[_key(name, sname)] = tensor
            continue
        # A DTensor's shape is its global one: this rank's experts, whole.
        whole = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
        experts.append((tensor, whole))
        for entry, view in _entries(name, whole, slices):
            target[_key(entry, sname)] = view
    for name, buf in model.named_buffers():
        target[f"model/{name}"] = buf
    missing = [k for k in target if k not in stored]
    if missing:
        raise ValueError(f"checkpoint {path} lacks {len(missing)} entries this model needs, e.g. {missing[:3]}")
    if optimizer is not None:
        target[PARAM_GROUPS_KEY] = [{} for _ in optimizer.param_groups]
    safe_load.load(target, path)
    with torch.no_grad():
        for tensor, whole in experts:
            if isinstance(tensor, DTensor):
                local = distribute_tensor(whole, tensor.device_mesh, tensor.placements, src_data_rank=None)
                tensor.to_local().copy_(local.to_local())
            else:
                tensor.copy_(whole)
    if optimizer is not None:
        for group, saved in zip(optimizer.param_groups, target[PARAM_GROUPS_KEY]):
            group.update(saved)


def _create_optimizer_states(model, optimizer, stored, slices):
    """Optimizer states the checkpoint has, shaped like their parameters, where the optimizer has none yet."""
    for name, p in model.named_parameters():
        if optimizer.state.get(p):
            continue
        first = slices[name][1][0][0] if name in slices else name
        for sname in _state_names(stored, first):
            meta = stored[f"optim/{first}/{sname}"]
            optimizer.state[p][sname] = (torch.zeros_like(p.data) if len(meta.size) else
                                         torch.zeros((), dtype=meta.properties.dtype))
