"""`export`: a converted model back in its family's own checkpoint layout, loadable by plain transformers.

A model converted at the experts seam (`convert(model, seam=True)`) already carries its family's tensor
names and layout; under expert parallelism each rank holds a slice of every experts tensor, which
`hf_state_dict` gathers from the EP group before `save_pretrained` or `export` writes."""
import os
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from fmoe.app.files import UMASK, fsync_dir
from fmoe.integrations.hf.block import HFMoEBlock, converted_blocks
from fmoe.integrations.hf.families import BY_NAME, ExpertWeights
from fmoe.integrations.hf.seam import EXPERT_TENSORS, SeamMoE
from fmoe.layer import FMoE


def _all_experts(tensor_e, moe: FMoE):
    """This rank's experts' tensor gathered along the expert dimension from the layer's EP group."""
    if tensor_e is None or moe.world_size == 1:
        return tensor_e
    parts = [torch.empty_like(tensor_e) for _ in range(moe.world_size)]
    dist.all_gather(parts, tensor_e.detach().contiguous(), group=moe.moe_group)
    return torch.cat(parts)


def block_state(block: HFMoEBlock, pick=lambda t: t) -> dict:
    """The block's tensors under transformers' names (relative to the block), all experts gathered.
    `pick` maps each tensor first (tests pass `lambda p: p.grad` to compare gradients)."""
    family = BY_NAME[block.family]
    moe, experts = block.moe, block.moe.experts

    def picked(t):
        return None if t is None else pick(t)

    weights = ExpertWeights(*(_all_experts(picked(t), moe) for t in (experts.w1_eDF, experts.w2_eFD,
                                                                         experts.b1_eF, experts.b2_eD)))
    state = family.write(weights)
    gate_state = moe.gate.state_dict(keep_vars=True)
    state.update({hf_key: picked(gate_state[key]) for hf_key, key in family.router_keys.items()})
    if family.shared:
        for key, tensor in moe.shared_experts[0].state_dict(keep_vars=True).items():
            state[f"{family.shared}.{key}"] = picked(tensor)
    if family.shared_gate:
        state[f"{family.shared_gate}.weight"] = picked(moe.shared_expert_gate.weight)
    return {key: t.detach() for key, t in state.items() if t is not None}


def hf_state_dict(model: nn.Module, drop_selection_bias: bool = False) -> dict:
    """The model's state dict with every converted block in its family's layout and every experts tensor
    of a seam layer gathered from its EP group (a collective under EP). A learned selection bias the
    family's layout has no slot for is refused, unless `drop_selection_bias`."""
    blocks = {name: m for name, m in model.named_modules() if isinstance(m, HFMoEBlock)}
    seams = {name: m for name, m in model.named_modules() if isinstance(m, SeamMoE)}
    if not blocks and not seams:
        raise ValueError(f"export: {type(model).__name__} holds no converted block or seam layer (convert it with "
                         "fmoe.integrations.hf.convert)")
    if not drop_selection_bias:
        for name, block in blocks.items():
            check_nothing_dropped(name, block)
    state = {key: t for key, t in model.state_dict().items()
             if not any(key.startswith(name + ".") for name in blocks)}
    for name, block in blocks.items():
        state.update({f"{name}.{key}": t for key, t in block_state(block).items()})
    for name, layer in seams.items():
        for tensor in EXPERT_TENSORS:
            if tensor in layer.experts._parameters:
                state[f"{name}.{tensor}"] = _all_experts(state[f"{name}.{tensor}"], layer)
    return state


def check_nothing_dropped(name: str, block: HFMoEBlock):
    """A nonzero selection bias (learned with selection_bias="updated", or loaded) must have a slot in
    the family's layout: plain transformers would route without it."""
    family, gate = BY_NAME[block.family], block.moe.gate
    bias = getattr(gate, "e_score_correction_bias", None)
    if bias is None or "e_score_correction_bias" in family.router_keys.values() or not bias.any():
        return
    raise ValueError(f"export: {name}.moe.gate.e_score_correction_bias (a selection bias, max |b| = "
                     f"{bias.abs().max().item():.3g}) has no place in {family.name}'s checkpoint layout, and a "
                     "model reloaded without it routes differently; pass drop_selection_bias=True to export "
                     "without it")


def save_pretrained(model: nn.Module, save_directory, *args, state_dict=None, drop_selection_bias: bool = False,
                    **kwargs):
    """A converted model's `save_pretrained` (fmoe.integrations.hf.convert installs it): transformers' own, handed the
    state dict in the family's layout (`hf_state_dict`, what `export` writes), so that plain
    `from_pretrained` loads the routers and experts instead of initialising them at random. Under
    expert parallelism every rank calls it (the experts are gathered) and global rank 0 writes."""
    blocks = [name for name, _ in converted_blocks(model)]
    if state_dict is not None and any(key.startswith(f"{name}.moe.") for key in state_dict for name in blocks):
        raise ValueError("save_pretrained: state_dict holds fmoe's layer names, which plain transformers would "
                         "load with the routers and experts initialised at random; call save_pretrained without "
                         "state_dict (it writes the family's layout), or fmoe.integrations.hf.export(model, path)")
    for name, layer in (model.named_modules() if state_dict is not None else ()):
        if not isinstance(layer, SeamMoE) or layer.world_size == 1:
            continue
        for key in (f"{name}.{t}" for t in EXPERT_TENSORS if f"{name}.{t}" in state_dict):
            if state_dict[key].shape[0] != layer.gate.tot_expert:
                raise ValueError(f"save_pretrained: state_dict's {key} holds {state_dict[key].shape[0]} of its "
                                 f"{layer.gate.tot_expert} experts (one rank's, at ep_size={layer.world_size}); call "
                                 "save_pretrained without state_dict on every rank (it gathers them)")
    if dist.is_available() and dist.is_initialized():
        kwargs.setdefault("is_main_process", dist.get_rank() == 0)
    return type(model).save_pretrained(model, save_directory, *args,
                                       state_dict=hf_state_dict(model, drop_selection_bias) if state_dict is None
                                       else state_dict,
                                       **kwargs)


def export(model: nn.Module, path, drop_selection_bias: bool = False) -> Path:
    """Write `model` (converted with fmoe.integrations.hf.convert, at the seam or whole blocks) to the folder
    `path` as its original family's checkpoint: config.json and model.safetensors, which
    `AutoModelForCausalLM.from_pretrained(path)` loads with no fmoe installed. Under expert parallelism
    every rank must call it (the experts are gathered); global rank 0 writes. A learned selection bias the
    family's layout cannot hold is refused unless `drop_selection_bias=True`. The files are written into a
    staging folder beside `path`, fsynced, then renamed into it: each file in `path` is whole, the old one or
    the new. Returns the path."""
    path = Path(path)
    state = hf_state_dict(model, drop_selection_bias)
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return path
    path.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.export.", dir=path.parent))
    try:
        # Tied tensors (lm_head = embeddings) share storage, which safetensors refuses: each gets its own copy.
        save_file({key: t.detach().contiguous().clone().cpu() for key, t in state.items()},
                  str(staging / "model.safetensors"), metadata={"format": "pt"})
        model.config.save_pretrained(staging)
        generation_config = getattr(model, "generation_config", None)
        if generation_config is not None:
            generation_config.save_pretrained(staging)
        for src in sorted(staging.iterdir()):
            with open(src, "rb") as f:
                os.fsync(f.fileno())
            os.chmod(src, 0o666 & ~UMASK)           # a plain open()'s mode (safetensors writes 0600)
            os.replace(src, path / src.name)
        fsync_dir(path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path
