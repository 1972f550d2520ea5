"""fmoe inside torchtitan (docs/torchtitan.md), at two levels:

- `use_fmoe_experts(model)`: torchtitan's grouped experts run by fmoe's kernels, same parameters
  (`fmoe.integrations.torchtitan.experts`);
- `convert(model, ep_mesh=None, **options)`: each torchtitan MoE module replaced by fmoe's layer with
  torchtitan's router, experts and shared experts carried over, under torchtitan's parameter names
  (`fmoe.integrations.torchtitan.moe`).

`fmoe.integrations.torchtitan.models` builds torchtitan's debug models to run on a CPU.
Never imported by fmoe's core; it imports torchtitan (the `torchtitan` extra).
"""
from fmoe.integrations.torchtitan.experts import TorchtitanExperts, swap_experts, use_fmoe_experts
from fmoe.integrations.torchtitan.moe import TorchtitanMoE, TorchtitanRouterGate, convert, titan_layers

__all__ = ["TorchtitanExperts", "TorchtitanMoE", "TorchtitanRouterGate", "convert", "swap_experts", "titan_layers",
           "use_fmoe_experts"]
