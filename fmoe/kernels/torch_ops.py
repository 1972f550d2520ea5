"""Torch implementations of the data-movement and grouped-GEMM ops (the CPU path, for good).

The functions here compute; `fmoe.kernels.ops` wraps them (and the Triton ones) as custom ops
with autograd, looking them up through `fmoe.kernels.bodies`; nothing here imports the seam. Every
sum is deterministic: each output row adds its own rows in a fixed order, never an atomic or an
`index_add` of several rows onto one.

Two flavours of the grouped GEMM: the eager CPU one loops over the per-expert counts read on
the host (as fast as the grouped GEMM there, and it fuses the bias), the *sync-free* one
(`sync_free=True`: under torch.compile, on CUDA tensors, or with FMOE_SYNC_FREE=1) keeps the
counts on the device and runs `torch._grouped_mm`, falling back to the loop only where that op
does not take the shapes. Rows past the last expert's segment (the rows of dropped slots) come
out as zeros.
"""
from typing import Optional

import torch


def permute_rows(x_TD, token_N):
    return x_TD.index_select(0, token_N)


def gather_sum(y_ND, row_of_slot_TK, weight_TK=None, sync_free=False):
    """out[t] = sum_k weight[t, k] * y[row_of_slot[t, k]], skipping dropped slots (row -1)."""
    T, K = row_of_slot_TK.shape
    N, D = y_ND.shape
    acc_dtype = torch.float32 if y_ND.dtype in (torch.float16, torch.bfloat16) else y_ND.dtype
    if N == 0 or K == 0:
        return y_ND.new_zeros(T, D)
    # A dropped slot reads row 0 and adds nothing: its read is masked, so a non-finite row can
    # never leak into another token (0 * inf would be NaN). With no dropped slot (asked on the
    # host, where that is allowed) the masking pass is skipped.
    live_TK = row_of_slot_TK >= 0
    masked = sync_free or not bool(live_TK.all())
    rows_TK = row_of_slot_TK.clamp_min(0)
    scale_TK = live_TK.to(acc_dtype) if weight_TK is None else torch.where(live_TK, weight_TK.to(acc_dtype), 0)

    def picked(k):
        rows = y_ND.index_select(0, rows_TK[:, k]).to(acc_dtype)
        return rows.masked_fill_(~live_TK[:, k:k + 1], 0) if masked else rows

    out_TD = picked(0).mul_(scale_TK[:, :1])
    for k in range(1, K):
        out_TD.addcmul_(picked(k), scale_TK[:, k:k + 1])
    return out_TD.to(y_ND.dtype)


def unpermute_backward(grad_TD, y_ND, weight_TK, token_N, slot_N):
    """(grad of y_ND, grad of weight_TK) of the weighted gather-sum (dropped slots masked by the caller)."""
    grad_ND = grad_TD.contiguous().index_select(0, token_N)     # gathered once for both gradients
    weight_N = weight_TK.reshape(-1).index_select(0, slot_N).to(grad_ND.dtype)
    if grad_ND.dtype in (torch.float32, torch.float64):
        dots_N = torch.linalg.vecdot(grad_ND, y_ND.to(grad_ND.dtype))   # no N x D product in memory
    else:
        dots_N = (grad_ND.float() * y_ND.float()).sum(-1)
    grad_y = grad_ND.mul_(weight_N[:, None])                    # the gathered copy is ours to scale
    grad_w = torch.zeros(weight_TK.numel(), dtype=dots_N.dtype, device=grad_ND.device)
    grad_w.index_copy_(0, slot_N, dots_N)                       # slots are distinct: no sum
    return grad_y, grad_w.view(weight_TK.shape).to(weight_TK.dtype)


_grouped_mm_runs = {}


def grouped_mm_runs_on(device_type: str) -> bool:
    """Whether this torch has a `torch._grouped_mm` kernel for the device type, tried once: torch 2.8
    has the function but no CPU kernel (grouped GEMMs on the CPU need torch 2.9 or later)."""
    if device_type not in _grouped_mm_runs:
        try:
            x = torch.zeros(4, 4, device=device_type)
            torch._grouped_mm(x, torch.zeros(1, 4, 4, device=device_type),
                              offs=torch.tensor([4], dtype=torch.int32, device=device_type))
            _grouped_mm_runs[device_type] = True
        except (AttributeError, NotImplementedError, RuntimeError):
            _grouped_mm_runs[device_type] = False
    return _grouped_mm_runs[device_type]


def _fits_grouped_mm(*tensors) -> bool:
    """torch._grouped_mm wants fp32/bf16 on CPU (bf16 on CUDA from sm90), 16-byte aligned strides."""
    if tensors[0].is_cpu and not grouped_mm_runs_on("cpu"):
        return False
    if not hasattr(torch, "_grouped_mm"):
        return False
    for t in tensors:
        allowed = (torch.bfloat16,) if t.is_cuda else (torch.float32, torch.bfloat16)
        if t.dtype not in allowed or t.data_ptr() % 16:
            return False
        if any(s != 1 and (s * t.element_size()) % 16 for s in t.stride()):
            return False
    if tensors[0].is_cuda and torch.cuda.get_device_capability(tensors[0].device) < (9, 0):
        return False
    return True


def _offsets(counts_e):
    return torch.cumsum(counts_e, 0, dtype=torch.int32)


def expert_of_rows(counts_e, num_rows: int):
    """The expert of each row, from the device counts; E for the rows past the last segment."""
    rows_N = torch.arange(num_rows, device=counts_e.device, dtype=torch.int32)
    return torch.searchsorted(_offsets(counts_e), rows_N, right=True)


def _mm_loop(x_NI, w_eIO, counts_e, bias_eO):
    # On the CPU a loop of addmm over contiguous segments is as fast as the grouped GEMM and
    # fuses the bias, which an add over all rows afterwards would cost a full pass for.
    y_NO = x_NI.new_empty(x_NI.shape[0], w_eIO.shape[2])
    start = 0
    for e, n in enumerate(counts_e.tolist()):
        if bias_eO is None:
            torch.matmul(x_NI[start:start + n], w_eIO[e], out=y_NO[start:start + n])
        else:
            torch.addmm(bias_eO[e], x_NI[start:start + n], w_eIO[e], out=y_NO[start:start + n])
        start += n
    y_NO[start:].zero_()
    return y_NO


def grouped_mm_rows(x_XI, w_eIO, counts_e, rows_N=None, bias_eO=None, sync_free=False):
    """y[r] = x[rows_N[r]] @ w[e] (+ bias[e]) over expert e's rows r (rows_N[r] = r when None)."""
    x_NI = x_XI if rows_N is None else x_XI.index_select(0, rows_N)
    if not (sync_free and _fits_grouped_mm(x_NI, w_eIO)):
        return _mm_loop(x_NI, w_eIO, counts_e, bias_eO)
    y_NO = torch._grouped_mm(x_NI, w_eIO, offs=_offsets(counts_e))
    expert_N = expert_of_rows(counts_e, y_NO.shape[0])
    y_NO.masked_fill_((expert_N == counts_e.numel())[:, None], 0)    # rows past the segments are not written
    if bias_eO is not None:
        y_NO += torch.cat([bias_eO, bias_eO.new_zeros(1, bias_eO.shape[1])]).index_select(0, expert_N)
    return y_NO


def grouped_mm_weight_grad(x_XI, dy_NO, counts_e, rows_N=None, sync_free=False):
    """dw[e] = x[rows of e]^T @ dy[rows of e]; zero for an expert with no rows."""
    x_NI = x_XI if rows_N is None else x_XI.index_select(0, rows_N)
    if sync_free and _fits_grouped_mm(x_NI, dy_NO):
        return torch._grouped_mm(x_NI.t(), dy_NO, offs=_offsets(counts_e))
    # Every expert's slice is written (an empty segment's product is zeros), so no zero fill first.
    dw = x_NI.new_empty(counts_e.numel(), x_NI.shape[1], dy_NO.shape[1])
    start = 0
    for e, n in enumerate(counts_e.tolist()):
        torch.matmul(x_NI[start:start + n].t(), dy_NO[start:start + n], out=dw[e])
        start += n
    return dw


def expert_row_sums(dy_NO, counts_e, dtype, sync_free=False):
    """Per-expert sum of rows (the bias gradient), in `dtype`."""
    E = counts_e.numel()
    if sync_free:
        # One-hot rows times dy: a GEMM E rows high, summing each expert's rows in a fixed order.
        onehot_EN = expert_of_rows(counts_e, dy_NO.shape[0])[None, :] == torch.arange(E, device=dy_NO.device)[:, None]
        acc = torch.float32 if dy_NO.dtype in (torch.float16, torch.bfloat16) else dy_NO.dtype
        dy_masked = torch.where(onehot_EN.any(0)[:, None], dy_NO.to(acc), 0)
        return (onehot_EN.to(acc) @ dy_masked).to(dtype)
    if dy_NO.is_cuda:
        return torch.segment_reduce(dy_NO, "sum", lengths=counts_e, axis=0, unsafe=True).to(dtype)
    # segment_reduce is several times slower than plain row sums on the CPU.
    sums, start = [], 0
    for n in counts_e.tolist():
        sums.append(dy_NO[start:start + n].sum(0))
        start += n
    return torch.stack(sums).to(dtype) if sums else dy_NO.new_zeros(0, dy_NO.shape[1], dtype=dtype)


# The activations the fused MLP takes, by name (a string, so the custom op can carry it):
# "gelu", "relu", "swiglu" (SiLU of the gate half times the up half, gate first), and gated specs
# "glu:<act>:<layout>" (act one of GLU_ACTS, layout "split" or "interleaved") and
# "clamped_swiglu:<alpha>:<limit>:<layout>" (gpt-oss). fmoe.experts.fused_activation_spec names them.
GLU_ACTS = ("silu", "gelu", "gelu_tanh", "relu")


def parse_activation(spec: str):
    """(kind, act, layout, alpha, limit) of a fused activation spec; ValueError for any other string."""
    if spec in ("gelu", "relu"):
        return spec, spec, None, None, None
    if spec == "swiglu":
        return "glu", "silu", "split", None, None
    parts = spec.split(":")
    if parts[0] == "glu" and len(parts) == 3 and parts[1] in GLU_ACTS and parts[2] in ("split", "interleaved"):
        return "glu", parts[1], parts[2], None, None
    if parts[0] == "clamped_swiglu" and len(parts) == 4 and parts[3] in ("split", "interleaved"):
        return "clamped_swiglu", None, parts[3], float(parts[1]), float(parts[2])
    raise ValueError(f"not a fused MLP activation: {spec!r}")


def fused_activation_ok(spec) -> bool:
    try:
        return isinstance(spec, str) and parse_activation(spec) is not None
    except ValueError:
        return False


def _halves(h, layout):
    if layout == "interleaved":
        return h[:, 0::2], h[:, 1::2]
    F = h.shape[1] // 2
    return h[:, :F], h[:, F:]


def _plain_act(h, act):
    if act == "silu":
        return torch.nn.functional.silu(h)
    if act in ("gelu", "gelu_tanh"):
        return torch.nn.functional.gelu(h, approximate="tanh" if act == "gelu_tanh" else "none")
    return torch.relu(h)


def _plain_act_backward(grad, h, act):
    if act == "silu":
        return torch.ops.aten.silu_backward(grad, h)
    if act in ("gelu", "gelu_tanh"):
        return torch.ops.aten.gelu_backward(grad, h, approximate="tanh" if act == "gelu_tanh" else "none")
    return grad * (h > 0)


def apply_activation(h, spec):
    """The activation of one expert's hidden rows h (width F, or 2F when gated)."""
    return activation_vjp(h, spec)[0]


def activation_vjp(h, spec):
    """(activation of h, grad -> d activation / d h): the backward's recompute, sharing the
    forward's intermediates with the gradient; the same masks as torch's autograd."""
    kind, act, layout, alpha, limit = parse_activation(spec)
    if kind in ("gelu", "relu"):
        return _plain_act(h, act), lambda grad: _plain_act_backward(grad, h, act)
    gate, up = _halves(h, layout)
    if kind == "glu":
        act_gate = _plain_act(gate, act)

        def vjp(grad):
            dh = torch.empty_like(h)
            dgate, dup = _halves(dh, layout)
            dgate.copy_(_plain_act_backward(grad * up, gate, act))
            torch.mul(grad, act_gate, out=dup)
            return dh
        return act_gate * up, vjp
    gate_c, up_c = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    sig = torch.sigmoid(gate_c * alpha)
    glu = gate_c * sig

    def vjp(grad):
        dh = torch.empty_like(h)
        dgate, dup = _halves(dh, layout)
        # d(g sigmoid(alpha g))/dg = sigmoid + alpha g sigmoid (1 - sigmoid); a clamp passes where in range.
        d_glu = grad * (up_c + 1)
        dgate.copy_(torch.where(gate <= limit, d_glu * (sig + alpha * glu * (1 - sig)), 0))
        dup.copy_(torch.where((up >= -limit) & (up <= limit), grad * glu, 0))
        return dh
    return (up_c + 1) * glu, vjp


def expert_mlp_forward(x_ND, counts_e, activation, w1_eDF, w2_eFD, b1_eF, b2_eD):
    """(y, h): the experts' whole MLP one expert's segment at a time: addmm -> activation -> addmm.

    On a CPU this keeps each expert's hidden rows in cache between the two GEMMs; the backward
    recomputes the activation from the saved pre-activation h instead of saving both.
    """
    N = x_ND.shape[0]
    h_NF = x_ND.new_empty(N, w1_eDF.shape[2])
    y_ND = x_ND.new_empty(N, w2_eFD.shape[2])
    start = 0
    for e, n in enumerate(counts_e.tolist()):
        rows = slice(start, start + n)
        if b1_eF is None:
            torch.mm(x_ND[rows], w1_eDF[e], out=h_NF[rows])
            torch.mm(apply_activation(h_NF[rows], activation), w2_eFD[e], out=y_ND[rows])
        else:
            torch.addmm(b1_eF[e], x_ND[rows], w1_eDF[e], out=h_NF[rows])
            torch.addmm(b2_eD[e], apply_activation(h_NF[rows], activation), w2_eFD[e], out=y_ND[rows])
        start += n
    h_NF[start:].zero_()
    y_ND[start:].zero_()
    return y_ND, h_NF


def expert_mlp_backward(dy_ND, x_ND, counts_e, activation, w1_eDF, w2_eFD, h_NF, with_bias=True):
    """(dx, dw1, dw2, db1, db2) of expert_mlp_forward; db1 and db2 are empty without biases."""
    dy_ND = dy_ND.contiguous()
    dx_ND = torch.empty_like(x_ND)
    dw1, dw2 = torch.empty_like(w1_eDF), torch.empty_like(w2_eFD)
    if with_bias:
        db1 = h_NF.new_empty(w1_eDF.shape[0], w1_eDF.shape[2])
        db2 = dy_ND.new_empty(w2_eFD.shape[0], w2_eFD.shape[2])
    else:
        db1, db2 = h_NF.new_empty(0), dy_ND.new_empty(0)
    start = 0
    for e, n in enumerate(counts_e.tolist()):
        rows = slice(start, start + n)
        h, dy = h_NF[rows], dy_ND[rows]
        a, vjp = activation_vjp(h, activation)
        torch.mm(a.t(), dy, out=dw2[e])
        dh = vjp(dy @ w2_eFD[e].t())
        torch.mm(x_ND[rows].t(), dh, out=dw1[e])
        torch.mm(dh, w1_eDF[e].t(), out=dx_ND[rows])
        if with_bias:
            torch.sum(dh, 0, out=db1[e])
            torch.sum(dy, 0, out=db2[e])
        start += n
    dx_ND[start:].zero_()
    return dx_ND, dw1, dw2, db1, db2
