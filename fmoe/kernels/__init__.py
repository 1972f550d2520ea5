"""The kernel seam: `permute`, `unpermute`, `grouped_mm` (and the fused `gather_grouped_mm`), torch or Triton.

Triton is chosen for CUDA tensors on GPUs of compute capability 8.0 or later (A100, H100, ...)
when it imports, torch elsewhere: before Ampere, Triton's tl.dot has no tensor-core path, so
its GEMMs would run on the CUDA cores while cuBLAS (the torch path) uses the tensor cores.
`backend=` or the environment variable `FMOE_BACKEND=torch|triton` force one. Every op is an `fmoe::` custom op
(`fmoe.kernels.ops`), so `torch.compile` traces through it. The torch backend runs *sync-free*
(counts never read on the host) under torch.compile, on CUDA tensors, with FMOE_SYNC_FREE=1 or
inside `forced_sync_free()` (a layer built with `sync_free=True`);
otherwise, on the CPU in eager mode, it loops over host counts where that is faster.
Under torch.autocast the GEMMs run as nn.Linear's do there (`like_linear_under_autocast`).

One hop from here to the work: each function checks its arguments (`fmoe.kernels.checks`, the
one place for both backends), then calls its `fmoe::` op with the `impl` this tensor gets; the op
runs its torch or Triton body.
"""
import contextlib
import functools
import os
import threading
from typing import Optional, Tuple

import torch

from fmoe.autocast import autocast_dtype
from fmoe.env import env_choice
from fmoe.kernels import checks, fp8, ops, torch_ops
from fmoe.routing import RoutingPlan

BACKENDS = ("torch", "triton")


def triton_import_error() -> Optional[str]:
    """Why fmoe.kernels.triton_ops does not import, or None when it does."""
    try:
        from fmoe.kernels import triton_ops  # noqa: F401
    except ImportError as err:
        return str(err)
    return None


def triton_available() -> bool:
    return triton_import_error() is None


def check_backend(backend: Optional[str]) -> Optional[str]:
    """The backend asked for (the argument, else FMOE_BACKEND), or None to choose by device."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    return backend or env_choice("FMOE_BACKEND", BACKENDS)


# The first compute capability where Triton's tl.dot runs on tensor cores (mma.sync; wgmma on 9.0).
TRITON_MIN_CAPABILITY = (8, 0)


def cuda_capability(device: torch.device) -> Tuple[int, int]:
    """(major, minor) compute capability of a CUDA device."""
    return torch.cuda.get_device_capability(device)


def gpu_backend(capability: Tuple[int, int]) -> Tuple[str, str]:
    """(backend, why) that CUDA tensors on a GPU of this compute capability get by default."""
    sm = "sm_{}{}".format(*capability)
    if capability < TRITON_MIN_CAPABILITY:
        return "torch", (f"{sm} is before sm_80: Triton's GEMMs would run on the CUDA cores there, "
                         "cuBLAS reaches the tensor cores")
    if not triton_available():
        return "torch", f"{sm}: fmoe.kernels.triton_ops does not import"
    return "triton", f"{sm} is sm_80 or later: Triton's GEMMs use the tensor cores"


def backend_for_device(device: Optional[torch.device], backend: Optional[str] = None) -> str:
    """The backend for tensors on `device` (None: not a CUDA device), `backend` or FMOE_BACKEND first."""
    choice = check_backend(backend)
    if choice is not None:
        if choice == "triton" and not triton_available():
            raise ValueError("backend='triton' was asked for but fmoe.kernels.triton_ops cannot be imported")
        return choice
    return "torch" if device is None else gpu_backend(cuda_capability(device))[0]


def resolve_backend(tensor: torch.Tensor, backend: Optional[str] = None) -> str:
    return backend_for_device(tensor.device if tensor.is_cuda else None, backend)


def backend_report() -> dict:
    """Which backends import and which one each visible GPU's and CPU tensors get now, and why
    (`fmoe info` prints it)."""
    report = {
        "importable": {"torch": True, "triton": triton_available()},
        "triton_import_error": triton_import_error(),
        "torch_grouped_mm": hasattr(torch, "_grouped_mm"),
        "cuda_available": torch.cuda.is_available(),
        "FMOE_BACKEND": os.environ.get("FMOE_BACKEND"),
        "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes"),
        "cuda_rule": "triton on sm_80 and later, torch (cuBLAS) before",
        "triton_tma": _tma_state(),
    }
    devices = [(f"cuda:{i}_tensors", torch.device("cuda", i)) for i in range(torch.cuda.device_count())]
    for key, device in devices + [("cpu_tensors", None)]:
        try:
            report[key] = _explained_choice(device)
        except ValueError as err:
            report[key] = f"error: {err}"
    return report


def _tma_state() -> str:
    """Whether the Hopper grouped GEMM (tensor descriptors, persistent tiles) is on."""
    from fmoe.kernels.triton_grouped_mm_tma import tma_setting
    try:
        setting = tma_setting()
    except ValueError as err:
        return f"error: {err}"
    if setting is None:
        return "default: on for bf16/fp16 on sm_90 and later (FMOE_TRITON_TMA=0 turns it off)"
    if setting:
        return "on (FMOE_TRITON_TMA=1): the row-reading GEMMs on sm_90 and later, and in the interpreter"
    return "off (FMOE_TRITON_TMA=0)"


def _explained_choice(device: Optional[torch.device]) -> str:
    chosen = backend_for_device(device)
    if check_backend(None) is not None:
        return f"{chosen} (FMOE_BACKEND)"
    return f"{chosen} ({'not CUDA' if device is None else gpu_backend(cuda_capability(device))[1]})"


_forced = threading.local()    # per thread: interleaved micro-batches (fmoe.distributed.interleave)


@contextlib.contextmanager
def forced_sync_free(forced: bool = True):
    """The ops called inside keep their counts on the device (their backward too: each op keeps
    the choice it was called with); `forced=False`: as outside, inside another such block."""
    before, _forced.on = getattr(_forced, "on", False), forced
    try:
        yield
    finally:
        _forced.on = before


def sync_free(tensor: torch.Tensor) -> bool:
    """Whether the torch backend must keep counts on the device for this tensor."""
    if torch.compiler.is_compiling() or tensor.is_cuda or getattr(_forced, "on", False):
        return True
    return os.environ.get("FMOE_SYNC_FREE", "0").lower() in ("1", "true", "on", "yes")


def impl_for(tensor: torch.Tensor, backend: Optional[str] = None) -> str:
    """The `impl` the `fmoe::` ops take for this tensor and backend."""
    if resolve_backend(tensor, backend) == "triton":
        return "triton"
    return "torch_sync_free" if sync_free(tensor) else "torch"


def _family(impl: str) -> str:
    return "triton" if impl == "triton" else "torch"


def like_linear_under_autocast(gemm):
    """Under torch.autocast, `gemm(x, ...)` runs as nn.Linear does there: x and the other floating
    operands cast to the autocast dtype (their gradients flow back in their own dtypes), the
    product in that dtype, autocast off inside (the ops' bodies must not cast again)."""
    @functools.wraps(gemm)
    def run(x, *args, **kwargs):
        dtype = autocast_dtype(x)
        if dtype is None:
            return gemm(x, *args, **kwargs)

        def cast(a):
            return a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
        with torch.autocast(x.device.type, enabled=False):
            return gemm(cast(x), *map(cast, args), **{k: cast(v) for k, v in kwargs.items()})
    return run


def permute(x_TD: torch.Tensor, plan: RoutingPlan, backend: Optional[str] = None) -> torch.Tensor:
    """Rows of `x_TD` in expert order: row n is token `plan.token_N[n]`."""
    impl = impl_for(x_TD, backend)
    checks.check_float("x_TD", x_TD, 2, _family(impl))
    checks.check_plan(plan, x_TD.shape[0], x_TD.device)
    return ops.permute(x_TD, plan.token_N, plan.row_of_slot_TK, impl)


def unpermute(y_ND: torch.Tensor, plan: RoutingPlan, weight_TK: torch.Tensor,
              backend: Optional[str] = None) -> torch.Tensor:
    """out[t] = sum over k of weight[t, k] * y[row of slot (t, k)], dropped slots adding 0."""
    impl = impl_for(y_ND, backend)
    checks.check_rows("y_ND", y_ND, plan, _family(impl))
    checks.check_routing_weight(weight_TK, plan, y_ND.device, _family(impl))
    return ops.unpermute(y_ND, weight_TK, plan.token_N, plan.slot_N, plan.row_of_slot_TK, impl)


@like_linear_under_autocast
def grouped_mm(x_NI: torch.Tensor, w_eIO: torch.Tensor, counts_e: torch.Tensor,
               bias_eO: Optional[torch.Tensor] = None, backend: Optional[str] = None) -> torch.Tensor:
    """Rows sorted by expert, `counts_e[e]` of them for expert e: y = x_seg @ w_eIO[e] + bias_eO[e].

    Rows past the last segment (sum(counts_e) to the end: the rows of dropped slots) are zero.
    """
    impl = impl_for(x_NI, backend)
    checks.check_weights("x_NI", x_NI, w_eIO, counts_e, bias_eO, _family(impl))
    return ops.grouped_mm(x_NI, w_eIO, counts_e, bias_eO, impl)


def fp8_grouped_mm(x_NI: torch.Tensor, w_eIO: torch.Tensor, counts_e: torch.Tensor, recipe: str,
                   bias_eO: Optional[torch.Tensor] = None, activation=None,
                   backend: Optional[str] = None) -> torch.Tensor:
    """grouped_mm with FP8 operands: y = q(a_seg) @ q(w_eIO[e]) + bias_eO[e], a = x or `activation(x)`,
    accumulated in fp32, in x's dtype (under torch.autocast, its dtype, as grouped_mm).

    `recipe` is "blockwise", "rowwise" or "mxfp8" (`fmoe.kernels.fp8`: how each GEMM of the forward
    and backward quantises its operands). On Triton (CUDA tensors, or `backend="triton"` under the
    interpreter) the forward and input-gradient products run the FP8 kernel (`fmoe.kernels.triton_fp8`),
    which needs FP8 tensor cores (sm_89 or later: an older GPU is refused in one line; FMOE_BACKEND=torch
    emulates there); the weight gradient, and everything on the torch backend, is emulated (dequantise,
    fp32 GEMMs expert by expert). The counts are read on the host. The weights are quantised once a step
    (`fmoe.kernels.fp8_weights`); under torch.autocast from their cast to its dtype, as nn.Linear casts them.
    """
    with _fp8_under_autocast(x_NI, bias_eO) as (x_NI, bias_eO, weight_dtype):
        return _fp8_grouped_mm(x_NI, w_eIO, counts_e, recipe, bias_eO, activation, backend, weight_dtype)


@contextlib.contextmanager
def _fp8_under_autocast(x, bias):
    """(x, bias, weight_dtype) for an FP8 GEMM: under torch.autocast x and the bias cast as nn.Linear's and
    autocast off inside, the weight's cast left to its quantised cache (`weight_dtype`); else as they are."""
    dtype = autocast_dtype(x)
    if dtype is None:
        yield x, bias, None
        return
    with torch.autocast(x.device.type, enabled=False):
        yield x.to(dtype), None if bias is None else bias.to(dtype), dtype


def _fp8_grouped_mm(x_NI, w_eIO, counts_e, recipe, bias_eO, activation, backend, weight_dtype):
    checks.check_float("x_NI", x_NI, 2, "torch")
    if activation is None and weight_dtype is None:
        checks.check_weights("x_NI", x_NI, w_eIO, counts_e, bias_eO, "torch")
    else:       # the activation may change the width (a gated one halves it): checked once it has run
        checks.check_float("w_eIO", w_eIO, 3, "torch")
        if weight_dtype is None and w_eIO.dtype != x_NI.dtype:
            raise TypeError(f"w_eIO must have x_NI's dtype {x_NI.dtype}, got {w_eIO.dtype}")
        checks.check_index("counts_e", counts_e, (w_eIO.shape[0],), x_NI.device)
    triton = resolve_backend(x_NI, backend) == "triton"
    if triton and x_NI.is_cuda:
        check_fp8_tensor_cores(torch.cuda.get_device_capability(x_NI.device), recipe)
    return fp8.fp8_grouped_mm(x_NI, w_eIO, counts_e, recipe, bias_eO, activation, triton, weight_dtype)


def fp8_gather_grouped_mm(x_TD: torch.Tensor, token_N: torch.Tensor, w_eIO: torch.Tensor, counts_e: torch.Tensor,
                          row_of_slot_TK: torch.Tensor, recipe: str, bias_eO: Optional[torch.Tensor] = None,
                          backend: Optional[str] = None) -> torch.Tensor:
    """fp8_grouped_mm(permute(x_TD, plan), w_eIO, counts_e, recipe, bias_eO), given plan.token_N and
    plan.row_of_slot_TK: the rows are gathered as they are quantised (on Triton in one pass), so they reach
    the GEMM as FP8 and no permuted copy exists or is kept; bit-identical to permute then fp8_grouped_mm."""
    checks.check_float("x_TD", x_TD, 2, "torch")
    checks.check_index("token_N", token_N, (None,), x_TD.device)
    checks.check_index("row_of_slot_TK", row_of_slot_TK, (x_TD.shape[0], None), x_TD.device)
    if autocast_dtype(x_TD) is None:
        checks.check_weights("x_TD", x_TD, w_eIO, counts_e, bias_eO, "torch")
    else:
        checks.check_float("w_eIO", w_eIO, 3, "torch")
        checks.check_index("counts_e", counts_e, (w_eIO.shape[0],), x_TD.device)
    impl = impl_for(x_TD, backend)
    triton = resolve_backend(x_TD, backend) == "triton"
    if triton and x_TD.is_cuda:
        check_fp8_tensor_cores(torch.cuda.get_device_capability(x_TD.device), recipe)
    with _fp8_under_autocast(x_TD, bias_eO) as (x_TD, bias_eO, weight_dtype):
        return fp8.fp8_gather_grouped_mm(x_TD, token_N, w_eIO, counts_e, row_of_slot_TK, recipe, bias_eO, triton,
                                         weight_dtype, impl)


def check_fp8_tensor_cores(capability, recipe: str):
    """One line refusing FP8 GEMMs on Triton for a GPU of this (major, minor) capability without FP8 tensor cores."""
    if tuple(capability) < (8, 9):
        major, minor = capability
        raise ValueError(f"fp8={recipe!r}: this GPU (sm_{major}{minor}) has no FP8 tensor cores (sm_89 or later "
                         "has them); FMOE_BACKEND=torch runs the FP8 emulation instead")


@like_linear_under_autocast
def gather_grouped_mm(x_TD: torch.Tensor, token_N: torch.Tensor, w_eIO: torch.Tensor, counts_e: torch.Tensor,
                      row_of_slot_TK: torch.Tensor, bias_eO: Optional[torch.Tensor] = None,
                      backend: Optional[str] = None) -> torch.Tensor:
    """grouped_mm(permute(x_TD, plan), w_eIO, counts_e, bias_eO), given plan.token_N and plan.row_of_slot_TK.

    On Triton the GEMM reads x_TD's rows through token_N, so the permuted copy never exists; the
    backward sums each token's K row gradients in a fixed order, as permute's does.
    """
    impl = impl_for(x_TD, backend)
    checks.check_weights("x_TD", x_TD, w_eIO, counts_e, bias_eO, _family(impl))
    checks.check_index("token_N", token_N, (None,), x_TD.device)
    checks.check_index("row_of_slot_TK", row_of_slot_TK, (x_TD.shape[0], None), x_TD.device)
    return ops.gather_grouped_mm(x_TD, token_N, w_eIO, counts_e, row_of_slot_TK, bias_eO, impl)


def fused_expert_mlp_applies(x_ND: torch.Tensor, activation, backend: Optional[str] = None) -> bool:
    """The per-expert fused MLP pays on CPU tensors in eager mode with the torch backend and an
    activation it knows by name (`torch_ops.parse_activation`: gelu, relu, swiglu, the GLU and
    clamped-SwiGLU specs); it reads the counts on the host, so the sync-free path never takes it."""
    return (not sync_free(x_ND) and resolve_backend(x_ND, backend) == "torch"
            and torch_ops.fused_activation_ok(activation))


@like_linear_under_autocast
def fused_expert_mlp(x_ND, counts_e, activation: str, w1_eDF, w2_eFD, b1_eF=None, b2_eD=None):
    """act(x_seg @ w1[e] + b1[e]) @ w2[e] + b2[e], expert by expert (CPU, torch backend); `activation`
    is a spec string (`fmoe.experts.fused_activation_spec`)."""
    checks.check_weights("x_ND", x_ND, w1_eDF, counts_e, b1_eF, "torch", "w1_eDF", "b1_eF")
    return ops.expert_mlp(x_ND, counts_e, activation, w1_eDF, w2_eFD, b1_eF, b2_eD)


@like_linear_under_autocast
def weighted_mlp(x_XD, counts_e, activation: str, w1_eDF, w2_eFD, b1_eF=None, b2_eD=None, *,
                 rows_N=None, row_of_slot_TK=None, weight_N=None, keep_hidden: bool = True,
                 backend: Optional[str] = None) -> torch.Tensor:
    """weight_N[r] * (act(x[rows_N[r]] @ w1[e] + b1[e]) @ w2[e] + b2[e]) for expert e's rows r.

    The lean expert MLP (`fmoe.kernels.lean`): x is read through `rows_N` (its rows as they
    are when None; `row_of_slot_TK` then sums x's gradient back per token), and the backward keeps
    x, the routing and, with `keep_hidden`, the pre-activation; without it, the first GEMM is
    recomputed. `activation` is a spec string (`fmoe.experts.fused_activation_spec`).
    """
    if (rows_N is None) != (row_of_slot_TK is None):
        raise ValueError("weighted_mlp: rows_N and row_of_slot_TK go together (pass both or neither)")
    impl = impl_for(x_XD, backend)
    checks.check_weights("x_XD", x_XD, w1_eDF, counts_e, b1_eF, _family(impl), "w1_eDF", "b1_eF")
    if rows_N is not None:
        checks.check_index("rows_N", rows_N, (None,), x_XD.device)
        checks.check_index("row_of_slot_TK", row_of_slot_TK, (x_XD.shape[0], None), x_XD.device)
    return ops.weighted_mlp(x_XD, rows_N, row_of_slot_TK, counts_e, weight_N, activation, w1_eDF, w2_eFD,
                            b1_eF, b2_eD, keep_hidden, impl)[0]


def sum_rows(y_ND: torch.Tensor, plan: RoutingPlan, backend: Optional[str] = None) -> torch.Tensor:
    """out[t] = the sum of token t's rows (already weighted), dropped slots adding nothing."""
    impl = impl_for(y_ND, backend)
    checks.check_rows("y_ND", y_ND, plan, _family(impl))
    return ops.sum_rows(y_ND, plan.token_N, plan.row_of_slot_TK, impl)


@like_linear_under_autocast
def routed_mlp(x_TD: torch.Tensor, plan: RoutingPlan, weight_TK: torch.Tensor, activation: str, w1_eDF, w2_eFD,
               b1_eF=None, b2_eD=None, *, keep_hidden: bool = True, backend: Optional[str] = None) -> torch.Tensor:
    """y[t] = sum over token t's kept slots k of weight[t, k] * (act(x[t] @ w1[e] + b1[e]) @ w2[e] + b2[e]),
    e the slot's expert: the lean MLP and the combine in one op, for a plan on one rank.

    On Triton: three kernels forward (the gather inside the first GEMM's loads, the activation in
    its epilogue; the down GEMM; the weighted gather-sum), six backward (`fmoe.kernels.triton_lean`).
    The backward keeps x, the routing and, with `keep_hidden`, the pre-activation.
    """
    impl = impl_for(x_TD, backend)
    checks.check_weights("x_TD", x_TD, w1_eDF, counts_of(plan), b1_eF, _family(impl), "w1_eDF", "b1_eF")
    checks.check_plan(plan, x_TD.shape[0], x_TD.device)
    checks.check_routing_weight(weight_TK, plan, x_TD.device, _family(impl))
    return ops.routed_mlp(x_TD, plan.token_N, plan.slot_N, plan.row_of_slot_TK, plan.counts_E, weight_TK,
                          activation, w1_eDF, w2_eFD, b1_eF, b2_eD, keep_hidden, impl)[0]


def counts_of(plan: RoutingPlan) -> torch.Tensor:
    """Rows per expert of a plan on one rank (routed_mlp runs no exchange)."""
    if plan.across_ranks:
        raise ValueError("routed_mlp takes a plan on one rank; across ranks the rows travel first "
                         "(FMoE's exchange path)")
    return plan.counts_E
