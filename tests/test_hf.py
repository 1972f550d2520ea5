"""fmoe.integrations.hf on tiny GPT-2 and Llama models built from local configs (nothing is downloaded)."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

import fmoe  # noqa: E402
import fmoe.integrations.hf  # noqa: E402

VOCAB = 64


def tiny(kind, **overrides):
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=2, n_head=2,
                                      bos_token_id=0, eos_token_id=0, **overrides)
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0, **overrides)
    return transformers.LlamaForCausalLM(cfg)


def tokens(batch=4, length=12, seed=1):
    return torch.randint(VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


KINDS = ["gpt2", "llama"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("gate,top_k", [("naive", 2), ("naive", 1), ("noisy", 2)])
def test_upcycled_logits_unchanged(kind, gate, top_k):
    model = tiny(kind).eval()
    ids = tokens()
    with torch.no_grad():
        dense = model(ids).logits
        fmoe.integrations.hf.moefy(model, num_experts=4, top_k=top_k, gate=gate)
        moe = model(ids).logits
    assert sum(isinstance(m, fmoe.FMoE) for m in model.modules()) == 2
    assert not any(type(m).__name__ in ("GPT2MLP", "LlamaMLP") for m in model.modules())
    torch.testing.assert_close(moe, dense, atol=1e-5, rtol=1e-5)


def test_swiglu_experts_are_gated_copies():
    model = tiny("llama")
    mlp = model.model.layers[0].mlp
    gate_w, up_w, down_w = (mlp.gate_proj.weight.clone(), mlp.up_proj.weight.clone(), mlp.down_proj.weight.clone())
    fmoe.integrations.hf.moefy(model, num_experts=2, top_k=1)
    experts = model.model.layers[0].mlp.moe.experts
    assert experts.activation == "swiglu" and experts.b1_eF is None
    torch.testing.assert_close(experts.w1_eDF[1], torch.cat([gate_w.t(), up_w.t()], dim=1))
    torch.testing.assert_close(experts.w2_eFD[1], down_w.t())


@pytest.mark.parametrize("return_dict", [True, False])
def test_loss_includes_the_balance_losses(return_dict):
    model = tiny("gpt2").eval()
    fmoe.integrations.hf.moefy(model, num_experts=4, top_k=2, gate="gshard",
                  gate_kwargs={"capacity": None, "random_routing": False}, aux_loss_coef=0.5)
    ids = tokens()
    with torch.no_grad():
        out = model(ids, labels=ids, return_dict=return_dict)
        loss = out.loss if return_dict else out[0]
        aux = fmoe.collect_aux_loss(model)
        model.config.fmoe["aux_loss_coef"] = 0.0
        plain = model(ids, labels=ids).loss
    assert aux > 0
    torch.testing.assert_close(loss, plain + 0.5 * aux)


def train(model, steps=8, lr=1e-2):
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    ids = tokens(batch=8, length=16)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("kind", KINDS)
def test_training_loss_falls(kind):
    model = fmoe.integrations.hf.moefy(tiny(kind), num_experts=4, top_k=2, gate="gshard")
    losses = train(model)
    assert losses[-1] < losses[0] - 0.3, losses
    gate_grads = [m.gate for m in model.modules() if isinstance(m, fmoe.FMoE)]
    assert all(p.grad is not None for g in gate_grads for p in g.parameters())


@pytest.mark.parametrize("kind", KINDS)
def test_save_pretrained_and_reload_keep_the_experts(kind, tmp_path):
    model = fmoe.integrations.hf.moefy(tiny(kind), num_experts=4, top_k=2, gate="gshard",
                          gate_kwargs={"capacity": [1.5, 3.0], "random_routing": False})
    train(model, steps=2)   # the experts now differ from each other and from the dense MLP
    model.eval()
    model.save_pretrained(tmp_path)
    reloaded = fmoe.integrations.hf.from_pretrained(tmp_path)
    assert reloaded.config.fmoe == model.config.fmoe
    state, again = model.state_dict(), reloaded.state_dict()
    assert state.keys() == again.keys()
    for key in state:
        torch.testing.assert_close(again[key], state[key], msg=lambda m: f"{key}: {m}")
    ids = tokens()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids, labels=ids).loss, model(ids, labels=ids).loss)


def test_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="SwiGLU"):
        fmoe.integrations.hf.moefy(tiny("llama", hidden_act="gelu"), num_experts=2)
    model = fmoe.integrations.hf.moefy(tiny("gpt2"), num_experts=2)
    with pytest.raises(ValueError, match="already MoE-ified"):
        fmoe.integrations.hf.moefy(model, num_experts=2)
    with pytest.raises(ValueError, match="num_experts"):
        fmoe.integrations.hf.moefy(tiny("gpt2"), num_experts=0)
    tiny("gpt2").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no 'fmoe' entry"):
        fmoe.integrations.hf.from_pretrained(tmp_path)
