"""Each HuggingFace MoE family's block: where its router and experts live, how its routing maps to
RouterGate options, and its expert tensors in fmoe's layout and back.

fmoe's experts hold w1_EDF ([E, D, 2F]: gate and up side by side) and w2_EFD ([E, F, D]).
transformers' fused experts hold `gate_up_proj` [E, 2F, D] (gate half first) and `down_proj`
[E, D, F]; gpt-oss holds them transposed ([E, D, 2F] interleaved, [E, F, D]) with biases; DBRX
holds `w1`, `v1`, `w2` as [E*F, D].
"""
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from fmoe.experts import GLU, ClampedSwiGLU
from fmoe.layer import FMoE


@dataclass
class ExpertWeights:
    """All E experts of one block in fmoe's layout."""

    w1_EDF: torch.Tensor
    w2_EFD: torch.Tensor
    b1_EF: Optional[torch.Tensor] = None
    b2_ED: Optional[torch.Tensor] = None
    activation: object = "swiglu"

    @property
    def shape(self) -> Tuple[int, int, int]:
        """(E, D, F)"""
        return self.w2_EFD.shape[0], self.w2_EFD.shape[2], self.w2_EFD.shape[1]


@dataclass(frozen=True)
class Family:
    """One model family's sparse MoE block.

    `router` names the block's child whose class transformers records `router_logits` from;
    `router_keys` maps the router's state-dict keys (relative to the block) to RouterGate's names;
    `gate_options(block, config)` gives RouterGate.from_preset's overrides; `read(block)` the experts
    in fmoe's layout (raising ValueError on a wrong shape); `write(weights)` HF's expert keys.
    `shared` names the block's shared-expert child and `shared_gate` its sigmoid gate, if any.
    """

    name: str
    block: str
    router: str
    router_keys: Dict[str, str]
    gate_options: Callable
    read: Callable
    write: Callable
    shared: Optional[str] = None
    shared_gate: Optional[str] = None
    returns_router_scores: bool = False    # gpt-oss's block returns (hidden_states, router_scores)
    input_jitter: Optional[Callable] = None  # config -> the block's multiplicative input noise in training
    config_of: Callable = field(default=lambda config: config)
    preset: Optional[str] = None             # RouterGate's preset, when not the family's name

    @property
    def router_preset(self) -> str:
        return self.preset or self.name


def _activation(act_fn) -> object:
    """HF's act_fn applied to the gate half: fmoe's "swiglu" for SiLU, else GLU(act_fn)."""
    if isinstance(act_fn, nn.SiLU) or type(act_fn).__name__ in ("SiLUActivation", "SiLU"):
        return "swiglu"
    return GLU(act_fn)


def _check(name: str, tensor: torch.Tensor, shape: tuple):
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"expert tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(shape)}")


def read_fused(block) -> ExpertWeights:
    """transformers' fused experts: gate_up_proj [E, 2F, D] (gate first), down_proj [E, D, F]."""
    experts = block.experts
    gate_up, down = experts.gate_up_proj, experts.down_proj
    if gate_up.dim() != 3 or down.dim() != 3:
        raise ValueError(f"expert tensors gate_up_proj / down_proj must be 3D, got {tuple(gate_up.shape)} / "
                         f"{tuple(down.shape)}")
    E, D, F = down.shape
    _check("gate_up_proj", gate_up, (E, 2 * F, D))
    return ExpertWeights(gate_up.transpose(1, 2), down.transpose(1, 2), activation=_activation(experts.act_fn))


def write_fused(w: ExpertWeights) -> dict:
    return {"experts.gate_up_proj": w.w1_EDF.transpose(1, 2), "experts.down_proj": w.w2_EFD.transpose(1, 2)}


def read_gpt_oss(block) -> ExpertWeights:
    """gpt-oss: gate_up_proj [E, D, 2F] interleaved, down_proj [E, F, D], both with biases."""
    experts = block.experts
    down = experts.down_proj
    if down.dim() != 3:
        raise ValueError(f"expert tensor down_proj must be 3D [E, F, D], got {tuple(down.shape)}")
    E, F, D = down.shape
    _check("gate_up_proj", experts.gate_up_proj, (E, D, 2 * F))
    _check("gate_up_proj_bias", experts.gate_up_proj_bias, (E, 2 * F))
    _check("down_proj_bias", experts.down_proj_bias, (E, D))
    return ExpertWeights(experts.gate_up_proj, down, experts.gate_up_proj_bias, experts.down_proj_bias,
                         ClampedSwiGLU(alpha=experts.alpha, limit=experts.limit, interleaved=True))


def write_gpt_oss(w: ExpertWeights) -> dict:
    return {"experts.gate_up_proj": w.w1_EDF, "experts.gate_up_proj_bias": w.b1_EF,
            "experts.down_proj": w.w2_EFD, "experts.down_proj_bias": w.b2_ED}


def read_dbrx(block) -> ExpertWeights:
    """DBRX: w1 (gate), v1 (up) and w2 (down), each [E*F, D]."""
    mlp = block.experts.mlp
    E, F, D = mlp.moe_num_experts, mlp.ffn_hidden_size, mlp.hidden_size
    for name in ("w1", "v1", "w2"):
        _check(name, getattr(mlp, name), (E * F, D))
    gate, up = (getattr(mlp, n).view(E, F, D).transpose(1, 2) for n in ("w1", "v1"))
    return ExpertWeights(torch.cat([gate, up], dim=2), mlp.w2.view(E, F, D), activation=_activation(mlp.activation_fn))


def write_dbrx(w: ExpertWeights) -> dict:
    E, D, F = w.shape
    gate, up = w.w1_EDF[..., :F], w.w1_EDF[..., F:]
    return {"experts.mlp.w1": gate.transpose(1, 2).reshape(E * F, D),
            "experts.mlp.v1": up.transpose(1, 2).reshape(E * F, D),
            "experts.mlp.w2": w.w2_EFD.reshape(E * F, D)}


def _top_k(config):
    return dict(top_k=config.num_experts_per_tok)


def _softmax_topk(renormalise: bool):
    def options(block, config):
        return dict(_top_k(config), score="softmax", softmax_after_topk=False, norm_topk_prob=renormalise)
    return options


def _norm_from_config(block, config):
    return dict(_top_k(config), score="softmax", softmax_after_topk=False, norm_topk_prob=bool(config.norm_topk_prob))


def _deepseek_v2(block, config):
    if config.topk_method == "greedy":
        groups = dict(n_group=1, topk_group=1)
    elif config.topk_method == "group_limited_greedy":
        groups = dict(n_group=config.n_group, topk_group=config.topk_group, group_score="max")
    else:
        raise ValueError(f"DeepSeek-V2 topk_method must be 'greedy' or 'group_limited_greedy', "
                         f"got {config.topk_method!r}")
    return dict(_top_k(config), score="softmax", norm_topk_prob=False,
                routed_scaling_factor=float(config.routed_scaling_factor), **groups)


def _deepseek_v3(block, config):
    return dict(_top_k(config), score="sigmoid", norm_topk_prob=bool(config.norm_topk_prob),
                routed_scaling_factor=float(config.routed_scaling_factor), n_group=config.n_group,
                topk_group=config.topk_group, group_score="top2_sum", selection_bias="frozen")


def _after_topk(bias: bool):
    def options(block, config):
        return dict(_top_k(config), score="softmax", softmax_after_topk=True, gate_bias=bias)
    return options


def _phimoe(block, config):
    if config.num_experts_per_tok != 2:
        raise ValueError(f"PhiMoE's sparsemixer routes to exactly 2 experts, config has "
                         f"num_experts_per_tok={config.num_experts_per_tok}")
    return dict(top_k=2, sparsemixer=True, jitter_eps=float(config.router_jitter_noise))


def _dbrx(block, config):
    p = config.moe_normalize_expert_weights
    if p not in (None, 1, 1.0):
        raise ValueError(f"DBRX moe_normalize_expert_weights must be None or 1 (a sum), got {p!r}")
    return dict(top_k=config.moe_top_k, score="softmax", norm_topk_prob=p is not None)


FAMILIES: List[Family] = [
    Family("mixtral", "MixtralSparseMoeBlock", "gate", {"gate.weight": "gate.proj.weight"},
           _softmax_topk(True), read_fused, write_fused, input_jitter=lambda c: c.router_jitter_noise),
    Family("qwen2_moe", "Qwen2MoeSparseMoeBlock", "gate", {"gate.weight": "gate.proj.weight"}, _norm_from_config,
           read_fused, write_fused, shared="shared_expert", shared_gate="shared_expert_gate"),
    Family("qwen3_moe", "Qwen3MoeSparseMoeBlock", "gate", {"gate.weight": "gate.proj.weight"}, _norm_from_config,
           read_fused, write_fused),
    Family("olmoe", "OlmoeSparseMoeBlock", "gate", {"gate.weight": "gate.proj.weight"}, _norm_from_config,
           read_fused, write_fused),
    Family("deepseek_v2", "DeepseekV2Moe", "gate", {"gate.weight": "gate.proj.weight"}, _deepseek_v2,
           read_fused, write_fused, shared="shared_experts"),
    Family("deepseek_v3", "DeepseekV3MoE", "gate",
           {"gate.weight": "gate.proj.weight", "gate.e_score_correction_bias": "e_score_correction_bias"}, _deepseek_v3,
           read_fused, write_fused, shared="shared_experts"),
    Family("gpt_oss", "GptOssMLP", "router", {"router.weight": "gate.proj.weight", "router.bias": "gate.proj.bias"},
           _after_topk(True), read_gpt_oss, write_gpt_oss, returns_router_scores=True),
    Family("granitemoe", "GraniteMoeMoE", "router", {"router.weight": "gate.proj.weight"}, _after_topk(False),
           read_fused, write_fused),
    Family("granitemoeshared", "GraniteMoeSharedMoE", "router", {"router.weight": "gate.proj.weight"},
           _after_topk(False), read_fused, write_fused, preset="granitemoe"),
    Family("phimoe", "PhimoeSparseMoeBlock", "router", {"router.weight": "gate.proj.weight"}, _phimoe,
           read_fused, write_fused, input_jitter=lambda c: c.input_jitter_noise),
    Family("dbrx", "DbrxFFN", "router", {"router.layer.weight": "gate.proj.weight"}, _dbrx, read_dbrx, write_dbrx,
           input_jitter=lambda c: c.moe_jitter_eps, config_of=lambda c: c.ffn_config),
    Family("jamba", "JambaSparseMoeBlock", "router", {"router.weight": "gate.proj.weight"}, _softmax_topk(False),
           read_fused, write_fused),
]
"""The transformers MoE families `convert` and `export` know, one `Family` each (its block class,
router, expert layout and routing options)."""
BY_BLOCK = {f.block: f for f in FAMILIES}
BY_NAME = {f.name: f for f in FAMILIES}


def looks_like_moe_block(module: nn.Module) -> bool:
    """A block of a family fmoe may not know: experts beside a router, or a known block class."""
    children = dict(module.named_children())
    return type(module).__name__ in BY_BLOCK or ("experts" in children and ("gate" in children or "router" in children))


def find_moe_blocks(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """(name, module) of every transformers sparse MoE block, not looking inside one nor inside fmoe layers."""
    found = []
    skip = None
    for name, module in model.named_modules():
        if skip is not None and name.startswith(skip):
            continue
        if isinstance(module, FMoE):
            skip = name + "."
        elif looks_like_moe_block(module):
            found.append((name, module))
            skip = name + "."
    return found
