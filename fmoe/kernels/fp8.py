"""FP8 recipes for the experts' grouped GEMMs, emulated with torch's float8 dtypes (#49).

A recipe says how each GEMM operand is cut into blocks, each block getting one scale, and what the
scales are. Data is e4m3 (`torch.float8_e4m3fn`, largest finite 448); a block's values are divided
by its scale, clamped to +-448 and rounded to e4m3. Every operand is quantised along the dimension
its GEMM reduces over, so that a scale is constant along each product's sum and an FP8 tensor core
can apply it to the fp32 partial sums:

| recipe      | activation tiles          | weight blocks (w_IO)          | scales                         |
|-------------|---------------------------|-------------------------------|--------------------------------|
| `blockwise` | 1 x 128 along the sum     | 128 x 128                     | fp32, amax / 448 (DeepSeek-V3) |
| `rowwise`   | one per row of the sum    | one per output column         | fp32, amax / 448 (torchao)     |
| `mxfp8`     | 1 x 32 along the sum      | 32 x 1 along the sum          | e8m0: 2^ceil(log2(amax / 448)) |

The three GEMMs of y = x @ w (x [N, I], w [I, O]) and where each operand's blocks run:

- forward  y[N, O]  = q(x) @ q(w):      x in tiles along I (per row); w along I (its rows).
- dgrad    dx[N, I] = q(dy) @ q(w^T):   dy in tiles along O (per row); w^T along O, i.e. w along its
  columns. Blockwise 128 x 128 blocks are the same blocks either way, so DeepSeek-V3 keeps one
  quantised weight for both; rowwise and mxfp8 quantise w again along the other dimension.
- wgrad    dw[I, O] = q(x^T) @ q(dy):   both along N, the tokens, within each expert's segment
  (tiles of 128 rows for blockwise, all of the segment's rows for rowwise, 32 rows for mxfp8),
  so a tile never spans two experts.

A dimension that is not a multiple of the block ends in a partial block: it is padded with zeros
for the computation, which leaves its amax, and so its scale, that of its real elements. MXFP8's
scales are powers of two stored as `torch.float8_e8m0fnu` where this torch has it, else as fp32
powers of two (the same values). The scale is rounded up (no value saturates), as NVIDIA's
cuBLAS MXFP8 recipe does, where the OCP MX specification's default rounds down and clamps.

The emulation dequantises both operands to fp32 and multiplies in fp32 expert by expert, which is
what an FP8 tensor core computes up to the order of the fp32 sums. On Triton (a CUDA GPU with FP8
tensor cores, or the interpreter) the three products run `fmoe.kernels.triton_fp8`: e4m3 tiles into the
tensor cores, the scales applied to each partial in the fp32 accumulator. The master weights keep their
dtype (the optimiser never sees FP8). The weights are quantised once a step and kept until they change
(`fmoe.kernels.fp8_weights`); the activations are quantised by each GEMM from the tensors autograd saved
(x, or the pre-activation).
"""
from typing import Callable, List, Optional, Sequence, Tuple

import torch

# The recipes and the quantiser (re-exported: `fp8.quantise_activation` and the rest are this module's API too).
from fmoe.kernels.fp8_quant import (ACTIVATION_TILE, E4M3, E4M3_MAX, E8M0, RECIPES, WEIGHT_BLOCK,  # noqa: F401
                                    Quantised, activation_block, check_fp8, dequantise, power_of_two_scale,
                                    quantise, quantise_activation, quantise_weight, weight_block)
from fmoe.kernels.fp8_weights import quantised_weight


def _segments(counts: Sequence[int]) -> List[Tuple[int, int, int]]:
    """(expert, first row, end row) of each non-empty expert segment."""
    out, start = [], 0
    for e, n in enumerate(counts):
        if n:
            out.append((e, start, start + n))
        start += n
    return out


def _grouped(a_NK: torch.Tensor, b_eKO: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """fp32 rows a[seg] @ b[e] per expert segment; rows past the segments are 0."""
    out = a_NK.new_zeros(a_NK.shape[0], b_eKO.shape[-1])
    for e, lo, hi in _segments(counts):
        out[lo:hi] = a_NK[lo:hi] @ b_eKO[e]
    return out


def fused_quantiser_applies(x: torch.Tensor) -> bool:
    """Whether x's rows can be quantised by the fused Triton quantiser: a GPU with e4m3 conversions (sm_89+)."""
    return x.is_cuda and torch.cuda.get_device_capability(x.device) >= (8, 9)


def quantise_rows(a_NK: torch.Tensor, recipe: str, triton: bool = False, spec: Optional[str] = None,
                  rows_N: Optional[torch.Tensor] = None) -> Quantised:
    """act(a) (`spec` a fused activation spec, None: a itself; given `rows_N`, a's rows in that order)
    quantised along its rows: on Triton (`fmoe.kernels.triton_fp8_quantise`: gather, activation and
    quantisation in one pass) or in torch."""
    if triton:
        from fmoe.kernels.triton_fp8_quantise import quantise_rows as fused
        return fused(a_NK, recipe, spec, rows_N)
    if rows_N is not None:
        a_NK = a_NK[rows_N]
    if spec is not None:
        from fmoe.kernels.torch_ops import apply_activation
        a_NK = apply_activation(a_NK, spec)
    return quantise_activation(a_NK, recipe)


def _quantised_product(qa: Quantised, qb: Quantised, counts: Sequence[int],
                       counts_e: Optional[torch.Tensor]) -> torch.Tensor:
    """fp32 qa @ qb[e] per segment: on Triton's FP8 kernel when `counts_e` (the counts as a tensor on a's
    device) is given, else emulated (dequantised, fp32 products)."""
    if counts_e is not None:
        from fmoe.kernels.triton_fp8 import fp8_grouped_mm_rows
        return fp8_grouped_mm_rows(qa.data, qa.scale, qa.block[1], qb.data, qb.scale, qb.block, counts_e)
    return _grouped(dequantise(qa), dequantise(qb), counts)


def forward_product(a_NI: torch.Tensor, w_eIO: torch.Tensor, counts: Sequence[int], recipe: str,
                    counts_e: Optional[torch.Tensor] = None, weight_dtype: Optional[torch.dtype] = None,
                    spec: Optional[str] = None) -> torch.Tensor:
    """fp32 q(a) @ q(w[e]) per segment: a in tiles along I (act(a) given a fused activation `spec`), w along I
    (Triton's kernels given `counts_e`); w cast to `weight_dtype` first (None: as it is), quantised once a
    step (`fmoe.kernels.fp8_weights`)."""
    qa = quantise_rows(a_NI, recipe, counts_e is not None, spec)
    return _quantised_product(qa, quantised_weight(w_eIO, recipe, False, weight_dtype), counts, counts_e)


def input_gradient(dy_NO: torch.Tensor, w_eIO: torch.Tensor, counts: Sequence[int], recipe: str,
                   counts_e: Optional[torch.Tensor] = None, weight_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """fp32 q(dy) @ q(w[e]^T) per segment: dy in tiles along O, w^T along O (w's columns)."""
    qd = quantise_rows(dy_NO, recipe, counts_e is not None)
    return _quantised_product(qd, quantised_weight(w_eIO, recipe, True, weight_dtype), counts, counts_e)


def weight_gradient(a_NI: torch.Tensor, dy_NO: torch.Tensor, counts: Sequence[int], recipe: str,
                    counts_e: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fp32 q(a_seg^T) @ q(dy_seg) per expert, both in tiles along the segment's rows: [e, I, O] (on Triton's
    FP8 kernel given `counts_e`, the counts as a tensor on a's device)."""
    if counts_e is not None:
        return _weight_gradient_triton(a_NI, dy_NO, counts, recipe, counts_e)
    dw = a_NI.new_zeros(len(counts), a_NI.shape[1], dy_NO.shape[1], dtype=torch.float32)
    for e, lo, hi in _segments(counts):
        a_T = dequantise(quantise_activation(a_NI[lo:hi].t(), recipe, reduce_dim=1))
        dy = dequantise(quantise_activation(dy_NO[lo:hi], recipe, reduce_dim=0))
        dw[e] = a_T @ dy
    return dw


def _weight_gradient_triton(a_NI, dy_NO, counts: Sequence[int], recipe: str, counts_e) -> torch.Tensor:
    """`weight_gradient` on `fmoe.kernels.triton_fp8`: each segment quantised as the emulation quantises it,
    the e4m3 rows laid in expert order and the scales in [E, I, S] / [E, S, O] (S: the most tiles a segment
    has), then one kernel multiplies them."""
    from fmoe.kernels.triton_fp8 import fp8_weight_grad
    tile = ACTIVATION_TILE[check_fp8(recipe)]
    N, I, O = a_NI.shape[0], a_NI.shape[1], dy_NO.shape[1]
    longest = max(counts, default=0)
    S = 1 if tile is None else max(1, -(-longest // tile))
    a_q = torch.zeros(N, I, dtype=E4M3, device=a_NI.device)
    dy_q = torch.zeros(N, O, dtype=E4M3, device=a_NI.device)
    a_scale = torch.ones(len(counts), I, S, device=a_NI.device)
    dy_scale = torch.ones(len(counts), S, O, device=a_NI.device)
    for e, lo, hi in _segments(counts):
        qa = quantise_activation(a_NI[lo:hi].t(), recipe, reduce_dim=1)     # [I, n], scales [I, tiles]
        qd = quantise_activation(dy_NO[lo:hi], recipe, reduce_dim=0)        # [n, O], scales [tiles, O]
        a_q[lo:hi] = qa.data.t()
        dy_q[lo:hi] = qd.data
        a_scale[e, :, :qa.scale.shape[1]] = qa.scale.float()
        dy_scale[e, :qd.scale.shape[0]] = qd.scale.float()
    # A tile as long as the segment (rowwise) is one scale over it: the kernel's tile 0.
    return fp8_weight_grad(a_q, a_scale, dy_q, dy_scale, 0 if tile is None else tile, counts_e)


def _segment_sums(dy_NO: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    db = dy_NO.new_zeros(len(counts), dy_NO.shape[1], dtype=torch.float32)
    for e, lo, hi in _segments(counts):
        db[e] = dy_NO[lo:hi].float().sum(0)
    return db


def _bias_rows(bias_eO: torch.Tensor, counts: Sequence[int], rows: int) -> torch.Tensor:
    """Each row's expert bias in fp32 (zeros past the segments)."""
    out = bias_eO.new_zeros(rows, bias_eO.shape[1], dtype=torch.float32)
    for e, lo, hi in _segments(counts):
        out[lo:hi] = bias_eO[e].float()
    return out


class _Fp8GroupedMM(torch.autograd.Function):
    """y = q(act(x)) @ q(w[e]) + b[e] per segment, accumulated in fp32, returned in x's dtype."""

    @staticmethod
    def forward(ctx, x_NI, w_eIO, bias_eO, counts, recipe, activation, counts_e=None, weight_dtype=None):
        # A fused activation spec on Triton: applied inside the quantiser, act(x) never stored.
        fused = counts_e is not None and isinstance(activation, str)
        if isinstance(activation, str):
            from fmoe.kernels.torch_ops import activation_vjp
            from fmoe.kernels.triton_lean import activation_width
            width = activation_width(activation, x_NI.shape[-1])
            a_NI = None if fused else activation_vjp(x_NI, activation)[0]
        else:
            a_NI = x_NI if activation is None else activation(x_NI)
            width = a_NI.shape[-1]
        if width != w_eIO.shape[1]:
            raise ValueError(f"fp8_grouped_mm: the GEMM's input has width {width}, w_eIO has "
                             f"{w_eIO.shape[1]} rows (shape {tuple(w_eIO.shape)})")
        if fused:
            y = forward_product(x_NI, w_eIO, counts, recipe, counts_e, weight_dtype, spec=activation)
        else:
            y = forward_product(a_NI, w_eIO, counts, recipe, counts_e, weight_dtype)
        if bias_eO is not None:
            y += _bias_rows(bias_eO, counts, y.shape[0])
        ctx.save_for_backward(x_NI, w_eIO)
        ctx.counts, ctx.recipe, ctx.activation, ctx.counts_e = counts, recipe, activation, counts_e
        ctx.weight_dtype = weight_dtype
        ctx.bias_dtype = None if bias_eO is None else bias_eO.dtype
        return y.to(x_NI.dtype)

    @staticmethod
    def backward(ctx, dy_NO):
        x_NI, w_eIO = ctx.saved_tensors
        counts, recipe, activation = ctx.counts, ctx.recipe, ctx.activation
        dx = dw = db = None
        if activation is None:
            h, a_NI = None, x_NI
        elif isinstance(activation, str):       # a fused spec: recomputed with its vjp, as the lean path
            from fmoe.kernels.torch_ops import activation_vjp
            h = None
            a_NI, vjp = activation_vjp(x_NI, activation)
        else:       # the activation recomputed from the saved pre-activation, as the forward ran it
            with torch.enable_grad(), torch.autocast(x_NI.device.type, enabled=False):
                h = x_NI.detach().requires_grad_(True)
                a_NI = activation(h)
        if ctx.needs_input_grad[0]:
            da = input_gradient(dy_NO, w_eIO, counts, recipe, ctx.counts_e, ctx.weight_dtype).to(a_NI.dtype)
            if isinstance(activation, str):
                dx = vjp(da)
            else:
                dx = da if h is None else torch.autograd.grad(a_NI, h, da)[0]
        if ctx.needs_input_grad[1]:
            dw = weight_gradient(a_NI.detach(), dy_NO, counts, recipe, ctx.counts_e).to(w_eIO.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            db = _segment_sums(dy_NO, counts).to(ctx.bias_dtype)
        return dx, dw, db, None, None, None, None, None


class _Fp8GatherGroupedMM(torch.autograd.Function):
    """y = q(x[token_N]) @ q(w[e]) + b[e] per segment: the permute's gather runs inside the quantisation, so
    the rows reach the GEMM as FP8 and no permuted copy of x exists or is kept for the backward; x's
    gradient is summed back per token as the permute's backward sums it (bit-identical)."""

    @staticmethod
    def forward(ctx, x_TD, w_eIO, bias_eO, token_N, row_of_slot_TK, counts, recipe, counts_e, weight_dtype, impl):
        if x_TD.shape[-1] != w_eIO.shape[1]:
            raise ValueError(f"fp8_gather_grouped_mm: x_TD has width {x_TD.shape[-1]}, w_eIO has {w_eIO.shape[1]} rows "
                             f"(shape {tuple(w_eIO.shape)})")
        qa = quantise_rows(x_TD, recipe, counts_e is not None, rows_N=token_N)
        y = _quantised_product(qa, quantised_weight(w_eIO, recipe, False, weight_dtype), counts, counts_e)
        if bias_eO is not None:
            y += _bias_rows(bias_eO, counts, y.shape[0])
        ctx.save_for_backward(x_TD, w_eIO, token_N, row_of_slot_TK)
        ctx.counts, ctx.recipe, ctx.counts_e, ctx.weight_dtype, ctx.impl = counts, recipe, counts_e, weight_dtype, impl
        ctx.bias_dtype = None if bias_eO is None else bias_eO.dtype
        return y.to(x_TD.dtype)

    @staticmethod
    def backward(ctx, dy_NO):
        from fmoe.kernels.ops import gather_sum
        x_TD, w_eIO, token_N, row_of_slot_TK = ctx.saved_tensors
        counts, recipe = ctx.counts, ctx.recipe
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            da = input_gradient(dy_NO, w_eIO, counts, recipe, ctx.counts_e, ctx.weight_dtype).to(x_TD.dtype)
            dx = gather_sum(da, row_of_slot_TK, None, ctx.impl)
        if ctx.needs_input_grad[1]:     # the rows gathered again, for this product only
            dw = weight_gradient(x_TD[token_N], dy_NO, counts, recipe, ctx.counts_e).to(w_eIO.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            db = _segment_sums(dy_NO, counts).to(ctx.bias_dtype)
        return dx, dw, db, None, None, None, None, None, None, None


@torch.compiler.disable     # reads the counts on the host: under torch.compile a graph break, run eagerly
def fp8_gather_grouped_mm(x_TD: torch.Tensor, token_N: torch.Tensor, w_eIO: torch.Tensor, counts_e: torch.Tensor,
                          row_of_slot_TK: torch.Tensor, recipe: str, bias_eO: Optional[torch.Tensor] = None,
                          triton: bool = False, weight_dtype: Optional[torch.dtype] = None,
                          impl: str = "torch") -> torch.Tensor:
    """fp8_grouped_mm(x_TD[token_N], ...) with the gather inside the quantisation (`_Fp8GatherGroupedMM`);
    `impl` sums x's gradient back per token (`fmoe.kernels.ops.gather_sum`)."""
    if recipe not in RECIPES:
        raise ValueError(f"fp8_gather_grouped_mm: recipe must be one of {RECIPES}, got {recipe!r}")
    counts = tuple(int(n) for n in counts_e.tolist())
    if sum(counts) > token_N.shape[0]:
        raise ValueError(f"counts_e sums to {sum(counts)} rows, token_N has {token_N.shape[0]}")
    return _Fp8GatherGroupedMM.apply(x_TD, w_eIO, bias_eO, token_N, row_of_slot_TK, counts, recipe,
                                     counts_e if triton else None, weight_dtype, impl)


@torch.compiler.disable     # reads the counts on the host: under torch.compile a graph break, run eagerly
def fp8_grouped_mm(x_NI: torch.Tensor, w_eIO: torch.Tensor, counts_e: torch.Tensor, recipe: str,
                   bias_eO: Optional[torch.Tensor] = None, activation: Optional[Callable] = None,
                   triton: bool = False, weight_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Rows in expert order, `counts_e[e]` of them for expert e: y = q(a_seg) @ q(w_eIO[e]) + bias_eO[e]
    with a = x, or `activation(x)` (then x, the pre-activation, is what the backward keeps, and the
    activation is recomputed there; a fused activation spec (`fmoe.kernels.torch_ops.parse_activation`)
    runs inside the quantiser on Triton, act(x) never stored). Forward, input gradient and weight gradient each quantise their
    operands with `recipe` along the dimension they reduce over (module docstring), multiply in fp32
    and add the bias in fp32; y is in x's dtype, the gradients in their tensors' dtypes. Rows past
    the segments are 0. The counts are read on the host. `triton`: the three products on Triton's FP8
    kernels (`fmoe.kernels.triton_fp8`), the rows quantised in one pass (`fmoe.kernels.triton_fp8_quantise`),
    the weight gradient's tiles along the tokens in torch. `weight_dtype`: w is quantised from its cast
    to it (autocast's dtype), its gradient returned in w's own dtype.
    """
    if recipe not in RECIPES:
        raise ValueError(f"fp8_grouped_mm: recipe must be one of {RECIPES}, got {recipe!r}")
    counts = tuple(int(n) for n in counts_e.tolist())
    if sum(counts) > x_NI.shape[0]:
        raise ValueError(f"counts_e sums to {sum(counts)} rows, x_NI has {x_NI.shape[0]}")
    return _Fp8GroupedMM.apply(x_NI, w_eIO, bias_eO, counts, recipe, activation, counts_e if triton else None,
                               weight_dtype)
