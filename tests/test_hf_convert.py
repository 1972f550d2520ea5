"""fmoe.integrations.hf.convert / export on every transformers MoE family: same logits, gradients, router logits and
aux loss as transformers' own blocks; whole-or-nothing conversion; a round trip through plain transformers."""
import copy

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

import fmoe.integrations.hf  # noqa: E402
from fmoe.integrations.hf.convert import HFMoEBlock  # noqa: E402
from fmoe.integrations.hf.export import block_state  # noqa: E402
from fmoe.integrations.hf.families import find_moe_blocks  # noqa: E402
from tests.hf_models import FAMILIES, tiny, tokens  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-5)


def hf_named_grads(model):
    """Every gradient under transformers' names, converted blocks mapped back to their family's layout."""
    blocks = {name: m for name, m in model.named_modules() if isinstance(m, HFMoEBlock)}
    grads = {n: p.grad for n, p in model.named_parameters()
             if p.grad is not None and not any(n.startswith(b + ".") for b in blocks)}
    for name, block in blocks.items():
        grads.update({f"{name}.{k}": g for k, g in block_state(block, pick=lambda p: p.grad).items()})
    return grads


def run(model, ids, **kwargs):
    model.zero_grad()
    out = model(ids, labels=ids, **kwargs)
    out.loss.backward()
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_block_matches_transformers(family):
    model = tiny(family)
    converted = fmoe.integrations.hf.convert(copy.deepcopy(model))
    (name, hf_block), = find_moe_blocks(model)[-1:]
    block = converted.get_submodule(name)
    assert isinstance(block, HFMoEBlock) and block.family == family
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(3))
    outs = []
    for b in (hf_block, block):
        xb = x.clone().requires_grad_(True)
        y = b(xb)
        y = y[0] if isinstance(y, tuple) else y
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        outs.append((y, xb.grad))
    torch.testing.assert_close(outs[1][0], outs[0][0], **TOL)
    torch.testing.assert_close(outs[1][1], outs[0][1], **TOL)
    want = {k: p.grad for k, p in hf_block.named_parameters() if p.grad is not None}
    got = block_state(block, pick=lambda p: p.grad)
    assert want.keys() <= got.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], **TOL, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("family", FAMILIES)
def test_model_logits_loss_router_logits_and_grads_match(family):
    model = tiny(family)
    converted = fmoe.integrations.hf.convert(copy.deepcopy(model))
    assert not find_moe_blocks(converted) and fmoe.integrations.hf.converted_blocks(converted)
    ids = tokens()
    kwargs = {"output_router_logits": True} if hasattr(model.config, "output_router_logits") else {}
    want, got = run(model, ids, **kwargs), run(converted, ids, **kwargs)
    torch.testing.assert_close(got.logits, want.logits, **TOL)
    torch.testing.assert_close(got.loss, want.loss, **TOL)     # with HF's aux loss where the family has one
    if getattr(want, "router_logits", None):
        assert len(got.router_logits) == len(want.router_logits)
        for g, w in zip(got.router_logits, want.router_logits):
            torch.testing.assert_close(g.float(), w.float(), **TOL)
    if getattr(want, "aux_loss", None) is not None:
        torch.testing.assert_close(got.aux_loss, want.aux_loss, **TOL)
    want_grads, got_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, \
        hf_named_grads(converted)
    assert want_grads.keys() <= got_grads.keys()
    for key in want_grads:
        torch.testing.assert_close(got_grads[key], want_grads[key], **TOL, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss", "dbrx", "qwen2_moe"])
def test_export_loads_in_plain_transformers_with_the_same_logits(family, tmp_path):
    model = fmoe.integrations.hf.convert(tiny(family))
    with torch.no_grad():       # the fmoe weights, not stale HF ones, must be what is written
        for _, block in fmoe.integrations.hf.converted_blocks(model):
            block.moe.experts.w2_eFD.mul_(1.5)
    fmoe.integrations.hf.export(model, tmp_path)
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert not any(isinstance(m, HFMoEBlock) for m in plain.modules())
    ids = tokens()
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, model(ids).logits, **TOL)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss", "qwen2_moe", "deepseek_v3"])
def test_save_pretrained_writes_the_family_layout_plain_transformers_loads(family, tmp_path):
    """Without fmoe.integrations.hf.export: what a converted model's save_pretrained writes loads in plain transformers
    with nothing missing or re-initialised, and the model stays converted."""
    model = fmoe.integrations.hf.convert(tiny(family))
    with torch.no_grad():
        for _, block in fmoe.integrations.hf.converted_blocks(model):
            block.moe.experts.w2_eFD.mul_(1.5)
    keys = list(model.state_dict())
    model.save_pretrained(tmp_path)
    plain, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert not any(isinstance(m, HFMoEBlock) for m in plain.modules())
    ids = tokens()
    with torch.no_grad():
        torch.testing.assert_close(plain.eval()(ids).logits, model(ids).logits, **TOL)
    assert list(model.state_dict()) == keys and fmoe.integrations.hf.converted_blocks(model)
    with pytest.raises(ValueError, match="state_dict.*fmoe.integrations.hf.export"):
        model.save_pretrained(tmp_path / "given", state_dict=model.state_dict())
    assert not (tmp_path / "given").exists()


def test_half_convertible_model_is_left_untouched():
    model = tiny("deepseek_v3", seed=2)
    model.config.num_hidden_layers = 3
    bad_layer = copy.deepcopy(model.model.layers[1])
    with torch.no_grad():
        bad_layer.mlp.experts.gate_up_proj = nn.Parameter(torch.zeros(8, 7, 16))
    model.model.layers.append(bad_layer)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp .*gate_up_proj.*expected .*unchanged"):
        fmoe.integrations.hf.convert(model)
    assert not any(isinstance(m, HFMoEBlock) for m in model.modules())
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


class StrangeMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.experts = nn.Linear(16, 4), nn.Linear(16, 16)


def test_bad_input_fails_clearly_and_changes_nothing():
    dense = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(ValueError, match="no sparse MoE block.*moefy"):
        fmoe.integrations.hf.convert(dense)
    model = tiny("mixtral")
    model.model.layers[1].mlp = StrangeMoE()
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp \(StrangeMoE\): unknown MoE family"):
        fmoe.integrations.hf.convert(model)
    assert type(model.model.layers[0].mlp).__name__ == "MixtralSparseMoeBlock"
    with pytest.raises(ValueError, match="ep_size=3 must be a positive divisor of the block's 4 experts"):
        fmoe.integrations.hf.convert(tiny("qwen3_moe"), ep_size=3)
    unconverted = tiny("qwen3_moe")
    with pytest.raises(ValueError, match=r"convert: ep_size=2: .*needs torch.distributed initialised"):
        fmoe.integrations.hf.convert(unconverted, ep_size=2)
    assert not fmoe.integrations.hf.converted_blocks(unconverted)
    with pytest.raises(ValueError, match="already a sparse MoE model.*fmoe.integrations.hf.convert"):
        fmoe.integrations.hf.moefy(tiny("mixtral"), num_experts=4)
    converted = fmoe.integrations.hf.convert(tiny("olmoe"))
    with pytest.raises(ValueError, match="already converted"):
        fmoe.integrations.hf.convert(converted)
    with pytest.raises(ValueError, match="holds no converted block"):
        fmoe.integrations.hf.export(tiny("olmoe"), "/nonexistent")


def test_moefy_upcycles_a_dense_model_whole_or_not_at_all():
    from tests.hf_models import COMMON
    cfg = transformers.DeepseekV3Config(**dict(COMMON, intermediate_size=32, moe_intermediate_size=12,
                                               n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
                                               n_group=1, topk_group=1, kv_lora_rank=8, q_lora_rank=8,
                                               qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8))
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ValueError, match="fmoe.integrations.hf.convert"):
        fmoe.integrations.hf.moefy(model, num_experts=4)
    assert not any(isinstance(m, fmoe.integrations.hf.MoEMLP) for m in model.modules())


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_experts_implementation_fmoe_matches_eager(family):
    model = tiny(family)
    fast = copy.deepcopy(model)
    fast.set_experts_implementation("fmoe")
    model.set_experts_implementation("eager")
    ids = tokens()
    want, got = run(model, ids), run(fast, ids)
    torch.testing.assert_close(got.logits, want.logits, **TOL)
    for (n, p), q in zip(model.named_parameters(), fast.parameters()):
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, **TOL, msg=lambda m: f"{n}: {m}")


def test_experts_implementation_fmoe_takes_the_lean_fused_path_where_it_knows_the_activation(monkeypatch):
    """transformers' default gate with SiLU runs fmoe.kernels.routed_mlp (the fused kernels on a GPU);
    gpt-oss's own clamped gate keeps the unfused path."""
    from fmoe.integrations.hf import experts_impl
    calls = []
    real = experts_impl.kernels.routed_mlp
    monkeypatch.setattr(experts_impl.kernels, "routed_mlp", lambda *a, **k: calls.append(a[3]) or real(*a, **k))
    for family, spec in (("mixtral", "swiglu"), ("gpt_oss", None)):
        model = tiny(family)
        experts = next(m for m in model.modules() if hasattr(m, "down_proj"))
        assert experts_impl.fused_spec(experts, True) == spec, family
        model.set_experts_implementation("fmoe")
        calls.clear()
        run(model, tokens())
        assert calls == ([spec] * len(calls) if spec else []) and (bool(calls) == bool(spec)), family


def test_experts_implementation_fmoe_reads_layouts_of_releases_without_the_flags():
    """transformers before 5.20 sets no `has_gate` / `has_post_expert_norm` on the experts: the
    tensors present stand in for them."""
    model = tiny("mixtral")
    fast = copy.deepcopy(model)
    fast.set_experts_implementation("fmoe")
    for experts in fast.modules():
        for flag in ("has_gate", "has_post_expert_norm"):
            if flag in vars(experts):
                delattr(experts, flag)
    ids = tokens()
    torch.testing.assert_close(run(fast, ids).logits, run(model, ids).logits, **TOL)

    class UngatedExperts(nn.Module):        # up_proj [E, F, D], down_proj [E, D, F], no flags at all
        num_experts = 3

        def __init__(self):
            super().__init__()
            self.up_proj = nn.Parameter(torch.randn(3, 6, 4))
            self.down_proj = nn.Parameter(torch.randn(3, 4, 6))
            self.act_fn = nn.GELU()
    experts = UngatedExperts()
    x = torch.randn(5, 4)
    idx = torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1], [2, 0]])
    w = torch.rand(5, 2)
    want = torch.stack([sum(w[t, k] * experts.down_proj[e] @ experts.act_fn(experts.up_proj[e] @ x[t])
                            for k, e in enumerate(idx[t].tolist())) for t in range(5)])
    torch.testing.assert_close(fmoe.integrations.hf.experts_impl.fmoe_experts_forward(experts, x, idx, w), want, **TOL)


def test_register_experts_implementation_is_false_where_transformers_refuses_the_name(monkeypatch):
    from transformers.integrations.moe import ExpertsInterface
    monkeypatch.setattr(ExpertsInterface, "_global_mapping", dict(ExpertsInterface._global_mapping))
    del ExpertsInterface._global_mapping["fmoe"]

    def as_in_5_0(self, requested):     # transformers 5.0 took only its own names
        if requested not in ("eager", "grouped_mm", "batched_mm"):
            raise ValueError(f'Specified `experts_implementation="{requested}"` is not supported.')
        return requested
    monkeypatch.setattr(transformers.PreTrainedModel, "get_correct_experts_implementation", as_in_5_0)
    assert fmoe.integrations.hf.register_experts_implementation() is False
    assert "fmoe" not in ExpertsInterface._global_mapping
    monkeypatch.undo()
    assert fmoe.integrations.hf.register_experts_implementation() is True


def test_dbrx_says_it_cannot_take_the_fmoe_experts_implementation():
    model = tiny("dbrx")
    with pytest.warns(UserWarning, match="DBRX's experts .* cannot use experts_implementation='fmoe'"):
        model.set_experts_implementation("fmoe")
    assert model.config._experts_implementation == "eager"


def test_router_options_pass_through():
    model = fmoe.integrations.hf.convert(tiny("deepseek_v3"), selection_bias="updated")
    (_, block), = fmoe.integrations.hf.converted_blocks(model)
    assert block.moe.gate.selection_bias == "updated"


@pytest.mark.parametrize("family", FAMILIES)
def test_expert_layouts_read_and_write_back(family):
    """fmoe's stacked experts read from the family's tensors compute what its experts compute, and
    write back to exactly its tensors."""
    from fmoe.experts import GroupedExperts
    from fmoe.integrations.hf.families import BY_BLOCK
    from fmoe.kernels import permute, unpermute
    from fmoe.routing import RoutingPlan
    _, block = find_moe_blocks(tiny(family))[-1]
    layout = BY_BLOCK[type(block).__name__]
    w = layout.read(block)
    E, D, F = w.shape
    experts = GroupedExperts(E, D, F, w.activation, bias=w.b1_EF is not None)
    with torch.no_grad():
        experts.w1_eDF.copy_(w.w1_EDF)
        experts.w2_eFD.copy_(w.w2_EFD)
        if w.b1_EF is not None:
            experts.b1_eF.copy_(w.b1_EF)
            experts.b2_eD.copy_(w.b2_ED)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(10, D, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(10)])
    weight = torch.rand(10, 2, generator=g)
    plan = RoutingPlan.build(idx, E)
    got = unpermute(experts(permute(x, plan), plan.counts_E), plan, weight)
    torch.testing.assert_close(got, block.experts(x, idx, weight).reshape(10, D), **TOL)
    state = block.state_dict()
    for key, tensor in layout.write(w).items():
        assert torch.equal(tensor, state[key]), key


def test_export_is_atomic_per_file(tmp_path, monkeypatch):
    """A failed export leaves the previous one whole and no staging folder; files get a plain mode."""
    import os
    import sys
    from fmoe.app.files import UMASK
    export_module = sys.modules["fmoe.integrations.hf.export"]       # fmoe.integrations.hf.export is the function
    model = fmoe.integrations.hf.convert(tiny("qwen3_moe"))
    out = tmp_path / "exported"
    fmoe.integrations.hf.export(model, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert {"config.json", "model.safetensors"} <= set(before)
    assert all(os.stat(p).st_mode & 0o777 == 0o666 & ~UMASK for p in out.iterdir())

    def broken_save(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"half a file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export_module, "save_file", broken_save)
    with torch.no_grad():
        next(model.parameters()).add_(1)
    with pytest.raises(OSError, match="No space"):
        fmoe.integrations.hf.export(model, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["exported"]


@pytest.mark.parametrize("family", FAMILIES)
def test_convert_and_load_keep_each_modules_mode(family, tmp_path):
    model = tiny(family).eval()
    converted = fmoe.integrations.hf.convert(copy.deepcopy(model))
    assert not any(m.training for m in converted.modules())
    ids = tokens()
    with torch.no_grad():           # eval routing: deterministic and equal to transformers' (PhiMoE, Mixtral too)
        want = model(ids).logits
        for _ in range(2):
            torch.testing.assert_close(converted(ids).logits, want, **TOL)
    assert fmoe.integrations.hf.convert(copy.deepcopy(model).train()).training
    assert all(m.training for m in fmoe.integrations.hf.convert(copy.deepcopy(model).train()).modules())
    model.save_pretrained(tmp_path)
    loaded = fmoe.integrations.hf.load(tmp_path)
    assert not any(m.training for m in loaded.modules())


def test_convert_keeps_a_shared_experts_own_mode():
    model = tiny("qwen2_moe").eval()
    (name, block), = find_moe_blocks(model)[-1:]
    block.shared_expert.train()
    converted = fmoe.integrations.hf.convert(model)
    new = converted.get_submodule(name)
    assert new.moe.shared_experts[0].training and not new.moe.gate.training and not new.training


def test_moefy_takes_the_mlps_mode():
    from tests.hf_models import COMMON
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON, intermediate_size=24)).eval()
    fmoe.integrations.hf.moefy(model, num_experts=4)
    assert not any(m.training for m in model.modules())


def learned_bias_model(family):
    model = fmoe.integrations.hf.convert(tiny(family), selection_bias="updated")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    fmoe.register_bias_update(model, optimizer)
    model.train()(tokens(), labels=tokens()).loss.backward()
    optimizer.step()
    return model.eval()


def test_export_refuses_to_drop_a_learned_selection_bias(tmp_path):
    model = learned_bias_model("qwen3_moe")
    with pytest.raises(ValueError, match=r"e_score_correction_bias.*qwen3_moe.*drop_selection_bias=True"):
        fmoe.integrations.hf.export(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="drop_selection_bias"):
        model.save_pretrained(tmp_path / "saved")
    fmoe.integrations.hf.export(model, tmp_path / "dropped", drop_selection_bias=True)
    assert (tmp_path / "dropped" / "model.safetensors").is_file()


def test_export_keeps_a_learned_selection_bias_where_the_family_holds_one(tmp_path):
    model = learned_bias_model("deepseek_v3")
    assert any(g.e_score_correction_bias.any() for g in model.modules() if hasattr(g, "e_score_correction_bias"))
    fmoe.integrations.hf.export(model, tmp_path)
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(tokens()).logits, model(tokens()).logits, **TOL)


def test_convert_under_a_bf16_default_dtype_keeps_the_router_in_fp32():
    """#53 case 10: transformers keeps DeepSeek-V3's router weight and score-correction bias in fp32
    under torch.set_default_dtype(torch.bfloat16); so does the converted layer's gate."""
    from fmoe.layer import FMoE
    model = tiny("deepseek_v3")
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        converted = fmoe.integrations.hf.convert(model)
        gates = [m.gate for m in converted.modules() if isinstance(m, FMoE)]
        layer = FMoE(num_expert=4, d_model=8, d_hidden=8, gate="router", top_k=2)
    finally:
        torch.set_default_dtype(before)
    assert gates
    for gate in gates + [layer.gate]:
        low = {n: t.dtype for n, t in list(gate.named_parameters()) + list(gate.named_buffers())
               if t.is_floating_point() and t.dtype != torch.float32}
        assert not low, low


def test_convert_deepseek_v3_with_fewer_groups_than_top_k_needs_routes_as_transformers():
    """#53 case 9: transformers' own test config (8 experts in 2 groups, topk_group=1, top_k=8) lets the
    top-k reach past the chosen group; fmoe's router refuses such a config, so convert keeps the
    family's router and converts at the experts seam, saying so, equal to transformers."""
    import warnings
    from fmoe.integrations.hf.seam import seam_layers
    from tests.hf_models import COMMON, DEEPSEEK
    cfg = transformers.DeepseekV3Config(**dict(DEEPSEEK, n_routed_experts=8, n_group=2, topk_group=1,
                                               num_experts_per_tok=8), q_lora_rank=8, rope_interleave=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for name, tensor in model.named_parameters():
            tensor.copy_(torch.randn(tensor.shape, generator=g) * 0.3)
    ids = tokens()
    want = model(ids).logits
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        converted = fmoe.integrations.hf.convert(copy.deepcopy(model))
    assert seam_layers(converted), "converted at the experts seam"
    assert any("experts seam instead" in str(w.message) and "top_k" in str(w.message) for w in caught), \
        [str(w.message) for w in caught]
    torch.testing.assert_close(converted(ids).logits, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="top_k"):
        fmoe.integrations.hf.convert(copy.deepcopy(model), seam=False)
