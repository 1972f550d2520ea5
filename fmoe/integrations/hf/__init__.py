"""fmoe for HuggingFace Transformers.

- `convert(model, ep_size=1)`: a published MoE model's sparse blocks (Mixtral, Qwen2/3-MoE, OLMoE,
  DeepSeek-V2/V3, gpt-oss, GraniteMoe(Shared), PhiMoE, DBRX, Jamba) become fmoe layers with the
  same weights; `export(model, path)` writes them back in the family's own checkpoint layout, and so
  does the converted model's `save_pretrained`.
- `convert(model, ep_size=1, seam=True)`: any family whose experts dispatch through transformers' experts
  interface (about 67 in transformers 5.24, the default for those outside the table) converted at the
  experts seam: its own block and router, fmoe's experts, exchanges and statistics behind them
  (`SeamMoE`); `discover()` lists those families and builds a tiny model of each.
- `load(path, ep_size=1)`: a checkpoint folder loaded and converted, the EP ranks taking turns so
  that no two of them hold all experts at once.
- `moefy(model, num_experts)`: upcycle a dense model's MLPs into fmoe layers;
  `from_pretrained(path)` reloads what `save_pretrained` wrote after `moefy`.
- `RoutingStatsCallback.add_to(trainer)`: every MoE layer's routing statistics in a Trainer's logs.
- `BiasUpdateCallback()`: a learned selection bias moved once per Trainer optimizer step.
- `trace_from_router_logits(model, router_logits)`: a routing trace for `fmoe.replay_routing` from the
  router logits of a transformers forward (`output_router_logits=True`).
- Importing this package registers the experts implementation "fmoe" with transformers.
"""
from fmoe.integrations.hf.block import HFMoEBlock, converted_blocks
from fmoe.integrations.hf.callback import BiasUpdateCallback, RoutingStatsCallback
from fmoe.integrations.hf.convert import convert
from fmoe.integrations.hf.discovery import discover
from fmoe.integrations.hf.experts_impl import register_experts_implementation
from fmoe.integrations.hf.export import export
from fmoe.integrations.hf.families import FAMILIES
from fmoe.integrations.hf.loading import load
from fmoe.integrations.hf.routing import trace_from_router_logits
from fmoe.integrations.hf.seam import SeamMoE, seam_layers
from fmoe.integrations.hf.upcycle import MoEMLP, add_aux_loss, from_pretrained, moefy

register_experts_implementation()

__all__ = ["convert", "load", "export", "converted_blocks", "HFMoEBlock", "FAMILIES", "moefy", "from_pretrained",
           "MoEMLP", "add_aux_loss", "register_experts_implementation", "RoutingStatsCallback",
           "BiasUpdateCallback", "trace_from_router_logits", "SeamMoE", "seam_layers", "discover"]
