"""FMoE against the per-token oracle: outputs and every gradient."""
import pytest
import torch
from torch import nn

import fmoe
from tests.reference import grads_of, per_token_moe

GATE_TOPK = [("naive", k) for k in (1, 2, 3, 4)] + [("noisy", 2), ("noisy", 4), ("gshard", 2), ("switch", 1),
                                                  ("balanced", 1), ("balanced", 3)]


def make_layer(gate, top_k, num_expert, d_model=8, d_hidden=16, activation="gelu", dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    layer = fmoe.FMoETransformerMLP(num_expert=num_expert, d_model=d_model, d_hidden=d_hidden, top_k=top_k,
                                    gate=gate, activation=activation)
    return layer.to(dtype)


def assert_matches_oracle(layer, x, atol, rtol, train=False, seed=7):
    layer.train(train)
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    xa = x.clone().requires_grad_(True)
    torch.manual_seed(seed)
    out = layer(xa)
    grads = grads_of(layer, xa, out)
    layer.load_state_dict(state)        # undo buffer updates (BalancedGate's bias) before the oracle
    xb = x.clone().requires_grad_(True)
    torch.manual_seed(seed)
    ref, _ = per_token_moe(layer, xb)
    ref_grads = grads_of(layer, xb, ref)
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")
    return out


@pytest.mark.parametrize("gate,top_k", GATE_TOPK)
@pytest.mark.parametrize("num_expert", [4, 16])
def test_gates_match_oracle_fp32(gate, top_k, num_expert):
    layer = make_layer(gate, top_k, num_expert)
    x = torch.randn(2, 13, 8)
    assert_matches_oracle(layer, x, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("gate,top_k", [("noisy", 2), ("gshard", 2), ("switch", 1), ("balanced", 2)])
def test_training_mode_randomness_matches_oracle(gate, top_k):
    layer = make_layer(gate, top_k, 4)
    assert_matches_oracle(layer, torch.randn(37, 8), atol=1e-5, rtol=1e-5, train=True)


@pytest.mark.parametrize("num_tokens", [0, 1, 7, 256])
def test_token_counts(num_tokens):
    layer = make_layer("naive", 2, 4)
    assert_matches_oracle(layer, torch.randn(num_tokens, 8), atol=1e-5, rtol=1e-5)


def test_one_expert():
    layer = make_layer("naive", 1, 1)
    assert_matches_oracle(layer, torch.randn(9, 8), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("activation", ["relu", "swiglu", nn.GELU(), torch.tanh])
def test_activations(activation):
    layer = make_layer("naive", 2, 4, activation=activation)
    assert_matches_oracle(layer, torch.randn(11, 8), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_bf16(top_k):
    layer = make_layer("naive", top_k, 4, d_model=16, d_hidden=32, dtype=torch.bfloat16)
    assert_matches_oracle(layer, torch.randn(19, 16).bfloat16(), atol=5e-2, rtol=5e-2)


def test_all_tokens_on_one_expert_others_empty():
    layer = make_layer("naive", 1, 4)
    with torch.no_grad():
        layer.gate.gate.proj.weight.zero_()
        layer.gate.gate.proj.bias.copy_(torch.tensor([0.0, 0.0, 5.0, 0.0]))
    x = torch.randn(10, 8)
    assert_matches_oracle(layer, x, atol=1e-5, rtol=1e-5)
    assert layer.last_counts_E.tolist() == [0, 0, 10, 0]
    grads = grads_of(layer, x.requires_grad_(True), layer(x))
    assert torch.all(grads["experts.w1_eDF"][[0, 1, 3]] == 0)


class TinyExpert(nn.Module):
    def __init__(self, d_model):
        super().__init__()
        self.fc = nn.Linear(d_model, d_model)

    def forward(self, x):
        return torch.tanh(self.fc(x)) * 2


def test_user_expert_class():
    torch.manual_seed(0)
    layer = fmoe.FMoE(num_expert=3, d_model=8, top_k=2, expert=TinyExpert)
    assert_matches_oracle(layer, torch.randn(14, 8), atol=1e-5, rtol=1e-5)


def test_any_leading_shape_and_fmoelinear():
    layer = make_layer("naive", 2, 4)
    x = torch.randn(2, 3, 4, 8)
    assert layer(x).shape == x.shape
    lin = fmoe.FMoELinear(3, 8, 5)
    counts = torch.tensor([2, 0, 4])
    inp = torch.randn(6, 8)
    ref = torch.cat([inp[:2] @ lin.weight[0].T + lin.bias[0], inp[2:] @ lin.weight[2].T + lin.bias[2]])
    torch.testing.assert_close(lin(inp, counts), ref)


def test_bitwise_deterministic():
    outs = []
    for _ in range(2):
        layer = make_layer("noisy", 2, 8).train()
        torch.manual_seed(3)
        x = torch.randn(64, 8, requires_grad=True)
        y = layer(x)
        y.square().sum().backward()
        outs.append((y.detach(), x.grad, layer.experts.w1_eDF.grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_collect_aux_loss_sums_layers():
    model = nn.Sequential(make_layer("gshard", 2, 4), make_layer("switch", 1, 4, seed=1))
    x = torch.randn(16, 8)
    model(x)
    expected = model[0].aux_loss + model[1].aux_loss
    torch.testing.assert_close(fmoe.collect_aux_loss(model), expected)
    assert model[0].gate.get_loss() is not None and not model[0].gate.has_loss


FUSED_ACTIVATIONS = {
    "gelu": lambda: "gelu", "relu": lambda: "relu", "swiglu": lambda: "swiglu",
    "geglu": lambda: fmoe.experts.GLU(torch.nn.functional.gelu),
    "geglu_tanh_interleaved": lambda: fmoe.experts.GLU(torch.nn.GELU("tanh"), interleaved=True),
    "reglu": lambda: fmoe.experts.GLU(torch.nn.ReLU()),
    # A small limit so that both clamps cut (their gradient masks are checked too).
    "clamped_swiglu": lambda: fmoe.experts.ClampedSwiGLU(alpha=1.702, limit=0.5),
    "clamped_swiglu_split": lambda: fmoe.experts.ClampedSwiGLU(alpha=1.1, limit=0.7, interleaved=False),
}


@pytest.mark.parametrize("name", sorted(FUSED_ACTIVATIONS))
@pytest.mark.parametrize("bias", [True, False])
def test_fused_expert_mlp_equals_grouped_gemms(name, bias):
    """The CPU's per-expert fused MLP against two grouped GEMMs around the activation module."""
    from fmoe import kernels
    from fmoe.experts import fused_activation_spec
    torch.manual_seed(0)
    experts = fmoe.GroupedExperts(4, 8, 16, FUSED_ACTIVATIONS[name](), bias=bias)
    spec = fused_activation_spec(experts.activation)
    assert kernels.fused_expert_mlp_applies(torch.zeros(1, 8), spec), spec
    counts = torch.tensor([5, 0, 1, 7])
    x = torch.randn(15, 8, requires_grad=True)          # 2 rows past the segments: dropped slots
    args = (experts.w1_eDF, experts.w2_eFD, experts.b1_eF, experts.b2_eD)
    fused = kernels.fused_expert_mlp(x, counts, spec, *args)
    h = kernels.grouped_mm(x, experts.w1_eDF, counts, experts.b1_eF)
    plain = kernels.grouped_mm(experts.act(h), experts.w2_eFD, counts, experts.b2_eD)
    torch.testing.assert_close(fused, plain)
    assert fused[13:].eq(0).all()
    probe = torch.randn_like(fused)
    params = [x] + [p for p in args if p is not None]
    for g_fused, g_plain in zip(torch.autograd.grad((fused * probe).sum(), params),
                                torch.autograd.grad((plain * probe).sum(), params)):
        torch.testing.assert_close(g_fused, g_plain)


def test_gated_activation_with_an_arbitrary_fn_runs_unfused():
    """A GatedActivation whose fn fmoe cannot name takes the two grouped GEMMs, and is still right."""
    from fmoe.experts import GatedActivation, fused_activation_spec
    act = GatedActivation(lambda gate, up: torch.tanh(gate) * up)
    assert fused_activation_spec(act) is None
    assert fused_activation_spec(fmoe.experts.GLU(lambda t: t.sigmoid())) is None
    torch.manual_seed(0)
    experts = fmoe.GroupedExperts(3, 8, 4, act)
    counts = torch.tensor([2, 0, 3])
    x = torch.randn(5, 8)
    ref = torch.cat([experts.expert_forward(0, x[:2]), experts.expert_forward(2, x[2:])])
    torch.testing.assert_close(experts(x, counts), ref)


def test_bf16_combine_weights_are_rounded_to_the_input_dtype_unless_fp32_combine():
    """FastMoE's gates hand back bf16 scores and transformers casts its routing weights to the
    hidden dtype: by default the combine uses the weights rounded so; fp32_combine keeps fp32."""
    torch.manual_seed(0)
    layer = fmoe.FMoETransformerMLP(num_expert=4, d_model=16, d_hidden=32, top_k=2).to(torch.bfloat16)
    x = torch.randn(64, 16).to(torch.bfloat16)
    routing = layer.gate.routing(x)
    assert routing.weight_TK.dtype == torch.float32
    plan = fmoe.routing.RoutingPlan.build(routing.expert_idx_TK, 4)
    y_ND = layer.experts(fmoe.kernels.permute(x, plan), plan.counts_E)
    rounded = routing.weight_TK.to(torch.bfloat16).float()
    assert not torch.equal(rounded, routing.weight_TK)
    assert torch.equal(layer(x), fmoe.kernels.unpermute(y_ND, plan, rounded))
    layer.fp32_combine = True
    assert torch.equal(layer(x), fmoe.kernels.unpermute(y_ND, plan, routing.weight_TK))
    with pytest.raises(ValueError, match="fp32_combine must be a bool"):
        fmoe.FMoE(num_expert=2, d_model=8, d_hidden=8, fp32_combine=1)


@pytest.mark.parametrize("kwargs", [dict(recompute="activation"), dict(recompute="experts"),
                                    dict(recompute="none"), dict(expert=TinyExpert)])
def test_double_backward_is_refused_with_a_message(kwargs):
    torch.manual_seed(0)
    layer_kwargs = dict(num_expert=2, d_model=4, top_k=2, **kwargs)
    layer = (fmoe.FMoE(**layer_kwargs) if "expert" in kwargs else
             fmoe.FMoETransformerMLP(d_hidden=6, **layer_kwargs)).double()
    x = torch.randn(3, 4, dtype=torch.double, requires_grad=True)
    with pytest.raises(RuntimeError, match="double backward .* is not supported by fmoe's fused ops"):
        torch.autograd.gradgradcheck(layer, (x,))


@pytest.mark.parametrize("gate", ["naive", "gshard", "noisy", "dc"])
def test_deepcopy_after_forward_and_backward(gate):
    """The aux loss and router logits a forward leaves are inside its graph: a copy starts without them."""
    import copy
    layer = make_layer(gate, 2, 4)
    (layer(torch.randn(6, 8, requires_grad=True)).sum() + fmoe.collect_aux_loss(layer)).backward()
    twin = copy.deepcopy(layer)
    assert twin.aux_loss is None and twin.gate.last_logits_TE is None and twin.gate.loss is None
    assert layer.gate.last_logits_TE is not None
    for (name, p), q in zip(layer.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), name
    x = torch.randn(5, 8)
    torch.testing.assert_close(twin.eval()(x), layer.eval()(x))
