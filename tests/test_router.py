"""RouterGate: each preset equals its family's router in transformers (same weights, same
chosen experts and weights), and the options behave as documented."""
import importlib

import pytest
import torch

import fmoe
from fmoe.gates import PRESETS, RouterGate
from fmoe.gates.router import SparseMixerGrad, load_balancing_loss

D, E = 16, 8
transformers = pytest.importorskip("transformers")


def hf(family, name):
    """transformers' class, or a skip where this release has none of that name (older releases route
    inside the sparse block, or name the router otherwise)."""
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    if not hasattr(module, name):
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    return getattr(module, name)


def weights_and_indices(out):
    """(weights, indices) of a router's (logits, weights, indices); a skip for a release whose router
    returns something else (the logits alone, or its own tuple)."""
    if not (isinstance(out, tuple) and len(out) == 3 and out[2].dtype in (torch.int32, torch.int64)):
        pytest.skip(f"this router returns another form in transformers {transformers.__version__}")
    return out[1:]


def hf_config(family, **kw):
    cls = {"mixtral": "MixtralConfig", "qwen2_moe": "Qwen2MoeConfig", "qwen3_moe": "Qwen3MoeConfig",
           "olmoe": "OlmoeConfig", "deepseek_v2": "DeepseekV2Config", "deepseek_v3": "DeepseekV3Config",
           "gpt_oss": "GptOssConfig", "granitemoe": "GraniteMoeConfig", "phimoe": "PhimoeConfig",
           "jamba": "JambaConfig"}[family]
    return getattr(transformers, cls)(hidden_size=D, **kw)


def sorted_by_expert(idx_TK, w_TK):
    order = idx_TK.argsort(-1)
    return idx_TK.gather(1, order), w_TK.gather(1, order)


def hf_router(family):
    """(HF router module, a function x -> (weights, indices), our RouterGate with its weights)."""
    if family == "dbrx":
        # ffn_hidden_size=D: transformers 5.0's router reads its width from ffn_hidden_size
        cfg = transformers.DbrxConfig(d_model=D, ffn_config=dict(moe_num_experts=E, moe_top_k=2, ffn_hidden_size=D))
        ffn = hf("dbrx", "DbrxFFN")(cfg)
        gate = RouterGate.from_preset("dbrx", D, E, top_k=2)
        gate.gate.proj.weight.data.copy_(ffn.router.layer.weight)
        return ffn, lambda x: ffn.route_tokens_to_experts(ffn.router(x)), gate
    experts = dict(num_experts=E) if family in ("qwen2_moe", "qwen3_moe", "olmoe", "jamba", "deepseek_v2") \
        else dict(num_local_experts=E)
    extra = {
        "qwen3_moe": dict(num_experts_per_tok=3, norm_topk_prob=True),
        "qwen2_moe": dict(num_experts_per_tok=3),
        "olmoe": dict(num_experts_per_tok=3),
        "deepseek_v2": dict(num_attention_heads=2, num_experts_per_tok=3, n_group=4, topk_group=2, topk_method="group_limited_greedy",
                            routed_scaling_factor=1.5),
        "deepseek_v3": dict(num_experts_per_tok=3, n_group=4, topk_group=2, routed_scaling_factor=2.5),
        "gpt_oss": dict(num_experts_per_tok=3),
    }.get(family, {})
    cfg = hf_config(family, **experts, **extra)
    router_cls = {"mixtral": "MixtralTopKRouter", "qwen2_moe": "Qwen2MoeTopKRouter",
                  "qwen3_moe": "Qwen3MoeTopKRouter", "olmoe": "OlmoeTopKRouter",
                  "deepseek_v2": "DeepseekV2TopkRouter", "deepseek_v3": "DeepseekV3TopkRouter",
                  "gpt_oss": "GptOssTopKRouter", "granitemoe": "GraniteMoeTopKRouter",
                  "phimoe": "PhimoeTopKRouter", "jamba": "JambaTopKRouter"}[family]
    router = hf(family, router_cls)(cfg)
    with torch.no_grad():
        router.weight.normal_()
        if family == "gpt_oss":
            router.bias.normal_()
        if family == "deepseek_v3":
            router.e_score_correction_bias.normal_(std=0.3)
    overrides = {k: v for k, v in extra.items() if k in ("n_group", "topk_group", "routed_scaling_factor",
                                                          "norm_topk_prob")}
    gate = RouterGate.from_preset(family, D, E, top_k=cfg.num_experts_per_tok, **overrides)
    gate.load_state_dict({"gate.proj." + k if k in ("weight", "bias") else k: v
                          for k, v in router.state_dict().items()})

    return router, lambda x: weights_and_indices(router(x)), gate


@pytest.mark.parametrize("family", sorted(PRESETS))
def test_preset_equals_transformers_router(family):
    torch.manual_seed(0)
    router, run, gate = hf_router(family)
    router.eval(), gate.eval()
    x = torch.randn(64, D)
    w_hf, i_hf = run(x)
    i_hf, w_hf = sorted_by_expert(i_hf.long(), w_hf.detach())
    r = gate.routing(x)
    i, w = sorted_by_expert(r.expert_idx_TK, r.weight_TK)
    assert torch.equal(i, i_hf)
    torch.testing.assert_close(w, w_hf.float(), rtol=1e-5, atol=1e-6)
    assert gate.last_logits_TE.dtype == torch.float32 and gate.last_logits_TE.shape == (64, E)


def test_every_preset_builds_with_its_own_top_k():
    for name in PRESETS:
        gate = RouterGate.from_preset(name, D, 16)
        assert gate.top_k == PRESETS[name]["top_k"]
        assert gate.gate.proj.weight.shape == (16, D)


def test_router_is_a_gate_name_and_forward_returns_fastmoe_tuple():
    layer = fmoe.FMoETransformerMLP(num_expert=4, d_model=D, d_hidden=8, gate="router",
                                    gate_bias=False, gate_kwargs=dict(norm_topk_prob=True))
    assert isinstance(layer.gate, RouterGate) and layer.gate.gate.proj.bias is None
    x = torch.randn(5, D)
    idx, val = layer.gate(x)
    assert idx.shape == val.shape == (5, 2)
    torch.testing.assert_close(val.sum(-1), torch.ones(5))
    layer(x).sum().backward()
    assert layer.gate.gate.proj.weight.grad is not None


def test_sparsemixer_multiplier_backward_equals_phimoe():
    torch.manual_seed(0)
    logits = torch.randn(6, E, requires_grad=True)
    probs = torch.softmax(logits.detach(), -1)
    idx = probs.argmax(-1, keepdim=True)
    w = probs.gather(1, idx)
    mid = torch.tensor([1.0, 0.3333, 1.0, 1.0, 0.3333, 1.0]).unsqueeze(1)
    g = torch.randn(6, 1)
    ours = torch.autograd.grad(SparseMixerGrad.apply(logits, w, idx, probs, mid), logits, g)[0]
    theirs = torch.autograd.grad(hf("phimoe", "PhimoeMultiplier").apply(logits, w, idx, probs, mid), logits, g)[0]
    torch.testing.assert_close(ours, theirs)


def test_sparsemixer_training_picks_within_the_jitter_band():
    torch.manual_seed(0)
    gate = RouterGate.from_preset("phimoe", D, E, jitter_eps=0.5).train()
    x = torch.randn(32, D)
    r = gate.routing(x)
    assert (r.expert_idx_TK[:, 0] != r.expert_idx_TK[:, 1]).all()
    r.weight_TK.sum().backward()
    assert torch.isfinite(gate.gate.proj.weight.grad).all()


def test_aux_loss_switch_equals_transformers_for_one_layer():
    torch.manual_seed(0)
    gate = RouterGate(D, E, 1, 2, aux_loss="switch", aux_loss_coef=0.5)
    x = torch.randn(40, D)
    r = gate.routing(x)
    func = hf("mixtral", "load_balancing_loss_func")
    torch.testing.assert_close(r.aux_loss, 0.5 * func((gate.last_logits_TE,), E, 2))
    assert load_balancing_loss(torch.zeros(0, E), 2) == 0


def test_selection_bias_steers_choice_not_weights():
    torch.manual_seed(0)
    gate = RouterGate(D, 4, 1, 1, score="sigmoid", selection_bias="frozen").eval()
    gate.e_score_correction_bias.copy_(torch.tensor([0.0, 0.0, 10.0, 0.0]))
    x = torch.randn(10, D)
    r = gate.routing(x)
    assert (r.expert_idx_TK == 2).all()
    torch.testing.assert_close(r.weight_TK[:, 0], torch.sigmoid(gate.gate(x))[:, 2])
    gate.train().routing(x)       # frozen: training does not move it
    assert gate.e_score_correction_bias.tolist() == [0.0, 0.0, 10.0, 0.0]


def test_updated_selection_bias_moves_toward_balance():
    torch.manual_seed(0)
    gate = RouterGate(D, 4, 1, 1, score="sigmoid", selection_bias="updated", bias_update_speed=0.01,
                      gate_bias=True).train()
    with torch.no_grad():
        gate.gate.proj.bias.copy_(torch.tensor([3.0, 0.0, 0.0, 0.0]))
    x = torch.randn(256, D)
    gate.routing(x)
    assert gate.e_score_correction_bias.tolist() == [0.0] * 4     # moves at the step's end, not in a forward
    gate.end_step()
    assert gate.e_score_correction_bias.tolist() == pytest.approx([-0.01, 0.01, 0.01, 0.01])
    for _ in range(300):
        gate.routing(x)
        gate.end_step()
    load = torch.bincount(gate.routing(x).expert_idx_TK.reshape(-1), minlength=4)
    assert load.max() < 2 * 64, load


def test_group_limited_top_k_stays_in_best_groups():
    torch.manual_seed(0)
    gate = RouterGate(D, 8, 1, 2, n_group=4, topk_group=1, group_score="max").eval()
    idx = gate.routing(torch.randn(50, D)).expert_idx_TK
    assert (idx[:, 0] // 2 == idx[:, 1] // 2).all()      # both from the one chosen group of 2


def test_scaling_and_renormalisation():
    torch.manual_seed(0)
    x = torch.randn(7, D)
    plain = RouterGate(D, E, 1, 3)
    scaled = RouterGate(D, E, 1, 3, norm_topk_prob=True, routed_scaling_factor=2.0)
    scaled.load_state_dict(plain.state_dict())
    a, b = plain.routing(x), scaled.routing(x)
    assert torch.equal(a.expert_idx_TK, b.expert_idx_TK)
    torch.testing.assert_close(b.weight_TK, 2 * a.weight_TK / a.weight_TK.sum(-1, keepdim=True))


@pytest.mark.parametrize("kwargs,match", [
    (dict(score="relu"), "score"),
    (dict(norm_topk_prob=1), "norm_topk_prob"),
    (dict(routed_scaling_factor=float("nan")), "routed_scaling_factor"),
    (dict(n_group=3), "n_group"),
    (dict(n_group=4, topk_group=5), "topk_group"),
    (dict(n_group=4, topk_group=1, top_k=3), "top_k"),
    (dict(selection_bias="moving"), "selection_bias"),
    (dict(bias_update_speed=float("inf")), "bias_update_speed"),
    (dict(sparsemixer=True, top_k=3), "sparsemixer"),
    (dict(aux_loss="gshard"), "aux_loss"),
    (dict(aux_loss_coef=-1.0), "aux_loss_coef"),
    (dict(softmax_after_topk=True, norm_topk_prob=True), "softmax_after_topk"),
    (dict(gate_bias="yes"), "gate_bias"),
])
def test_invalid_router_options_raise_naming_them(kwargs, match):
    args = dict(top_k=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        RouterGate(D, E, 1, **args)


def test_invalid_preset_name():
    with pytest.raises(ValueError, match="preset"):
        RouterGate.from_preset("mistral", D, E)
