"""`convert`: every sparse MoE block of a transformers model becomes an fmoe layer with the same weights.

    model = AutoModelForCausalLM.from_pretrained(...)      # Mixtral, Qwen3-MoE, DeepSeek-V3, gpt-oss, ...
    fmoe.integrations.hf.convert(model, ep_size=2)  # each of 2 ranks keeps half of every block's experts
    out = model(ids, labels=ids, output_router_logits=True)   # HF's aux loss still works
    fmoe.integrations.hf.export(model, path)        # back to the family's own checkpoint layout

Each block is replaced by an `HFMoEBlock` (`fmoe.integrations.hf.block`).
"""
import functools
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from fmoe.gates.router import RouterGate
from fmoe.integrations.hf.block import (HFMoEBlock, converted_blocks,  # noqa: F401 (converted_blocks: a public path)
                                        recorder_for)
from fmoe.integrations.hf.export import save_pretrained
from fmoe.integrations.hf.families import BY_BLOCK, ExpertWeights, Family, find_moe_blocks
from fmoe.integrations.hf.seam import SeamMoE, convert_at_seam, find_seam_experts
from fmoe.layer import FMoE, check_world

FMOE_OPTIONS = ("backend", "shadow", "schedule", "schedule_group_size", "recompute", "fp8")  # to FMoE; others to the gate


@dataclass
class BlockPlan:
    """What converting one block needs, all checked before any block changes."""

    name: str
    block: nn.Module
    family: Family
    config: object
    experts: ExpertWeights
    router_state: dict          # RouterGate-relative name -> tensor
    gate_options: dict


def plan_block(name: str, block: nn.Module, model_config, ep_size: int, options: dict) -> BlockPlan:
    cls = type(block).__name__
    family = BY_BLOCK.get(cls)
    try:
        if family is None:
            raise ValueError(f"unknown MoE family: fmoe converts {sorted(BY_BLOCK)} whole; seam=True converts "
                             "any family whose experts use transformers' experts interface at the experts seam")
        config = family.config_of(model_config)
        experts = family.read(block)
        E, D, F = experts.shape
        state = block.state_dict(keep_vars=True)
        router_state = {}
        for hf_key, key in family.router_keys.items():
            if hf_key not in state:
                raise ValueError(f"router tensor {hf_key} is missing")
            router_state[key] = state[hf_key]
        weight = router_state["gate.proj.weight"]
        if tuple(weight.shape) != (E, D):
            raise ValueError(f"router weight has shape {tuple(weight.shape)}, expected [experts, d_model] = {(E, D)}")
        if not isinstance(ep_size, int) or ep_size < 1 or E % ep_size:
            raise ValueError(f"ep_size={ep_size!r} must be a positive divisor of the block's {E} experts")
        gate_options = dict(family.gate_options(block, config), gate_bias="gate.proj.bias" in router_state)
        gate_options.update({k: v for k, v in options.items() if k not in FMOE_OPTIONS})
    except ValueError as err:
        raise ValueError(f"convert: cannot take {name} ({cls}): {err}; the model is unchanged") from err
    return BlockPlan(name, block, family, config, experts, router_state, gate_options)


class RouterOptionsRefused(ValueError):
    """fmoe's router cannot take the family's routing options (its own, or the ones passed)."""


def build_block(plan: BlockPlan, ep_size: int, moe_group, options: dict) -> HFMoEBlock:
    E, D, F = plan.experts.shape
    e = E // ep_size
    rank = dist.get_rank(moe_group) if ep_size > 1 else 0
    family, block, w = plan.family, plan.block, plan.experts
    try:
        gate = RouterGate.from_preset(family.router_preset, D, e, ep_size, **plan.gate_options)
    except (TypeError, ValueError) as err:
        raise RouterOptionsRefused(f"convert: {plan.name}: the router options {plan.gate_options} do not fit: {err}") \
            from err
    shared = getattr(block, family.shared) if family.shared else None
    moe = FMoE(num_expert=e, d_model=D, world_size=ep_size, moe_group=moe_group, gate=gate, d_hidden=F,
               activation=w.activation, expert_bias=w.b1_EF is not None, shared_expert=shared,
               shared_expert_gate=family.shared_gate is not None,
               **{k: v for k, v in options.items() if k in FMOE_OPTIONS})
    moe.to(device=w.w1_EDF.device, dtype=w.w1_EDF.dtype)
    mine = slice(rank * e, (rank + 1) * e)
    with torch.no_grad():
        moe.experts.w1_eDF.copy_(w.w1_EDF[mine])
        moe.experts.w2_eFD.copy_(w.w2_EFD[mine])
        if w.b1_EF is not None:
            moe.experts.b1_eF.copy_(w.b1_EF[mine])
            moe.experts.b2_eD.copy_(w.b2_ED[mine])
        gate_state = gate.state_dict(keep_vars=True)
        for key, tensor in plan.router_state.items():
            gate_state[key].copy_(tensor)
        if family.shared_gate:
            moe.shared_expert_gate.weight.copy_(getattr(block, family.shared_gate).weight)
    jitter = family.input_jitter(plan.config) if family.input_jitter else 0.0
    prefix = family.router + "."
    views = {hf_key[len(prefix):]: key for hf_key, key in family.router_keys.items() if hf_key.startswith(prefix)}
    new = HFMoEBlock(family.name, moe, recorder_for(getattr(block, family.router), gate, views), jitter)
    return take_modes(new, block)


def take_modes(new: nn.Module, old: nn.Module) -> nn.Module:
    """`new` in `old`'s train / eval mode: modules it took over from `old` (a shared expert) keep
    their own, the ones it built take `old`'s. A fresh module is in training mode, which would turn on
    routing noise, jitter and the training capacity in a model the user had put in eval."""
    kept = {id(m): m.training for m in old.modules()}
    for module in new.modules():
        module.training = kept.get(id(module), old.training)
    return new


def convert(model: nn.Module, ep_size: int = 1, moe_group: Optional[dist.ProcessGroup] = None,
            seam: Optional[bool] = None, **options):
    """Replace every sparse MoE block of the transformers model `model` by an `HFMoEBlock` holding the
    same weights, in place; returns the model.

    `seam` chooses where fmoe takes over. True: at the experts seam, for any family whose experts
    dispatch through transformers' experts interface (`fmoe.integrations.hf.seam`): the family's block,
    router and shared experts stay, each experts module becomes a `SeamMoE` (options: FMoE's, and a
    `capacity`). False: the whole block, for the families of `FAMILIES` only (fmoe's router, its
    options). None (the default): the seam where no MoE block of the model is one of `FAMILIES`,
    else the whole block, and the seam (with a warning saying why) where fmoe's router cannot route
    the model's config as the family does.

    Every block is checked (and its replacement built) before any is swapped in: on an error naming
    the block the model is left unchanged. With `ep_size` > 1 (torch.distributed initialised;
    `moe_group` of that size, or the world) each rank keeps only its slice of every block's experts.
    `options` override the family's router (RouterGate options such as aux_loss="switch",
    selection_bias="updated", capacity) or go to FMoE (backend, shadow, schedule, schedule_group_size).
    """
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"convert: {type(model).__name__} has no .config; pass a transformers PreTrainedModel")
    if seam not in (None, True, False):
        raise ValueError(f"convert: seam must be True, False or None (decide by the model), got {seam!r}")
    if any(isinstance(m, (HFMoEBlock, SeamMoE)) for m in model.modules()):
        raise ValueError(f"convert: {type(model).__name__} is already converted (it holds fmoe layers)")
    blocks = find_moe_blocks(model)
    decide = seam is None
    if decide:
        seam = not any(type(block).__name__ in BY_BLOCK for _, block in blocks) and bool(find_seam_experts(model))
    if seam:
        convert_at_seam(model, ep_size, moe_group, **options)
    else:
        try:
            convert_blocks(model, blocks, config, ep_size, moe_group, options)
        except RouterOptionsRefused as err:
            # A config fmoe's router cannot route as the family does (DeepSeek-V3 with fewer expert
            # groups than top_k needs): the family's own router keeps routing, at the seam.
            if not (decide and not options and find_seam_experts(model)):
                raise
            warnings.warn(f"{err}; converted at the experts seam instead (the family's own router kept, "
                          "fmoe's experts behind it): pass seam=True to choose it, seam=False to refuse", stacklevel=2)
            convert_at_seam(model, ep_size, moe_group, **options)
    # transformers' own would write fmoe's names (and under EP only this rank's experts), which plain
    # from_pretrained initialises at random.
    model.save_pretrained = functools.partial(save_pretrained, model)
    return model


def convert_blocks(model: nn.Module, blocks, config, ep_size: int, moe_group, options: dict):
    """The full conversion: every block of `blocks` (the table's families) planned, built, then swapped in."""
    if not blocks:
        raise ValueError(f"convert: {type(model).__name__} has no sparse MoE block; upcycle a dense model with "
                         "fmoe.integrations.hf.moefy instead")
    plans = [plan_block(name, block, config, ep_size, options) for name, block in blocks]
    try:
        check_world(ep_size, moe_group)
    except ValueError as err:
        raise ValueError(f"convert: ep_size={ep_size}: {err}; the model is unchanged") from err
    new_blocks = [build_block(plan, ep_size, moe_group, options) for plan in plans]
    for plan, new in zip(plans, new_blocks):
        parent, _, child = plan.name.rpartition(".")
        setattr(model.get_submodule(parent), child, new)
