"""Triton grouped GEMM on FP8 operands with their block scales (#49): y = q(a) @ q(b[e]) per expert segment.

`a` [N, K] and `b` [E, K, O] arrive quantised as `fmoe.kernels.fp8` quantises them (e4m3 data, one fp32
scale per block, blocks along K, the dimension the GEMM reduces over). Each program computes one
[BLOCK_M, BLOCK_N] tile of one expert, walking K in BLOCK_K steps: the FP8 tensor cores multiply the
e4m3 tiles into an fp32 partial product, and the partial is scaled by its row's activation scale and
its column's weight scale before it joins the fp32 accumulator (DeepSeek-V3's promotion: the scales
change every 128 along K, so each 128-wide slice is scaled on its own). Where both operands have one
scale along the whole of K (the rowwise recipe), the scales are applied once, after the loop.

BLOCK_K divides the recipe's block along K (128 for blockwise, 32 for MXFP8), so a slice never spans
two scales. Rows are tiled as in `triton_grouped_mm` (the tile's expert worked out in the kernel from
the counts; no host sync, no padding). The forward (a = x, b = w) and the input gradient (a = dy, b =
w^T, through its strides) are this kernel. The weight gradient is `_fp8_weight_grad_kernel`: its K is
an expert's rows, and its scales run along them in tiles from the segment's start (per column of x
and of dy), so one program walks one expert's segment.
"""
import torch
import triton
import triton.language as tl

from fmoe.kernels.triton_grouped_mm import _expert_segment, _row_tile, _swizzle


@triton.jit(do_not_specialize=["N", "E"])
def _fp8_grouped_mm_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, y_ptr, counts_ptr,
    N, K, O, E,
    stride_an, stride_ak, stride_asn, stride_ask,
    stride_be, stride_bk, stride_bo, stride_bse, stride_bsk, stride_bso,
    stride_yn, stride_yo,
    A_TILE: tl.constexpr, B_TILE_K: tl.constexpr, B_TILE_O: tl.constexpr, BLOCK_SCALED: tl.constexpr,
    E_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """y[r] = sum over K of a[r, k] * a_scale[r, k // A_TILE] * b[e, k, o] * b_scale[e, k // B_TILE_K, o // B_TILE_O]
    for each row r of expert e's segment. A_TILE / B_TILE_K of 0: one scale along the whole of K. BLOCK_SCALED
    (MXFP8: 32-wide blocks on both sides, scales as e8m0 bytes): the tensor cores apply the scales themselves
    (`tl.dot_scaled`, Blackwell's block-scaled MMA), BLOCK_K spanning several blocks."""
    num_tiles_m = tl.cdiv(N, BLOCK_M) + E
    pid_m, pid_n = _swizzle(tl.program_id(0), num_tiles_m, tl.cdiv(O, BLOCK_N), GROUP_M)
    e, rows, row_ok, live = _row_tile(counts_ptr, pid_m, N, E, E_POW2, BLOCK_M)
    if not live:
        return
    e64 = e.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < O
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_an + ks[None, :] * stride_ak
    b_ptrs = b_ptr + e64 * stride_be + ks[:, None] * stride_bk + cols[None, :] * stride_bo
    a_scale_rows = a_scale_ptr + rows.to(tl.int64) * stride_asn
    b_scale_cols = b_scale_ptr + e64 * stride_bse + (cols // B_TILE_O) * stride_bso
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_ok = ks < K - k
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if BLOCK_SCALED:
            blocks = k // 32 + tl.arange(0, BLOCK_K // 32)
            block_ok = blocks < tl.cdiv(K, 32)
            # e8m0 127 is a scale of 1: the blocks past K hold zeros anyway.
            a_s = tl.load(a_scale_rows[:, None] + blocks[None, :] * stride_ask,
                          mask=row_ok[:, None] & block_ok[None, :], other=127)
            b_s = tl.load(b_scale_cols[:, None] + blocks[None, :] * stride_bsk,
                          mask=col_ok[:, None] & block_ok[None, :], other=127)
            acc = tl.dot_scaled(a, a_s, "e4m3", b, b_s, "e4m3", acc)
        elif A_TILE == 0 and B_TILE_K == 0:
            acc = tl.dot(a, b, acc)
        else:
            part = tl.dot(a, b)
            if A_TILE != 0:
                part *= tl.load(a_scale_rows + (k // A_TILE) * stride_ask, mask=row_ok, other=0.0)[:, None]
            if B_TILE_K != 0:
                part *= tl.load(b_scale_cols + (k // B_TILE_K) * stride_bsk, mask=col_ok, other=0.0)[None, :]
            acc += part
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if A_TILE == 0 and not BLOCK_SCALED:
        acc *= tl.load(a_scale_rows, mask=row_ok, other=0.0)[:, None]
    if B_TILE_K == 0 and not BLOCK_SCALED:
        acc *= tl.load(b_scale_cols, mask=col_ok, other=0.0)[None, :]
    y_ptrs = y_ptr + rows[:, None].to(tl.int64) * stride_yn + cols[None, :] * stride_yo
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages): BLOCK_K 128 (the blockwise recipe's slice: one scale
# each), 32 for MXFP8's 32-wide blocks. e4m3 tiles are half bf16's bytes, so the deeper K tile fits.
CONFIGS = {128: triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8}, num_warps=8,
                              num_stages=3),
           32: triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "GROUP_M": 8}, num_warps=8,
                             num_stages=4)}
INTERPRETER_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4}


def tile_along_k(block_k, K: int) -> int:
    """A recipe's block along K as the kernel's constexpr: 0 for one block over the whole of K (None, or a
    block as long as K: the quantiser makes the whole dimension concrete)."""
    return 0 if block_k is None or block_k >= K else int(block_k)


def block_k_for(a_tile: int, b_tile_k: int) -> int:
    """The K step: 128, or the smallest block along K when a recipe's is narrower (MXFP8's 32)."""
    tiles = [t for t in (a_tile, b_tile_k) if t]
    return min([128] + tiles)


def fp8_grouped_mm_launch(a_q, a_scale, a_tile, b_q, b_scale, b_tile, counts_e, y_NO, interpreter: bool = False,
                          block_scaled: bool = False):
    """(kernel, args, constexprs) of one launch: `a_q` [N, K] e4m3 with `a_scale` [N, K / a_tile] fp32,
    `b_q` [E, K, O] e4m3 (any strides) with `b_scale` [E, K / b_tile[0], O / b_tile[1]] fp32, into y_NO.
    `block_scaled`: MXFP8 (32-wide blocks both sides) on the block-scaled MMA, the scales as e8m0 bytes (uint8)."""
    N, K = a_q.shape
    O = b_q.shape[-1]
    E = counts_e.shape[0]
    A_TILE, B_TILE_K, B_TILE_O = tile_along_k(a_tile, K), tile_along_k(b_tile[0], K), int(b_tile[1])
    for name, tile in (("a_tile", A_TILE), ("b_tile[0]", B_TILE_K)):
        if tile and (tile & (tile - 1) or tile < 16):
            raise ValueError(f"fp8_grouped_mm_launch: {name}={tile} must be a power of two >= 16 (or the whole of K)")
    args = (a_q, a_scale, b_q, b_scale, y_NO, counts_e, N, K, O, E,
            *a_q.stride(), *a_scale.stride(), *b_q.stride(), *b_scale.stride(), *y_NO.stride())
    if block_scaled and (A_TILE, B_TILE_K, B_TILE_O) != (32, 32, 1):
        raise ValueError("fp8_grouped_mm_launch: block_scaled takes MXFP8's blocks (a_tile 32, b_tile (32, 1)), "
                         f"got a_tile={a_tile}, b_tile={b_tile}")
    # The block-scaled MMA takes several 32-wide blocks a step, as the blockwise recipe's 128.
    step = 128 if block_scaled else block_k_for(A_TILE, B_TILE_K)
    config = dict(INTERPRETER_CONFIG, BLOCK_K=min(step, 64)) if interpreter else dict(CONFIGS[step].kwargs)
    constexprs = dict(A_TILE=A_TILE, B_TILE_K=B_TILE_K, B_TILE_O=B_TILE_O, BLOCK_SCALED=block_scaled,
                      E_POW2=triton.next_power_of_2(max(E, 1)), **config)
    options = {} if interpreter else {"num_warps": CONFIGS[step].num_warps, "num_stages": CONFIGS[step].num_stages}
    return _fp8_grouped_mm_kernel, args, constexprs, options


def e8m0_bytes(scale: torch.Tensor) -> torch.Tensor:
    """Power-of-two scales (e8m0, or fp32 powers of two) as e8m0's bytes: the biased exponent, 127 for 1."""
    if scale.dtype == torch.uint8:
        return scale
    if scale.element_size() == 1:           # torch.float8_e8m0fnu
        return scale.view(torch.uint8)
    return (torch.frexp(scale.float())[1] + 126).to(torch.uint8)


def block_scaled_applies(a_tile, b_tile, device: torch.device) -> bool:
    """Whether MXFP8 runs on the block-scaled MMA: its 32-wide blocks, on a Blackwell GPU (sm_100+). Hopper has no
    such MMA (Triton would emulate it in bf16), so there the scales are applied in the accumulator instead."""
    return ((a_tile, tuple(b_tile)) == (32, (32, 1)) and device.type == "cuda"
            and torch.cuda.get_device_capability(device)[0] >= 10)


def fp8_grouped_mm_rows(a_q, a_scale, a_tile, b_q, b_scale, b_tile, counts_e, out_dtype=torch.float32,
                        block_scaled=None):
    """y [N, O] = per expert segment, q(a) @ q(b[e]) with the scales applied in the fp32 accumulator; rows past
    the segments are 0. Scales in e8m0 (MXFP8) are read as the fp32 powers of two they are. `block_scaled`
    (None: `block_scaled_applies`): MXFP8 on the block-scaled MMA, the tensor cores applying the scales."""
    from fmoe.kernels.triton_grouped_mm import interpreting
    N, O = a_q.shape[0], b_q.shape[-1]
    y_NO = torch.zeros(N, O, dtype=out_dtype, device=a_q.device)
    if N == 0 or O == 0:
        return y_NO
    if block_scaled is None:
        block_scaled = block_scaled_applies(a_tile, b_tile, a_q.device)
    convert = e8m0_bytes if block_scaled else (lambda scale: scale.float())
    kernel, args, constexprs, options = fp8_grouped_mm_launch(
        a_q, convert(a_scale), a_tile, b_q, convert(b_scale), b_tile, counts_e, y_NO, interpreter=interpreting(),
        block_scaled=block_scaled)
    num_m = triton.cdiv(N, constexprs["BLOCK_M"]) + counts_e.shape[0]
    grid = (num_m * triton.cdiv(O, constexprs["BLOCK_N"]),)
    kernel[grid](*args, **constexprs, **options)
    return y_NO


@triton.jit(do_not_specialize=["N", "E", "S"])
def _fp8_weight_grad_kernel(
    a_ptr, a_scale_ptr, dy_ptr, dy_scale_ptr, dw_ptr, counts_ptr,
    N, I, O, E, S,
    stride_an, stride_ai, stride_ase, stride_asi, stride_ass,
    stride_dyn, stride_dyo, stride_dse, stride_dss, stride_dso,
    stride_dwe, stride_dwi, stride_dwo,
    TILE: tl.constexpr, E_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """dw[e] = sum over expert e's rows n of a[n, i] * a_scale[e, i, t] * dy[n, o] * dy_scale[e, t, o], t the
    row's tile (TILE rows from the segment's start; TILE 0: one tile, the whole segment). One (I block,
    O block) tile of one expert per program; BLOCK_K walks the segment's rows."""
    e = tl.program_id(1)
    pid_i, pid_o = _swizzle(tl.program_id(0), tl.cdiv(I, BLOCK_M), tl.cdiv(O, BLOCK_N), GROUP_M)
    seg_start, count = _expert_segment(counts_ptr, E, e, E_POW2)
    e64 = e.to(tl.int64)
    ins = pid_i * BLOCK_M + tl.arange(0, BLOCK_M)
    outs = pid_o * BLOCK_N + tl.arange(0, BLOCK_N)
    in_ok, out_ok = ins < I, outs < O
    ks = tl.arange(0, BLOCK_K)
    a_scale_rows = a_scale_ptr + e64 * stride_ase + ins * stride_asi
    dy_scale_cols = dy_scale_ptr + e64 * stride_dse + outs * stride_dso
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, count, BLOCK_K):
        rows = seg_start + k + ks
        row_ok = (k + ks < count) & (rows < N)
        at = tl.load(a_ptr + ins[:, None] * stride_ai + rows[None, :] * stride_an,
                     mask=in_ok[:, None] & row_ok[None, :], other=0.0)
        dy = tl.load(dy_ptr + rows[:, None] * stride_dyn + outs[None, :] * stride_dyo,
                     mask=row_ok[:, None] & out_ok[None, :], other=0.0)
        if TILE == 0:
            acc = tl.dot(at, dy, acc)
        else:
            t = k // TILE
            part = tl.dot(at, dy)
            part *= tl.load(a_scale_rows + t * stride_ass, mask=in_ok, other=0.0)[:, None]
            part *= tl.load(dy_scale_cols + t * stride_dss, mask=out_ok, other=0.0)[None, :]
            acc += part
    if TILE == 0:
        acc *= tl.load(a_scale_rows, mask=in_ok, other=0.0)[:, None]
        acc *= tl.load(dy_scale_cols, mask=out_ok, other=0.0)[None, :]
    dw_ptrs = dw_ptr + e64 * stride_dwe + ins[:, None] * stride_dwi + outs[None, :] * stride_dwo
    tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=in_ok[:, None] & out_ok[None, :])


# The weight gradient's K is the expert's rows: 64-row steps (the blockwise tile of 128 holds two), 32 for MXFP8.
WGRAD_CONFIGS = {64: triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8,
                                   num_stages=3),
                 32: triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "GROUP_M": 8}, num_warps=8,
                                   num_stages=4)}
# Blackwell (sm_100) keeps the accumulator in tensor memory and brings each scaled partial through registers:
# 128 x 128 tiles spill there (60 bytes blockwise, 36 MXFP8; `make aot`), 64 x 128 ones do not.
WGRAD_CONFIGS_BLACKWELL = {
    64: triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=3),
    32: triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 32, "GROUP_M": 8}, num_warps=8, num_stages=3)}


def wgrad_configs(capability_major: int) -> dict:
    """The weight-gradient kernel's configs for a GPU of this major compute capability."""
    return WGRAD_CONFIGS_BLACKWELL if capability_major >= 10 else WGRAD_CONFIGS


def fp8_weight_grad_launch(a_q, a_scale, dy_q, dy_scale, tile: int, counts_e, dw_eIO, interpreter: bool = False,
                           capability_major: int = 9):
    """(kernel, args, constexprs, options, grid) of one weight-gradient launch: `a_q` [N, I] and `dy_q` [N, O] e4m3
    (rows in expert order), `a_scale` [E, I, S] and `dy_scale` [E, S, O] fp32, S the most tiles of a segment; `tile` rows per tile from each segment's start (0: the whole segment)."""
    N, I = a_q.shape
    O = dy_q.shape[1]
    E, S = a_scale.shape[0], a_scale.shape[2]
    if tile and (tile & (tile - 1) or tile < 16):
        raise ValueError(f"fp8_weight_grad_launch: tile={tile} must be a power of two >= 16 (or 0: the segment)")
    step = 32 if tile == 32 else 64
    pinned = wgrad_configs(capability_major)[step]
    config = dict(INTERPRETER_CONFIG, BLOCK_K=32) if interpreter else dict(pinned.kwargs)
    args = (a_q, a_scale, dy_q, dy_scale, dw_eIO, counts_e, N, I, O, E, S, *a_q.stride(), *a_scale.stride(),
            *dy_q.stride(), *dy_scale.stride(), *dw_eIO.stride())
    constexprs = dict(TILE=tile, E_POW2=triton.next_power_of_2(max(E, 1)), **config)
    options = {} if interpreter else {"num_warps": pinned.num_warps, "num_stages": pinned.num_stages}
    grid = (triton.cdiv(I, config["BLOCK_M"]) * triton.cdiv(O, config["BLOCK_N"]), E)
    return _fp8_weight_grad_kernel, args, constexprs, options, grid


def fp8_weight_grad(a_q, a_scale, dy_q, dy_scale, tile: int, counts_e) -> torch.Tensor:
    """dw [E, I, O] in fp32 (see `fp8_weight_grad_launch`); an expert without rows gets zeros."""
    from fmoe.kernels.triton_grouped_mm import interpreting
    E, I, O = counts_e.shape[0], a_q.shape[1], dy_q.shape[1]
    dw = torch.zeros(E, I, O, dtype=torch.float32, device=a_q.device)
    if E == 0 or I == 0 or O == 0:
        return dw
    major = torch.cuda.get_device_capability(a_q.device)[0] if a_q.is_cuda else 9
    kernel, args, constexprs, options, grid = fp8_weight_grad_launch(a_q, a_scale, dy_q, dy_scale, tile, counts_e,
                                                                     dw, interpreter=interpreting(),
                                                                     capability_major=major)
    kernel[grid](*args, **constexprs, **options)
    return dw


def aot_launches(a_tile, b_tile, shape: dict, device: str = "meta", target: int = 90):
    """(name, kernel, args, constexprs, config) of the FP8 launches a layer makes with a recipe's activation
    tile `a_tile` and weight block `b_tile` (`fmoe.kernels.fp8.ACTIVATION_TILE` / `WEIGHT_BLOCK`) at `shape`
    (T, D, F, E, K: tokens, widths, experts, top-k), on `device` tensors, for `fmoe.tools.aot` and a GPU of
    compute capability `target` (its weight-gradient config): the up
    projection's forward ([N, D] @ [E, D, F]), its input gradient ([N, F] @ w^T, read through strides) and
    its weight gradient (x^T @ dy per expert)."""
    T, D, F, E, K = (shape[k] for k in ("T", "D", "F", "E", "K"))
    N = T * K

    def empty(*size, dt=torch.float32):
        return torch.empty(*size, dtype=dt, device=device)

    def scales(rows, cols, block):
        br, bc = (rows if block[0] is None else block[0]), (cols if block[1] is None else block[1])
        return triton.cdiv(rows, br), triton.cdiv(cols, bc)

    counts_e = empty(E, dt=torch.int64)
    e4m3 = torch.float8_e4m3fn
    # MXFP8 on Blackwell: the block-scaled MMA, scales as e8m0 bytes (as `block_scaled_applies` picks at run time).
    block_scaled = target >= 100 and (a_tile, tuple(b_tile)) == (32, (32, 1))
    scale_dtype = torch.uint8 if block_scaled else torch.float32
    out = []
    for name, (k_dim, o_dim, transposed) in (("fp8_grouped_mm", (D, F, False)), ("fp8_grouped_mm[w^T]", (F, D, True))):
        a_q, a_scale = empty(N, k_dim, dt=e4m3), empty(N, *scales(1, k_dim, (1, a_tile))[1:], dt=scale_dtype)
        w = empty(E, o_dim, k_dim, dt=e4m3).transpose(1, 2) if transposed else empty(E, k_dim, o_dim, dt=e4m3)
        w_scale = empty(E, *scales(k_dim, o_dim, b_tile), dt=scale_dtype)
        kernel, args, constexprs, options = fp8_grouped_mm_launch(a_q, a_scale, a_tile, w, w_scale, b_tile, counts_e,
                                                                  empty(N, o_dim, dt=torch.bfloat16),
                                                                  block_scaled=block_scaled)
        blocks = {k: constexprs.pop(k) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")}
        out.append((name, kernel, args, constexprs, triton.Config(blocks, **options)))
    # The up projection's weight gradient: x [N, D] and dy [N, F] along the tokens, S tiles a segment at most.
    S = 1 if a_tile is None else triton.cdiv(N, a_tile)
    kernel, args, constexprs, options, _ = fp8_weight_grad_launch(
        empty(N, D, dt=e4m3), empty(E, D, S), empty(N, F, dt=e4m3), empty(E, S, F), a_tile or 0, counts_e,
        empty(E, D, F), capability_major=target // 10)
    blocks = {k: constexprs.pop(k) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")}
    out.append(("fp8_weight_grad", kernel, args, constexprs, triton.Config(blocks, **options)))
    return out
