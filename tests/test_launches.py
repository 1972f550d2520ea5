"""What the default layer launches on a GPU, counted on the CPU (fmoe.observe.launches): a bf16 layer on the
Triton path, in Triton's interpreter. Exact counts: the number of launches, the bytes of the glue
between the kernels, no fp32 temporary of the rows' size, and the combine's bytes to the byte."""
import pytest
import torch

import fmoe
from fmoe.observe.launches import count_launches

T, D, H = 8, 16, 16


def layer_and_table(act, bias, K, recompute="activation"):
    torch.manual_seed(0)
    layer = fmoe.FMoETransformerMLP(num_expert=8, d_model=D, d_hidden=H, top_k=K, activation=act, backend="triton",
                                    expert_bias=bias, recompute=recompute).to(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, D, generator=g).to(torch.bfloat16).requires_grad_(True)
    dy = torch.randn(T, D, generator=g).to(torch.bfloat16)
    return layer, count_launches(layer, x, dy)


@pytest.mark.parametrize("K", [1, 2, 8])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("act", ["gelu", "swiglu"])
def test_the_default_layer_launches_no_glue(act, bias, K):
    _, table = layer_and_table(act, bias, K)
    layer = table.layer_launches()
    # Forward: up GEMM (+ activation), down GEMM, combine. Backward: activation-gradient GEMM, the
    # routing weights' sums, dW2, dW1, dx GEMM, its gather-sum, and the two bias gradients.
    assert len(layer) == (11 if bias else 9), table.render()
    assert len(layer) <= 12
    combine_bytes = 2 * (K + 1) * D * 2
    assert table.bytes_per_token("glue") <= 0.5 * combine_bytes, table.render()
    N = T * K
    width1 = 2 * H if act == "swiglu" else H
    for launch in layer:
        for shape, dtype in launch.tensors:
            assert not (dtype == torch.float32 and shape in {(N, H), (N, width1), (N, D)}), (launch.name, shape)


def test_the_combine_moves_its_rows_once():
    """The forward's gather-sum reads each kept row, its slot map and weight once and writes each
    token once: (K D 2 + K (8 + 4) + D 2) bytes a token, exactly."""
    K = 2
    _, table = layer_and_table("gelu", False, K)
    combine = [lau for lau in table.layer_launches() if lau.phase == "forward"][-1]
    assert combine.name == "triton:_gather_sum_kernel"
    assert combine.written == T * D * 2
    assert combine.read == T * K * D * 2 + T * K * (8 + 4)


def test_the_router_and_the_none_mode_are_counted_apart():
    _, fused = layer_and_table("swiglu", True, 2)
    _, none = layer_and_table("swiglu", True, 2, recompute="none")
    assert fused.router and none.router
    assert len(fused.router) == len(none.router)
    # The path that keeps every intermediate launches more, glue included.
    assert len(none.layer_launches()) > len(fused.layer_launches())
    assert none.bytes_per_token("glue") > fused.bytes_per_token("glue")
    summary = fused.summary()
    assert summary["launches"] == len(fused.layer_launches()) and summary["by_kind"]["glue"] == 0
