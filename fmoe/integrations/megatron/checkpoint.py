"""FastMoE path `fmoe.megatron.checkpoint`.

FastMoE's `save_checkpoint` / `load_checkpoint` wrote Megatron-LM's per-rank files with the
experts split out; Megatron-Core has its own distributed checkpointing, which fmoe's
`MegatronMLP.sharded_state_dict` plugs into (experts by global id, any expert-parallel size).
What carries over from a FastMoE run is its MoE weights: `load_fastmoe_mlp` loads one fmoefied
layer's state dict (FastMoE's `...mlp.gate.gate.weight`, `...mlp.experts.<i>.htoh4.weight`, from
that rank's file) into an fmoe MegatronMLP.
"""
from fmoe.integrations.megatron.mlp import MegatronMLP

REPLACEMENT = ("on Megatron-Core, save and load with megatron.core.dist_checkpointing "
               "(model.sharded_state_dict()), or fmoe.distributed.checkpoint.save_checkpoint(path, model, "
               "optimizer) / load_checkpoint(path, model, optimizer); FastMoE's own MoE weights load with "
               "fmoe.megatron.checkpoint.load_fastmoe_mlp(mlp, state_dict)")


def save_checkpoint(iteration, model, optimizer, lr_scheduler):
    """FastMoE's Megatron-LM checkpoint writer: raises `NotImplementedError` naming the replacement
    (Megatron-Core's `dist_checkpointing`, or `fmoe.distributed.checkpoint.save_checkpoint`)."""
    raise NotImplementedError(f"fmoe.megatron.save_checkpoint writes Megatron-LM's file layout: {REPLACEMENT}")


def load_checkpoint(model, optimizer, lr_scheduler, load_arg="load"):
    """FastMoE's Megatron-LM checkpoint reader: raises `NotImplementedError` naming the replacement
    (FastMoE's MoE weights load with `fmoe.megatron.checkpoint.load_fastmoe_mlp`)."""
    raise NotImplementedError(f"fmoe.megatron.load_checkpoint reads Megatron-LM's file layout: {REPLACEMENT}")


def load_fastmoe_mlp(mlp: MegatronMLP, state_dict: dict, prefix: str = "", strict: bool = True):
    """Load FastMoE's MegatronMLP state (keys `<prefix>gate.*`, `<prefix>experts.*`) into `mlp`."""
    if not isinstance(mlp, MegatronMLP):
        raise TypeError(f"mlp must be an fmoe MegatronMLP, got {type(mlp).__name__}")
    own = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
    return mlp.moe.load_state_dict(own, strict=strict)
