"""The layer pieces HF MoE families need: shared experts and gated expert activations."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fmoe import FMoE
from fmoe.experts import GLU, ClampedSwiGLU, GatedActivation, GroupedExperts
from tests.reference import grads_of, per_token_moe

D, H = 8, 12


def layer(**kwargs):
    torch.manual_seed(0)
    return FMoE(num_expert=4, d_model=D, top_k=2, d_hidden=H, **kwargs)


def assert_same(layer_, x, extra):
    """Layer output and gradients equal the per-token oracle plus `extra(x)` (the shared term)."""
    x = x.clone().requires_grad_(True)
    out = layer_(x)
    ref_routed, _ = per_token_moe(layer_, x)
    ref = ref_routed + extra(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    got, want = grads_of(layer_, x, out), grads_of(layer_, x, ref)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


class Dense(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.up, self.down = nn.Linear(D, width), nn.Linear(width, D)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


@pytest.mark.parametrize("gate", [False, True])
def test_shared_experts_add_their_term(gate):
    shared = [Dense(6), Dense(10)]
    moe = layer(shared_expert=shared, shared_expert_gate=gate)

    def term(x):
        y = shared[0](x) + shared[1](x)
        return torch.sigmoid(x @ moe.shared_expert_gate.weight.t()) * y if gate else y

    assert_same(moe, torch.randn(3, 5, D), term)


def test_shared_expert_from_width_is_data_parallel():
    moe = layer(shared_expert=16, activation="swiglu")
    shared = moe.shared_experts[0]
    assert not any(getattr(p, "is_moe_expert", False) for p in shared.parameters())
    assert all(getattr(p, "is_moe_expert", False) for p in moe.experts.parameters())
    assert shared.mlp.w1_eDF.shape == (1, D, 32)
    assert_same(moe, torch.randn(7, D), lambda x: shared.mlp.expert_forward(0, x))


def test_shared_expert_bad_input():
    with pytest.raises(ValueError, match="shared_expert_gate=True needs shared_expert"):
        layer(shared_expert_gate=True)
    with pytest.raises(ValueError, match="shared_expert must be"):
        layer(shared_expert="mlp")
    with pytest.raises(ValueError, match="positive int"):
        layer(shared_expert=0)


def test_gated_activation_is_a_callable_of_gate_and_up():
    geglu = GatedActivation(lambda gate, up: F.gelu(gate) * up)
    moe = layer(activation=geglu)
    assert moe.experts.w1_eDF.shape == (4, D, 2 * H)
    assert_same(moe, torch.randn(9, D), lambda x: 0)
    h = torch.randn(5, 2 * H)
    torch.testing.assert_close(geglu(h), GLU(F.gelu)(h))
    torch.testing.assert_close(GLU(F.silu)(h), F.silu(h[:, :H]) * h[:, H:])


def test_clamped_swiglu_matches_gpt_oss_with_interleaved_layout_and_biases():
    act = ClampedSwiGLU(alpha=1.702, limit=0.5)
    moe = layer(activation=act, expert_bias=True)
    with torch.no_grad():
        moe.experts.w1_eDF.mul_(8)      # pre-activations well beyond the limit, both sides
    experts = moe.experts

    def gpt_oss_expert(e, x):           # transformers' GptOssExperts for one expert
        gate_up = x @ experts.w1_eDF[e] + experts.b1_eF[e]
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate, up = gate.clamp(max=0.5), up.clamp(-0.5, 0.5)
        return ((up + 1) * gate * torch.sigmoid(gate * 1.702)) @ experts.w2_eFD[e] + experts.b2_eD[e]

    x = torch.randn(6, D)
    for e in range(4):
        torch.testing.assert_close(experts.expert_forward(e, x), gpt_oss_expert(e, x))
    assert_same(moe, x, lambda x: 0)


def test_gated_experts_run_on_the_grouped_path(monkeypatch):
    """No Python loop over experts in the module: the CPU's fused per-expert MLP op once in eager
    mode, two grouped GEMMs on the sync-free path (compile, CUDA)."""
    import fmoe.kernels as kernels
    calls = []
    for name in ("grouped_mm", "fused_expert_mlp"):
        real = getattr(kernels, name)
        def spy(*a, _real=real, _name=name, **k):
            calls.append(_name)
            return _real(*a, **k)
        monkeypatch.setattr(kernels, name, spy)
    experts = GroupedExperts(4, D, H, ClampedSwiGLU())
    x, counts = torch.randn(10, D), torch.tensor([3, 0, 5, 2])
    eager = experts(x, counts)
    assert calls == ["fused_expert_mlp"]
    calls.clear()
    monkeypatch.setenv("FMOE_SYNC_FREE", "1")
    torch.testing.assert_close(experts(x, counts), eager)
    assert calls == ["grouped_mm", "grouped_mm"]


def test_bad_gated_activation():
    with pytest.raises(ValueError, match="fn must be a callable"):
        GatedActivation(3)
    with pytest.raises(ValueError, match="limit must be > 0"):
        ClampedSwiGLU(limit=0)
