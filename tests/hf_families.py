"""The MoE families of the installed transformers (found by fmoe.integrations.hf.discovery), their tiny models,
and the checks the sweep holds each to: one forward and backward, compared by name."""
import copy
import functools

import torch

from fmoe.integrations.hf.discovery import FamilyUnavailable, discover
from fmoe.integrations.hf.seam import SeamMoE

VOCAB = 64


@functools.lru_cache(maxsize=None)
def families():
    return {family.name: family for family in discover()}


@functools.lru_cache(maxsize=None)
def build_error(name: str):
    """None when the family's tiny model builds, else why not."""
    try:
        families()[name].build()
    except FamilyUnavailable as err:
        return str(err)
    return None


def tiny(name: str):
    return families()[name].build(seed=0)


def tokens(batch=2, length=7, seed=1):
    return torch.randint(VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def output(model, ids):
    out = model(input_ids=ids, use_cache=False)
    logits = getattr(out, "logits", None)
    return logits if logits is not None else out.last_hidden_state


def forward_backward(model, ids):
    """The model's output and every parameter's gradient (under transformers' names) after a backward
    of a fixed random projection of the output."""
    model.zero_grad()
    y = output(model, ids)
    probe = torch.randn(y.shape, generator=torch.Generator().manual_seed(2))
    (y * probe).sum().backward()
    return y.detach(), family_named(model, lambda p: p.grad)


def family_named(model, pick):
    """`pick(p)` of every parameter (None dropped) under the names of the unconverted model: a seam layer's
    `<name>.experts.<tensor>` is `<name>.<tensor>`."""
    seams = [name for name, m in model.named_modules() if isinstance(m, SeamMoE)]
    named = {}
    for name, p in model.named_parameters():
        for seam in seams:
            if name.startswith(seam + ".experts."):
                name = seam + "." + name[len(seam + ".experts."):]
        value = pick(p)
        if value is not None:
            named[name] = value
    return named


def assert_close_fp32(got, want, what: str):
    """Equal to fp32 rounding: relative 1e-4, absolute 1e-5 of the tensor's largest magnitude."""
    atol = 1e-5 * max(1.0, float(want.abs().max())) if want.numel() else 1e-5
    torch.testing.assert_close(got, want, rtol=1e-4, atol=atol, msg=lambda m: f"{what}: {m}")


def assert_same_run(got, want, label: str):
    (y_got, g_got), (y_want, g_want) = got, want
    assert_close_fp32(y_got, y_want, f"{label}: output")
    assert set(g_got) == set(g_want), f"{label}: gradients differ in names: {sorted(set(g_got) ^ set(g_want))}"
    for key in g_want:
        assert_close_fp32(g_got[key], g_want[key], f"{label}: grad {key}")


def copied(model):
    return copy.deepcopy(model)
