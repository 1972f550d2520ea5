"""Experts: stacked per-expert weights run as grouped GEMMs, or one user module per expert."""
import functools
import inspect
import math
from typing import Callable, Dict, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from fmoe import kernels
from fmoe.kernels import deferred, torch_ops
from fmoe.kernels.fp8 import check_fp8
from fmoe.layer_checks import check_fits

ACTIVATIONS = ("gelu", "relu", "swiglu")
# What the experts keep for backward: the pre-activation ("activation", the default), nothing
# but their input ("experts": the first GEMM is redone), or every intermediate ("none").
RECOMPUTE = ("activation", "experts", "none")


def check_recompute(recompute) -> str:
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    return recompute


class GatedActivation(nn.Module):
    """A gated activation: the first projection yields a gate and an up part (width 2F) and
    `fn(gate, up)` maps them to width F. The columns hold the gate half first, or, with
    `interleaved`, alternate gate, up, gate, up (gpt-oss's layout)."""

    def __init__(self, fn: Optional[Callable] = None, interleaved: bool = False):
        super().__init__()
        if fn is not None and not callable(fn):
            raise ValueError(f"GatedActivation: fn must be a callable fn(gate, up), got {fn!r}")
        self.fn = fn
        self.interleaved = bool(interleaved)

    def split(self, h_N2F):
        if self.interleaved:
            return h_N2F[..., 0::2], h_N2F[..., 1::2]
        return h_N2F.chunk(2, dim=-1)

    def combine(self, gate, up):
        if self.fn is None:
            raise NotImplementedError("GatedActivation needs fn, or a subclass defining combine(gate, up)")
        return self.fn(gate, up)

    def forward(self, h_N2F):
        return self.combine(*self.split(h_N2F))

    @property
    def layout(self) -> str:
        return "interleaved" if self.interleaved else "split"

    def fused_spec(self) -> Optional[str]:
        """The name the CPU's fused expert MLP knows this activation by, or None (an arbitrary fn)."""
        return None


class GLU(GatedActivation):
    """act(gate) * up: SwiGLU with SiLU, GeGLU with GELU, or any F -> F activation."""

    def __init__(self, act: Callable, interleaved: bool = False):
        if not callable(act):
            raise ValueError(f"GLU: act must be a callable activation, got {act!r}")
        super().__init__(interleaved=interleaved)
        self.act = act

    def combine(self, gate, up):
        return self.act(gate) * up

    def fused_spec(self) -> Optional[str]:
        name = glu_act_name(self.act)
        return None if name is None else f"glu:{name}:{self.layout}"


class ClampedSwiGLU(GatedActivation):
    """gpt-oss's activation: gate clamped above at `limit`, up to [-limit, limit], then
    (up + 1) * gate * sigmoid(alpha * gate); gate and up interleaved by default."""

    def __init__(self, alpha: float = 1.702, limit: float = 7.0, interleaved: bool = True):
        if not limit > 0:
            raise ValueError(f"ClampedSwiGLU: limit must be > 0, got {limit!r}")
        super().__init__(interleaved=interleaved)
        self.alpha, self.limit = float(alpha), float(limit)

    def combine(self, gate, up):
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def fused_spec(self) -> str:
        return f"clamped_swiglu:{self.alpha!r}:{self.limit!r}:{self.layout}"

    def extra_repr(self):
        return f"alpha={self.alpha}, limit={self.limit}, interleaved={self.interleaved}"


def glu_act_name(act) -> Optional[str]:
    """torch's (and transformers') SiLU / GELU / ReLU under the names of torch_ops.GLU_ACTS, else None."""
    if act is F.silu or isinstance(act, nn.SiLU):
        return "silu"
    if act is F.relu or isinstance(act, nn.ReLU):
        return "relu"
    if act is F.gelu:
        return "gelu"
    if isinstance(act, nn.GELU):
        return "gelu_tanh" if act.approximate == "tanh" else "gelu"
    # transformers' activation classes (ACT2FN), matched by name so transformers stays optional;
    # their pure-Python variants round differently, so only the ones calling torch's op are taken.
    name = type(act).__name__
    inner = getattr(act, "act", None)
    if name == "SiLUActivation":
        return "silu"
    if name == "GELUActivation" and inner is F.gelu:
        return "gelu"
    if name in ("GELUTanh", "PytorchGELUTanh") and isinstance(inner, functools.partial) \
            and inner.func is F.gelu and inner.keywords == {"approximate": "tanh"} and not inner.args:
        return "gelu_tanh"
    return None


def fused_activation_spec(activation) -> Optional[str]:
    """The spec string `fmoe.kernels.fused_expert_mlp` takes for a resolved activation, or None."""
    if isinstance(activation, str):
        return activation
    if isinstance(activation, GatedActivation):
        return activation.fused_spec()
    return None


def is_gated(activation) -> bool:
    """Whether the experts' first projection is twice as wide (gate and up)."""
    return activation == "swiglu" or isinstance(activation, GatedActivation)


def resolve_activation(activation) -> Union[str, Callable]:
    """A name from ACTIVATIONS, a GatedActivation (its input is gate and up, width 2F), or
    FastMoE's style: an activation module such as nn.GELU() or any callable mapping F to F."""
    if isinstance(activation, GatedActivation):
        return activation
    if isinstance(activation, str):
        if activation.lower() not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS} or a callable, got {activation!r}")
        return activation.lower()
    if isinstance(activation, type) and issubclass(activation, nn.Module):
        activation = activation()
    if activation is F.gelu:
        return "gelu"
    if activation is F.relu:
        return "relu"
    if isinstance(activation, nn.GELU) and activation.approximate == "none":
        return "gelu"
    if isinstance(activation, nn.ReLU):
        return "relu"
    if callable(activation):
        return activation
    raise ValueError(f"activation must be one of {ACTIVATIONS} or a callable, got {activation!r}")


def _uniform_(tensor: torch.Tensor, fan_in: int):
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    nn.init.uniform_(tensor, -bound, bound)


class FMoELinear(nn.Module):
    """FastMoE's per-expert linear layer: `weight` is [num_expert, out_feat, in_feat]."""

    def __init__(self, num_expert: int, in_feat: int, out_feat: int, bias: bool = True, rank: int = 0):
        super().__init__()
        self.num_expert, self.in_feat, self.out_feat, self.rank = num_expert, in_feat, out_feat, rank
        tensors = [("weight", (num_expert, out_feat, in_feat), 1)]
        if bias:
            tensors.append(("bias", (num_expert, out_feat), 1))
        check_fits(f"FMoELinear(num_expert={num_expert}, in_feat={in_feat}, out_feat={out_feat})", "its weights need",
                   tensors)
        self.weight = nn.Parameter(torch.empty(num_expert, out_feat, in_feat))
        self.bias = nn.Parameter(torch.empty(num_expert, out_feat)) if bias else None
        _uniform_(self.weight, in_feat)
        if self.bias is not None:
            _uniform_(self.bias, in_feat)

    def forward(self, inp_NI, fwd_expert_count_e):
        return kernels.grouped_mm(inp_NI, self.weight.transpose(1, 2), fwd_expert_count_e, self.bias)

    def extra_repr(self):
        return f"num_expert={self.num_expert}, in_features={self.in_feat}, out_features={self.out_feat}, bias={self.bias is not None}"


def expert_shapes(num_expert: int, d_model: int, d_hidden: int, gated: bool, bias: bool) -> Dict[str, Tuple[int, ...]]:
    """GroupedExperts' parameters by name, their shapes: what it allocates, known before it does."""
    width1 = 2 * d_hidden if gated else d_hidden
    shapes = {"w1_eDF": (num_expert, d_model, width1), "w2_eFD": (num_expert, d_hidden, d_model)}
    if bias:
        shapes.update(b1_eF=(num_expert, width1), b2_eD=(num_expert, d_model))
    return shapes


class GroupedExperts(nn.Module):
    """`num_expert` two-layer MLPs with stacked weights: w1_eDF, w2_eFD (+ b1_eF, b2_eD).

    For a gated activation ("swiglu" or a GatedActivation), `w1_eDF` holds the gate and the up
    projection side by side ([e, D, 2F]: gate first, or interleaved as the activation says), so
    both run in one grouped GEMM.

    `fp8` ("blockwise", "rowwise" or "mxfp8"; None, the default, is off) runs both GEMMs, forward
    and backward, with FP8 operands (`fmoe.kernels.fp8_grouped_mm`); the weights stay in their dtype,
    the biases and the activation run in the input's. The lean fused path is not taken then.
    """

    def __init__(self, num_expert: int, d_model: int, d_hidden: int, activation="gelu", bias: bool = True,
                 backend=None, recompute: str = "activation", fp8: Optional[str] = None):
        super().__init__()
        self.backend = backend
        self.recompute = check_recompute(recompute)
        self.fp8 = check_fp8(fp8)
        for name, value in (("num_expert", num_expert), ("d_model", d_model), ("d_hidden", d_hidden)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.num_expert, self.d_model, self.d_hidden = num_expert, d_model, d_hidden
        self.activation = resolve_activation(activation)
        shapes = expert_shapes(num_expert, d_model, d_hidden, is_gated(self.activation), bias)
        check_fits(f"{type(self).__name__}(num_expert={num_expert}, d_model={d_model}, d_hidden={d_hidden})",
                   "the experts' weights need", [(name, shape, 1) for name, shape in shapes.items()])
        self.w1_eDF = nn.Parameter(torch.empty(shapes["w1_eDF"]))
        self.w2_eFD = nn.Parameter(torch.empty(shapes["w2_eFD"]))
        self.b1_eF = nn.Parameter(torch.empty(shapes["b1_eF"])) if bias else None
        self.b2_eD = nn.Parameter(torch.empty(shapes["b2_eD"])) if bias else None
        self.reset_parameters()

    def reset_parameters(self):
        _uniform_(self.w1_eDF, self.d_model)
        _uniform_(self.w2_eFD, self.d_hidden)
        if self.b1_eF is not None:
            _uniform_(self.b1_eF, self.d_model)
            _uniform_(self.b2_eD, self.d_hidden)

    def act(self, h_NF):
        if self.activation == "gelu":
            return F.gelu(h_NF)
        if self.activation == "relu":
            return F.relu(h_NF)
        if self.activation == "swiglu":
            gate, up = h_NF.chunk(2, dim=-1)
            return F.silu(gate) * up
        return self.activation(h_NF)

    def forward(self, x_ND, counts_e, weight_N=None, rows_N=None, row_of_slot_TK=None, *, lean: bool = False,
                plan=None, weight_TK=None):
        """The experts on rows in expert order; with `lean=True` the lean MLP (`weighted`), and given
        a one-rank `plan` and its `weight_TK`, the lean MLP and the combine (`routed`): tokens in,
        tokens out. Called through the module either way, so hooks on it (FSDP2's unshard) run."""
        if plan is not None:
            return self.routed(x_ND, plan, weight_TK)
        if lean:
            return self.weighted(x_ND, counts_e, weight_N, rows_N, row_of_slot_TK)
        if rows_N is not None and self.fp8 is not None:     # tokens in, rows out: the gather fused in the quantiser
            return self.run_fp8(x_ND, counts_e, self.w1_eDF, self.w2_eFD, self.b1_eF, self.b2_eD, rows_N, row_of_slot_TK)
        return self.run(x_ND, counts_e, self.w1_eDF, self.w2_eFD, self.b1_eF, self.b2_eD)

    @property
    def lean(self) -> bool:
        """Whether `weighted` runs the lean MLP: recompute is not "none", the activation has a
        spec the kernels know (an arbitrary callable keeps what autograd keeps for it), no fp8."""
        return (self.recompute != "none" and self.fp8 is None
                and torch_ops.fused_activation_ok(fused_activation_spec(self.activation)))

    def weighted(self, x_XD, counts_e, weight_N=None, rows_N=None, row_of_slot_TK=None):
        """weight_N[r] * expert_e(x[rows_N[r]]) for expert e's rows r, through the lean MLP
        (`fmoe.kernels.weighted_mlp`); needs `self.lean`. Under a deferral made for these weights
        (`fmoe.kernels.deferred`: the exchange's backward first) the weights are its aliases."""
        w1_eDF, w2_eFD = self.w1_eDF, self.w2_eFD
        deferral = deferred.current()
        if deferral is not None and deferral.weights_of(self):
            w1_eDF, w2_eFD = deferral.aliases
        return kernels.weighted_mlp(x_XD, counts_e, fused_activation_spec(self.activation), w1_eDF,
                                    w2_eFD, self.b1_eF, self.b2_eD, rows_N=rows_N,
                                    row_of_slot_TK=row_of_slot_TK, weight_N=weight_N,
                                    keep_hidden=self.recompute == "activation", backend=self.backend)

    def routed(self, x_TD, plan, weight_TK):
        """sum over token t's slots of weight_TK[t, k] * expert(x[t]) (`fmoe.kernels.routed_mlp`); needs `self.lean`."""
        return kernels.routed_mlp(x_TD, plan, weight_TK, fused_activation_spec(self.activation), self.w1_eDF,
                                  self.w2_eFD, self.b1_eF, self.b2_eD, keep_hidden=self.recompute == "activation",
                                  backend=self.backend)

    def run(self, x_ND, counts_e, w1_eDF, w2_eFD, b1_eF=None, b2_eD=None):
        """The experts' MLP with the given stacked weights (shadowing passes pulled ones)."""
        if self.fp8 is not None:
            return self.run_fp8(x_ND, counts_e, w1_eDF, w2_eFD, b1_eF, b2_eD)
        spec = fused_activation_spec(self.activation)
        if kernels.fused_expert_mlp_applies(x_ND, spec, self.backend):
            return kernels.fused_expert_mlp(x_ND, counts_e, spec, w1_eDF, w2_eFD, b1_eF, b2_eD)
        h_NF = kernels.grouped_mm(x_ND, w1_eDF, counts_e, b1_eF, self.backend)
        return kernels.grouped_mm(self.act(h_NF), w2_eFD, counts_e, b2_eD, self.backend)

    def run_fp8(self, x_ND, counts_e, w1_eDF, w2_eFD, b1_eF=None, b2_eD=None, rows_N=None, row_of_slot_TK=None):
        """The MLP as two FP8 grouped GEMMs keeping what `recompute` says: x and the pre-activation
        ("activation": the activation is recomputed inside the second GEMM's backward), x alone
        ("experts": the whole MLP is recomputed, both GEMMs), or what autograd keeps ("none"). Given
        `rows_N` (and `row_of_slot_TK`), x is tokens and the first GEMM reads its rows `rows_N` as it
        quantises them (`fmoe.kernels.fp8_gather_grouped_mm`): the permuted rows never exist."""
        def mlp(x):
            if rows_N is None:
                h = kernels.fp8_grouped_mm(x, w1_eDF, counts_e, self.fp8, b1_eF, backend=self.backend)
            else:
                h = kernels.fp8_gather_grouped_mm(x, rows_N, w1_eDF, counts_e, row_of_slot_TK, self.fp8, b1_eF,
                                                  backend=self.backend)
            if self.recompute == "none":
                return kernels.fp8_grouped_mm(self.act(h), w2_eFD, counts_e, self.fp8, b2_eD, backend=self.backend)
            # A fused spec runs inside the quantiser on Triton (act(h) never stored), else the callable.
            spec = fused_activation_spec(self.activation)
            activation = spec if torch_ops.fused_activation_ok(spec) else self.act
            return kernels.fp8_grouped_mm(h, w2_eFD, counts_e, self.fp8, b2_eD, activation=activation,
                                          backend=self.backend)
        if self.recompute == "experts" and torch.is_grad_enabled():
            return checkpoint(mlp, x_ND, use_reentrant=False)
        return mlp(x_ND)

    def expert_forward(self, e: int, x_TD):
        """Expert `e` alone on a batch of tokens: the per-token reference uses this."""
        # Under torch.autocast the products come in its dtype; so do the sums, as nn.Linear's.
        h = x_TD @ self.w1_eDF[e]
        if self.b1_eF is not None:
            h = h + self.b1_eF[e].to(h.dtype)
        y = self.act(h) @ self.w2_eFD[e]
        return y + self.b2_eD[e].to(y.dtype) if self.b2_eD is not None else y

    def extra_repr(self):
        act = self.activation if isinstance(self.activation, str) else repr(self.activation)
        fp8 = "" if self.fp8 is None else f", fp8={self.fp8}"
        return f"num_expert={self.num_expert}, d_model={self.d_model}, d_hidden={self.d_hidden}, activation={act}{fp8}"


def takes_expert_count(module: nn.Module) -> bool:
    """Whether `module.forward` accepts a second positional argument (FastMoE's `fwd_expert_count`)."""
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params)


class ModuleListExperts(nn.ModuleList):
    """User experts, one module per expert (FastMoE's `expert=` class or list of classes).

    A ModuleList, as in FastMoE: `experts[i]`, iteration and the state-dict keys
    `experts.<i>.<param>` are FastMoE's. An expert whose forward takes a second argument gets
    FastMoE's `fwd_expert_count` (a one-element tensor with its row count).
    """

    def __init__(self, expert, num_expert: int, d_model: int):
        classes = list(expert) if isinstance(expert, (list, tuple)) else [expert] * num_expert
        if len(classes) != num_expert:
            raise ValueError(f"expert: a list of expert classes needs num_expert={num_expert} entries, got {len(classes)}")
        super().__init__([cls(d_model) for cls in classes])
        self.num_expert = num_expert
        self.with_count = [takes_expert_count(m) for m in self]

    def forward(self, x_ND, counts_e):
        # The split sizes are read on the host: under torch.compile this is a graph break.
        counts = counts_e.tolist()
        chunks = torch.split(x_ND, counts + [x_ND.shape[0] - sum(counts)])   # last: rows of dropped slots
        outs = [self.expert_forward(e, chunk) if chunk.shape[0] else chunk for e, chunk in enumerate(chunks[:-1])]
        # The experts' width and dtype (under torch.autocast, not the input's) for the dropped rows.
        like = next((y for y in outs if y.shape[0]), x_ND)
        # Empty chunks stay in: with no rows at all the output must still reach x_ND in the backward
        # (the exchange's backward on this rank is a collective the others wait in).
        outs = [y if y.shape[0] else y.to(like.dtype) for y in outs]
        return torch.cat(outs + [like.new_zeros(chunks[-1].shape[0], like.shape[-1])], dim=0)

    def expert_forward(self, e: int, x_TD):
        if self.with_count[e]:
            return self[e](x_TD, torch.tensor([x_TD.shape[0]]))
        return self[e](x_TD)
