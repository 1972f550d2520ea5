"""Rows that leave the permute as FP8 (#49): on tokens, the FP8 experts' first GEMM gathers the rows as it
quantises them (`fmoe.kernels.fp8_gather_grouped_mm`, `fmoe.expert_calls.GatherFp8Call`). Held bit for bit to
permuting first (the plain call), and counted: the permuted copy is not kept for the backward. Every test
name contains "fp8"."""
import pytest
import torch

import fmoe
from fmoe import kernels
from fmoe.expert_calls import GatherFp8Call, PlainCall
from fmoe.kernels import fp8

D, H, E, T, K = 64, 32, 4, 48, 2


def make_layer(recipe, **kwargs):
    torch.manual_seed(0)
    return fmoe.FMoETransformerMLP(num_expert=E, d_model=D, d_hidden=H, top_k=K, fp8=recipe, **kwargs)


def run(layer, plain: bool, seed=0):
    """Output, every gradient and the bytes of the distinct storages autograd saved, through the gathered
    call or (plain) the permute then the experts."""
    if plain:
        layer.__dict__["experts_call"] = PlainCall(layer)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g).requires_grad_(True)
    probe = torch.randn(T, D, generator=g)
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x)
    (y * probe).sum().backward()
    grads = {"x": x.grad, **{name: p.grad.clone() for name, p in layer.named_parameters()}}
    layer.zero_grad()
    return y.detach(), grads, sum(saved.values())


@pytest.mark.parametrize("case", [dict(recompute="activation"), dict(recompute="experts"), dict(recompute="none"),
                                  dict(activation="swiglu"),
                                  dict(gate="gshard", gate_kwargs={"capacity": (0.5, 0.5), "random_routing": False})],
                         ids=["activation", "experts", "none", "swiglu", "capacity"])
@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_fp8_gathered_rows_equal_permuting_first_and_keep_no_permuted_copy(recipe, case):
    """Output and every gradient bit-identical to the plain call; autograd keeps exactly the permuted rows'
    bytes (T * K rows of D fp32) fewer."""
    layer = make_layer(recipe, **case)
    assert type(layer.experts_call) is GatherFp8Call
    if "gate" in case:
        layer(torch.randn(T, D))
        assert layer.num_dropped > 0
    y, grads, kept = run(layer, plain=False)
    y_ref, grads_ref, kept_ref = run(layer, plain=True)
    assert torch.equal(y, y_ref)
    for name in grads_ref:
        assert torch.equal(grads[name], grads_ref[name]), name
    assert kept_ref - kept == T * K * D * 4


def test_fp8_gathered_rows_on_triton_equal_the_torch_backend():
    """The gather inside the Triton quantiser (the interpreter here) against the torch backend's gather: the
    same e4m3 rows, so outputs and gradients equal to fp32 rounding."""
    torch.manual_seed(0)
    x = torch.randn(9, 40, requires_grad=True)
    token_N = torch.tensor([3, 0, 8, 1, 1, 5, 7, 2, 4, 6, 0, 2])
    row_of_slot = torch.full((9, 2), -1)
    for row, token in enumerate(token_N.tolist()):
        row_of_slot[token, 0 if row_of_slot[token, 0] < 0 else 1] = row
    counts = torch.tensor([5, 0, 7])
    w = torch.randn(3, 40, 24, requires_grad=True)
    outs = []
    for backend in ("torch", "triton"):
        y = kernels.fp8_gather_grouped_mm(x, token_N, w, counts, row_of_slot, "blockwise", backend=backend)
        dx, dw = torch.autograd.grad(y, (x, w), torch.ones_like(y))
        outs.append((y, dx, dw))
    for want, have in zip(*outs):
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5)


def test_fp8_gathered_rows_refuse_a_mismatched_weight():
    x = torch.randn(4, 40)
    with pytest.raises(ValueError, match="w_eIO"):
        kernels.fp8_gather_grouped_mm(x, torch.tensor([0, 1]), torch.randn(2, 32, 8), torch.tensor([1, 1]),
                                      torch.tensor([[0], [1], [-1], [-1]]), "rowwise")
