"""fmoe inside torchtitan (fmoe.integrations.torchtitan), one process: both levels equal to torchtitan's own
modules for each MoE model family torchtitan ships, a per-token reference, gradcheck, every mode, the
balancing hook, and refusals. Runs where torchtitan is installed (`make test-torchtitan`)."""
import copy

import pytest
import torch

torchtitan = pytest.importorskip("torchtitan")

from fmoe.integrations import torchtitan as fmoe_titan  # noqa: E402
from fmoe.integrations.torchtitan import models  # noqa: E402
from tests.torchtitan_reference import (one_process_group, per_token_moe, torchtitan_in_input_dtype,  # noqa: E402
                                        torchtitan_on_cpu)

FAMILIES = sorted(models.FAMILIES)
# Few layers keep the debug models small on a CPU; each keeps at least one MoE layer.
N_LAYERS = {"qwen3": 2, "deepseek_v3": 2, "gpt_oss": 2, "kimi_k2_7": 2, "qwen3_5": 1}


def tiny(family, seed=0):
    return models.debug_model(family, n_layers=N_LAYERS[family], seed=seed)


def tokens_for(model, seed=1, B=2, L=16):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.tok_embeddings.num_embeddings, (B, L), generator=g)


def loss_and_grads(model, tokens, reference=False):
    model.zero_grad(set_to_none=True)
    if reference:
        with torchtitan_in_input_dtype():
            logits = models.forward(model, tokens)
    else:
        logits = models.forward(model, tokens)
    loss = logits.float().pow(2).mean()
    loss.backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def assert_same(got, want, rtol, atol, what):
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def assert_grads_same(got, want, rtol, atol):
    assert sorted(got) == sorted(want)
    for name in want:
        assert_same(got[name], want[name], rtol, atol, name)


def moe_modules(model):
    from torchtitan.models.common.moe import MoE
    return [m for m in model.modules() if isinstance(m, MoE)]


@pytest.mark.parametrize("family", FAMILIES)
def test_torchtitan_experts_level_equals_torchtitan_fp32(family):
    """use_fmoe_experts(dtype=None): the same logits and every gradient as torchtitan's modules in float32."""
    model = tiny(family)
    reference = copy.deepcopy(model)
    fmoe_titan.use_fmoe_experts(model, dtype=None)
    swapped = [m for m in model.modules() if isinstance(m, fmoe_titan.TorchtitanExperts)]
    assert len(swapped) == len(moe_modules(reference)) >= 1
    for m in swapped:       # the very parameters torchtitan made, nothing copied
        assert m.w1_eDF.shape[0] == m.num_expert
    tokens = tokens_for(model)
    want, want_grads = loss_and_grads(reference, tokens, reference=True)
    got, got_grads = loss_and_grads(model, tokens)
    assert_same(got, want, 1e-5, 1e-5, "logits")
    assert_grads_same(got_grads, want_grads, 1e-4, 1e-6)
    assert model.state_dict().keys() == reference.state_dict().keys()


@pytest.mark.parametrize("family", FAMILIES)
def test_torchtitan_experts_level_default_runs_bf16_as_torchtitan(family):
    """The default (dtype=bfloat16) computes the experts as torchtitan does: equal within bf16 rounding.
    torchtitan's gpt-oss experts return bfloat16, which its combine adds only into bfloat16 tokens: that
    model runs in bfloat16."""
    dtype = torch.bfloat16 if family == "gpt_oss" else torch.float32
    model = models.debug_model(family, n_layers=N_LAYERS[family], dtype=dtype)
    reference = copy.deepcopy(model)
    fmoe_titan.use_fmoe_experts(model)
    assert_near_torchtitan_as_is(model, reference, logits_tol=1e-2, grad_tol=2e-2)


def assert_near_torchtitan_as_is(model, reference, logits_tol, grad_tol):
    """Logits and every gradient of `model` within these relative errors of torchtitan's unmodified `reference`."""
    tokens = tokens_for(model)
    want, want_grads = loss_and_grads(reference, tokens)
    got, got_grads = loss_and_grads(model, tokens)
    assert relative_error(got, want) < logits_tol
    for name in want_grads:
        assert relative_error(got_grads[name], want_grads[name]) < grad_tol, name


def relative_error(got, want):
    """|got - want| / |want| over the whole tensor: bfloat16's rounding, summed over a model, moves single
    elements further than an elementwise tolerance for it allows."""
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("family", FAMILIES)
def test_torchtitan_moe_level_equals_torchtitan_fp32(family):
    """convert(): fmoe's layer with torchtitan's router, experts and shared experts gives torchtitan's
    logits and every gradient in float32, under torchtitan's state-dict keys."""
    model = tiny(family)
    reference = copy.deepcopy(model)
    fmoe_titan.convert(model)
    layers = fmoe_titan.titan_layers(model)
    assert len(layers) == len(moe_modules(reference)) >= 1
    assert not moe_modules(model)
    assert model.state_dict().keys() == reference.state_dict().keys()
    assert dict(model.named_parameters()).keys() == dict(reference.named_parameters()).keys()
    tokens = tokens_for(model)
    want, want_grads = loss_and_grads(reference, tokens, reference=True)
    got, got_grads = loss_and_grads(model, tokens)
    assert_same(got, want, 1e-5, 1e-5, "logits")
    assert_grads_same(got_grads, want_grads, 1e-4, 1e-6)
    # torchtitan's balancing counts: the same tokens per expert, on the same buffer names
    for (_, layer), theirs in zip(layers, moe_modules(reference)):
        assert torch.equal(layer.tokens_per_expert_E, theirs.tokens_per_expert_E)
        assert layer.tokens_per_expert_E.sum() == tokens.numel() * layer.top_k


def router_variant(moe_module, **changes):
    for name, value in changes.items():
        setattr(moe_module.router, name, value)


VARIANTS = {
    "softmax": {},
    "sigmoid_groups_scale": dict(score_func="sigmoid", num_expert_groups=4, num_limited_groups=2, route_norm=True,
                                 route_scale=2.5),
    "softmax_unnormalised": dict(route_norm=False, route_scale=1.5),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss"])
def test_torchtitan_moe_matches_per_token_reference(family, variant):
    """The converted layer against a token-by-token loop over torchtitan's parameters: router options,
    a non-zero balancing bias, shared experts (DeepSeek-V3), gpt-oss's biases and clamped SwiGLU."""
    torch.manual_seed(3)
    model = tiny(family)
    titan_moe = moe_modules(model)[0]
    if titan_moe.router.num_experts < 8:
        pytest.skip("the grouped variant needs 8 experts")
    router_variant(titan_moe, **VARIANTS[variant])
    titan_moe.expert_bias_E.copy_(torch.randn(titan_moe.router.num_experts) * 0.05)
    for p in titan_moe.parameters():
        p.data.normal_(0, 0.1)
    config = titan_moe.router
    params = {k: v.detach().clone() for k, v in titan_moe.state_dict().items()}
    shared = copy.deepcopy(titan_moe.shared_experts)
    bias = titan_moe.expert_bias_E.clone()
    limit = getattr(titan_moe.routed_experts.inner_experts, "swiglu_limit", None)
    layer = fmoe_titan.TorchtitanMoE(titan_moe)
    x = torch.randn(2, 5, layer.d_model)
    with torch.no_grad():
        got = layer(x).reshape(-1, layer.d_model)
        want = per_token_moe(config, params, x.reshape(-1, layer.d_model), bias, shared, limit)
    assert_same(got, want, 1e-4, 1e-4, "per-token")


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss"])
def test_torchtitan_gradcheck_float64(family):
    """Both levels under torch.autograd.gradcheck in float64 (the input and every parameter), on the
    family's debug MoE config shrunk to 4 experts of width 8."""
    torch.manual_seed(0)
    config = next(layer.moe for layer in models.debug_config(family).layers if getattr(layer, "moe", None))
    D, F_, E, K = 8, 4, 4, 2
    config.num_experts = E
    config.routed_experts.inner_experts.dim, config.routed_experts.inner_experts.hidden_dim = D, F_
    config.routed_experts.inner_experts.num_experts = E
    config.router.num_experts, config.router.top_k = E, K
    config.router.gate.in_features, config.router.gate.out_features = D, E
    if config.shared_experts is not None:
        config.shared_experts.w1.in_features = config.shared_experts.w3.in_features = D
        config.shared_experts.w1.out_features = config.shared_experts.w3.out_features = F_
        config.shared_experts.w2.in_features, config.shared_experts.w2.out_features = F_, D
    titan_moe = config.build().double()
    for p in titan_moe.parameters():
        torch.nn.init.normal_(p, std=0.5)
    experts = fmoe_titan.swap_experts(copy.deepcopy(titan_moe.routed_experts.inner_experts), dtype=None)
    counts = torch.tensor([2, 0, 1, 2])
    x = torch.randn(5, D, dtype=torch.float64, requires_grad=True)
    params = list(experts.parameters())

    def experts_fn(x_, *ps):
        return experts(x_, counts)
    assert torch.autograd.gradcheck(experts_fn, (x, *params), eps=1e-6, atol=1e-6)
    layer = fmoe_titan.TorchtitanMoE(titan_moe)
    x = torch.randn(1, 3, D, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x_, *ps: layer(x_), (x, *layer.parameters()), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("recompute", ["activation", "experts", "none"])
def test_torchtitan_moe_every_mode_same_answer(recompute):
    """train and eval, recompute modes, eager and torch.compile: one answer."""
    model = tiny("deepseek_v3")
    titan_moe = moe_modules(model)[0]
    eager = fmoe_titan.TorchtitanMoE(copy.deepcopy(titan_moe))
    layer = fmoe_titan.TorchtitanMoE(copy.deepcopy(titan_moe), recompute=recompute)
    x = torch.randn(2, 8, layer.d_model)
    g = torch.randn(2, 8, layer.d_model)

    def run(module, fn=None):
        x_ = x.clone().requires_grad_()
        (module if fn is None else fn)(x_).backward(g)
        grads = {n: p.grad.clone() for n, p in module.named_parameters()}
        module.zero_grad(set_to_none=True)
        return x_.grad, grads

    want_x, want = run(eager)
    got_x, got = run(layer)
    assert_same(got_x, want_x, 1e-5, 1e-6, "input gradient")
    assert_grads_same(got, want, 1e-5, 1e-6)
    if recompute == "activation":
        compiled_x, compiled = run(layer, torch.compile(layer, backend="aot_eager"))
        assert_same(compiled_x, want_x, 1e-5, 1e-6, "compiled input gradient")
        assert_grads_same(compiled, want, 1e-5, 1e-6)
    layer.eval()
    eager.eval()
    with torch.no_grad():
        assert_same(layer(x), eager(x), 1e-6, 1e-6, "eval")
    before = layer.tokens_per_expert_E.clone()
    layer(x)
    assert torch.equal(layer.tokens_per_expert_E, before)      # eval counts nothing, as torchtitan's MoE


def test_torchtitan_balancing_hook_moves_fmoe_bias_as_its_own(tmp_path):
    """torchtitan's optimizer pre-step hook (auxiliary-loss-free balancing) moves the converted layers'
    expert_bias_E exactly as it moves its own MoE's, and the next forward routes by it."""
    from torchtitan.distributed import ParallelDims

    model = tiny("deepseek_v3")
    reference = copy.deepcopy(model)
    fmoe_titan.convert(model)
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
    tokens = tokens_for(model)
    torchtitan_on_cpu()
    with one_process_group(tmp_path):
        for m in (model, reference):
            step_with_hook(m, dims, tokens)
    (_, layer), theirs = fmoe_titan.titan_layers(model)[0], moe_modules(reference)[0]
    assert layer.expert_bias_E.abs().sum() > 0
    assert torch.equal(layer.expert_bias_E, theirs.expert_bias_E)
    assert layer.tokens_per_expert_E.sum() == 0
    with torch.no_grad(), torchtitan_in_input_dtype():
        assert_same(models.forward(model, tokens), models.forward(reference, tokens), 1e-5, 1e-5, "after the step")


def step_with_hook(m, dims, tokens):
    """One step of an optimizer (lr 0: only the balancing moves anything) with torchtitan's hook on it
    (its OptimizersContainer is a torch Optimizer; the hook is Optimizer's step pre-hook)."""
    from torchtitan.components.optimizer import register_moe_load_balancing_hook
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    register_moe_load_balancing_hook(opt, [m], dims)
    with torchtitan_in_input_dtype():
        models.forward(m, tokens).pow(2).mean().backward()
    opt.step()


def test_torchtitan_refusals_leave_the_model_unchanged():
    model = tiny("deepseek_v3")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    kinds = [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match="not taken"):
        fmoe_titan.convert(model, gate="naive")
    moe = moe_modules(model)[0]
    moe.router._debug_force_load_balance = True
    with pytest.raises(ValueError, match="_debug_force_load_balance"):
        fmoe_titan.convert(model)
    moe.router._debug_force_load_balance = False
    with pytest.raises(ValueError, match="overlap"):      # refused by fmoe's layer after the experts' swap: undone
        fmoe_titan.convert(model, overlap="sideways")
    assert [type(m) for m in model.modules()] == kinds
    assert not any(hasattr(m, "titan_layout") for m in model.modules())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="no torchtitan MoE"):
        fmoe_titan.convert(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="dtype"):
        fmoe_titan.use_fmoe_experts(model, dtype=torch.int8)
    with pytest.raises(ValueError, match="family"):
        models.debug_model("llama3")


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3"])
def test_torchtitan_moe_level_bf16_experts_match_torchtitan_as_is(family):
    """convert(experts_dtype=torch.bfloat16): torchtitan's own numerics in a float32 model (its experts cast
    to bfloat16), so the converted model matches torchtitan's unmodified one to the order of its sums."""
    model = tiny(family)
    reference = copy.deepcopy(model)
    fmoe_titan.convert(model, experts_dtype=torch.bfloat16)
    assert_near_torchtitan_as_is(model, reference, logits_tol=1e-4, grad_tol=1e-2)


def test_torchtitan_example_trains_both_and_prints_the_curves(tmp_path):
    """examples/torchtitan/train_qwen3_debug.py as the README runs it (fewer steps): both curves printed,
    equal within its tolerance, fmoe's routing statistics printed and written."""
    import json
    import os
    import subprocess
    import sys
    out = tmp_path / "curves.json"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "-W", "ignore", "examples/torchtitan/train_qwen3_debug.py", "--steps", "5",
                          "--json", str(out)], cwd=root, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "torchtitan        fmoe" in run.stdout and "router_entropy" in run.stdout
    result = json.loads(out.read_text())
    assert len(result["curves"]["torchtitan"]) == len(result["curves"]["fmoe"]) == 5
    assert result["largest_relative_difference"] < 1e-2
    assert result["curves"]["fmoe"][-1] < result["curves"]["fmoe"][0]
    assert set(result["routing_stats"]) == {"layers.0.moe", "layers.1.moe"}


@pytest.mark.parametrize("level", ["experts", "moe"])
def test_torchtitan_fp8_at_both_levels(level):
    """fmoe's FP8 recipes carry into torchtitan's models: at each level the experts run the recipe, and the logits
    stay within FP8's error of torchtitan's own in float32."""
    model = tiny("deepseek_v3")
    reference = copy.deepcopy(model)
    if level == "experts":
        fmoe_titan.use_fmoe_experts(model, dtype=None, fp8="blockwise")
    else:
        fmoe_titan.convert(model, fp8="blockwise")
    experts = [m for m in model.modules() if isinstance(m, fmoe_titan.TorchtitanExperts)]
    assert experts and all(m.fp8 == "blockwise" for m in experts)
    tokens = tokens_for(model)
    want, _ = loss_and_grads(reference, tokens, reference=True)
    got, grads = loss_and_grads(model, tokens)
    assert 0 < relative_error(got, want) < 0.08
    assert all(torch.isfinite(g).all() for g in grads.values())
    with pytest.raises(ValueError, match="fp8 must be"):
        fmoe_titan.convert(tiny("deepseek_v3"), fp8="e5m2")
