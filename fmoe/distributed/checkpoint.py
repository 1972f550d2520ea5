"""Sharded checkpoints that reshard: every expert is stored under its global expert id.

`save_checkpoint` writes, with torch.distributed.checkpoint, one entry per global expert for
each expert parameter and each of its optimizer states (`<param>@expert<g>`), and one entry for
each shared parameter and state. A checkpoint written at one expert-parallel size therefore
loads at any other: each rank asks for the experts it now owns.
"""
import warnings
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from fmoe.distributed import safe_load
from fmoe.experts import ModuleListExperts
from fmoe.layer import FMoE

PARAM_GROUPS_KEY = "optim/param_groups"


def _expert_slices(model: nn.Module) -> Dict[str, Tuple[str, list]]:
    """param name -> (kind, [(checkpoint key, index or None)]) for every expert parameter.

    Stacked experts (first dim = local expert) are sliced; a user expert module's parameters
    are renamed from local to global expert id.
    """
    slices = {}
    for prefix, layer in model.named_modules():
        if not isinstance(layer, FMoE):
            continue
        base = f"{prefix}.experts" if prefix else "experts"
        first = layer.moe_rank * layer.num_expert
        # A parameter of the experts module that every rank holds whole (a seam layer's post-expert
        # norm, `is_moe_expert` False) is saved as any replicated one.
        per_expert = [(name, p) for name, p in layer.experts.named_parameters() if getattr(p, "is_moe_expert", True)]
        if isinstance(layer.experts, ModuleListExperts):
            for name, _ in per_expert:
                local, rest = name.split(".", 1)
                slices[f"{base}.{name}"] = ("module", [(f"{base}.{first + int(local)}.{rest}", None)])
        else:
            for name, _ in per_expert:
                key = f"{base}.{name}"
                slices[key] = ("stacked", [(f"{key}@expert{first + j}", j) for j in range(layer.num_expert)])
    return slices


def _entries(name: str, tensor: torch.Tensor, slices) -> list:
    """(checkpoint key, tensor view) pairs for a parameter or a state of the same shape."""
    if name not in slices:
        return [(name, tensor)]
    kind, keys = slices[name]
    if kind == "module" or tensor.dim() == 0:
        return [(key, tensor) for key, _ in keys]
    return [(key, tensor[j]) for key, j in keys]


def checkpoint_state(model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> dict:
    """The flat, resharding-ready state: `model/<key>` and `optim/<key>/<state>` entries."""
    slices = _expert_slices(model)
    state = {}
    for name, p in model.named_parameters():
        for key, view in _entries(name, p.data, slices):
            state[f"model/{key}"] = view
    for name, buf in model.named_buffers():
        state[f"model/{name}"] = buf
    if optimizer is not None:
        names = {p: n for n, p in model.named_parameters()}
        for p, pstate in optimizer.state.items():
            for sname, value in pstate.items():
                if isinstance(value, torch.Tensor):
                    for key, view in _entries(names[p], value, slices):
                        state[f"optim/{key}/{sname}"] = view
        state[PARAM_GROUPS_KEY] = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return state


def save_checkpoint(path: str, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                    extra: Optional[dict] = None):
    """Save from every rank (a collective when torch.distributed is initialised)."""
    state = checkpoint_state(model, optimizer)
    if extra:
        state.update({f"extra/{k}": v for k, v in extra.items()})
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path, overwrite=True), no_dist=not dist.is_initialized())


def load_checkpoint(path: str, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                    extra_keys=()) -> dict:
    """Load into `model` (and `optimizer`) at this run's expert-parallel size; returns the extras."""
    no_dist = not dist.is_initialized()
    stored = safe_load.read_metadata(path).state_dict_metadata
    target = checkpoint_state(model)
    missing = [k for k in target if k not in stored]
    if missing:
        raise ValueError(f"checkpoint {path} lacks {len(missing)} entries this model needs, e.g. {missing[:3]}")
    optim_slots = {}
    if optimizer is not None:
        slices = _expert_slices(model)
        names = {p: n for n, p in model.named_parameters()}
        for group in optimizer.param_groups:
            for p in group["params"]:
                keys = [key for key, _ in _entries(names[p], p.data, slices)]
                for sname in _state_names(stored, keys[0]):
                    entries = {}
                    for key in keys:
                        meta = stored[f"optim/{key}/{sname}"]
                        entries[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
                        target[f"optim/{key}/{sname}"] = entries[key]
                    optim_slots[(p, sname)] = (names[p] in slices and slices[names[p]][0] == "stacked", entries)
        target[PARAM_GROUPS_KEY] = [{} for _ in optimizer.param_groups]
    for key in extra_keys:
        target[f"extra/{key}"] = stored_placeholder(stored, f"extra/{key}")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        safe_load.load(target, path, no_dist=no_dist)
    if optimizer is not None:
        for (p, sname), (stacked, entries) in optim_slots.items():
            values = list(entries.values())
            value = torch.stack(values) if stacked and values[0].dim() > 0 else values[0]
            optimizer.state[p][sname] = value.to(p.device)
        for group, saved in zip(optimizer.param_groups, target[PARAM_GROUPS_KEY]):
            group.update(saved)
    return {k: target[f"extra/{k}"] for k in extra_keys}


def _state_names(stored, key: str) -> list:
    prefix = f"optim/{key}/"
    return sorted(k[len(prefix):] for k in stored if k.startswith(prefix))


def stored_placeholder(stored, key):
    meta = stored[key]
    if hasattr(meta, "size") and hasattr(meta, "properties"):
        return torch.empty(meta.size, dtype=meta.properties.dtype)
    return None
