"""The fused FP8 row quantiser on Triton (#49, `fmoe.kernels.triton_fp8_quantise`), under the interpreter:
bit for bit torch's quantisation without an activation, within one e4m3 step of it with each fused
activation, and the kernels and bytes it saves, counted. Every test name contains "fp8"."""
import pytest
import torch
from torch.utils._pytree import tree_leaves
from torch.utils._python_dispatch import TorchDispatchMode

from fmoe.kernels import fp8
from fmoe.kernels.torch_ops import apply_activation
from fmoe.kernels.triton_fp8_quantise import bytes_moved, quantise_rows

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


class LaunchCounter(TorchDispatchMode):
    """Each torch op that would be a kernel on a GPU (views excluded) and the bytes of its tensors."""
    VIEWS = {"view", "_unsafe_view", "reshape", "squeeze", "unsqueeze", "slice", "t", "transpose", "expand",
             "alias", "detach", "split", "select", "permute"}

    def __init__(self):
        super().__init__()
        self.launches, self.bytes = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.__name__.split(".")[0] not in self.VIEWS:
            self.launches += 1
            self.bytes += sum(t.numel() * t.element_size() for t in tree_leaves((args, kwargs, out))
                              if isinstance(t, torch.Tensor))
        return out


@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_fp8_quantise_rows_moves_a_fraction_of_the_torch_paths_bytes(recipe):
    """Qwen3-30B-A3B's second GEMM input (SwiGLU over 2 x 768, 512 rows here, bf16): torch's activation
    and quantisation launch 12 or more kernels; the fused quantiser is one launch, whose bytes (h read,
    rowwise twice; e4m3 and scales written) are under a fifth of theirs and at most 0.85x of the least
    two separate kernels could move."""
    N, W = 512, 2 * 768
    h = torch.randn(N, W, dtype=torch.bfloat16)
    counter = LaunchCounter()
    with counter:
        fp8.quantise_activation(apply_activation(h, "swiglu"), recipe)
    q = quantise_rows(h, recipe, "swiglu")
    reads = 2 if recipe == "rowwise" else 1
    fused = reads * h.numel() * h.element_size() + q.data.numel() + q.scale.numel() * 4
    counted = bytes_moved(N, W, recipe, "swiglu")
    assert counted["fused"] == fused
    assert counter.launches >= 12
    assert fused < counter.bytes / 5
    assert fused <= 0.85 * counted["unfused"]
