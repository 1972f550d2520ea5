"""Triton grouped GEMM over rows sorted by expert, segments of any size, no padding.

Which expert and row block a tile works on is worked out inside the kernel from `counts_e`
(a cumulative sum of tiles per expert), so launching never reads the counts on the host: the
grid is an upper bound, cdiv(N, BLOCK_M) + E row tiles, and the tiles past the real count exit.
Operands are read through their strides, so a transposed weight view costs no copy, and the
input rows may be gathered through an index (`rows_N`), so a permuted copy need not exist.
"""
import functools
import os
from typing import Optional

import torch
import triton
import triton.language as tl

from fmoe.kernels import triton_tuning


def interpreting() -> bool:
    """Whether kernels run in Triton's CPU interpreter (decided when triton jits them)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@triton.jit
def _swizzle(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """Visit tiles GROUP_M row blocks at a time, so neighbouring programs share operands in L2."""
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    return pid_m, pid_n


@triton.jit
def _expert_segment(counts_ptr, E, e, E_POW2: tl.constexpr):
    """(first row, row count) of expert e's segment."""
    idx = tl.arange(0, E_POW2)
    counts = tl.load(counts_ptr + idx, mask=idx < E, other=0).to(tl.int64)
    ends = tl.cumsum(counts, 0)
    picked = idx == e
    return tl.sum(tl.where(picked, ends - counts, 0)), tl.sum(tl.where(picked, counts, 0))


@triton.jit
def _row_tile(counts_ptr, pid_m, N, E, E_POW2: tl.constexpr, BLOCK_M: tl.constexpr):
    """(expert e, rows, row_ok, live) of row tile `pid_m`: tiles are numbered expert after expert,
    cdiv(count, BLOCK_M) each; a tile past the last (`live` false) has nothing to do."""
    idx = tl.arange(0, E_POW2)
    counts = tl.load(counts_ptr + idx, mask=idx < E, other=0).to(tl.int64)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tile_ends = tl.cumsum(tiles, 0)
    live = pid_m < tl.sum(tiles)
    e = tl.sum((tile_ends <= pid_m).to(tl.int32))
    picked = idx == e
    first_tile = tl.sum(tl.where(picked, tile_ends - tiles, 0))
    seg_start = tl.sum(tl.where(picked, tl.cumsum(counts, 0) - counts, 0))
    seg_end = seg_start + tl.sum(tl.where(picked, counts, 0))
    rows = seg_start + (pid_m - first_tile) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = (rows < seg_end) & (rows < N)   # `rows < N` guards counts that overrun the rows
    return e, rows, row_ok, live


@triton.jit(do_not_specialize=["N", "E"])
def _grouped_mm_kernel(
    x_ptr, rows_ptr, w_ptr, bias_ptr, y_ptr, counts_ptr,
    N, I, O, E,
    stride_xn, stride_xi, stride_we, stride_wi, stride_wo, stride_be, stride_bo, stride_yn, stride_yo,
    GATHER: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    E_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """y[r] = x[rows[r]] @ w[e] (+ bias[e]) for each row r of expert e's segment (rows[r] = r unless GATHER)."""
    num_tiles_m = tl.cdiv(N, BLOCK_M) + E    # no expert needs more than one partial tile
    pid_m, pid_n = _swizzle(tl.program_id(0), num_tiles_m, tl.cdiv(O, BLOCK_N), GROUP_M)
    e, rows, row_ok, live = _row_tile(counts_ptr, pid_m, N, E, E_POW2, BLOCK_M)
    if not live:
        return
    if GATHER:
        src = tl.load(rows_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    else:
        src = rows
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < O
    ks = tl.arange(0, BLOCK_K)

    a_ptrs = x_ptr + src[:, None] * stride_xn + ks[None, :] * stride_xi
    b_ptrs = w_ptr + e.to(tl.int64) * stride_we + ks[:, None] * stride_wi + cols[None, :] * stride_wo
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, I, BLOCK_K):
        k_ok = ks < I - k
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K * stride_xi
        b_ptrs += BLOCK_K * stride_wi
    if HAS_BIAS:
        bias = tl.load(bias_ptr + e.to(tl.int64) * stride_be + cols * stride_bo, mask=col_ok, other=0.0)
        acc += bias.to(tl.float32)[None, :]

    y_ptrs = y_ptr + rows[:, None].to(tl.int64) * stride_yn + cols[None, :] * stride_yo
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["N", "E"])
def _grouped_mm_weight_grad_kernel(
    x_ptr, rows_ptr, dy_ptr, dy_rows_ptr, dw_ptr, counts_ptr,
    N, I, O, E,
    stride_xn, stride_xi, stride_dyn, stride_dyo, stride_dwe, stride_dwi, stride_dwo,
    GATHER: tl.constexpr, GATHER_DY: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr, E_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """dw[e] = x[rows of e]^T @ dy[rows of e], one (I block, O block) tile of one expert per program;
    x's rows are read through rows_ptr (GATHER), dy's through dy_rows_ptr (GATHER_DY).

    BLOCK_M tiles I, BLOCK_N tiles O and BLOCK_K walks the expert's rows; an expert without rows
    stores zeros.
    """
    e = tl.program_id(1)
    pid_i, pid_o = _swizzle(tl.program_id(0), tl.cdiv(I, BLOCK_M), tl.cdiv(O, BLOCK_N), GROUP_M)
    seg_start, count = _expert_segment(counts_ptr, E, e, E_POW2)

    ins = pid_i * BLOCK_M + tl.arange(0, BLOCK_M)
    outs = pid_o * BLOCK_N + tl.arange(0, BLOCK_N)
    in_ok = ins < I
    out_ok = outs < O
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, count, BLOCK_K):
        rows = seg_start + k + ks
        row_ok = (k + ks < count) & (rows < N)
        if GATHER:
            src = tl.load(rows_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        else:
            src = rows
        if GATHER_DY:
            dy_src = tl.load(dy_rows_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        else:
            dy_src = rows
        xt = tl.load(x_ptr + ins[:, None] * stride_xi + src[None, :] * stride_xn,
                     mask=in_ok[:, None] & row_ok[None, :], other=0.0)
        dy = tl.load(dy_ptr + dy_src[:, None] * stride_dyn + outs[None, :] * stride_dyo,
                     mask=row_ok[:, None] & out_ok[None, :], other=0.0)
        if UPCAST:
            xt = xt.to(tl.float32)
            dy = dy.to(tl.float32)
        acc = tl.dot(xt, dy, acc, input_precision=INPUT_PRECISION)

    dw_ptrs = dw_ptr + e.to(tl.int64) * stride_dwe + ins[:, None] * stride_dwi + outs[None, :] * stride_dwo
    tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=in_ok[:, None] & out_ok[None, :])


def _config(m, n, k, group, warps, stages):
    return triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": group},
                         num_warps=warps, num_stages=stages)


# One config per line: (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages), per generation and dot
# mode (`dot_mode`). The first of each list is the one FMOE_TRITON_AUTOTUNE=0 pins. Each was
# compiled for its GPUs at a Mixtral shape by `python -m fmoe.kernels.aot` (tests/test_kernels_aot.py):
# none spills a register or needs more shared memory than a block may have. That is why fp32
# keeps BLOCK_K at 32 on Hopper (at 64 it needs 256-288 KB), why Ampere has no 128x256 or
# 4-warp 128x128 tile (255 registers and spills), and why fp32 without TF32 (CUDA-core FMA, no
# tensor cores) gets small tiles only.
_GPU_CONFIGS = {
    # Three: the first won at every bench shape on an H200; fewer configs, a shorter first call.
    ("hopper", "16bit"): [(128, 256, 64, 8, 8, 3), (128, 128, 64, 8, 8, 4), (64, 128, 64, 8, 4, 4)],
    ("hopper", "tf32"): [(128, 256, 32, 8, 8, 3), (128, 128, 32, 8, 8, 4), (128, 128, 64, 8, 8, 3),
                         (64, 128, 32, 8, 4, 4), (64, 64, 32, 8, 4, 4)],
    ("hopper", "ieee"): [(64, 64, 32, 8, 4, 3), (128, 64, 16, 8, 8, 3)],
    ("ampere", "16bit"): [(128, 128, 32, 8, 8, 4), (128, 128, 64, 8, 8, 3), (64, 128, 32, 8, 4, 4),
                          (64, 64, 32, 8, 4, 3)],
    ("ampere", "tf32"): [(128, 128, 32, 8, 8, 3), (128, 128, 16, 8, 8, 4), (64, 128, 32, 8, 4, 3),
                         (64, 64, 32, 8, 4, 3)],
    ("ampere", "ieee"): [(64, 64, 16, 8, 4, 3)],
    # Only under FMOE_BACKEND=triton: before sm_80 fmoe.kernels picks the torch path (cuBLAS).
    ("volta", "16bit"): [(128, 128, 32, 8, 8, 2), (64, 64, 32, 8, 4, 2)],
}
_GPU_CONFIGS.update({("volta", mode): _GPU_CONFIGS["volta", "16bit"] for mode in ("tf32", "ieee")})
_INTERPRETER_CONFIG = (16, 16, 16, 1, 1, 1)


def generation_of(major: int) -> str:
    """The config family of a CUDA compute capability's major version."""
    return "hopper" if major >= 9 else "ampere" if major >= 8 else "volta"


def dot_mode(dtype: torch.dtype) -> str:
    """How tl.dot multiplies `dtype` on a GPU: "16bit", "tf32" (fp32 while torch allows TF32 matmuls)
    or "ieee" (fp32 otherwise: exact, on the CUDA cores)."""
    if dtype != torch.float32:
        return "16bit"
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"


def gpu_configs(generation: str, mode: str, autotune: bool = True):
    """The triton.Configs a GEMM kernel is tuned over (only the first without autotuning)."""
    if generation == "interpreter":
        rows = [_INTERPRETER_CONFIG]
    else:
        if (generation, mode) not in _GPU_CONFIGS:
            raise ValueError(f"no configs for generation {generation!r} and dot mode {mode!r}; "
                             f"known: {sorted(_GPU_CONFIGS)}")
        rows = _GPU_CONFIGS[generation, mode]
    return [_config(*r) for r in (rows if autotune else rows[:1])]


def pinned(configs, fixed: dict):
    """`configs` with the meta-parameters in `fixed` set to those values, duplicates dropped."""
    seen, out = set(), []
    for c in configs:
        kwargs = {**c.kwargs, **fixed}
        key = (tuple(sorted(kwargs.items())), c.num_warps, c.num_stages)
        if key not in seen:
            seen.add(key)
            out.append(triton.Config(kwargs, num_warps=c.num_warps, num_stages=c.num_stages))
    return out


def fit_epilogue(configs, block_n=None, accumulators: int = 1):
    """Configs for a GEMM with work in its epilogue: BLOCK_N pinned to `block_n` (when given) and no
    more than 64 fp32 elements a thread per accumulator-sized tile, counting `accumulators` such
    tiles live at once (two accumulators, or one and the epilogue's reloads). Past that the
    activation kernels spill on sm_80 / sm_90 (`python -m fmoe.kernels.aot`)."""
    if block_n is not None:
        configs = pinned(configs, {"BLOCK_N": block_n})
    return [c for c in configs
            if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] * accumulators <= 64 * 32 * c.num_warps] or configs[-1:]


@functools.lru_cache(maxsize=None)
def _tuned(kernel, generation: str, mode: str, autotune: bool, key: tuple, epilogue: Optional[tuple]):
    """`kernel` autotuned over its configs (fitted to an `epilogue` (block_n, accumulators)), keyed on `key`."""
    configs = gpu_configs(generation, mode, autotune)
    if epilogue is not None:
        configs = fit_epilogue(gpu_configs(generation, mode, True), *epilogue)[:len(configs)]
    return triton_tuning.autotune(kernel, configs, key)



def _launcher(kernel, device: torch.device, dtype: torch.dtype, key=("I", "O", "GATHER"), epilogue=None):
    """The kernel to launch: FMOE_TRITON_AUTOTUNE=0 skips tuning (fewer compiles, e.g. for tests);
    `epilogue` = (block_n or None, accumulators) fits the configs to a kernel with an epilogue."""
    generation = "interpreter" if interpreting() else generation_of(torch.cuda.get_device_capability(device)[0])
    return _tuned(kernel, generation, dot_mode(dtype), os.environ.get("FMOE_TRITON_AUTOTUNE", "1") != "0",
                  tuple(key), epilogue)


def _dot_args(dtype: torch.dtype) -> dict:
    """UPCAST and INPUT_PRECISION for tl.dot: the interpreter multiplies bf16 wrongly, so it gets fp32
    operands; on a GPU the dot mode decides."""
    return {"UPCAST": interpreting(), "INPUT_PRECISION": "ieee" if dot_mode(dtype) == "ieee" else "tf32"}


def _check_kernel_device(t: torch.Tensor):
    if not t.is_cuda and not interpreting():
        raise ValueError(
            f"the Triton kernels need CUDA tensors, got one on {t.device}; on CPU use backend='torch' "
            "or set TRITON_INTERPRET=1 before triton is imported"
        )


def grouped_mm_launch(x_XI, w_eIO, counts_e, rows_N, bias_eO, y_NO):
    """(kernel, args, constexprs) of the launch that fills y_NO; `fmoe.kernels.aot` compiles the same."""
    N, O = y_NO.shape
    E, I, _ = w_eIO.shape
    # Unread stand-ins keep the argument list fixed when there is no gather or no bias.
    rows_arg = x_XI if rows_N is None else rows_N
    bias_arg, bias_strides = (w_eIO, (0, 0)) if bias_eO is None else (bias_eO, bias_eO.stride())
    args = (x_XI, rows_arg, w_eIO, bias_arg, y_NO, counts_e, N, I, O, E,
            *x_XI.stride(), *w_eIO.stride(), *bias_strides, *y_NO.stride())
    return _grouped_mm_kernel, args, dict(GATHER=rows_N is not None, HAS_BIAS=bias_eO is not None,
                                          E_POW2=triton.next_power_of_2(E), **_dot_args(x_XI.dtype))


def grouped_mm_rows(x_XI, w_eIO, counts_e, rows_N=None, bias_eO=None, fill_tail=True):
    """y[r] = x[rows_N[r]] @ w[e] (+ bias_eO[e]) over expert e's rows r (rows_N[r] = r when None).

    Rows past the last segment (dropped slots) are zero, or, with `fill_tail=False` (a caller that
    never reads them), left unwritten: no zero-fill of the whole output first."""
    _check_kernel_device(x_XI)
    N = x_XI.shape[0] if rows_N is None else rows_N.shape[0]
    E, _, O = w_eIO.shape
    y_NO = x_XI.new_zeros(N, O) if fill_tail else x_XI.new_empty(N, O)
    if N == 0 or O == 0:
        return y_NO
    kernel, args, constexprs = grouped_mm_launch(x_XI, w_eIO, counts_e, rows_N, bias_eO, y_NO)

    def grid(meta):
        num_tiles_m = triton.cdiv(N, meta["BLOCK_M"]) + E
        return (num_tiles_m * triton.cdiv(O, meta["BLOCK_N"]),)

    _launcher(kernel, x_XI.device, x_XI.dtype)[grid](*args, **constexprs)
    return y_NO


def _num_rows(x_XI, dy_YO, rows_N, dy_rows_N):
    """The rows in expert order that a weight gradient walks: an index's length, else dy's rows."""
    return next((len(r) for r in (dy_rows_N, rows_N) if r is not None), dy_YO.shape[0])


def weight_grad_launch(x_XI, dy_YO, counts_e, rows_N, dw_eIO, dy_rows_N=None):
    """(kernel, args, constexprs) of the launch that fills dw_eIO; `fmoe.kernels.aot` compiles the same."""
    N, O = _num_rows(x_XI, dy_YO, rows_N, dy_rows_N), dy_YO.shape[1]
    E, I = counts_e.shape[0], x_XI.shape[1]
    args = (x_XI, x_XI if rows_N is None else rows_N, dy_YO, dy_YO if dy_rows_N is None else dy_rows_N, dw_eIO,
            counts_e, N, I, O, E, *x_XI.stride(), *dy_YO.stride(), *dw_eIO.stride())
    return _grouped_mm_weight_grad_kernel, args, dict(GATHER=rows_N is not None, GATHER_DY=dy_rows_N is not None,
                                                      E_POW2=triton.next_power_of_2(E), **_dot_args(x_XI.dtype))


def grouped_mm_weight_grad(x_XI, dy_YO, counts_e, rows_N=None, dy_rows_N=None):
    """dw[e] = x[rows_N of e]^T @ dy[dy_rows_N of e] (each index the identity when None), in x's
    dtype; zero for an expert with no rows."""
    _check_kernel_device(x_XI)
    N, O = _num_rows(x_XI, dy_YO, rows_N, dy_rows_N), dy_YO.shape[1]
    E, I = counts_e.shape[0], x_XI.shape[1]
    dw_eIO = x_XI.new_empty(E, I, O)
    if N == 0 or I == 0 or O == 0:
        return dw_eIO.zero_()
    kernel, args, constexprs = weight_grad_launch(x_XI, dy_YO, counts_e, rows_N, dw_eIO, dy_rows_N)

    def grid(meta):
        return (triton.cdiv(I, meta["BLOCK_M"]) * triton.cdiv(O, meta["BLOCK_N"]), E)

    _launcher(kernel, x_XI.device, x_XI.dtype)[grid](*args, **constexprs)
    return dw_eIO


@triton.jit(do_not_specialize=["N", "E"])
def _expert_row_sums_kernel(dy_ptr, rows_ptr, slot_ptr, weight_ptr, out_ptr, counts_ptr, N, O, E,
                            stride_dyn, stride_dyo, stride_oe, stride_oo, GATHER: tl.constexpr,
                            E_POW2: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_O: tl.constexpr):
    """out[e] = sum of dy over expert e's rows, in row order, in fp32; with GATHER, the sum of
    weight[slot[r]] * dy[rows[r]] (the output bias's gradient of rows weighted after the GEMM)."""
    e = tl.program_id(1)
    seg_start, count = _expert_segment(counts_ptr, E, e, E_POW2)
    cols = tl.program_id(0) * BLOCK_O + tl.arange(0, BLOCK_O)
    col_ok = cols < O
    ks = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_O,), dtype=tl.float32)
    for k in range(0, count, BLOCK_R):
        rows = seg_start + k + ks
        row_ok = (k + ks < count) & (rows < N)
        if GATHER:
            src = tl.load(rows_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        else:
            src = rows
        dy = tl.load(dy_ptr + src[:, None] * stride_dyn + cols[None, :] * stride_dyo,
                     mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        if GATHER:
            slots = tl.load(slot_ptr + rows, mask=row_ok, other=0).to(tl.int64)
            dy = dy * tl.load(weight_ptr + slots, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        acc += tl.sum(dy, axis=0)
    out_ptrs = out_ptr + e.to(tl.int64) * stride_oe + cols * stride_oo
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


def row_sums_launch(dy_NO, counts_e, out_eO, rows_N=None, slot_N=None, weight_S=None):
    """(kernel, args, constexprs) of the launch that fills out_eO; `fmoe.kernels.aot` compiles the same."""
    N, O = dy_NO.shape[0] if rows_N is None else rows_N.shape[0], dy_NO.shape[1]
    E = counts_e.shape[0]
    gather = rows_N is not None
    args = (dy_NO, rows_N if gather else dy_NO, slot_N if gather else dy_NO, weight_S if gather else dy_NO,
            out_eO, counts_e, N, O, E, *dy_NO.stride(), *out_eO.stride())
    return _expert_row_sums_kernel, args, dict(GATHER=gather, E_POW2=triton.next_power_of_2(E), BLOCK_R=32,
                                               BLOCK_O=min(triton.next_power_of_2(O), 256))


def expert_row_sums(dy_NO, counts_e, dtype, rows_N=None, slot_N=None, weight_S=None):
    """Per-expert sums of dy's rows (the bias gradient), in `dtype`; zero for an expert with no rows.
    Given rows_N, slot_N and weight_S: the sums of weight_S[slot_N[r]] * dy[rows_N[r]]."""
    _check_kernel_device(dy_NO)
    N, O = dy_NO.shape[0] if rows_N is None else rows_N.shape[0], dy_NO.shape[1]
    E = counts_e.shape[0]
    out_eO = dy_NO.new_empty(E, O, dtype=dtype)
    if N == 0 or O == 0:
        return out_eO.zero_()
    kernel, args, constexprs = row_sums_launch(dy_NO, counts_e, out_eO, rows_N, slot_N, weight_S)
    kernel[(triton.cdiv(O, constexprs["BLOCK_O"]), E)](*args, **constexprs)
    return out_eO
