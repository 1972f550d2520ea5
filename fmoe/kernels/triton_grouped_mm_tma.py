"""The Hopper grouped GEMM: tiles through tensor descriptors (TMA), a persistent tile scheduler.

Same contract as `triton_grouped_mm.grouped_mm_rows`: y[r] = x[rows[r]] @ w[e] (+ bias[e]) over
expert e's segment of rows, rows past the last segment zero, counts never read on the host. What
differs on sm_90:

- The weight tile, the input tile when rows are not gathered, and the output tile move through
  tensor descriptors made on the device (`tl.make_tensor_descriptor`), which Hopper runs on its
  copy engine (`cp.async.bulk.tensor`). The input and output descriptors end at the expert's last
  row, so the copy engine fills rows past it with zeros on load and clips them on store: a tile
  never writes the next expert's rows. Descriptors made on the device live in a global scratch
  buffer that Triton asks `triton.set_allocator`'s allocator for at every launch
  (`ensure_allocator`).
- Gathered rows (x read through `rows_N`) are loaded with plain pointer loads (`cp.async`): Triton
  3.9 lowers a descriptor `gather` to TMA's `tile::gather4`, which ptxas accepts on sm_100 and
  later only ("requires .target sm_100 or higher"), so on Hopper only the weight and output tiles
  of the gathered GEMM go through TMA.
- One program per multiprocessor walks the tiles (`tile += number of programs`), so the grid does
  not depend on the counts and no program exits early.

On by default for bf16 / fp16 on sm_90 and later (an H200 run of `benchmarks/gpu_check.sh` found
it correct and faster: forward GEMM 593 vs 545 TFLOP/s); fp32 keeps the plain kernel;
`FMOE_TRITON_TMA=0` turns it off, `=1` also runs it in Triton's interpreter (the tests). It falls
back to the plain kernel when an operand breaks the copy engine's rules (`tma_applies`).
"""
import functools
import os

import torch
import triton
import triton.language as tl

from fmoe.env import env_flag
from fmoe.kernels import triton_grouped_mm as gmm
from fmoe.kernels import triton_tuning
from fmoe.kernels.triton_grouped_mm import _config, _dot_args, _swizzle, dot_mode, interpreting

# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages) per dot mode; the first is the one
# FMOE_TRITON_AUTOTUNE=0 pins. Each fits sm_90 (python -m fmoe.kernels.aot: no spills, shared
# memory within 227 KB with the output tile's staging buffer). fp32 without TF32 never takes this
# path: its dot runs on the CUDA cores, where the copy engine buys nothing.
TMA_CONFIGS = {
    "16bit": [(128, 256, 64, 8, 8, 3), (128, 128, 64, 8, 8, 4), (128, 128, 64, 8, 4, 4), (64, 128, 64, 8, 4, 4)],
    # fp32's 128x256 output tile alone takes 128 KB to stage: 128x256x32 needs 272 KB in all.
    "tf32": [(128, 128, 32, 8, 8, 4), (128, 64, 32, 8, 4, 4), (64, 128, 32, 8, 4, 4)],
}
_INTERPRETER_CONFIG = (16, 16, 16, 1, 1, 1)
# What the interpreter pretends to have: enough programs that each walks several tiles.
_INTERPRETER_PROGRAMS = 3
TMA_MIN_CAPABILITY = (9, 0)


def tma_configs(mode: str, autotune: bool = True):
    """The triton.Configs the TMA kernel is tuned over ("interpreter": the interpreter's one)."""
    if mode == "interpreter":
        rows = [_INTERPRETER_CONFIG]
    elif mode in TMA_CONFIGS:
        rows = TMA_CONFIGS[mode]
    else:
        raise ValueError(f"no TMA configs for dot mode {mode!r}; known: {sorted(TMA_CONFIGS)}")
    return [_config(*r) for r in (rows if autotune else rows[:1])]


@triton.jit(do_not_specialize=["N", "E"])
def _grouped_mm_tma_kernel(
    x_ptr, rows_ptr, w_ptr, bias_ptr, y_ptr, counts_ptr,
    N, I, O, E,
    stride_xn, stride_we, stride_w_major, stride_be, stride_yn,
    GATHER: tl.constexpr, HAS_BIAS: tl.constexpr, W_TRANSPOSED: tl.constexpr, UPCAST: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, E_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """y[r] = x[rows[r]] @ w[e] (+ bias[e]) for each row r of expert e's segment, tile after tile.

    w is [E, I, O] with O contiguous, or (W_TRANSPOSED) a transposed view of an [E, O, I] tensor
    with I contiguous; `stride_w_major` is the stride of its non-contiguous inner dimension.
    """
    idx = tl.arange(0, E_POW2)
    counts = tl.load(counts_ptr + idx, mask=idx < E, other=0).to(tl.int64)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tile_ends = tl.cumsum(tiles, 0)
    seg_ends = tl.cumsum(counts, 0)
    num_tiles_m = tl.sum(tiles).to(tl.int32)
    num_tiles_n = tl.cdiv(O, BLOCK_N)

    if W_TRANSPOSED:
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[E, O, I], strides=[stride_we, stride_w_major, 1],
                                           block_shape=[1, BLOCK_N, BLOCK_K])
    else:
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[E, I, O], strides=[stride_we, stride_w_major, 1],
                                           block_shape=[1, BLOCK_K, BLOCK_N])
    ks = tl.arange(0, BLOCK_K)

    for tile in tl.range(tl.program_id(0), num_tiles_m * num_tiles_n, tl.num_programs(0)):
        pid_m, pid_n = _swizzle(tile, num_tiles_m, num_tiles_n, GROUP_M)
        e = tl.sum((tile_ends <= pid_m).to(tl.int32))
        picked = idx == e
        first_tile = tl.sum(tl.where(picked, tile_ends - tiles, 0))
        seg_end = tl.minimum(tl.sum(tl.where(picked, seg_ends, 0)), N).to(tl.int32)   # N guards counts overrunning x
        row0 = (tl.sum(tl.where(picked, seg_ends - counts, 0)) + (pid_m - first_tile) * BLOCK_M).to(tl.int32)
        col0 = (pid_n * BLOCK_N).to(tl.int32)

        if GATHER:
            rows = row0 + tl.arange(0, BLOCK_M)
            row_ok = rows < seg_end
            src = tl.load(rows_ptr + rows, mask=row_ok, other=0).to(tl.int64)
            a_ptrs = x_ptr + src[:, None] * stride_xn + ks[None, :]
        else:
            # Rows at and past seg_end load as zeros: they belong to the next expert or to no one.
            x_desc = tl.make_tensor_descriptor(x_ptr, shape=[seg_end, I], strides=[stride_xn, 1],
                                               block_shape=[BLOCK_M, BLOCK_K])
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, I, BLOCK_K):
            if GATHER:
                a = tl.load(a_ptrs, mask=row_ok[:, None] & (ks[None, :] < I - k), other=0.0)
                a_ptrs += BLOCK_K
            else:
                a = x_desc.load([row0, k])
            if W_TRANSPOSED:
                b = w_desc.load([e, col0, k]).reshape(BLOCK_N, BLOCK_K).T
            else:
                b = w_desc.load([e, k, col0]).reshape(BLOCK_K, BLOCK_N)
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        if HAS_BIAS:
            cols = col0 + tl.arange(0, BLOCK_N)
            bias = tl.load(bias_ptr + e.to(tl.int64) * stride_be + cols, mask=cols < O, other=0.0)
            acc += bias.to(tl.float32)[None, :]
        # The store is clipped at seg_end: rows past it stay the next expert's (or zero).
        y_desc = tl.make_tensor_descriptor(y_ptr, shape=[seg_end, O], strides=[stride_yn, 1],
                                           block_shape=[BLOCK_M, BLOCK_N])
        y_desc.store([row0, col0], acc.to(y_ptr.dtype.element_ty))


def tma_setting():
    """FMOE_TRITON_TMA as True / False, or None when unset."""
    return env_flag("FMOE_TRITON_TMA", False) if "FMOE_TRITON_TMA" in os.environ else None


def tma_enabled(on_gpu: bool = True) -> bool:
    """Whether row-reading GEMMs try the TMA kernel (`tma_applies` then checks the GPU and the
    operands): by default on a GPU (checked on an H200: faster than the plain kernel in bf16), never
    in the interpreter unless FMOE_TRITON_TMA=1 asks; FMOE_TRITON_TMA=0 turns it off everywhere."""
    setting = tma_setting()
    return setting if setting is not None else on_gpu and not interpreting()


def gpu_takes_tma(capability, dtype: torch.dtype) -> bool:
    """Whether a GPU of this compute capability runs the TMA kernel for `dtype`: sm_90 and later
    (the copy engine, wgmma) in bf16 or fp16. fp32 keeps the plain kernel: without TF32 its dot runs
    on the CUDA cores, and with TF32 the TMA kernel has not been measured faster."""
    return tuple(capability) >= TMA_MIN_CAPABILITY and dtype in (torch.bfloat16, torch.float16)


def _tma_ok(t: torch.Tensor) -> bool:
    """The copy engine's rules for a 2-D (or 3-D) operand: 16-byte-aligned base, inner stride 1, the
    other strides multiples of 16 bytes."""
    size = t.element_size()
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(s * size % 16 == 0 for s in t.stride()[:-1]))


def tma_applies(x_XI, w_eIO, rows_N, bias_eO) -> bool:
    """Whether the TMA kernel can run these operands here (else the plain kernel does); the output,
    a new contiguous [N, O] tensor, needs O * element size a multiple of 16 bytes."""
    if not interpreting() and not (x_XI.is_cuda and gpu_takes_tma(torch.cuda.get_device_capability(x_XI.device),
                                                                  x_XI.dtype)):
        return False
    w_view = w_eIO if w_eIO.stride(2) == 1 else w_eIO.transpose(1, 2)
    x_ok = x_XI.stride(1) == 1 and (rows_N is not None or _tma_ok(x_XI))
    bias_ok = bias_eO is None or bias_eO.stride(1) == 1
    y_ok = w_eIO.shape[2] * x_XI.element_size() % 16 == 0
    N = x_XI.shape[0] if rows_N is None else rows_N.shape[0]
    # A descriptor's coordinates are 32-bit.
    return x_ok and bias_ok and y_ok and _tma_ok(w_view) and max(x_XI.shape[0], N) < 2 ** 31


def _torch_scratch(size: int, alignment: int, stream):
    """Global scratch for descriptors made on the device, from torch's caching allocator."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_allocator():
    """Give Triton an allocator for on-device descriptors unless this context has one.

    `triton.set_allocator` sets a ContextVar, so a value set on the main thread is not seen on
    autograd's backward threads: this runs before every launch, on whichever thread launches. A
    user's own allocator is left in place.
    """
    try:
        from triton.runtime._allocation import NullAllocator, _allocator
        if not isinstance(_allocator.get(), NullAllocator):
            return
    except ImportError:  # a Triton without this module layout: setting it is always safe
        pass
    triton.set_allocator(_torch_scratch)


@functools.lru_cache(maxsize=None)
def _tuned(mode: str, autotune: bool):
    return triton_tuning.autotune(_grouped_mm_tma_kernel, tma_configs(mode, autotune),
                                  ("I", "O", "GATHER", "W_TRANSPOSED"))


def grouped_mm_tma_launch(x_XI, w_eIO, counts_e, rows_N, bias_eO, y_NO):
    """(kernel, args, constexprs) of the launch that fills y_NO; `fmoe.kernels.aot` compiles the same."""
    N, O = y_NO.shape
    E, I, _ = w_eIO.shape
    transposed = w_eIO.stride(2) != 1
    rows_arg = x_XI if rows_N is None else rows_N
    bias_arg, stride_be = (w_eIO, 0) if bias_eO is None else (bias_eO, bias_eO.stride(0))
    args = (x_XI, rows_arg, w_eIO, bias_arg, y_NO, counts_e, N, I, O, E,
            x_XI.stride(0), w_eIO.stride(0), w_eIO.stride(2) if transposed else w_eIO.stride(1), stride_be,
            y_NO.stride(0))
    return _grouped_mm_tma_kernel, args, dict(GATHER=rows_N is not None, HAS_BIAS=bias_eO is not None,
                                              W_TRANSPOSED=transposed, E_POW2=triton.next_power_of_2(E),
                                              **_dot_args(x_XI.dtype))


def _num_programs(device: torch.device) -> int:
    if interpreting():
        return _INTERPRETER_PROGRAMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def grouped_mm_rows_tma(x_XI, w_eIO, counts_e, rows_N=None, bias_eO=None, fill_tail=True):
    """`triton_grouped_mm.grouped_mm_rows` through the TMA kernel (see `tma_applies` first)."""
    N = x_XI.shape[0] if rows_N is None else rows_N.shape[0]
    E, _, O = w_eIO.shape
    y_NO = x_XI.new_zeros(N, O) if fill_tail else x_XI.new_empty(N, O)
    if N == 0 or O == 0:
        return y_NO
    kernel, args, constexprs = grouped_mm_tma_launch(x_XI, w_eIO, counts_e, rows_N, bias_eO, y_NO)
    programs = _num_programs(x_XI.device)

    def grid(meta):
        upper_bound = (triton.cdiv(N, meta["BLOCK_M"]) + E) * triton.cdiv(O, meta["BLOCK_N"])
        return (min(programs, upper_bound),)

    mode = "interpreter" if interpreting() else dot_mode(x_XI.dtype)
    if not interpreting():
        ensure_allocator()
    _tuned(mode, os.environ.get("FMOE_TRITON_AUTOTUNE", "1") != "0")[grid](*args, **constexprs)
    return y_NO


def grouped_mm_rows_best(x_XI, w_eIO, counts_e, rows_N=None, bias_eO=None, fill_tail=True):
    """y[r] = x[rows_N[r]] @ w[e] (+ bias_eO[e]): the TMA kernel where it is enabled and applies
    (sm_90 and later, bf16 / fp16, operands the copy engine takes), the plain kernel otherwise."""
    if tma_enabled(x_XI.is_cuda):
        gmm._check_kernel_device(x_XI)
        if tma_applies(x_XI, w_eIO, rows_N, bias_eO):
            return grouped_mm_rows_tma(x_XI, w_eIO, counts_e, rows_N, bias_eO, fill_tail)
    return gmm.grouped_mm_rows(x_XI, w_eIO, counts_e, rows_N, bias_eO, fill_tail)
