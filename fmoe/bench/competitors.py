"""The competitors `fmoe bench` runs beside fmoe: same inputs, and where they route, the same routing.

Every MoE competitor calls the workload's gate itself (so its cost is in every row) and computes
with fmoe's expert weights: the same function, which the benchmark checks on every run.

DeepSpeed's MoE layer has its own gate (TopKGate, no bias, Gumbel sampling of the second expert),
so copying fmoe's router into it would route differently. Instead its TopKGate is replaced by
`RoutingAsLogitsGate`, which turns fmoe's routing into logits (log of fmoe's weight at the chosen
experts, -1e4 elsewhere) and hands them to DeepSpeed's own gating function: DeepSpeed's softmax
then gives back fmoe's weights, its top-k picks fmoe's experts (the Gumbel noise cannot lift a
-1e4 logit), and its capacity rule, drops, dispatch, experts and combine all run unchanged.
"""
import contextlib
import inspect
import io
import os
import socket
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from fmoe.bench.flops import dense_ffn_flops, layer_flops
from fmoe.bench.workload import Workload

PER_TOKEN_TOKENS = 16       # the per-token loop runs on this many tokens: its cost is linear in them


class Unavailable(Exception):
    """A competitor that cannot run here; the message says why."""


@dataclass
class Contender:
    name: str
    fn: Callable                # x -> y, with autograd
    x: torch.Tensor             # its input, a leaf
    grad: torch.Tensor          # the gradient its backward starts from
    params: list
    flops: dict                 # forward / backward / total FLOPs it is credited with
    same_rows: Optional[int]    # its output equals fmoe's first `same_rows` rows; None: another function
    dropped: Callable[[], int] = lambda: 0


def _moe_contender(name, fn, w: Workload, tokens=None) -> Contender:
    p = w.point
    tokens = p.tokens if tokens is None else tokens
    x = w.x_TD if tokens == p.tokens else w.x_TD.detach()[:tokens].clone().requires_grad_()
    return Contender(name, fn, x, w.grad_TD[:tokens], list(w.layer.parameters()),
                     layer_flops(tokens, p.d_model, p.d_hidden, p.top_k, p.num_expert), tokens)


def build_fmoe(w: Workload) -> Contender:
    return _moe_contender("fmoe", w.layer, w)


def build_per_token(w: Workload, tokens: int = PER_TOKEN_TOKENS) -> Contender:
    """Token by token, slot by slot: each expert runs as a GEMV. Timed on the first `tokens`
    tokens (the loop's cost is linear in them), which the gate routes as in the whole batch."""
    layer = w.layer

    def per_token_loop(x_TD):
        routing = layer.gate.routing(x_TD)
        idx_TK = routing.expert_idx_TK.tolist()
        rows = []
        for t, experts in enumerate(idx_TK):
            row = 0
            for k, e in enumerate(experts):
                if e >= 0:                              # -1: a slot dropped by a capacity limit
                    y = layer.experts.expert_forward(e, x_TD[t:t + 1])
                    row = row + routing.weight_TK[t, k].to(y.dtype) * y
            rows.append(row)
        return torch.cat(rows)

    return _moe_contender("per_token", per_token_loop, w, tokens=min(tokens, w.point.tokens))


class MaskedLoopMoE(nn.Module):
    """How MoE is written in plain PyTorch: for each expert, select its tokens by mask, add back."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x_TD):
        routing = self.layer.gate.routing(x_TD)
        out = torch.zeros_like(x_TD)
        for e in range(self.layer.tot_expert):
            token, slot = torch.nonzero(routing.expert_idx_TK == e, as_tuple=True)
            y = self.layer.experts.expert_forward(e, x_TD[token])
            out = out.index_add(0, token, y * routing.weight_TK[token, slot, None].to(y.dtype))
        return out


def build_masked_loop(w: Workload) -> Contender:
    return _moe_contender("masked_loop", MaskedLoopMoE(w.layer), w)


def build_dense_ffn(w: Workload) -> Contender:
    """The ceiling: one FFN of the experts' shape over T*K rows, the FLOPs of the routed rows."""
    p = w.point
    dense = nn.Sequential(nn.Linear(p.d_model, p.d_hidden), nn.GELU(), nn.Linear(p.d_hidden, p.d_model))
    dense.to(device=w.x_TD.device, dtype=w.x_TD.dtype)
    x = w.x_TD.detach().repeat(p.top_k, 1).requires_grad_()
    return Contender("dense_ffn", dense, x, w.grad_TD.repeat(p.top_k, 1), list(dense.parameters()),
                     dense_ffn_flops(p.tokens * p.top_k, p.d_model, p.d_hidden), None)


def grouped_mm_unavailable(w: Workload) -> Optional[str]:
    x = w.x_TD
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    if x.is_cuda and (x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device) < (9, 0)):
        return "torch._grouped_mm on CUDA wants bf16 on sm90 or newer"
    if not x.is_cuda and x.dtype not in (torch.float32, torch.bfloat16):
        return f"torch._grouped_mm on CPU wants float32 or bfloat16, got {x.dtype}"
    if any(n * x.element_size() % 16 for n in (w.point.d_model, w.point.d_hidden)):
        return "torch._grouped_mm wants d_model and d_hidden rows of a multiple of 16 bytes"
    return None


def build_grouped_mm(w: Workload) -> Contender:
    """torch._grouped_mm called directly: sort rows by expert, two grouped GEMMs, weighted index_add."""
    reason = grouped_mm_unavailable(w)
    if reason:
        raise Unavailable(reason)
    layer, K, E = w.layer, w.point.top_k, w.point.num_expert
    ex = layer.experts

    def grouped(x_TD):
        routing = layer.gate.routing(x_TD)
        idx_S = routing.expert_idx_TK.reshape(-1)
        order_N = torch.argsort(idx_S, stable=True)
        offs_E = torch.cumsum(torch.bincount(idx_S, minlength=E), 0, dtype=torch.int32)
        token_N, expert_N = order_N // K, idx_S[order_N]
        h_NF = torch._grouped_mm(x_TD[token_N], ex.w1_eDF, offs=offs_E) + ex.b1_eF[expert_N]
        y_ND = torch._grouped_mm(ex.act(h_NF), ex.w2_eFD, offs=offs_E) + ex.b2_eD[expert_N]
        y_ND = y_ND * routing.weight_TK.reshape(-1)[order_N, None].to(y_ND.dtype)
        return torch.zeros_like(x_TD).index_add(0, token_N, y_ND)

    return _moe_contender("grouped_mm", grouped, w)


def deepspeed_unavailable() -> Optional[str]:
    """Why DeepSpeed's MoE layer cannot run here, or None."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")     # spares the "no GPU found" warning on import
    try:
        from deepspeed.moe.sharded_moe import TopKGate
    except Exception as err:                                # its import fails in more ways than ImportError
        return f"import deepspeed failed: {type(err).__name__}: {err}"
    if "sparse_routes" not in inspect.signature(TopKGate.forward).parameters:
        import deepspeed
        return f"deepspeed {deepspeed.__version__}: its gate has no sparse routes (0.19 or newer needed)"
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() != 1:
        return "DeepSpeed's layer is benchmarked at ep=1 and needs a 1-rank process group; this one has more"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_deepspeed_group():
    """A 1-rank gloo group in this process: DeepSpeed's MoE layer needs one even at ep=1."""
    import deepspeed

    if torch.distributed.is_initialized():
        return
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(_free_port())), ("RANK", "0"),
                       ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    with contextlib.redirect_stdout(io.StringIO()):
        deepspeed.init_distributed(dist_backend="gloo")


class RoutingAsLogitsGate(nn.Module):
    """DeepSpeed's TopKGate computing fmoe's routing (see the module's docstring)."""

    def __init__(self, fmoe_gate, ds_gate):
        super().__init__()
        self.fmoe_gate = fmoe_gate
        self.ds_gate = ds_gate
        self.num_dropped = torch.zeros((), dtype=torch.long)

    def _set_ep_group(self, ep_group):
        self.ds_gate._set_ep_group(ep_group)

    def forward(self, x_TD, used_token=None, sparse_routes=False, use_tutel=False):
        from deepspeed.moe.sharded_moe import top1gating, top2gating, topkgating

        routing = self.fmoe_gate.routing(x_TD)
        logits_TE = torch.full((x_TD.shape[0], self.fmoe_gate.tot_expert), -1e4, device=x_TD.device)
        logits_TE = logits_TE.scatter(1, routing.expert_idx_TK, routing.weight_TK.float().clamp_min(1e-30).log())
        g = self.ds_gate
        factor = g.capacity_factor if self.training else g.eval_capacity_factor
        if g.k == 1:
            out = top1gating(logits_TE, factor, g.min_capacity, used_token, None, g.drop_tokens, g.use_rts,
                             g.ep_group, sparse_routes, use_tutel)
        elif g.k == 2:
            out = top2gating(logits_TE, factor, g.min_capacity, g.drop_tokens, g.ep_group,
                             g.top2_2nd_expert_sampling, sparse_routes)
        else:
            out = topkgating(logits_TE, g.k, factor, g.min_capacity, g.drop_tokens, g.ep_group,
                             sparse_routes=sparse_routes)
        self.num_dropped = (out[3] < 0).sum()      # sparse routes: an evicted route's expert is -1
        return out


def build_deepspeed(w: Workload, drop_tokens: bool = False) -> Contender:
    """deepspeed.moe.layer.MoE at ep=1 with fmoe's routing and expert weights; `drop_tokens`
    gives it its default capacity (factor 1.0, at least 4 rows), else a capacity that drops nothing."""
    reason = deepspeed_unavailable()
    if reason:
        raise Unavailable(reason)
    from deepspeed.moe.layer import MoE

    init_deepspeed_group()
    p, ex = w.point, w.layer.experts
    expert = nn.Sequential(nn.Linear(p.d_model, p.d_hidden), nn.GELU(), nn.Linear(p.d_hidden, p.d_model))
    with contextlib.redirect_stdout(io.StringIO()):      # it prints the groups it creates
        moe = MoE(p.d_model, expert, num_experts=p.num_expert, k=p.top_k, drop_tokens=drop_tokens)
        moe.deepspeed_moe.gate = RoutingAsLogitsGate(w.layer.gate, moe.deepspeed_moe.gate)
        moe.set_deepspeed_parallelism()
    moe.to(device=w.x_TD.device, dtype=w.x_TD.dtype)
    with torch.no_grad():
        for e, mlp in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
            mlp[0].weight.copy_(ex.w1_eDF[e].t())
            mlp[0].bias.copy_(ex.b1_eF[e])
            mlp[2].weight.copy_(ex.w2_eFD[e].t())
            mlp[2].bias.copy_(ex.b2_eD[e])
    gate = moe.deepspeed_moe.gate
    c = _moe_contender("deepspeed_default" if drop_tokens else "deepspeed", lambda x: moe(x)[0], w)
    c.params = list(moe.parameters())
    c.dropped = lambda: int(gate.num_dropped)
    return c


COMPETITORS = {
    "fmoe": build_fmoe,
    "per_token": build_per_token,
    "masked_loop": build_masked_loop,
    "dense_ffn": build_dense_ffn,
    "grouped_mm": build_grouped_mm,
    "deepspeed": build_deepspeed,
    "deepspeed_default": lambda w: build_deepspeed(w, drop_tokens=True),
}
