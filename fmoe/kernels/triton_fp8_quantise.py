"""Rows to e4m3 in one pass on Triton (#49): the activation and the quantisation fused.

`quantise_rows(h, recipe, spec)` reads h [N, W] once and writes a = act(h) (or h itself) as e4m3 with one
scale per tile along each row (`fmoe.kernels.fp8.quantise_activation`'s tiles: 1 x 128 blockwise, the
whole row rowwise, 1 x 32 MXFP8), the values `fmoe.kernels.fp8` computes in torch: a rounded to h's
dtype (as torch's activation returns it), amax / 448 per tile (MXFP8: the power of two at or above),
division and clamp to +-448, round to nearest e4m3. The activations are the lean path's fused specs
(`fmoe.kernels.triton_lean`: relu, gelu, silu, GLUs, gpt-oss's clamped SwiGLU), evaluated with its
formulas in fp32, so a value on an e4m3 rounding boundary may land one step from torch's (the test
bounds it); without an activation the result is torch's, bit for bit.

Unfused, the second GEMM's input costs an activation kernel (read h, write a), then the quantiser's
passes over a (amax, divide, convert); fused, it is one read of h and one write of 1-byte data and
the scales (`benchmarks/bench_fp8_quantise.py` counts both). A tile is one program's columns (BLOCK_K =
the tile); rowwise's whole-row scale takes a program per row block that walks the row twice (amax,
then quantise; the second walk re-reads what the first brought into cache).
"""
import torch
import triton
import triton.language as tl

from fmoe.kernels.fp8_quant import ACTIVATION_TILE, E4M3, E8M0, Quantised, check_fp8
from fmoe.kernels.triton_lean import _act_and_grad, _gated, activation_constexprs, activation_width

# KIND of no activation: the rows as they are.
NO_ACT = -1
WHOLE_ROW_BLOCK_K = 128
# A memory-bound pass with no loop to pipeline (rowwise's two walks of a row aside): 4 warps, 1 stage.
OPTIONS = {"num_warps": 4, "num_stages": 1}


@triton.jit
def _activated(h_ptr, rows, cols, mask, stride_hn, stride_hk, alpha, limit,
               KIND: tl.constexpr, ACT: tl.constexpr, GATE_STEP: tl.constexpr, UP_OFFSET: tl.constexpr):
    """a = act(h[rows, cols]) in fp32, rounded to h's dtype; 0 where masked. `rows`: h's rows (gathered or not)."""
    base = h_ptr + rows[:, None].to(tl.int64) * stride_hn
    if KIND == -1:
        a = tl.load(base + cols[None, :] * stride_hk, mask=mask, other=0.0).to(tl.float32)
    elif KIND == 0:
        a, _ = _act_and_grad(tl.load(base + cols[None, :] * stride_hk, mask=mask, other=0.0).to(tl.float32), ACT)
    else:
        g = tl.load(base + (cols * GATE_STEP)[None, :] * stride_hk, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(base + (cols * GATE_STEP + UP_OFFSET)[None, :] * stride_hk, mask=mask, other=0.0).to(tl.float32)
        a, _, _ = _gated(g, u, alpha, limit, KIND, ACT)
    a = a.to(h_ptr.dtype.element_ty).to(tl.float32)
    return tl.where(mask, a, 0.0)


@triton.jit
def _tile_scale(amax, POW2: tl.constexpr):
    """amax / 448, or with POW2 the power of two at or above it (e8m0's, exponent within -127..127); 1 for 0."""
    ratio = tl.math.div_rn(amax, 448.0)
    if POW2:
        bits = ratio.to(tl.int32, bitcast=True)
        exponent = ((bits >> 23) & 0xFF) - 127
        exponent = tl.where((bits & 0x7FFFFF) != 0, exponent + 1, exponent)
        exponent = tl.minimum(tl.maximum(exponent, -127), 127)
        # 2^-127 is below fp32's normal range: its bits are the subnormal 0x00400000.
        scale = tl.where(exponent >= -126, ((exponent + 127) << 23).to(tl.float32, bitcast=True),
                         tl.full(exponent.shape, 0x00400000, tl.int32).to(tl.float32, bitcast=True))
    else:
        scale = ratio
    return tl.where(ratio > 0, scale, 1.0)


@triton.jit
def _stored_scale(scale, SCALE_BYTES: tl.constexpr):
    """The scale as stored: fp32, or with SCALE_BYTES e8m0's byte (a power of two's biased exponent; 2^-127,
    fp32's subnormal, is byte 0)."""
    if SCALE_BYTES:
        stored = ((scale.to(tl.int32, bitcast=True) >> 23) & 0xFF).to(tl.uint8)
    else:
        stored = scale
    return stored


@triton.jit
def _to_e4m3(a, scale):
    """e4m3(clamp(a / scale, +-448)), rounded to nearest even in fp32 first: adding and taking away 2^(e+20)
    (e: the binade, at least e4m3's smallest normal one, -6) leaves a multiple of the e4m3 step 2^(e-3),
    so the conversion itself has nothing to round (the interpreter's truncates, the GPU's rounds)."""
    v = tl.minimum(tl.maximum(tl.math.div_rn(a, scale[:, None]), -448.0), 448.0)
    bits = v.to(tl.int32, bitcast=True)
    binade = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    magic = ((binade + 20 + 127) << 23).to(tl.float32, bitcast=True)
    rounded = (tl.abs(v) + magic) - magic
    return tl.where(bits < 0, -rounded, rounded).to(tl.float8e4nv)      # the sign bit: -0 stays -0, as torch's


@triton.jit(do_not_specialize=["N"])
def _quantise_rows_kernel(
    h_ptr, rows_ptr, q_ptr, scale_ptr, N, K, alpha, limit,
    stride_hn, stride_hk, stride_qn, stride_qk, stride_sn, stride_sk,
    TILE: tl.constexpr, POW2: tl.constexpr, SCALE_BYTES: tl.constexpr, GATHER: tl.constexpr,
    KIND: tl.constexpr, ACT: tl.constexpr, GATE_STEP: tl.constexpr, UP_OFFSET: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """q[r, c] = e4m3(act(h)[src, c] / scale[r, c // TILE]), src = rows[r] with GATHER, else r; K the
    activation's width; TILE 0: one scale a row."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    if GATHER:
        src = tl.load(rows_ptr + rows, mask=row_ok, other=0)
    else:
        src = rows
    ks = tl.arange(0, BLOCK_K)
    q_rows = q_ptr + rows[:, None].to(tl.int64) * stride_qn
    s_rows = scale_ptr + rows.to(tl.int64) * stride_sn
    if TILE == 0:
        amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            cols = k + ks
            a = _activated(h_ptr, src, cols, row_ok[:, None] & (cols < K)[None, :], stride_hn, stride_hk,
                           alpha, limit, KIND, ACT, GATE_STEP, UP_OFFSET)
            amax = tl.maximum(amax, tl.max(tl.abs(a), axis=1))
        scale = _tile_scale(amax, POW2)
        tl.store(s_rows, _stored_scale(scale, SCALE_BYTES), mask=row_ok)
        for k in range(0, K, BLOCK_K):
            cols = k + ks
            mask = row_ok[:, None] & (cols < K)[None, :]
            a = _activated(h_ptr, src, cols, mask, stride_hn, stride_hk, alpha, limit, KIND, ACT, GATE_STEP,
                           UP_OFFSET)
            tl.store(q_rows + cols[None, :] * stride_qk, _to_e4m3(a, scale), mask=mask)
    else:
        tile = tl.program_id(1)
        cols = tile * TILE + ks
        mask = row_ok[:, None] & (cols < K)[None, :]
        a = _activated(h_ptr, src, cols, mask, stride_hn, stride_hk, alpha, limit, KIND, ACT, GATE_STEP, UP_OFFSET)
        scale = _tile_scale(tl.max(tl.abs(a), axis=1), POW2)
        tl.store(s_rows + tile * stride_sk, _stored_scale(scale, SCALE_BYTES), mask=row_ok)
        tl.store(q_rows + cols[None, :] * stride_qk, _to_e4m3(a, scale), mask=mask)


def _act_constexprs(spec, width: int) -> dict:
    if spec is None:
        return dict(KIND=NO_ACT, ACT=0, GATE_STEP=1, UP_OFFSET=0, alpha=0.0, limit=0.0)
    return activation_constexprs(spec, activation_width(spec, width))


def quantise_rows_launch(h_NW, q_NK, scale_NS, recipe: str, spec=None, interpreter: bool = False, rows_N=None):
    """(kernel, args, constexprs, grid) of the launch filling q_NK (e4m3) and scale_NS (fp32) from h_NW (its
    rows `rows_N` in order, given them)."""
    tile = ACTIVATION_TILE[check_fp8(recipe)]
    N, K = q_NK.shape
    act = _act_constexprs(spec, h_NW.shape[1])
    alpha, limit = act.pop("alpha"), act.pop("limit")
    block_m = 16 if interpreter else 32
    block_k = WHOLE_ROW_BLOCK_K if tile is None else tile
    args = (h_NW, h_NW if rows_N is None else rows_N, q_NK, scale_NS, N, K, alpha, limit, *h_NW.stride(),
            *q_NK.stride(), *scale_NS.stride())
    constexprs = dict(TILE=0 if tile is None else tile, POW2=recipe == "mxfp8",
                      SCALE_BYTES=scale_NS.dtype == torch.uint8, GATHER=rows_N is not None,
                      BLOCK_M=block_m, BLOCK_K=block_k, **act)
    grid = (triton.cdiv(N, block_m), 1 if tile is None else triton.cdiv(K, tile))
    return _quantise_rows_kernel, args, constexprs, grid


def quantise_rows(h_NW: torch.Tensor, recipe: str, spec=None, rows_N=None) -> Quantised:
    """act(h) (`spec` a fused activation spec; None: h itself) quantised along its rows in `recipe`'s tiles,
    as `fmoe.kernels.fp8.quantise_activation(act(h), recipe)`, in one launch; given `rows_N`, h's rows in
    that order (a permute's gather and the quantisation in one pass: quantise_activation(h[rows_N]))."""
    from fmoe.kernels.triton_grouped_mm import interpreting
    N = h_NW.shape[0] if rows_N is None else rows_N.shape[0]
    K = h_NW.shape[1] if spec is None else activation_width(spec, h_NW.shape[1])
    tile = ACTIVATION_TILE[recipe]
    q = torch.empty(N, K, dtype=E4M3, device=h_NW.device)
    # MXFP8's scales are written as e8m0 bytes where this torch has the dtype (else fp32 powers of two).
    as_bytes = recipe == "mxfp8" and E8M0 is not None
    scale = torch.empty(N, 1 if tile is None else triton.cdiv(K, tile), device=h_NW.device,
                        dtype=torch.uint8 if as_bytes else torch.float32)
    if N and K:
        kernel, args, constexprs, grid = quantise_rows_launch(h_NW, q, scale, recipe, spec, interpreting(), rows_N)
        kernel[grid](*args, **constexprs, **({} if interpreting() else OPTIONS))
    return Quantised(q, scale.view(E8M0) if as_bytes else scale, (1, K if tile is None else tile))


def aot_launches(recipe: str, shape: dict, device: str = "meta"):
    """(name, kernel, args, constexprs) of the quantiser's launches a layer makes at `shape` (T, D, F, E, K) for
    `fmoe.tools.aot`: the rows into the up projection (x, [N, D], no activation) and the down projection's
    input fused with its activation (SwiGLU over h [N, 2F]), bf16 in."""
    N, D, F = shape["T"] * shape["K"], shape["D"], shape["F"]
    out = []
    for name, (width, k, spec) in (("fp8_quantise_rows", (D, D, None)), ("fp8_quantise_rows[swiglu]", (2 * F, F, "swiglu"))):
        h = torch.empty(N, width, dtype=torch.bfloat16, device=device)
        tile = ACTIVATION_TILE[recipe]
        q = torch.empty(N, k, dtype=E4M3, device=device)
        scale = torch.empty(N, 1 if tile is None else triton.cdiv(k, tile), device=device,
                            dtype=torch.uint8 if recipe == "mxfp8" and E8M0 is not None else torch.float32)
        kernel, args, constexprs, _ = quantise_rows_launch(h, q, scale, recipe, spec)
        out.append((name, kernel, args, constexprs))
    return out
