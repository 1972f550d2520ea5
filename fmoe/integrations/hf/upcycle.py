"""Upcycle dense HuggingFace Transformers causal LMs into MoE models with fmoe layers.

    model = AutoModelForCausalLM.from_pretrained(...)
    fmoe.integrations.hf.moefy(model, num_experts=8, top_k=2)   # every `*.mlp` becomes an fmoe layer
    out = model(input_ids, labels=labels)                # out.loss includes aux_loss_coef * balance losses
    model.save_pretrained(path)                          # config.json records the MoE settings
    model = fmoe.integrations.hf.from_pretrained(path)   # rebuilds the MoE structure, loads its weights

Supported MLPs: GPT-2's (Conv1D `c_fc` / `c_proj` with the model's own activation) and the
SwiGLU MLPs of Llama, Mistral, Qwen and their kin (`gate_proj` / `up_proj` / `down_proj`, SiLU).
With `upcycle=True` every expert starts as a copy of the dense MLP, so with a gate whose top-k
weights sum to 1 (naive, noisy, balanced; gshard without capacity drops) the logits are
unchanged at the first step.
"""
import json
from pathlib import Path
from typing import Optional

import torch
from torch import nn

try:
    import transformers
    from safetensors.torch import load_file
    from transformers.pytorch_utils import Conv1D
except ImportError as err:     # pragma: no cover - depends on the install
    raise ImportError("fmoe.integrations.hf needs HuggingFace Transformers: pip install 'fmoe[hf]'") from err

from fmoe.integrations.hf.convert import take_modes
from fmoe.integrations.hf.families import find_moe_blocks
from fmoe.layer import collect_aux_loss
from fmoe.transformer import FMoETransformerMLP

CONFIG_KEY = "fmoe"     # the model config's attribute (and config.json entry) holding moefy's settings
SAVED_SETTINGS = ("num_experts", "top_k", "gate", "gate_kwargs", "aux_loss_coef")


class MoEMLP(nn.Module):
    """An fmoe layer in an MLP's place; keeps the dense MLP's output dropout (GPT-2 has one)."""

    def __init__(self, moe: FMoETransformerMLP, dropout: Optional[nn.Module] = None):
        super().__init__()
        self.moe = moe
        self.dropout = dropout if dropout is not None else nn.Identity()

    def forward(self, hidden_states, *args, **kwargs):
        return self.dropout(self.moe(hidden_states))


def _is_silu(act) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ in ("SiLUActivation", "SiLU")


def _dense_mlp(name: str, mlp: nn.Module):
    """(w1_DF, b1_F, w2_FD, b2_D, activation) in fmoe's expert layout, from a supported MLP."""
    parts = dict(mlp.named_children())
    if isinstance(parts.get("c_fc"), Conv1D) and isinstance(parts.get("c_proj"), Conv1D) and "act" in parts:
        fc, proj = parts["c_fc"], parts["c_proj"]
        # Conv1D stores its weight as [in, out]: already fmoe's [D, F] and [F, D].
        return fc.weight, fc.bias, proj.weight, proj.bias, parts["act"]
    if all(isinstance(parts.get(n), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj")):
        gate, up, down = parts["gate_proj"], parts["up_proj"], parts["down_proj"]
        act = getattr(mlp, "act_fn", None)
        if not _is_silu(act):
            raise ValueError(f"moefy: {name} gates with {type(act).__name__}; fmoe's gated experts are SwiGLU (SiLU)")
        # fmoe's swiglu experts hold the gate and the up projection side by side, gate first.
        w1 = torch.cat([gate.weight.t(), up.weight.t()], dim=1)
        b1 = None if gate.bias is None else torch.cat([gate.bias, up.bias])
        return w1, b1, down.weight.t(), down.bias, "swiglu"
    raise ValueError(
        f"moefy: {name} ({type(mlp).__name__}) is not a supported MLP: expected GPT-2's c_fc/c_proj/act or "
        f"gate_proj/up_proj/down_proj/act_fn, found children {sorted(parts)}"
    )


def _moe_from_mlp(name: str, mlp: nn.Module, num_expert: int, top_k: int, gate, gate_kwargs, upcycle: bool,
                  fmoe_kwargs: dict) -> MoEMLP:
    w1_DF, b1_F, w2_FD, b2_D, activation = _dense_mlp(name, mlp)
    moe = FMoETransformerMLP(num_expert=num_expert, d_model=w1_DF.shape[0], d_hidden=w2_FD.shape[0],
                             activation=activation, top_k=top_k, gate=gate, gate_kwargs=gate_kwargs,
                             expert_bias=b1_F is not None, **fmoe_kwargs)
    moe.to(device=w1_DF.device, dtype=w1_DF.dtype)
    if upcycle:
        with torch.no_grad():
            experts = moe.experts
            experts.w1_eDF.copy_(w1_DF.expand_as(experts.w1_eDF))
            experts.w2_eFD.copy_(w2_FD.expand_as(experts.w2_eFD))
            if b1_F is not None:
                experts.b1_eF.copy_(b1_F.expand_as(experts.b1_eF))
                experts.b2_eD.copy_(b2_D.expand_as(experts.b2_eD))
    dropout = getattr(mlp, "dropout", None)
    return take_modes(MoEMLP(moe, dropout if isinstance(dropout, nn.Dropout) else None), mlp)


def add_aux_loss(model: nn.Module, output, coef: float, labels_given: bool):
    """`output` with `coef` x the fmoe layers' balance losses added to its loss, where it has one."""
    if coef == 0:
        return output
    if getattr(output, "loss", None) is not None:
        output.loss = output.loss + coef * collect_aux_loss(model)
    elif isinstance(output, tuple) and labels_given and output and torch.is_tensor(output[0]) \
            and output[0].dim() == 0:
        output = (output[0] + coef * collect_aux_loss(model),) + output[1:]
    return output


def _aux_loss_hook(module, args, kwargs, output):
    settings = getattr(module.config, CONFIG_KEY)
    return add_aux_loss(module, output, settings["aux_loss_coef"], kwargs.get("labels") is not None)


def moefy(model: nn.Module, num_experts: int, top_k: int = 2, gate="naive", upcycle: bool = True,
          aux_loss_coef: float = 0.01, gate_kwargs: Optional[dict] = None, **fmoe_kwargs) -> nn.Module:
    """Replace every MLP of a Transformers causal LM (modules named `*.mlp`) with an fmoe layer of
    `num_experts` experts in all, in place; returns the model.

    When the model is called with labels, the loss it returns includes `aux_loss_coef` times the
    sum of the gates' balance losses (0 turns that off; `fmoe.collect_aux_loss(model)` still
    has them). The settings go into `model.config.fmoe`, so `save_pretrained` records them and
    `fmoe.integrations.hf.from_pretrained` can rebuild the model. `fmoe_kwargs` go to FMoETransformerMLP
    (e.g. world_size and moe_group for expert parallelism: then each rank holds
    num_experts / world_size experts).
    """
    if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    if not aux_loss_coef >= 0:
        raise ValueError(f"aux_loss_coef must be >= 0, got {aux_loss_coef!r}")
    world_size = fmoe_kwargs.get("world_size", 1)
    if not isinstance(world_size, int) or world_size < 1 or num_experts % world_size:
        raise ValueError(f"num_experts ({num_experts}) must be divisible by world_size ({world_size!r})")
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"moefy: {type(model).__name__} has no .config; pass a Transformers PreTrainedModel")
    if getattr(config, CONFIG_KEY, None):
        raise ValueError(f"moefy: {type(model).__name__} is already MoE-ified ({getattr(config, CONFIG_KEY)})")
    mlps = [(name, m) for name, m in model.named_modules() if name.rpartition(".")[2] == "mlp"]
    if not mlps:
        raise ValueError(f"moefy found no `*.mlp` module in {type(model).__name__}")
    families = find_moe_blocks(model)
    if families:
        raise ValueError(f"moefy: {type(model).__name__} is already a sparse MoE model ({families[0][0]} is a "
                         f"{type(families[0][1]).__name__}); convert it with fmoe.integrations.hf.convert(model) "
                         "instead")
    for name, mlp in mlps:      # every MLP checked before any is replaced: the model is changed whole or not at all
        _dense_mlp(name, mlp)
    gate_kwargs = dict(gate_kwargs or {})
    for name, mlp in mlps:
        moe = _moe_from_mlp(name, mlp, num_experts // world_size, top_k, gate, gate_kwargs, upcycle, fmoe_kwargs)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, moe)
    if not isinstance(gate, str):
        gate = getattr(gate, "__name__", type(gate).__name__)
    setattr(config, CONFIG_KEY, dict(num_experts=num_experts, top_k=top_k, gate=gate, gate_kwargs=gate_kwargs,
                                     aux_loss_coef=aux_loss_coef))
    model.register_forward_hook(_aux_loss_hook, with_kwargs=True)
    return model


def _read_weights(path: Path) -> dict:
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise ValueError(f"from_pretrained: {path} holds no model.safetensors (write it with save_pretrained)")
    state = {}
    for name in files:
        state.update(load_file(str(path / name)))
    return state


def from_pretrained(path, model_class=None, **fmoe_kwargs) -> nn.Module:
    """Load a model saved after `moefy` from the local folder `path`: build the dense model from its
    config, MoE-ify it with the recorded settings, then load every weight (experts included).
    `model_class` defaults to AutoModelForCausalLM."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"from_pretrained: path must be a local folder written by save_pretrained, got {str(path)!r}")
    config = transformers.AutoConfig.from_pretrained(path)
    settings = getattr(config, CONFIG_KEY, None)
    if not settings:
        raise ValueError(f"from_pretrained: {path}/config.json has no '{CONFIG_KEY}' entry: it was not saved "
                         "after fmoe.integrations.hf.moefy; load it with transformers instead")
    delattr(config, CONFIG_KEY)     # moefy records it again
    model_class = model_class or transformers.AutoModelForCausalLM
    model = model_class.from_config(config)
    moefy(model, upcycle=False, **{k: settings[k] for k in SAVED_SETTINGS if k in settings}, **fmoe_kwargs)
    state = _read_weights(path)
    missing, unexpected = model.load_state_dict(state, strict=False)
    # save_pretrained stores a tied weight once (e.g. lm_head = wte): missing is fine when tied to a loaded one.
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = {params[n].data_ptr() for n in state if n in params}
    absent = [n for n in missing if n not in params or params[n].data_ptr() not in loaded]
    if absent or unexpected:
        raise ValueError(f"from_pretrained: the weights in {path} do not fit the MoE-ified model: "
                         f"missing {absent[:5]}, unexpected {unexpected[:5]}")
    return model.eval()

