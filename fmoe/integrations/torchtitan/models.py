"""torchtitan's debug models, built to run (forward and backward) on a CPU.

torchtitan builds its language models with FlexAttention (or varlen attention, CUDA only), and
FlexAttention has no backward on a CPU (torch raises "FlexAttention does not support backward on
CPU"). `debug_model` builds the flavor's config with torchtitan's own `ScaledDotProductAttention`
as each layer's inner attention instead (causal; no document mask, so each sequence is one document),
optionally fewer layers, and initialises it with torchtitan's `init_states`. Qwen3.5's linear-attention
layers (GatedDeltaNet) run flash-linear-attention's Triton kernels, which need a GPU (under Triton's CPU
interpreter they find no driver): on a CPU only its full-attention layers are kept (`gpu_layers=False`). `forward` calls such a
model as torchtitan's trainer does, without masks.
"""
import importlib
from typing import Optional

import torch

# torchtitan's MoE model families and the flavor of each one's debug model.
FAMILIES = {"qwen3": "debugmodel_moe", "deepseek_v3": "debugmodel", "gpt_oss": "debugmodel",
            "kimi_k2_7": "debugmodel", "qwen3_5": "debugmodel_moe"}


def debug_config(family: str, flavor: Optional[str] = None, n_layers: Optional[int] = None,
                 gpu_layers: bool = False):
    """The flavor's model config (default: the family's MoE debug model) with SDPA attention and the first
    `n_layers` layers (all by default) of those a CPU runs (all of them with `gpu_layers=True`)."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {sorted(FAMILIES)}, got {family!r}")
    from torchtitan.models.common.attention import ScaledDotProductAttention
    module = importlib.import_module(f"torchtitan.models.{family}")
    config = module.model_registry(flavor or FAMILIES[family]).model
    if not gpu_layers:
        config.layers = [layer for layer in config.layers if getattr(layer, "delta_net", None) is None]
    if n_layers is not None:
        if not isinstance(n_layers, int) or not 1 <= n_layers <= len(config.layers):
            raise ValueError(f"n_layers must be an int in [1, {len(config.layers)}], got {n_layers!r}")
        config.layers = config.layers[:n_layers]
    for layer in config.layers:
        attention = getattr(layer, "attention", None)
        if attention is not None and hasattr(attention, "inner_attention"):
            attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def debug_model(family: str, flavor: Optional[str] = None, n_layers: Optional[int] = None, seed: int = 0,
                dtype: torch.dtype = torch.float32, gpu_layers: bool = False):
    """torchtitan's debug model of `family` on the CPU (see `debug_config`), initialised by torchtitan
    from `seed`."""
    config = debug_config(family, flavor, n_layers, gpu_layers)
    torch.manual_seed(seed)
    model = config.build()
    model.init_states(buffer_device=torch.device("cpu"))
    # Floating tensors only: Module.to(dtype) would cast DeepSeek-V3's complex RoPE table to real.
    return model._apply(lambda t: t.to(dtype) if t.is_floating_point() else t)


def forward(model, tokens_BL: torch.Tensor) -> torch.Tensor:
    """The model's logits [B, L, vocab] for `tokens_BL`, positions 0..L-1, no attention masks."""
    B, L = tokens_BL.shape
    positions_BL = torch.arange(L, device=tokens_BL.device).expand(B, L)
    extra = {}
    if type(model).__name__ == "Qwen35Model":
        # Qwen3.5 reads its image and video token ids even for text alone: ids no token has.
        extra["special_tokens"] = {"image_id": -1, "video_id": -1}
    return model(tokens_BL, positions=positions_BL, attention_masks=None, **extra)
