"""FP8 recipes and their quantisation (#49): e4m3 blocks with one scale each, along the sum a GEMM reduces over.

A recipe says how each GEMM operand is cut into blocks, each block getting one scale, and what the
scales are (the table, and the three GEMMs' blocks, are in `fmoe.kernels.fp8`, which multiplies
with them). This module holds the recipes, the `Quantised` form and the quantiser every FP8 path
shares: the emulation, the weight cache (`fmoe.kernels.fp8_weights`) and the fused Triton row
quantiser (`fmoe.kernels.triton_fp8_quantise`), which equals it bit for bit.
"""
from typing import NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

RECIPES = ("blockwise", "rowwise", "mxfp8")
E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)            # 448
E8M0 = getattr(torch, "float8_e8m0fnu", None)      # MXFP8's scale dtype; None: fp32 powers of two instead
# Blocks along the reduction dimension: (activation tile, weight block) per recipe; None is the whole dimension.
ACTIVATION_TILE = {"blockwise": 128, "rowwise": None, "mxfp8": 32}
WEIGHT_BLOCK = {"blockwise": (128, 128), "rowwise": (None, 1), "mxfp8": (32, 1)}


def check_fp8(fp8: Optional[str]) -> Optional[str]:
    """`fp8` if it names a recipe (or is None), else a one-line error naming the argument and the choices."""
    if fp8 is not None and fp8 not in RECIPES:
        raise ValueError(f"fp8 must be None or one of {RECIPES}, got {fp8!r}")
    return fp8


class Quantised(NamedTuple):
    """A tensor [..., R, C] in e4m3 blocks of `block` = (rows, cols): `data` (e4m3, [..., R, C]) and
    `scale` ([..., ceil(R / rows), ceil(C / cols)], fp32 or e8m0); value = data * scale of its block."""
    data: torch.Tensor
    scale: torch.Tensor
    block: Tuple[int, int]


def _padded_blocks(t: torch.Tensor, block: Tuple[int, int]) -> torch.Tensor:
    """t [..., R, C] zero-padded to whole blocks and viewed as [..., R/br, br, C/bc, bc]."""
    br, bc = block
    rows, cols = t.shape[-2:]
    pad_r, pad_c = -rows % br, -cols % bc
    if pad_r or pad_c:
        t = F.pad(t, (0, pad_c, 0, pad_r))
    return t.reshape(*t.shape[:-2], (rows + pad_r) // br, br, (cols + pad_c) // bc, bc)


def _whole(block: Tuple[Optional[int], Optional[int]], shape: Sequence[int]) -> Tuple[int, int]:
    """A block with None (the whole dimension) made concrete for a tensor of `shape` [..., R, C]."""
    return tuple(max(1, shape[-2 + i]) if b is None else b for i, b in enumerate(block))


def power_of_two_scale(ratio: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= ratio (> 0), within e8m0's range 2^-127 .. 2^127, in fp32 (exact)."""
    mantissa, exponent = torch.frexp(ratio)         # ratio = mantissa * 2^exponent, mantissa in [0.5, 1)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent).clamp(-127, 127)
    return torch.ldexp(torch.ones_like(ratio), exponent)


def quantise(t: torch.Tensor, block: Tuple[Optional[int], Optional[int]], pow2_scales: bool = False) -> Quantised:
    """t [..., R, C] (any float dtype) in e4m3 blocks of `block` (None: the whole dimension).

    Each block's scale maps its largest magnitude (amax, over its real elements) to 448: amax / 448
    in fp32, or with `pow2_scales` the power of two at or above it (MXFP8's e8m0). An all-zero block
    gets scale 1. Values are divided by the scale, clamped to +-448 and rounded to nearest e4m3.
    """
    block = _whole(block, t.shape)
    blocks = _padded_blocks(t.float(), block)
    amax = blocks.abs().amax(dim=(-3, -1), keepdim=True)
    ratio = amax / E4M3_MAX
    scale = power_of_two_scale(ratio) if pow2_scales else ratio
    scale = torch.where(ratio > 0, scale, torch.ones_like(scale))
    data = (blocks / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    rows, cols = t.shape[-2:]
    data = data.reshape(*data.shape[:-4], data.shape[-4] * block[0], data.shape[-2] * block[1])[..., :rows, :cols]
    scale = scale.squeeze(-1).squeeze(-2)
    if pow2_scales and E8M0 is not None:
        scale = scale.to(E8M0)
    return Quantised(data, scale, block)


def dequantise(q: Quantised) -> torch.Tensor:
    """The fp32 values q holds: data * the scale of each element's block, shape [..., R, C]."""
    rows, cols = q.data.shape[-2:]
    blocks = _padded_blocks(q.data.float(), q.block)
    values = blocks * q.scale.float()[..., :, None, :, None]
    return values.reshape(*values.shape[:-4], -1, values.shape[-2] * q.block[1])[..., :rows, :cols]


def activation_block(recipe: str, reduce_dim: int) -> Tuple[Optional[int], Optional[int]]:
    """An activation's tile for a GEMM that reduces over its dimension `reduce_dim` (1: along its
    rows' elements, as x in the forward; 0: down its columns, as x^T and dy in the weight gradient)."""
    tile = ACTIVATION_TILE[check_fp8(recipe)]
    return (1, tile) if reduce_dim == 1 else (tile, 1)


def weight_block(recipe: str) -> Tuple[Optional[int], Optional[int]]:
    """A weight's block as the right operand [K, O] of a GEMM reducing over K (its rows)."""
    return WEIGHT_BLOCK[check_fp8(recipe)]


def quantise_activation(x_NK: torch.Tensor, recipe: str, reduce_dim: int = 1) -> Quantised:
    """An activation [N, K] quantised along `reduce_dim`: scale [N, ceil(K / tile)] for 1 (blockwise:
    1 x 128 tiles, rowwise: [N, 1], mxfp8: 1 x 32), [ceil(N / tile), K] for 0."""
    return quantise(x_NK, activation_block(recipe, reduce_dim), pow2_scales=recipe == "mxfp8")


def quantise_weight(w_eKO: torch.Tensor, recipe: str) -> Quantised:
    """Weights [..., K, O] as the right operand of a GEMM reducing over K: scale [..., ceil(K/128),
    ceil(O/128)] (blockwise), [..., 1, O] (rowwise: per output column), [..., ceil(K/32), O] (mxfp8)."""
    return quantise(w_eKO, weight_block(recipe), pow2_scales=recipe == "mxfp8")
