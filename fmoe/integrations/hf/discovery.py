"""Every MoE family of the installed transformers whose experts dispatch through its experts interface,
and a tiny model of each, made from the family's own config class (nothing downloaded).

    for family in discover():               # one `MoEFamily` per transformers model folder
        model = family.build(seed=0)        # or raises FamilyUnavailable naming why
        ...

A family is found by what marks its experts class, not by a list: transformers' decorator
`@use_experts_implementation` replaces the class's forward with one dispatching through its
`ExpertsInterface`, so an experts class is one whose forward is that dispatcher (recognised by its
code object, read from the decorator itself). A family added by a newer transformers is found with
no change here. `discover()` imports only the modeling modules whose source names the decorator.

The tiny model: the family's config class with its sizes shrunk by name (hidden width, heads, layers,
experts, top-k, vocabulary, the LoRA ranks of multi-head latent attention, ...), every attribute
being one the config class declares. A layer-type pattern is cut to one layer of each type, so a
hybrid (Mamba, linear attention, dense MLP beside MoE layers) keeps an MoE layer. The model class is
the family's causal LM on its text config where it has one, else its text model, else its base
model. Every floating parameter and every bias buffer (a selection bias) is drawn at random, so
routing has no ties. A family that cannot be built says why (`FamilyUnavailable`).
"""
import functools
import importlib
import pathlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

VOCAB = 64
# Config attribute -> tiny value, set where the family's config class declares the attribute.
TINY_SIZES = {
    "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 8, "max_position_embeddings": 64,
    "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16, "moe_shared_expert_intermediate_size": 16,
    "shared_intermediate_size": 16, "expert_intermediate_size": 16,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_top_k": 2, "moe_k": 2, "top_k_experts": 2,
    "n_shared_experts": 1, "num_shared_experts": 1, "moe_num_shared_experts": 1,
    "n_group": 2, "topk_group": 1, "first_k_dense_replace": 0,
    "kv_lora_rank": 8, "q_lora_rank": 8, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
    "sliding_window": 8, "num_nextn_predict_layers": 0,
    "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "mamba_num_heads": 4, "mamba_head_dim": 8, "ssm_state_size": 8, "n_groups": 1, "mamba_d_state": 8,
    "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": 4, "mamba_n_heads": 4, "mamba_d_head": 16,
    "chunk_size": 8, "moe_latent_size": None,
    "use_mamba_kernels": False, "pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0,
    # MoE in every layer: no dense-only layers first, and the MoE block switched on where it is optional
    "num_dense_layers": 0, "mlp_only_layers": [], "enable_moe_block": True,
}
# A layer-type pattern a config leaves None (its model reads it per layer): one type for every layer.
UNSET_LAYER_TYPES = {"layer_types": "full_attention", "mlp_layer_types": "sparse"}
LAYER_TYPE_ATTRS = ("layer_types", "layers_block_type")


class FamilyUnavailable(RuntimeError):
    """A discovered family whose tiny model cannot be made here; the message says why."""


@dataclass
class MoEFamily:
    """One transformers model folder whose experts dispatch through the experts interface."""

    name: str                                   # the model folder, e.g. "qwen3_5_moe"
    module: object                              # its modeling module
    experts_classes: Tuple[type, ...]           # the classes carrying @use_experts_implementation
    candidates: Tuple[type, ...] = field(default=())   # model classes to build, best first
    chosen: Optional[type] = None               # the one `build` made, once it has

    def build(self, seed: int = 0) -> nn.Module:
        """The family's tiny model in eval mode, fp32, its floating tensors random (see the module
        docstring), checked by one forward on token ids. Raises FamilyUnavailable naming each model
        class tried and why it failed."""
        if not self.candidates:
            raise FamilyUnavailable(f"{self.name}: no model class of {self.module.__name__} to build")
        failures = []
        for cls in self.candidates:
            try:
                model = build_tiny(cls, seed)
            except Exception as err:       # noqa: BLE001 - every reason is reported, never swallowed
                failures.append(f"{cls.__name__}: {type(err).__name__}: {first_line(err)}")
                continue
            if not any(isinstance(m, self.experts_classes) for m in model.modules()):
                failures.append(f"{cls.__name__}: built, but holds none of "
                                f"{[c.__name__ for c in self.experts_classes]}")
                continue
            try:
                with torch.no_grad():
                    model(input_ids=torch.arange(6).view(1, 6) % VOCAB, use_cache=False)
            except Exception as err:       # noqa: BLE001
                failures.append(f"{cls.__name__}: built, but its forward fails: {type(err).__name__}: "
                                f"{first_line(err)}")
                continue
            self.chosen = cls
            return model
        raise FamilyUnavailable(f"{self.name}: no tiny model could be built; " + "; ".join(failures))


def first_line(err: BaseException, limit: int = 300) -> str:
    """`err`'s message on one line (a validation error's cause is on its second line), cut at `limit`."""
    return " ".join(line.strip() for line in str(err).strip().splitlines())[:limit]


@functools.lru_cache(maxsize=None)
def experts_marker():
    """The code object of the forward that `@use_experts_implementation` installs, or None where the
    installed transformers has no experts interface."""
    try:
        from transformers.integrations.moe import use_experts_implementation
    except ImportError:
        return None

    class Probe(nn.Module):
        def forward(self, x):
            return x

    return use_experts_implementation(Probe).forward.__code__


def uses_experts_interface(cls) -> bool:
    """Whether `cls` is an experts class dispatching through transformers' experts interface."""
    forward = getattr(cls, "forward", None) if isinstance(cls, type) else None
    marker = experts_marker()
    return marker is not None and getattr(forward, "__code__", None) is marker


def discover(names: Optional[List[str]] = None) -> List[MoEFamily]:
    """Every family (model folder) of the installed transformers with an experts class that dispatches
    through the experts interface, sorted by name; `names` keeps only those folders. A modeling module
    that fails to import is a family too: its `build` raises with the import error."""
    import transformers
    if experts_marker() is None:
        return []
    models = pathlib.Path(transformers.__file__).parent / "models"
    families = []
    for folder in sorted(p for p in models.iterdir() if p.is_dir()):
        if names is not None and folder.name not in names:
            continue
        source = folder / f"modeling_{folder.name}.py"
        if not source.is_file() or "use_experts_implementation" not in source.read_text(encoding="utf-8"):
            continue
        try:
            module = importlib.import_module(f"transformers.models.{folder.name}.modeling_{folder.name}")
        except Exception as err:   # noqa: BLE001 - reported through build()
            families.append(BrokenFamily(folder.name, None, (), error=f"import failed: {type(err).__name__}: "
                                                                       f"{first_line(err)}"))
            continue
        experts = tuple(c for c in vars(module).values()
                        if isinstance(c, type) and c.__module__ == module.__name__ and uses_experts_interface(c))
        if experts:
            families.append(MoEFamily(folder.name, module, experts, tuple(model_candidates(module))))
    return families


@dataclass
class BrokenFamily(MoEFamily):
    error: str = ""

    def build(self, seed: int = 0) -> nn.Module:
        raise FamilyUnavailable(f"{self.name}: {self.error}")


def model_candidates(module) -> List[type]:
    """The module's model classes worth building, best first: causal LMs on a text config, then text
    models, then causal LMs, then base models (a model of the family's own name)."""
    from transformers import PreTrainedModel
    classes = [c for c in vars(module).values()
               if isinstance(c, type) and issubclass(c, PreTrainedModel) and c.__module__ == module.__name__
               and not c.__name__.endswith("PreTrainedModel") and getattr(c, "config_class", None) is not None]

    def rank(cls):
        name, config = cls.__name__, cls.config_class.__name__
        text = "Text" in config or "Text" in name
        if name.endswith("ForCausalLM"):
            return 0 if text else 2
        if name.endswith("TextModel"):
            return 1
        if name.endswith("Model") and not any(part in name for part in ("Vision", "Audio", "Encoder", "Code2Wav")):
            return 3
        return None

    ranked = [(rank(c), i, c) for i, c in enumerate(classes)]
    return [c for r, _, c in sorted((r, i, c) for r, i, c in ranked if r is not None)]


# Tried in turn when the tiny config is refused or its model fails to build: families that route to
# one expert only (a config check refuses more).
FALLBACKS = ({}, {"num_experts_per_tok": 1})


def tiny_config(config_class, extra: Optional[dict] = None):
    """`config_class` with the sizes of TINY_SIZES wherever it declares them (a per-layer or per-modality
    list of sizes becomes a list of tiny ones), one layer of each type of a layer-type pattern, a
    multimodal rotary split fitted to the tiny head, sub-configs made tiny alike; fp32, eager attention."""
    default = config_class()
    declared = dict(vars(default))
    overrides = {}
    for key, value in {**TINY_SIZES, **(extra or {})}.items():
        if not has_attribute(default, key):
            continue
        current = declared.get(key)
        if isinstance(current, (list, tuple)) and current and all(isinstance(v, int) for v in current) \
                and isinstance(value, int):
            value = [value] * len(current)
        overrides[key] = value
    for attr in sorted(k for k in declared if k.endswith("layer_types") or k == "layers_block_type"):
        types = declared[attr]
        if isinstance(getattr(type(default), attr, None), property):
            continue
        if isinstance(types, (list, tuple)) and types and all(isinstance(t, str) for t in types):
            one_each = list(dict.fromkeys(types))
            overrides[attr] = one_each
            if "num_hidden_layers" in overrides:
                overrides["num_hidden_layers"] = max(overrides["num_hidden_layers"], len(one_each))
    for attr, kind in UNSET_LAYER_TYPES.items():
        if attr in declared and declared[attr] is None:
            overrides[attr] = [kind]
    for attr in sorted(k for k in overrides if k.endswith("layer_types") or k == "layers_block_type"):
        n = overrides.get("num_hidden_layers", len(overrides[attr]))
        overrides[attr] = (overrides[attr] * n)[:n]
    rope = declared.get("rope_parameters")
    if isinstance(rope, dict) and isinstance(rope.get("mrope_section"), (list, tuple)):
        overrides["rope_parameters"] = dict(rope, mrope_section=mrope_section(rope, overrides, declared))
    for key, sub in declared.items():
        if key.endswith("_config") and sub is not None and hasattr(sub, "to_dict") and hasattr(sub, "model_type"):
            overrides[key] = tiny_config(type(sub), extra).to_dict()
    config = config_class(**overrides)
    config._attn_implementation = "eager"
    return config


def mrope_section(rope: dict, overrides: dict, declared: dict) -> list:
    """A multimodal rotary split (time, height, width, ...) summing to half the tiny rotary width."""
    head = overrides.get("qk_rope_head_dim") or overrides.get("head_dim") or TINY_SIZES["head_dim"]
    factor = rope.get("partial_rotary_factor", declared.get("partial_rotary_factor")) or 1.0
    half = int(head * factor) // 2
    parts = len(rope["mrope_section"])
    return [half // parts + (1 if i < half % parts else 0) for i in range(parts)]


def has_attribute(config, key: str) -> bool:
    return key in vars(config) or key in getattr(type(config), "attribute_map", {}) or \
        key in getattr(type(config), "__dataclass_fields__", {})


def build_tiny(model_class, seed: int = 0) -> nn.Module:
    """A tiny `model_class` (its config from `tiny_config`, the FALLBACKS tried in turn) in eval mode,
    fp32, tensors random; the first failure is raised when every fallback fails."""
    first = None
    for extra in FALLBACKS:
        try:
            config = tiny_config(model_class.config_class, extra)
            torch.manual_seed(seed)
            model = model_class(config).float().eval()
        except Exception as err:   # noqa: BLE001 - the first failure is raised below
            first = first or err
            continue
        randomise(model, seed)
        return model
    raise first


def randomise(model: nn.Module, seed: int):
    """Every floating parameter and bias buffer drawn from N(0, 0.3^2) (rotary tables, Mamba's A_log
    and norms' weights kept positive where they must be)."""
    g = torch.Generator().manual_seed(seed + 1)
    tensors: Dict[str, torch.Tensor] = dict(model.named_parameters())
    tensors.update({n: b for n, b in model.named_buffers() if "bias" in n.rsplit(".", 1)[-1]})
    with torch.no_grad():
        for name, tensor in tensors.items():
            if tensor.is_floating_point() and "inv_freq" not in name and "A_log" not in name:
                tensor.copy_(torch.randn(tensor.shape, generator=g) * 0.3)


def experts_modules(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """(name, module) of every experts module of `model` that dispatches through the experts interface."""
    return [(name, m) for name, m in model.named_modules() if uses_experts_interface(type(m))]

