"""The adapters around a layer's core: what comes in becomes token rows [T, D], and back.

- `TokenRows.enter`: the input checked; a tensor [..., D] (or FastMoE's tree of them sharing the
  leading dims) as rows; with a `slice_group`, this rank's slice of the tokens. Its `restore`
  undoes all of it for the output.
- `TokenMask`: FastMoE's `mask` / `mask_dict`: masked tokens get no expert (index -1) and, for
  each of their slots, `mask_dict[mask]` weighted like an expert's output. `NO_MASK` does nothing.
"""
import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from fmoe.autocast import autocast_dtype
from fmoe.distributed.slicing import gather_rows, slice_rows
from fmoe.gates.base import Routing
from fmoe.layer_checks import floating_parameters


class TokenRows:
    """A layer's input as token rows; `restore` turns the output rows back into the input's shape."""

    def __init__(self, layer):
        self.layer = layer

    def enter(self, moe_inp):
        """(x, x_TD, restore): the rows (a tree of them for a tree input), the first tensor's rows,
        and `restore`, which undoes it for the output (slices gathered, leading dims back)."""
        layer = self.layer
        if layer.experts is None:
            raise RuntimeError("FMoE was built without experts: pass expert= or d_hidden=, or assign self.experts")
        if isinstance(moe_inp, torch.Tensor):
            self.check_tensor(moe_inp)
        leaves, spec, lead = self.leaves_of(moe_inp)
        if layer.world_size > 1 and not (torch.compiler.is_compiling() and layer.layer_index is not None):
            layer.check_with_peers(leaves[0])   # once checked, a compiled forward leaves it out (fullgraph)
        rows = [t.reshape(-1, t.shape[-1]) for t in leaves]
        if layer.slice_group is not None:
            rows = [slice_rows(t, layer.slice_group) for t in rows]
        # Where its sequences are, for a gate that reads it. Asked of the class: reading the instance's
        # last value would make a compiled layer guard on it and recompile for every token count.
        if getattr(type(layer.gate), "reads_tokens_layout", False):
            layer.gate.tokens_layout = (tuple(lead), layer.sequence_first)

        def restore(y):
            out, out_spec = tree_flatten(y)
            if layer.slice_group is not None:
                out = [gather_rows(t, layer.slice_group) for t in out]
            # Not a view of the rows: FSDP2 hooks the output.
            return tree_unflatten([t if len(lead) == 1 else t.reshape(*lead, t.shape[-1]).clone() for t in out],
                                  out_spec)
        x = rows[0] if isinstance(moe_inp, torch.Tensor) else tree_unflatten(rows, spec)
        return x, rows[0], restore

    def check_tensor(self, x):
        layer = self.layer
        if not x.is_floating_point():
            raise TypeError(f"{layer.label}: x must be a floating-point tensor, got dtype {x.dtype}")
        if x.dim() < 1 or x.shape[-1] != layer.d_model:
            raise ValueError(f"{layer.label}: x must have last dimension d_model={layer.d_model}, "
                             f"got shape {tuple(x.shape)}")
        params = list(floating_parameters(layer))
        devices = {p.device for p in params}
        if devices and x.device not in devices:
            raise ValueError(f"{layer.label}: input is on {x.device}, the layer's parameters on "
                             f"{', '.join(sorted(map(str, devices)))}: move one to the other")
        dtypes = {p.dtype for p in params}
        # Under torch.autocast the GEMMs cast their operands, as nn.Linear's do.
        if dtypes and x.dtype not in dtypes and autocast_dtype(x) is None:
            raise ValueError(f"{layer.label}: input dtype {x.dtype} does not match the layer's parameters' "
                             f"{', '.join(sorted(map(str, dtypes)))}: cast the input or the layer (layer.to(dtype)), "
                             "or run the model under torch.autocast")

    def leaves_of(self, moe_inp):
        """The input's tensors, checked: floating point, sharing the leading dims; (leaves, spec, lead)."""
        leaves, spec = tree_flatten(moe_inp)
        if not leaves or not all(isinstance(t, torch.Tensor) for t in leaves):
            raise TypeError(f"x must be a torch.Tensor or a tree of them, got {type(moe_inp).__name__}")
        lead = leaves[0].shape[:-1]
        for t in leaves:
            if not t.is_floating_point():
                raise TypeError(f"x must be floating point, got dtype {t.dtype}")
            if t.dim() < 1 or t.shape[:-1] != lead:
                raise ValueError(f"every input tensor must share the leading dims {tuple(lead)}, got {tuple(t.shape)}")
        return leaves, spec, lead


class NoMask:
    """No FastMoE mask: routing and output pass as they are."""

    def route(self, routing: Routing, x_TD) -> Routing:
        return routing

    def add(self, y_TD, x_TD, weight_TK):
        return y_TD


NO_MASK = NoMask()


class TokenMask(NoMask):
    """FastMoE's `mask` (one integer per token; 0: routed) and `mask_dict` {mask value: output}."""

    def __init__(self, mask: torch.Tensor, mask_dict: dict):
        self.mask, self.mask_dict = mask, mask_dict

    def mask_of(self, x_TD):
        mask_T = self.mask.reshape(-1).to(x_TD.device)
        if mask_T.shape[0] != x_TD.shape[0]:
            raise ValueError(f"mask has {mask_T.shape[0]} entries, the input {x_TD.shape[0]} tokens")
        return mask_T

    def route(self, routing: Routing, x_TD) -> Routing:
        """Masked tokens get no slot (index -1)."""
        masked_TK = routing.expert_idx_TK.masked_fill(self.mask_of(x_TD)[:, None] != 0, -1)
        return routing.with_slots(expert_idx_TK=masked_TK)

    def add(self, y_TD, x_TD, weight_TK):
        """Masked tokens: each of their top-k slots yields mask_dict[k], weighted like an expert's output."""
        return tree_map(lambda t: self.add_one(t, x_TD, weight_TK), y_TD)

    def add_one(self, y_TD, x_TD, weight_TK):
        mask_T = self.mask_of(x_TD)
        weight_T1 = weight_TK.sum(-1, keepdim=True).to(y_TD.dtype)
        for k, value in self.mask_dict.items():
            picked_T1 = (mask_T == k)[:, None].to(y_TD.dtype)
            y_TD = y_TD + picked_T1 * weight_T1 * value.to(y_TD)
        return y_TD
