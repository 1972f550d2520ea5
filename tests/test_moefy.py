"""moefy: FFNs become MoE layers; upcycled models keep their outputs."""
import pytest
import torch
from torch import nn

import fmoe


def test_upcycled_encoder_output_unchanged():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, batch_first=True, activation="gelu")
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).eval()
    x = torch.randn(3, 5, 16)
    with torch.no_grad():
        dense = model(x)
    fmoe.moefy(model, num_expert=4, top_k=2)
    assert sum(isinstance(m, fmoe.FMoE) for m in model.modules()) == 2
    assert not any(hasattr(l, "linear1") for l in model.layers)
    with torch.no_grad():
        moe = model(x)
    torch.testing.assert_close(moe, dense, atol=1e-5, rtol=1e-5)
    loss = model.train()(x).sum() + fmoe.collect_aux_loss(model)
    loss.backward()
    assert model.layers[0].moe.experts.w1_eDF.grad is not None


def test_upcycled_decoder_output_unchanged():
    torch.manual_seed(0)
    model = nn.TransformerDecoderLayer(d_model=8, nhead=2, dim_feedforward=16, batch_first=True).eval()
    tgt, mem = torch.randn(2, 4, 8), torch.randn(2, 3, 8)
    with torch.no_grad():
        dense = model(tgt, mem)
        fmoe.moefy(model, num_expert=3, top_k=3, gate="noisy")
        torch.testing.assert_close(model(tgt, mem), dense, atol=1e-5, rtol=1e-5)


class SwiGLU(nn.Module):
    def __init__(self, d, f):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False), nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, ffn):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.ffn = ffn

    def forward(self, x):
        return x + self.ffn(self.norm(x))


@pytest.mark.parametrize("make_ffn", [lambda: nn.Sequential(nn.Linear(8, 24), nn.GELU(), nn.Linear(24, 8)),
                                      lambda: SwiGLU(8, 12)])
def test_selected_ffns_upcycled(make_ffn):
    torch.manual_seed(0)
    model = nn.Sequential(Block(make_ffn()), Block(make_ffn()))
    x = torch.randn(5, 8)
    dense = model(x)
    fmoe.moefy(model, num_expert=4, top_k=2, gate="gshard", gate_kwargs={"capacity": None},
               select=lambda name, m: name.endswith("ffn"))
    assert isinstance(model[0].ffn, fmoe.FMoETransformerMLP) and isinstance(model[1].ffn, fmoe.FMoETransformerMLP)
    torch.testing.assert_close(model.eval()(x), dense, atol=1e-5, rtol=1e-5)


def test_moefy_without_upcycle_and_errors():
    model = nn.Sequential(nn.Linear(8, 8))
    with pytest.raises(ValueError, match="no FFN"):
        fmoe.moefy(model, num_expert=2)
    with pytest.raises(ValueError, match="cannot read"):
        fmoe.moefy(nn.Sequential(Block(nn.Linear(8, 8))), num_expert=2, select=lambda n, m: n.endswith("ffn"))
    torch.manual_seed(0)
    model = nn.Sequential(Block(nn.Sequential(nn.Linear(8, 24), nn.ReLU(), nn.Linear(24, 8))))
    fmoe.moefy(model, num_expert=2, top_k=1, upcycle=False, select=lambda n, m: n.endswith("ffn"))
    assert model[0].ffn.experts.activation == "relu"
    assert not torch.equal(model[0].ffn.experts.w1_eDF[0], model[0].ffn.experts.w1_eDF[1])
