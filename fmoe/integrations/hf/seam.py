"""Conversion at the experts seam: a transformers experts module becomes an fmoe layer under the same contract.

    fmoe.integrations.hf.convert(model, ep_size=2, seam=True)   # any family whose experts use the interface

transformers' MoE blocks call their experts as `experts(hidden_states [T, D], top_k_index [T, K],
top_k_weights [T, K]) -> [T, D]`, the same in every family that dispatches through its experts
interface (`@use_experts_implementation`). Converting there keeps the family's own block, router
(whatever it routes by) and shared experts, and puts an `FMoE` behind the call (`SeamMoE`):

- `SeamGate` hands the family's choice to the layer as its routing (slots of experts outside
  [0, E), transformers' own expert-parallel sentinels, reach no expert and count as unrouted), so
  fmoe's dispatchers, exchanges, routing statistics, dropped-slot counts (a `capacity` may be
  given) and router replay (`fmoe.record_routing` / `fmoe.replay_routing`: under replay the family's
  router's own top-k returns the recorded experts and the router weighs them, see
  `fmoe.integrations.hf.seam_replay`) apply as to any fmoe layer;
- `SeamExperts` is the family's experts class itself (a subclass made per class, as transformers'
  initialisation and tensor plans recognise it), holding this rank's slice of the expert tensors under
  the family's own names and layout, read from what transformers declares on the module:
  `has_gate` (gate_up_proj or up_proj), `is_transposed`, `has_bias`, `has_post_expert_norm`, and
  the class's own `_apply_gate`. Where the activation is one fmoe's kernels know (transformers'
  default gate with SiLU / GELU / ReLU, or a plain GELU / ReLU, as `experts_implementation="fmoe"`
  decides) the experts run lean; otherwise they run the module's own gate or activation between
  two grouped GEMMs.

A converted model's state dict keeps transformers' keys (`...mlp.experts.gate_up_proj`); under
expert parallelism each rank's entries hold its own experts.
"""
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from fmoe.experts import GLU, GroupedExperts
from fmoe.kernels.fp8 import check_fp8
from fmoe.gates.base import BaseGate
from fmoe.integrations.hf.discovery import uses_experts_interface
from fmoe.integrations.hf.experts_impl import fused_spec
from fmoe.integrations.hf.seam_replay import begin_replay, end_replay
from fmoe.layer import FMoE

# The expert tensors of transformers' experts interface, each [E, ...].
EXPERT_TENSORS = ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias", "down_proj_bias")
# FMoE options a seam conversion passes on; `capacity` goes to the gate.
SEAM_OPTIONS = ("backend", "shadow", "schedule", "schedule_group_size", "recompute", "exchange", "ranks_per_node",
                "sync_free", "max_tokens_per_rank", "overlap", "fp32_combine", "capacity", "fp8")
TOP_K_ATTRS = ("num_experts_per_tok", "moe_top_k", "top_k", "moe_k")


class SeamGate(BaseGate):
    """The family's router's choice as an fmoe gate's routing: `hand(top_k_index, top_k_weights)` before
    each forward of the layer; `route` returns them (a slot naming no expert of [0, E) gets -1 and
    weight 0). It has no parameters: the family's router keeps its own, and its gradient flows back
    through the weights. With a `capacity`, fmoe drops each expert's lowest-weight slots over it."""

    unroute_before_capacity = True      # the slots that name no expert are counted apart from capacity drops
    repeats_experts = True              # the family's router may name an expert in two slots (hash routing)

    def __init__(self, d_model: int, num_expert: int, world_size: int = 1, top_k: int = 1, capacity=None):
        super().__init__(d_model, num_expert, world_size, top_k, capacity)
        self.handed: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        self.replay = None                  # a ReplayedTopK while the family's block runs under replay
        self.layer_name = "a seam layer"    # for messages; SeamMoE.attach_to_block names it

    def replayed_experts(self, x_TD):
        """Under replay: the experts the block's hook took from the tape (see `ReplayedTopK`)."""
        if self.replay is None:
            raise RuntimeError(f"replay_routing: {self.layer_name} was called outside its family's block, whose "
                               "hook takes the replayed experts; call the model (or the block), not the layer")
        return self.replay.recorded()

    def hand(self, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        if top_k_index.shape != top_k_weights.shape or top_k_index.dim() != 2:
            raise ValueError(f"{type(self).__name__}: top_k_index and top_k_weights must both be [tokens, top_k], "
                             f"got {tuple(top_k_index.shape)} and {tuple(top_k_weights.shape)}")
        self.top_k = top_k_index.shape[1]
        self.handed = (top_k_index, top_k_weights)

    def route(self, x_TD):
        if self.handed is None:
            raise RuntimeError(f"{type(self).__name__} routes only what the family's router hands it: call the "
                               "SeamMoE layer as transformers' experts, "
                               "layer(hidden_states, top_k_index, top_k_weights)")
        top_k_index, weight_TK = self.handed
        self.handed = None
        if self.replayed_TK is not None:
            self.replay.check_handed(top_k_index)
        if top_k_index.shape[0] != x_TD.shape[0]:
            raise ValueError(f"{type(self).__name__}: top_k_index has {top_k_index.shape[0]} tokens, hidden_states "
                             f"{x_TD.shape[0]}")
        idx_TK = top_k_index.long()
        outside_TK = (idx_TK < 0) | (idx_TK >= self.tot_expert)
        idx_TK = idx_TK.masked_fill(outside_TK, -1)
        weight_TK = weight_TK.masked_fill(outside_TK, 0)
        return idx_TK, weight_TK, weight_TK.detach(), None, x_TD.new_zeros((), dtype=torch.float32)

    def unroute(self, expert_idx_TK, weight_TK):
        """The slots the family's router sent to no expert of this layer (-1 after `route`)."""
        return expert_idx_TK, weight_TK, (expert_idx_TK < 0).sum()


class FamilyActivation:
    """Marks a `SeamExperts` whose activation is the family module's own (`_apply_gate` or `act_fn`),
    which `SeamExperts.act` runs; fmoe's kernels know no spec for it."""

    def __repr__(self):
        return "the family's own"


class SeamExperts(GroupedExperts):
    """A family's experts module run by fmoe's grouped GEMMs: this rank's experts under the family's
    tensor names and layout (see the module docstring). Made by `seam_experts`, never directly."""

    @property
    def w1_eDF(self):
        up = self.gate_up_proj if self.has_gate else self.up_proj
        return up if self.is_transposed else up.transpose(1, 2)

    @property
    def w2_eFD(self):
        return self.down_proj if self.is_transposed else self.down_proj.transpose(1, 2)

    @property
    def b1_eF(self):
        if not self.has_bias:
            return None
        return self.gate_up_proj_bias if self.has_gate else self.up_proj_bias

    @property
    def b2_eD(self):
        return self.down_proj_bias if self.has_bias else None

    @property
    def lean(self) -> bool:
        return not self.has_post_expert_norm and super().lean

    def act(self, h_NF):
        if not isinstance(self.activation, FamilyActivation):
            return super().act(h_NF)
        return self._apply_gate(h_NF) if self.has_gate else self.act_fn(h_NF)

    def run(self, x_ND, counts_e, w1_eDF, w2_eFD, b1_eF=None, b2_eD=None):
        y_ND = super().run(x_ND, counts_e, w1_eDF, w2_eFD, b1_eF, b2_eD)
        return self.post_expert_norm(y_ND) if self.has_post_expert_norm else y_ND

    def expert_forward(self, e: int, x_TD):
        y = super().expert_forward(e, x_TD)
        return self.post_expert_norm(y) if self.has_post_expert_norm else y

    def reset_parameters(self):
        raise NotImplementedError(f"{type(self).__name__} takes its weights from the family's module; the family's "
                                  "own initialisation (model.init_weights()) initialises them")

    def extra_repr(self):
        return (f"num_expert={self.num_expert}, d_model={self.d_model}, d_hidden={self.d_hidden}, "
                f"activation={self.activation!r}, is_transposed={self.is_transposed}, has_bias={self.has_bias}")


_SEAM_CLASSES = {}


def seam_class(family_cls: type) -> type:
    """SeamExperts and `family_cls` in one class (made once per family class)."""
    if family_cls not in _SEAM_CLASSES:
        _SEAM_CLASSES[family_cls] = type(f"FMoE{family_cls.__name__}", (SeamExperts, family_cls),
                                         {"__module__": __name__})
    return _SEAM_CLASSES[family_cls]


def layout_of(experts: nn.Module) -> dict:
    """What transformers declares on an experts module (transformers before 5.20 set only has_bias and
    is_transposed: the tensors tell the rest), and its sizes E, D, F; ValueError when the tensors
    do not fit the declaration."""
    has_gate = bool(getattr(experts, "has_gate", hasattr(experts, "gate_up_proj")))
    has_bias = bool(getattr(experts, "has_bias", False))
    is_transposed = bool(getattr(experts, "is_transposed", False))
    up_name = "gate_up_proj" if has_gate else "up_proj"
    params = dict(experts.named_parameters(recurse=False))
    needed = [up_name, "down_proj"] + ([f"{up_name}_bias", "down_proj_bias"] if has_bias else [])
    missing = [n for n in needed if n not in params]
    if missing:
        raise ValueError(f"its declared layout (has_gate={has_gate}, has_bias={has_bias}) needs {missing}, which "
                         f"it does not hold (it holds {sorted(params)})")
    unknown = sorted(set(params) - set(needed))
    if unknown:
        raise ValueError(f"it holds expert tensors fmoe does not know how to run: {unknown}")
    up, down = params[up_name], params["down_proj"]
    if up.dim() != 3 or down.dim() != 3:
        raise ValueError(f"{up_name} and down_proj must be 3-D [experts, ...], got {tuple(up.shape)} and "
                         f"{tuple(down.shape)}")
    E = up.shape[0]
    D, F = (down.shape[2], down.shape[1]) if is_transposed else (down.shape[1], down.shape[2])
    width = 2 * F if has_gate else F
    want_up = (E, D, width) if is_transposed else (E, width, D)
    if tuple(up.shape) != want_up or down.shape[0] != E:
        raise ValueError(f"{up_name} has shape {tuple(up.shape)} and down_proj {tuple(down.shape)}; with "
                         f"is_transposed={is_transposed} and has_gate={has_gate} {up_name} must be {want_up}")
    return dict(has_gate=has_gate, has_bias=has_bias, is_transposed=is_transposed, E=E, D=D, F=F,
                tensors=needed, post_norm=bool(getattr(experts, "has_post_expert_norm", False)))


def seam_experts(experts: nn.Module, layout: dict, rank: int, ep_size: int, backend=None,
                 recompute: str = "activation", fp8=None) -> SeamExperts:
    """`experts` as a SeamExperts holding experts [rank * e, (rank + 1) * e) (e = E / ep_size); on one
    rank the very parameters of `experts`."""
    e = layout["E"] // ep_size
    mine = slice(rank * e, (rank + 1) * e)
    new = seam_class(type(experts)).__new__(seam_class(type(experts)))
    nn.Module.__init__(new)
    for key, value in vars(experts).items():
        if not key.startswith("_"):
            object.__setattr__(new, key, value)
    new._is_expert_parallel = getattr(experts, "_is_expert_parallel", False)
    for name, module in experts.named_children():
        new.add_module(name, module)
    for name in layout["tensors"]:
        p = getattr(experts, name)
        new.register_parameter(name, p if ep_size == 1 else nn.Parameter(p.detach()[mine].clone(),
                                                                         requires_grad=p.requires_grad))
    new.num_experts = e
    new.has_gate, new.has_bias, new.is_transposed = layout["has_gate"], layout["has_bias"], layout["is_transposed"]
    new.has_post_expert_norm = layout["post_norm"]
    new.backend, new.recompute, new.fp8 = backend, recompute, check_fp8(fp8)
    new.num_expert, new.d_model, new.d_hidden = e, layout["D"], layout["F"]
    new.activation = activation_of(experts, layout["has_gate"])
    return new


def activation_of(experts: nn.Module, has_gate: bool):
    """fmoe's name for the module's activation where its kernels know it, else FamilyActivation()."""
    spec = fused_spec(experts, has_gate)
    if spec is None:
        return FamilyActivation()
    if spec == "swiglu" or spec in ("gelu", "relu"):
        return spec
    return GLU(experts.act_fn)          # "glu:<act>:split": transformers' default gate, gate half first


class SeamMoE(FMoE):
    """An `FMoE` called as transformers' experts: `layer(hidden_states [T, D], top_k_index [T, K],
    top_k_weights [T, K]) -> [T, D]`, routed by the family's router (through `SeamGate`). Its
    state-dict keys are the family's (`<name>.gate_up_proj`, not `<name>.experts.gate_up_proj`)."""

    def __init__(self, experts: SeamExperts, top_k: int, ep_size: int = 1, moe_group=None, capacity=None,
                 **options):
        gate = SeamGate(experts.d_model, experts.num_expert, ep_size, top_k, capacity)
        super().__init__(num_expert=experts.num_expert, d_model=experts.d_model, world_size=ep_size,
                         moe_group=moe_group, gate=gate, expert=experts, **options)
        for name, p in experts.named_parameters():
            if name not in EXPERT_TENSORS:      # one copy on every rank (a post-expert norm): data-parallel
                p.dp_comm, p.is_moe_expert = "dp", False
        self._register_state_dict_hook(_family_keys)

    def forward(self, hidden_states, top_k_index=None, top_k_weights=None):
        if top_k_index is None or top_k_weights is None:
            raise ValueError(f"{type(self).__name__} runs transformers' experts contract: pass hidden_states, "
                             "top_k_index and top_k_weights (the family's router's choice)")
        self.gate.hand(top_k_index, top_k_weights)
        return super().forward(hidden_states)

    def attach_to_block(self, block: nn.Module, name: str):
        """Hooks on the family's block (the module whose forward calls the router, then this layer): under
        `fmoe.replay_routing` the block takes this forward's recorded experts and runs under `ReplayedTopK`."""
        self.gate.layer_name = f"layer {name!r}"
        self.router_name = f"{type(block).__name__}'s router"
        block.register_forward_pre_hook(self._replay_begins, with_kwargs=True)
        block.register_forward_hook(self._replay_ends, always_call=True)

    def _replay_begins(self, block, args, kwargs):
        if self.gate.routing_mode == "replay":
            begin_replay(self.gate, block, self.router_name, args, kwargs)

    def _replay_ends(self, block, args, output):
        end_replay(self.gate)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for name in self.experts._parameters:
            if prefix + name in state_dict:
                state_dict[f"{prefix}experts.{name}"] = state_dict.pop(prefix + name)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def _family_keys(module, state_dict, prefix, local_metadata):
    for key in [k for k in state_dict if k.startswith(prefix + "experts.")]:
        state_dict[prefix + key[len(prefix + "experts."):]] = state_dict.pop(key)
    return state_dict


def top_k_of(experts: nn.Module) -> int:
    """The family's top-k from the config transformers keeps on the experts module (1 if none says;
    the layer takes K from each call's top_k_index anyway)."""
    config = getattr(experts, "config", None)
    for attr in TOP_K_ATTRS:
        value = getattr(config, attr, None) if config is not None else None
        if isinstance(value, int) and value >= 1:
            return value
    return 1


def find_seam_experts(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """(name, module) of every experts module dispatching through transformers' experts interface, not
    looking inside fmoe layers."""
    found, skip = [], None
    for name, module in model.named_modules():
        if skip is not None and name.startswith(skip):
            continue
        if isinstance(module, FMoE):
            skip = name + "."
        elif uses_experts_interface(type(module)) and not isinstance(module, SeamExperts):
            found.append((name, module))
    return found


def convert_at_seam(model: nn.Module, ep_size: int = 1, moe_group=None, **options) -> nn.Module:
    """Every experts module of `model` that dispatches through transformers' experts interface becomes a
    `SeamMoE` (this rank's experts under `ep_size` > 1), in place; all are checked before any changes."""
    from fmoe.layer_checks import check_world
    bad = sorted(set(options) - set(SEAM_OPTIONS))
    if bad:
        raise ValueError(f"convert(seam=True): options {bad} are not taken at the seam (the family's router "
                         f"routes); it takes {list(SEAM_OPTIONS)}")
    found = find_seam_experts(model)
    if not found:
        raise ValueError(f"convert: {type(model).__name__} holds no experts module dispatching through transformers' "
                         "experts interface (@use_experts_implementation), so it has no seam to convert at")
    plans = []
    for name, experts in found:
        try:
            layout = layout_of(experts)
            if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1 or layout["E"] % ep_size:
                raise ValueError(f"ep_size={ep_size!r} must be a positive divisor of its {layout['E']} experts")
        except ValueError as err:
            raise ValueError(f"convert: cannot take {name} ({type(experts).__name__}) at the seam: {err}; "
                             "the model is unchanged") from err
        plans.append((name, experts, layout))
    try:
        check_world(ep_size, moe_group)
    except ValueError as err:
        raise ValueError(f"convert: ep_size={ep_size}: {err}; the model is unchanged") from err
    rank = dist.get_rank(moe_group) if ep_size > 1 else 0
    fmoe_options = {k: v for k, v in options.items() if k not in ("capacity", "fp8")}     # fp8: on the experts
    new_layers = []
    for name, experts, layout in plans:
        local = seam_experts(experts, layout, rank, ep_size, options.get("backend"),
                             options.get("recompute", "activation"), options.get("fp8"))
        layer = SeamMoE(local, top_k_of(experts), ep_size, moe_group, options.get("capacity"), **fmoe_options)
        layer.train(experts.training)
        new_layers.append(layer)
    for (name, _, _), layer in zip(plans, new_layers):
        parent, _, child = name.rpartition(".")
        block = model.get_submodule(parent)
        setattr(block, child, layer)
        layer.attach_to_block(block, name)
    return model


def seam_layers(model: nn.Module) -> List[Tuple[str, SeamMoE]]:
    """(name, SeamMoE) of every seam-converted experts module."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, SeamMoE)]
