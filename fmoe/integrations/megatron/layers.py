"""FastMoE path `fmoe.megatron.layers`: its init helpers, FastMoE's `MegatronMLP` name and `fmoefy`.

The init helpers take any module with `weight` / `bias` (FastMoE's FMoELinear, fmoe's
`experts.htoh4` views of stacked experts) and write in place, so they reach the experts.
"""
import math

import numpy as np
import torch
from torch import nn

from fmoe.integrations.megatron.fmoefy import fmoefy
from fmoe.integrations.megatron.mlp import MegatronMLP


@torch.no_grad()
def _megatron_init_method(self, rng: np.random.Generator, sigma: float):
    """Weights from N(0, sigma) drawn with the numpy `rng`, bias zero (Megatron-LM's init)."""
    weight = rng.normal(loc=0.0, scale=sigma, size=tuple(self.weight.size()))
    self.weight.copy_(torch.from_numpy(weight))
    if self.bias is not None:
        self.bias.zero_()


@torch.no_grad()
def _random_init_weight(self, rng: np.random.Generator):
    """torch.nn.Linear's kaiming-uniform init per expert, drawn with the numpy `rng`."""
    fan_in = nn.init._calculate_correct_fan(self.weight[0], "fan_in")
    bound = math.sqrt(3.0) * nn.init.calculate_gain("leaky_relu", math.sqrt(5)) / math.sqrt(fan_in)
    self.weight.copy_(torch.from_numpy(rng.uniform(-bound, bound, size=tuple(self.weight.size()))))
    if self.bias is not None:
        bound = 1 / math.sqrt(fan_in)
        self.bias.copy_(torch.from_numpy(rng.uniform(-bound, bound, size=tuple(self.bias.size()))))


__all__ = ["MegatronMLP", "fmoefy", "_megatron_init_method", "_random_init_weight"]
