"""torchtitan's grouped experts run by fmoe's kernels, on torchtitan's own parameters.

    fmoe.integrations.torchtitan.use_fmoe_experts(model)

torchtitan's `GroupedExperts.forward(x_RD, num_tokens_per_expert_E)` takes rows already in expert
order and their counts: the same contract as fmoe's experts. `use_fmoe_experts` changes the class of
each such module in place to one that is also an fmoe `GroupedExperts` (made once per torchtitan
class, as `FMoEGroupedExperts`), so its parameters stay the very tensors torchtitan made, initialised,
sharded (DTensors under torchtitan's expert or FSDP2 parallelism: the forward reads the local shard,
as torchtitan's does) and checkpoints, under their names:

- SwiGLU experts (`w1_EFD`, `w3_EFD`, `w2_EDF`): fmoe's first grouped GEMM runs the gate and up
  projections together ([e, D, 2F], gate first), the second the down projection;
- gpt-oss's (`mlp1_weight_EGD` with gate and up interleaved, `mlp1_bias_EG`, `mlp2_weight_EDF`,
  `mlp2_bias_ED`): fmoe's clamped SwiGLU (alpha 1.702, torchtitan's `swiglu_limit`) and the biases.

torchtitan casts the experts' inputs and weights to bfloat16 whatever the model's dtype; so does the
swapped module by default (`dtype=torch.bfloat16`), and returns the input's dtype (torchtitan's SwiGLU
experts do; its gpt-oss experts return bfloat16, so a float32 gpt-oss model does not run in torchtitan).
`dtype=None` runs them in the input's dtype (float32: the exact product).
"""
from typing import Optional

import torch
from torch import nn

from fmoe.experts import ClampedSwiGLU, GroupedExperts, check_recompute
from fmoe.kernels.fp8 import check_fp8

SWIGLU_TENSORS = ("w1_EFD", "w2_EDF", "w3_EFD")
GPT_OSS_TENSORS = ("mlp1_weight_EGD", "mlp1_bias_EG", "mlp2_weight_EDF", "mlp2_bias_ED")
GPT_OSS_ALPHA = 1.702           # torchtitan's gpt-oss swiglu(alpha=1.702), fixed there


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor parameter (differentiable), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def layout_of(experts: nn.Module) -> str:
    """"swiglu" or "gpt_oss" from the tensors a torchtitan experts module holds; ValueError otherwise."""
    names = set(dict(experts.named_parameters(recurse=False)))
    for layout, tensors in (("swiglu", SWIGLU_TENSORS), ("gpt_oss", GPT_OSS_TENSORS)):
        if names == set(tensors):
            return layout
    raise ValueError(f"{type(experts).__name__} holds {sorted(names)}; fmoe runs torchtitan's SwiGLU experts "
                     f"{list(SWIGLU_TENSORS)} and gpt-oss's {list(GPT_OSS_TENSORS)}")


class TorchtitanExperts(GroupedExperts):
    """fmoe's grouped experts over a torchtitan experts module's parameters (see the module docstring).
    Made by `swap_experts`, never directly."""

    def local_tensor(self, name: str) -> torch.Tensor:
        return local(getattr(self, name))

    @property
    def w1_eDF(self):
        if self.titan_layout == "gpt_oss":
            return self.local_tensor("mlp1_weight_EGD").transpose(1, 2)
        return torch.cat([self.local_tensor("w1_EFD"), self.local_tensor("w3_EFD")], dim=1).transpose(1, 2)

    @property
    def w2_eFD(self):
        name = "mlp2_weight_EDF" if self.titan_layout == "gpt_oss" else "w2_EDF"
        return self.local_tensor(name).transpose(1, 2)

    @property
    def b1_eF(self):
        return self.local_tensor("mlp1_bias_EG") if self.titan_layout == "gpt_oss" else None

    @property
    def b2_eD(self):
        return self.local_tensor("mlp2_bias_ED") if self.titan_layout == "gpt_oss" else None

    @property
    def num_expert(self) -> int:
        """The experts this rank holds (torchtitan's `num_experts` counts them all)."""
        name = "mlp2_weight_EDF" if self.titan_layout == "gpt_oss" else "w2_EDF"
        return self.local_tensor(name).shape[0]

    @property
    def lean(self) -> bool:
        """fmoe's lean MLP where the experts compute in the input's dtype; with a `dtype` of their own they
        take torchtitan's contract (rows and counts), which casts."""
        return self.dtype is None and super().lean

    def forward(self, x_RD, num_tokens_per_expert_E, *args, **kwargs):
        """torchtitan's contract (rows in expert order, the count of each local expert); called by fmoe's
        layer with its own arguments, it is fmoe's `GroupedExperts.forward`."""
        if args or kwargs or self.dtype is None:
            return super().forward(x_RD, num_tokens_per_expert_E, *args, **kwargs)
        w1, w2, b1, b2 = (None if t is None else t.to(self.dtype) for t in
                          (self.w1_eDF, self.w2_eFD, self.b1_eF, self.b2_eD))
        y_RD = self.run(x_RD.to(self.dtype), num_tokens_per_expert_E, w1, w2, b1, b2)
        # In the input's dtype, as torchtitan's SwiGLU experts return it (its gpt-oss experts return bfloat16,
        # which its combine then refuses to add into a float32 model's tokens).
        return y_RD.type_as(x_RD)

    def reset_parameters(self):
        raise NotImplementedError(f"{type(self).__name__} runs torchtitan's parameters: torchtitan's own "
                                  "initialisation (model.init_states()) initialises them")

    def extra_repr(self):
        dtype = "the input's" if self.dtype is None else str(self.dtype).replace("torch.", "")
        return f"layout={self.titan_layout}, num_expert={self.num_expert}, d_model={self.d_model}, " \
               f"d_hidden={self.d_hidden}, dtype={dtype}"


_CLASSES = {}


def fmoe_class(titan_cls: type) -> type:
    """TorchtitanExperts and torchtitan's `titan_cls` in one class (made once per class)."""
    if titan_cls not in _CLASSES:
        _CLASSES[titan_cls] = type(f"FMoE{titan_cls.__name__}", (TorchtitanExperts, titan_cls),
                                   {"__module__": __name__})
    return _CLASSES[titan_cls]


def swap_experts(experts: nn.Module, dtype: Optional[torch.dtype] = torch.bfloat16, backend=None,
                 recompute: str = "activation", fp8: Optional[str] = None) -> TorchtitanExperts:
    """`experts` (a torchtitan experts module) becomes a TorchtitanExperts in place and is returned; its
    parameters are untouched. `dtype`: what the GEMMs run in when called as torchtitan's (see above);
    `fp8`: fmoe's FP8 recipe for the two GEMMs (`fmoe.kernels.fp8`; None: off)."""
    if isinstance(experts, TorchtitanExperts):
        return experts
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating torch.dtype or None (the input's), got {dtype!r}")
    layout = layout_of(experts)
    if layout == "gpt_oss":
        E2F, D = experts.mlp1_weight_EGD.shape[1:]
        activation = ClampedSwiGLU(GPT_OSS_ALPHA, float(experts.swiglu_limit), interleaved=True)
    else:
        E2F, D = 2 * experts.w1_EFD.shape[1], experts.w1_EFD.shape[2]
        activation = "swiglu"
    settings = dict(titan_layout=layout, dtype=dtype, backend=backend, recompute=check_recompute(recompute),
                    fp8=check_fp8(fp8), d_model=int(D), d_hidden=int(E2F) // 2, activation=activation)
    experts.__class__ = fmoe_class(type(experts))
    for name, value in settings.items():
        object.__setattr__(experts, name, value)
    return experts


def use_fmoe_experts(model: nn.Module, dtype: Optional[torch.dtype] = torch.bfloat16, backend=None,
                     recompute: str = "activation", fp8: Optional[str] = None) -> nn.Module:
    """Every torchtitan experts module of `model` (torchtitan's `GroupedExperts` and its subclasses) runs
    on fmoe's kernels, in place, with the same parameters; returns `model`. All are checked first: on an
    error nothing has changed."""
    from torchtitan.models.common.moe import GroupedExperts as TitanGroupedExperts
    found = [(name, m) for name, m in model.named_modules()
             if isinstance(m, TitanGroupedExperts) and not isinstance(m, TorchtitanExperts)]
    if not found:
        raise ValueError(f"use_fmoe_experts: {type(model).__name__} holds no torchtitan GroupedExperts")
    for name, m in found:
        try:
            layout_of(m)
        except ValueError as err:
            raise ValueError(f"use_fmoe_experts: {name}: {err}; the model is unchanged") from err
    check_fp8(fp8)
    for _, m in found:
        swap_experts(m, dtype, backend, recompute, fp8)
    return model
