"""A pytest plugin that lets FastMoE's own test files run on a CPU against fmoe, unchanged:
FastMoE's tests move every tensor and module with `.cuda()`, which is the identity here, and
seed CUDA's generator, which is a no-op. Used by `make test-fastmoe` (see the Makefile); not
collected by fmoe's own suite. Tests that need several GPUs skip themselves, as on a 1-GPU box;
ones that assert `device.type == 'cuda'` still fail, as they would on a CPU."""
import torch
from torch import nn


def pytest_configure(config):
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    nn.Module.cuda = lambda self, *args, **kwargs: self
    torch.cuda.manual_seed = lambda *args, **kwargs: None
    torch.cuda.set_device = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: 0
    torch.cuda.synchronize = lambda *args, **kwargs: None
