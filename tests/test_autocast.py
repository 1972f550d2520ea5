"""Layers under torch.autocast (bf16 on the CPU): the experts' GEMMs run in bf16 as nn.Linear's do,
routing stays fp32, the output is bf16 and the parameters' gradients fp32."""
import pytest
import torch
from torch import nn

import fmoe
from fmoe import kernels
from fmoe.transformer import _Expert
from tests import dist_workers
from tests.dist_utils import run_ranks
from tests.reference import grads_of, per_token_moe

D, H, E = 8, 16, 4
BF16 = torch.bfloat16


def assert_near(got, ref, what):
    """Within a few bf16 roundings (2^-8 each) as a whole, not elementwise: a hidden unit near a ReLU's
    kink may flip, and the router's gradients are differences of nearly equal terms."""
    error = (got.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)
    assert error < 4e-2, f"{what}: relative error {error:.4f} against the fp32 run"


def autocast(enabled=True):
    return torch.autocast("cpu", dtype=BF16, enabled=enabled)


def run(layer, x, under_autocast):
    """(output, gradients of x and every parameter, rows each expert received)."""
    xa = x.clone().requires_grad_(True)
    with autocast(under_autocast):
        out = layer(xa)
    return out, grads_of(layer, xa, out), layer.last_counts_E.clone()


def assert_autocast_matches_fp32(layer, x):
    """The autocast run against the fp32 run of the same layer on the same input."""
    out, grads, counts = run(layer.eval(), x, True)
    ref, ref_grads, ref_counts = run(layer, x, False)
    assert out.dtype == BF16 and ref.dtype == torch.float32
    assert torch.equal(counts, ref_counts), "routing must not change under autocast"
    assert_near(out, ref, "output")
    for name, g in grads.items():
        assert g.dtype == torch.float32, f"{name}'s gradient is {g.dtype}"
        assert_near(g, ref_grads[name], name)


def mlp(gate, activation, top_k=2, **kwargs):
    torch.manual_seed(0)
    return fmoe.FMoETransformerMLP(num_expert=E, d_model=D, d_hidden=H, top_k=top_k, gate=gate, activation=activation,
                                   **kwargs)


@pytest.mark.parametrize("gate, activation, backend", [
    ("naive", "gelu", None),
    ("gshard", "swiglu", None),
    ("noisy", "relu", None),
    ("switch", "swiglu", "sync_free"),
    ("naive", "swiglu", "triton"),
    ("gshard", "gelu", "triton"),
])
def test_transformer_mlp_under_autocast_matches_fp32(gate, activation, backend, monkeypatch):
    """backend None: the CPU's fused expert MLP; sync_free: the two grouped GEMMs; triton: its kernels."""
    if backend == "sync_free":
        monkeypatch.setenv("FMOE_SYNC_FREE", "1")
    kwargs = {"gate_kwargs": {"capacity": None}} if gate in ("gshard", "switch") else {}
    if gate == "switch":
        kwargs["top_k"] = 1
    layer = mlp(gate, activation, backend="triton" if backend == "triton" else None, **kwargs)
    assert_autocast_matches_fp32(layer, torch.randn(13, D))


class LinearExpert(nn.Linear):
    """A FastMoE-style expert class, built as expert(d_model)."""

    def __init__(self, d_model):
        super().__init__(d_model, d_model)


def fused_pattern_layer():
    """FastMoE's fused pattern: experts assigned after construction, called with the counts."""
    torch.manual_seed(0)
    layer = fmoe.FMoE(num_expert=E, d_model=D, top_k=2)
    layer.experts = _Expert(E, D, H, nn.GELU())
    return layer


@pytest.mark.parametrize("build", [
    lambda: mlp("naive", "swiglu", shared_expert=H, shared_expert_gate=True),
    lambda: mlp("gshard", "gelu", shared_expert=[nn.Sequential(nn.Linear(D, H), nn.GELU(), nn.Linear(H, D))],
                gate_kwargs={"capacity": None}),
    lambda: (torch.manual_seed(0), fmoe.FMoE(num_expert=E, d_model=D, top_k=2, expert=LinearExpert))[1],
    fused_pattern_layer,
], ids=["shared_mlp_gated", "shared_module", "expert_modules", "fmoe_linear_experts"])
def test_shared_and_fastmoe_experts_under_autocast(build):
    assert_autocast_matches_fp32(build(), torch.randn(11, D))


def test_behind_a_linear():
    """The standard recipe: autocast around an fp32 model, the MoE layer fed by a Linear (bf16)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), mlp("naive", "gelu"), nn.Linear(D, 1))
    x = torch.randn(9, D)
    with autocast():
        h = model[0](x)
        y = model[1](h)
        out = model[2](y)
    assert h.dtype == y.dtype == out.dtype == BF16
    out.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
    ref = model[1](h.detach().float())          # fp32 GEMMs on the same activations
    assert_near(y, ref, "output")


def test_a_mismatched_dtype_outside_autocast_is_still_an_error():
    layer = mlp("naive", "gelu")
    with pytest.raises(ValueError, match="input dtype torch.bfloat16 does not match.*torch.autocast"):
        layer(torch.randn(3, D, dtype=BF16))
    with autocast(), pytest.raises(ValueError, match="input dtype torch.float64 does not match"):
        layer(torch.randn(3, D, dtype=torch.float64))       # autocast leaves float64 alone, as for nn.Linear


@pytest.mark.parametrize("gate, activation", [("naive", "gelu"), ("gshard", "swiglu")])
def test_matches_per_token_reference_under_autocast(gate, activation):
    """The layer and the per-token oracle, both under autocast (the oracle's GEMMs are torch's,
    autocast to bf16 one token at a time): outputs and every gradient."""
    kwargs = {"gate_kwargs": {"capacity": None}} if gate == "gshard" else {}
    layer = mlp(gate, activation, **kwargs).eval()
    x = torch.randn(10, D)
    results = []
    for forward in (layer, lambda xa: per_token_moe(layer, xa)[0]):
        xa = x.clone().requires_grad_(True)
        with autocast():
            out = forward(xa)
        results.append((out, grads_of(layer, xa, out)))
    (out, grads), (ref, ref_grads) = results
    assert out.dtype == BF16
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=1e-2)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], atol=1e-2, rtol=1e-2, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_grouped_mm_under_autocast_runs_like_a_linear(backend):
    """The kernel seam: fp32 operands, a bf16 product, fp32 gradients; equal to the product of the
    operands rounded to bf16."""
    torch.manual_seed(0)
    x, w, b = torch.randn(7, D), torch.randn(2, D, 5), torch.randn(2, 5)
    counts = torch.tensor([3, 4])
    leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
    with autocast():
        y = kernels.grouped_mm(*leaves[:2], counts, leaves[2], backend)
    y.float().sum().backward()
    assert y.dtype == BF16 and all(t.grad.dtype == torch.float32 for t in leaves)
    rounded = kernels.grouped_mm(x.to(BF16), w.to(BF16), counts, b.to(BF16), backend)
    torch.testing.assert_close(y, rounded, atol=0, rtol=0)


def test_expert_parallel_under_autocast_matches_one_process():
    run_ranks(dist_workers.check_autocast_matches_single_process, 2)
