"""The fused lean MLP on Triton: the experts' MLP and the top-k combine with no glue between GEMMs.

Forward, three launches: the up GEMM reads x's rows through `rows_N` while loading its A
operand and, in its epilogue, adds the bias, stores the pre-activation h (saved) and the
activation a (a transient), both cast in registers; the down GEMM y = a @ w2 (+ b2); the
combine sums each token's K rows times their routing weights in fp32 (`triton_permute.gather_sum`).

Backward: one kernel computes dA' = dy[token] @ w2^T and, in its epilogue, recomputes the
activation from h, stores dh = activation-backward(s * dA') and s * a (dW2's operand), and
writes per-tile fp32 partial sums of a * dA' (+ <dy, b2> from the first column tile) that a small
kernel adds up per slot: the routing weight's gradient, deterministic, without atomics. Then dW2
and dW1 are grouped weight-gradient GEMMs that read dy's and x's rows through `rows_N`; dx is a
grouped GEMM and an unweighted gather-sum. No buffer is zero-filled: every element a later step
reads is written first, and rows past the experts' segments (dropped slots) are never read.

Activations are the fused specs of `torch_ops.parse_activation`, coded as constexprs: KIND
(plain, GLU, gpt-oss's clamped SwiGLU), ACT (the plain or gated function) and the gate/up
column layout (GATE_STEP, UP_OFFSET: split halves [gate | up] or interleaved columns).
"""
import torch
import triton
import triton.language as tl

from fmoe.kernels import torch_ops
from fmoe.kernels.triton_grouped_mm import (_check_kernel_device, _dot_args, _launcher, _row_tile, _swizzle,
                                            expert_row_sums, grouped_mm_weight_grad, interpreting)
from fmoe.kernels.triton_grouped_mm_tma import grouped_mm_rows_best as grouped_mm_rows
from fmoe.kernels.triton_permute import gather_sum

KIND_PLAIN, KIND_GLU, KIND_CLAMPED = 0, 1, 2
ACTS = {"relu": 0, "silu": 1, "gelu": 2, "gelu_tanh": 3}
# The column tile of the activation-gradient kernel is fixed (not tuned): the routing weight's
# partial sums are one fp32 column per tile, and their number must be known before the launch.
# The gated up GEMM (two accumulators) takes the same. 64: wider tiles spill (fmoe.kernels.aot).
GRAD_BLOCK_N = 64
_INTERPRETER_GRAD_BLOCK_N = 16
# (pinned BLOCK_N, fp32 tiles live at once) per kernel: `triton_grouped_mm.fit_epilogue`.
EPILOGUES = {"up_plain": (None, 1), "up_gated": (GRAD_BLOCK_N, 2), "act_grad": (GRAD_BLOCK_N, 2)}


def activation_constexprs(spec: str, F: int) -> dict:
    """The kernels' constexprs and scalars for a fused activation spec over activation width F."""
    kind, act, layout, alpha, limit = torch_ops.parse_activation(spec)
    gated = kind != "gelu" and kind != "relu"
    interleaved = layout == "interleaved"
    return dict(KIND=KIND_CLAMPED if kind == "clamped_swiglu" else KIND_GLU if gated else KIND_PLAIN,
                ACT=ACTS.get(act, 0), GATE_STEP=2 if interleaved else 1,
                UP_OFFSET=(1 if interleaved else F) if gated else 0,
                alpha=float(alpha or 0.0), limit=float(limit or 0.0))


def activation_width(spec: str, hidden_width: int) -> int:
    """F, the activation's width, of a pre-activation `hidden_width` wide (2F when gated)."""
    kind = torch_ops.parse_activation(spec)[0]
    return hidden_width if kind in ("gelu", "relu") else hidden_width // 2


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _act_and_grad(x, ACT: tl.constexpr):
    """(act(x), act'(x)) in fp32, with torch's formulas (relu' is 0 at 0)."""
    if ACT == 0:
        return tl.maximum(x, 0.0), (x > 0).to(tl.float32)
    elif ACT == 1:
        sig = tl.sigmoid(x)
        return x * sig, sig * (1.0 + x * (1.0 - sig))
    elif ACT == 2:
        cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
        pdf = tl.exp(-0.5 * x * x) * 0.3989422804014327
        return x * cdf, cdf + x * pdf
    else:
        inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        t = _tanh(inner)
        grad = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3 * 0.044715 * x * x)
        return 0.5 * x * (1.0 + t), grad


@triton.jit
def _gated(g, u, alpha, limit, KIND: tl.constexpr, ACT: tl.constexpr):
    """(a, da/dg, da/du) of a gated activation at gate g and up u (fp32)."""
    if KIND == 1:
        act_g, dact_g = _act_and_grad(g, ACT)
        return act_g * u, dact_g * u, act_g
    else:       # gpt-oss: clamp, g * sigmoid(alpha g) times (up + 1); a clamp passes gradient where in range
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        sig = tl.sigmoid(alpha * gc)
        glu = gc * sig
        dg = tl.where(g <= limit, (uc + 1.0) * (sig + alpha * glu * (1.0 - sig)), 0.0)
        du = tl.where((u >= -limit) & (u <= limit), glu, 0.0)
        return (uc + 1.0) * glu, dg, du


@triton.jit(do_not_specialize=["N", "E"])
def _up_act_kernel(
    x_ptr, rows_ptr, w_ptr, bias_ptr, h_ptr, a_ptr, counts_ptr,
    N, I, F, E, UP_OFFSET, alpha, limit,
    stride_xn, stride_xi, stride_we, stride_wi, stride_wo, stride_be, stride_bo, stride_hn, stride_ho,
    stride_an, stride_af,
    GATHER: tl.constexpr, HAS_BIAS: tl.constexpr, STORE_ACT: tl.constexpr, KIND: tl.constexpr, ACT: tl.constexpr,
    GATE_STEP: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr, E_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """h[r] = x[rows[r]] @ w1[e] (+ b1[e]) and a[r] = act(h[r]) over activation columns j: a plain
    activation reads h's column j, a gated one its gate column j * GATE_STEP and its up column
    j * GATE_STEP + UP_OFFSET, each with an accumulator of its own."""
    pid_m, pid_n = _swizzle(tl.program_id(0), tl.cdiv(N, BLOCK_M) + E, tl.cdiv(F, BLOCK_N), GROUP_M)
    e, rows, row_ok, live = _row_tile(counts_ptr, pid_m, N, E, E_POW2, BLOCK_M)
    if not live:
        return
    src = tl.load(rows_ptr + rows, mask=row_ok, other=0).to(tl.int64) if GATHER else rows
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < F
    gate_cols = cols * GATE_STEP
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + src[:, None] * stride_xn + ks[None, :] * stride_xi
    g_ptrs = w_ptr + e.to(tl.int64) * stride_we + ks[:, None] * stride_wi + gate_cols[None, :] * stride_wo
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, I, BLOCK_K):
        k_ok = ks < I - k
        xa = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        wg = tl.load(g_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:
            xa = xa.to(tl.float32)
            wg = wg.to(tl.float32)
        acc_g = tl.dot(xa, wg, acc_g, input_precision=INPUT_PRECISION)
        if KIND != 0:
            wu = tl.load(g_ptrs + UP_OFFSET * stride_wo, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if UPCAST:
                wu = wu.to(tl.float32)
            acc_u = tl.dot(xa, wu, acc_u, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K * stride_xi
        g_ptrs += BLOCK_K * stride_wi
    b_ptrs = bias_ptr + e.to(tl.int64) * stride_be + gate_cols * stride_bo
    h_ptrs = h_ptr + rows[:, None].to(tl.int64) * stride_hn + gate_cols[None, :] * stride_ho
    mask = row_ok[:, None] & col_ok[None, :]
    if HAS_BIAS:
        acc_g += tl.load(b_ptrs, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    # The activation reads h as stored (rounded to h's dtype), as the backward's recompute does.
    h_g = acc_g.to(h_ptr.dtype.element_ty)
    tl.store(h_ptrs, h_g, mask=mask)
    if KIND != 0:
        if HAS_BIAS:
            acc_u += tl.load(b_ptrs + UP_OFFSET * stride_bo, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        h_u = acc_u.to(h_ptr.dtype.element_ty)
        tl.store(h_ptrs + UP_OFFSET * stride_ho, h_u, mask=mask)
    if STORE_ACT:
        if KIND == 0:
            act = _act_and_grad(h_g.to(tl.float32), ACT)[0]
        else:
            act = _gated(h_g.to(tl.float32), h_u.to(tl.float32), alpha, limit, KIND, ACT)[0]
        tl.store(a_ptr + rows[:, None].to(tl.int64) * stride_an + cols[None, :] * stride_af,
                 act.to(a_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["N", "E"])
def _act_grad_kernel(
    dy_ptr, rows_ptr, slot_ptr, weight_ptr, w_ptr, b2_ptr, h_ptr, dh_ptr, as_ptr, part_ptr, counts_ptr,
    N, D, F, E, UP_OFFSET, alpha, limit,
    stride_dyt, stride_dyd, stride_we, stride_wf, stride_wd, stride_be, stride_bd, stride_hn, stride_ho,
    stride_dhn, stride_dho, stride_asn, stride_asf, stride_pn,
    HAS_B2: tl.constexpr, KIND: tl.constexpr, ACT: tl.constexpr, GATE_STEP: tl.constexpr, UPCAST: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, E_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """dA' = dy[rows[r]] @ w2[e]^T over activation columns j, then, with s = weight[slot[r]]:
    dh = activation-backward(s * dA') at h's columns, as = s * act(h), and part[r, pid_n] =
    sum_j act(h) * dA' (part[r, last] = <dy[rows[r]], b2[e]>, from the first column tile)."""
    pid_m, pid_n = _swizzle(tl.program_id(0), tl.cdiv(N, BLOCK_M) + E, tl.cdiv(F, BLOCK_N), GROUP_M)
    e, rows, row_ok, live = _row_tile(counts_ptr, pid_m, N, E, E_POW2, BLOCK_M)
    if not live:
        return
    src = tl.load(rows_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < F
    ks = tl.arange(0, BLOCK_K)
    dy_ptrs = dy_ptr + src[:, None] * stride_dyt + ks[None, :] * stride_dyd
    w_ptrs = w_ptr + e.to(tl.int64) * stride_we + ks[:, None] * stride_wd + cols[None, :] * stride_wf
    b2_ptrs = b2_ptr + e.to(tl.int64) * stride_be + ks * stride_bd
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    bias_dot = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k in range(0, D, BLOCK_K):
        k_ok = ks < D - k
        dy = tl.load(dy_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if HAS_B2:
            b2 = tl.load(b2_ptrs, mask=k_ok, other=0.0).to(tl.float32)
            bias_dot += tl.sum(dy.to(tl.float32) * b2[None, :], axis=1)
            b2_ptrs += BLOCK_K * stride_bd
        if UPCAST:
            dy = dy.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(dy, w, acc, input_precision=INPUT_PRECISION)
        dy_ptrs += BLOCK_K * stride_dyd
        w_ptrs += BLOCK_K * stride_wd

    mask = row_ok[:, None] & col_ok[None, :]
    slots = tl.load(slot_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    s = tl.load(weight_ptr + slots, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    gate_cols = cols * GATE_STEP
    rows64 = rows[:, None].to(tl.int64)
    g = tl.load(h_ptr + rows64 * stride_hn + gate_cols[None, :] * stride_ho, mask=mask, other=0.0).to(tl.float32)
    dh_ptrs = dh_ptr + rows64 * stride_dhn + gate_cols[None, :] * stride_dho
    if KIND == 0:
        act, dact = _act_and_grad(g, ACT)
        tl.store(dh_ptrs, (acc * s * dact).to(dh_ptr.dtype.element_ty), mask=mask)
    else:
        u = tl.load(h_ptr + rows64 * stride_hn + (gate_cols + UP_OFFSET)[None, :] * stride_ho,
                    mask=mask, other=0.0).to(tl.float32)
        act, d_g, d_u = _gated(g, u, alpha, limit, KIND, ACT)
        tl.store(dh_ptrs, (acc * s * d_g).to(dh_ptr.dtype.element_ty), mask=mask)
        tl.store(dh_ptrs + UP_OFFSET * stride_dho, (acc * s * d_u).to(dh_ptr.dtype.element_ty), mask=mask)
    act = tl.where(mask, act, 0.0)
    tl.store(as_ptr + rows64 * stride_asn + cols[None, :] * stride_asf, (act * s).to(as_ptr.dtype.element_ty),
             mask=mask)
    tl.store(part_ptr + rows.to(tl.int64) * stride_pn + pid_n, tl.sum(act * acc, axis=1), mask=row_ok)
    if HAS_B2:
        if pid_n == 0:
            tl.store(part_ptr + rows.to(tl.int64) * stride_pn + tl.cdiv(F, BLOCK_N), bias_dot, mask=row_ok)


@triton.jit(do_not_specialize=["S"])
def _slot_sums_kernel(part_ptr, row_of_slot_ptr, out_ptr, S, P, stride_pn,
                      BLOCK_S: tl.constexpr, BLOCK_P: tl.constexpr):
    """out[slot] = the sum of its row's P partial sums, in order (0 for a dropped slot)."""
    slots = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    slot_ok = slots < S
    rows = tl.load(row_of_slot_ptr + slots, mask=slot_ok, other=-1).to(tl.int64)
    ps = tl.arange(0, BLOCK_P)
    acc = tl.zeros((BLOCK_S,), dtype=tl.float32)
    for p in range(0, P, BLOCK_P):
        vals = tl.load(part_ptr + rows[:, None] * stride_pn + (p + ps)[None, :],
                       mask=(rows >= 0)[:, None] & (p + ps < P)[None, :], other=0.0)
        acc += tl.sum(vals, axis=1)
    tl.store(out_ptr + slots, acc.to(out_ptr.dtype.element_ty), mask=slot_ok)


def grad_block_n() -> int:
    return _INTERPRETER_GRAD_BLOCK_N if interpreting() else GRAD_BLOCK_N


def _epilogue(kernel: str):
    """The kernel's `EPILOGUES` entry; the interpreter's one config has its own tile width."""
    block_n, accumulators = EPILOGUES[kernel]
    return (None if block_n is None else grad_block_n(), accumulators)


def _grid_rows_cols(N, E, F):
    def grid(meta):
        return ((triton.cdiv(N, meta["BLOCK_M"]) + E) * triton.cdiv(F, meta["BLOCK_N"]),)
    return grid


def up_act_launch(x_XD, rows_N, counts_e, w1_eDH, b1_eH, h_NH, a_NF, spec):
    """(kernel, args, constexprs) of the launch that fills h_NH (and a_NF unless None)."""
    N, H = h_NH.shape
    E, I, _ = w1_eDH.shape
    F = activation_width(spec, H)
    act = activation_constexprs(spec, F)
    bias_arg, bias_strides = (w1_eDH, (0, 0)) if b1_eH is None else (b1_eH, b1_eH.stride())
    a_arg = h_NH if a_NF is None else a_NF      # an unread stand-in when only h is wanted
    args = (x_XD, x_XD if rows_N is None else rows_N, w1_eDH, bias_arg, h_NH, a_arg, counts_e,
            N, I, F, E, act.pop("UP_OFFSET"), act.pop("alpha"), act.pop("limit"),
            *x_XD.stride(), *w1_eDH.stride(), *bias_strides, *h_NH.stride(), *a_arg.stride())
    return _up_act_kernel, args, dict(GATHER=rows_N is not None, HAS_BIAS=b1_eH is not None,
                                      STORE_ACT=a_NF is not None, E_POW2=triton.next_power_of_2(E), **act,
                                      **_dot_args(x_XD.dtype))


def up_act(x_XD, rows_N, counts_e, w1_eDH, b1_eH, spec, store_act=True):
    """(h, act(h) or None): h[r] = x[rows_N[r]] @ w1[e] (+ b1[e]) over expert e's rows r."""
    _check_kernel_device(x_XD)
    N = x_XD.shape[0] if rows_N is None else rows_N.shape[0]
    E, _, H = w1_eDH.shape
    F = activation_width(spec, H)
    h_NH = x_XD.new_empty(N, H)
    a_NF = x_XD.new_empty(N, F) if store_act else None
    if N == 0 or H == 0:
        return h_NH, a_NF
    kernel, args, constexprs = up_act_launch(x_XD, rows_N, counts_e, w1_eDH, b1_eH, h_NH, a_NF, spec)
    tuned = _launcher(kernel, x_XD.device, x_XD.dtype, key=("I", "F", "GATHER", "KIND"),
                      epilogue=_epilogue("up_plain" if constexprs["KIND"] == KIND_PLAIN else "up_gated"))
    tuned[_grid_rows_cols(N, E, F)](*args, **constexprs)
    return h_NH, a_NF


def act_grad_launch(dy_TD, rows_N, slot_N, weight_S, counts_e, w2_eFD, b2_eD, h_NH, dh_NH, as_NF, part_NP, spec):
    """(kernel, args, constexprs) of the launch that fills dh_NH, as_NF and part_NP."""
    N, H = h_NH.shape
    E, F, D = w2_eFD.shape
    act = activation_constexprs(spec, F)
    b2_arg, b2_strides = (w2_eFD, (0, 0)) if b2_eD is None else (b2_eD, b2_eD.stride())
    args = (dy_TD, rows_N, slot_N, weight_S, w2_eFD, b2_arg, h_NH, dh_NH, as_NF, part_NP, counts_e,
            N, D, F, E, act.pop("UP_OFFSET"), act.pop("alpha"), act.pop("limit"),
            *dy_TD.stride(), *w2_eFD.stride(), *b2_strides, *h_NH.stride(), *dh_NH.stride(), *as_NF.stride(),
            part_NP.stride(0))
    return _act_grad_kernel, args, dict(HAS_B2=b2_eD is not None, E_POW2=triton.next_power_of_2(E), **act,
                                        **_dot_args(dy_TD.dtype))


def act_grad(dy_TD, rows_N, slot_N, weight_S, counts_e, w2_eFD, b2_eD, h_NH, spec):
    """(dh, s * act(h), partial sums of the routing weight's gradient [N, P] in fp32)."""
    _check_kernel_device(dy_TD)
    N, H = h_NH.shape
    E, F, _ = w2_eFD.shape
    block_n = grad_block_n()
    dh_NH = torch.empty_like(h_NH)
    as_NF = h_NH.new_empty(N, F)
    part_NP = h_NH.new_empty(N, triton.cdiv(F, block_n) + (b2_eD is not None), dtype=torch.float32)
    if N == 0:
        return dh_NH, as_NF, part_NP
    kernel, args, constexprs = act_grad_launch(dy_TD, rows_N, slot_N, weight_S, counts_e, w2_eFD, b2_eD, h_NH, dh_NH,
                                               as_NF, part_NP, spec)
    tuned = _launcher(kernel, dy_TD.device, dy_TD.dtype, key=("D", "F", "KIND"), epilogue=_epilogue("act_grad"))
    tuned[_grid_rows_cols(N, E, F)](*args, **constexprs)
    return dh_NH, as_NF, part_NP


def slot_sums_launch(part_NP, row_of_slot_S, out_S):
    S, P = out_S.shape[0], part_NP.shape[1]
    return _slot_sums_kernel, (part_NP, row_of_slot_S, out_S, S, P, part_NP.stride(0)), \
        dict(BLOCK_S=128, BLOCK_P=min(triton.next_power_of_2(max(P, 1)), 16))


def slot_sums(part_NP, row_of_slot_TK, dtype):
    """[T, K]: each slot's row's partial sums added up, in `dtype` (0 for a dropped slot)."""
    out_TK = part_NP.new_empty(row_of_slot_TK.shape, dtype=dtype)
    if out_TK.numel() == 0:
        return out_TK
    kernel, args, constexprs = slot_sums_launch(part_NP, row_of_slot_TK.contiguous().view(-1), out_TK.view(-1))
    kernel[(triton.cdiv(out_TK.numel(), constexprs["BLOCK_S"]),)](*args, **constexprs)
    return out_TK


def routed_mlp_forward(x_TD, token_N, slot_N, row_of_slot_TK, counts_e, weight_TK, spec, w1_eDH, w2_eFD,
                       b1_eH, b2_eD):
    """(y_TD, h_NH): y[t] = sum_k weight[t, k] * mlp_e(x[t]) over token t's kept slots; h saved."""
    h_NH, a_NF = up_act(x_TD, token_N, counts_e, w1_eDH, b1_eH, spec)
    y_ND = grouped_mm_rows(a_NF, w2_eFD, counts_e, None, b2_eD, fill_tail=False)
    del a_NF
    return gather_sum(y_ND, row_of_slot_TK, weight_TK), h_NH


def routed_mlp_backward(dy_TD, x_TD, token_N, slot_N, row_of_slot_TK, counts_e, weight_TK, spec,
                        w1_eDH, w2_eFD, b1_eH, b2_eD, h_NH):
    """(dx, d weight_TK, dw1, dw2, db1 or None, db2 or None); h recomputed (first GEMM only) when None."""
    if h_NH is None:
        h_NH = up_act(x_TD, token_N, counts_e, w1_eDH, b1_eH, spec, store_act=False)[0]
    weight_S = weight_TK.contiguous().view(-1)
    dh_NH, as_NF, part_NP = act_grad(dy_TD, token_N, slot_N, weight_S, counts_e, w2_eFD, b2_eD, h_NH, spec)
    dweight_TK = slot_sums(part_NP, row_of_slot_TK, weight_TK.dtype)
    del part_NP
    dw2 = grouped_mm_weight_grad(as_NF, dy_TD, counts_e, None, dy_rows_N=token_N)
    del as_NF
    dw1 = grouped_mm_weight_grad(x_TD, dh_NH, counts_e, token_N)
    db1 = db2 = None
    if b1_eH is not None:
        db1 = expert_row_sums(dh_NH, counts_e, b1_eH.dtype)
        db2 = expert_row_sums(dy_TD, counts_e, b2_eD.dtype, rows_N=token_N, slot_N=slot_N, weight_S=weight_S)
    dx_ND = grouped_mm_rows(dh_NH, w1_eDH.transpose(1, 2), counts_e, None, None, fill_tail=False)
    del dh_NH
    return gather_sum(dx_ND, row_of_slot_TK, None), dweight_TK, dw1, dw2, db1, db2
