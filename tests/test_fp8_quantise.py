"""The fused FP8 row quantiser on Triton (#49, `fmoe.kernels.triton_fp8_quantise`), under the interpreter:
bit for bit torch's quantisation without an activation, within one e4m3 step of it with each fused
activation, and the kernels and bytes it saves, counted. Every test name contains "fp8"."""
import pytest
import torch

from fmoe.kernels import fp8
from fmoe.kernels.torch_ops import apply_activation
from fmoe.kernels.triton_fp8_quantise import quantise_rows
from fmoe.observe.launches import counting

SPECS = ["relu", "gelu", "swiglu", "glu:gelu_tanh:interleaved", "clamped_swiglu:1.702:7.0:interleaved"]


def wide_rows(n, w, dtype, seed=0):
    """Rows spanning six decades across their columns, a zero row, a row of -0.0 and an exact zero column."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, w, generator=g) * torch.logspace(-3, 3, w)[torch.randperm(w, generator=g)]
    h[1] = 0.0
    h[2] = -0.0
    h[:, 3] = 0.0
    return h.to(dtype)


def bits(q):
    return q.data.view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_fp8_quantise_rows_is_torchs_bit_for_bit(recipe, dtype):
    """37 rows (not a multiple of the row block) by 200 columns (not of 128 or 32): data, signs of zero
    and scales equal torch's quantisation exactly."""
    h = wide_rows(37, 200, dtype)
    got, want = quantise_rows(h, recipe), fp8.quantise_activation(h, recipe)
    assert got.block == want.block and got.scale.dtype == want.scale.dtype
    assert torch.equal(bits(got), bits(want))
    assert torch.equal(got.scale.float(), want.scale.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_fp8_quantise_rows_with_the_activation_fused(recipe, spec, dtype):
    """act(h) quantised in one pass against torch's activation then quantisation: the fused activation
    computes in fp32 and rounds once (torch's bf16 GLU rounds twice), so a tile's amax may move one
    step of h's dtype and a value on an e4m3 boundary one e4m3 step; nothing more."""
    h = wide_rows(45, 2 * 96, dtype).float().clamp(-12, 12).to(dtype)
    got = quantise_rows(h, recipe, spec)
    want = fp8.quantise_activation(apply_activation(h, spec), recipe)
    ulp = 2.0 ** -23 if dtype == torch.float32 else 2.0 ** -7
    scale_got, scale_want = got.scale.float(), want.scale.float()
    torch.testing.assert_close(scale_got, scale_want, rtol=2 * ulp + (1.0 if recipe == "mxfp8" else 0.0), atol=0)
    K = got.data.shape[1]
    same_scale = (scale_got == scale_want).repeat_interleave(got.block[1], dim=1)[:, :K]
    a, b = fp8.dequantise(got), fp8.dequantise(want)
    # One e4m3 step: at most |b| / 8 among the normals, 2^-9 of the tile's scale among the subnormals.
    scale_of_each = scale_got.repeat_interleave(got.block[1], dim=1)[:, :K]
    step = b.abs() / 8 + scale_of_each * 2.0 ** -9
    assert ((a - b).abs() <= step * (1 + 1e-6))[same_scale].all()
    assert (a - b).norm() <= 0.02 * b.norm()


def test_fp8_quantise_rows_empty_and_narrow():
    for n, w in ((0, 64), (5, 1), (3, 31)):
        h = torch.randn(n, w)
        for recipe in fp8.RECIPES:
            got, want = quantise_rows(h, recipe), fp8.quantise_activation(h, recipe)
            assert got.data.shape == want.data.shape and got.scale.shape == want.scale.shape
            assert torch.equal(bits(got), bits(want))


@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_fp8_quantise_rows_moves_a_fraction_of_the_torch_paths_bytes(recipe):
    """The second GEMM's input at Qwen3-30B-A3B's expert width (SwiGLU over 2 x 768, 256 rows, bf16), counted by
    `fmoe.observe.launches` (torch ops by dispatch; the Triton kernel under the interpreter, its bytes the
    distinct addresses it loads and stores): torch's activation and quantisation launch 12 kernels or more,
    the fused quantiser one, which reads h once and writes the e4m3 rows and their scales, nothing else:
    under a fifth of the torch path's bytes."""
    h = torch.randn(256, 2 * 768, dtype=torch.bfloat16)
    with counting() as torch_path:
        fp8.quantise_activation(apply_activation(h, "swiglu"), recipe)
    with counting() as fused:
        q = quantise_rows(h, recipe, "swiglu")
    [launch] = fused.launches
    assert launch.kind == "triton" and launch.read == h.numel() * h.element_size()
    assert launch.written == q.data.numel() + q.scale.numel() * q.scale.element_size()
    assert len(torch_path.launches) >= 12
    assert launch.bytes < sum(lau.bytes for lau in torch_path.launches) / 5
