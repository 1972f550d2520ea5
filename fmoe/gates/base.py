"""What every gate shares: the `Routing` it returns, argument checks, capacity and z-loss.

Numerics: the router projection and all routing math run in fp32, or in the input's precision
when that is higher (float64 routes in float64), and a gate's own parameters and buffers stay
at least fp32 when the model is cast to bf16 / fp16.
"""
import inspect
import math
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from fmoe.autocast import autocast_off
from fmoe.gates.balance_losses import summed_over
from fmoe.gates.capacity import drop_over_capacity, expert_capacity
from fmoe.gates.tape import recorded_choice, replayed_choice
from fmoe.last_forward import ForgetsLastForward

CapacityArg = Optional[Union[float, Tuple[float, float]]]


@dataclass
class Routing:
    """Which experts each token goes to and with what weight.

    `expert_idx_TK` holds global expert ids; a slot that reaches no expert holds -1 and weight 0.
    `num_dropped` counts all such slots (0-dim tensors, so reading them needs no sync until the
    caller asks); `num_unrouted` is the part of them a gate chose not to route at all (GShard's
    random routing of the second expert), as opposed to slots a capacity limit dropped.
    """

    expert_idx_TK: torch.Tensor
    weight_TK: torch.Tensor
    aux_loss: torch.Tensor
    num_dropped: torch.Tensor
    num_unrouted: Optional[torch.Tensor] = None

    def __post_init__(self):
        if self.num_unrouted is None:
            self.num_unrouted = torch.zeros_like(self.num_dropped)

    def with_slots(self, expert_idx_TK: Optional[torch.Tensor] = None,
                   weight_TK: Optional[torch.Tensor] = None) -> "Routing":
        """A copy with new indices or weights (`dataclasses.replace` stops Dynamo before torch 2.5)."""
        return Routing(self.expert_idx_TK if expert_idx_TK is None else expert_idx_TK,
                       self.weight_TK if weight_TK is None else weight_TK,
                       self.aux_loss, self.num_dropped, self.num_unrouted)


# Option checks shared by every gate: each names the argument and what was expected.

def check_int(name: str, value, low: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


def check_float(name: str, value, low: float = 0.0, high: float = math.inf, low_open: bool = False,
                high_open: bool = False) -> float:
    """A finite real number (not a bool) in [low, high] (ends open where asked)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        lo, hi = "(" if low_open else "[", ")" if high_open or high == math.inf else "]"
        raise ValueError(f"{name} must be a finite number in {lo}{low}, {high}{hi}, got {value!r}")
    return float(value)


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def check_choice(name: str, value, choices):
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
    return value


def check_top_k(top_k, num_expert_total: int) -> int:
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= num_expert_total:
        raise ValueError(
            f"top_k must be an int from 1 to the number of experts ({num_expert_total}), got {top_k!r}"
        )
    return top_k


def check_capacity(capacity: CapacityArg) -> Optional[Tuple[float, float]]:
    """Normalise a capacity argument to (training, evaluation) factors, or None for dropless."""
    if capacity is None:
        return None
    pair = tuple(capacity) if isinstance(capacity, Sequence) else (capacity, capacity)
    if len(pair) != 2 or not all(isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c)
                                 and c > 0 for c in pair):
        raise ValueError(
            "capacity must be a finite positive capacity factor or a (training, evaluation) pair of them, "
            f"got {capacity!r}"
        )
    return float(pair[0]), float(pair[1])


def routing_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """fp32, or the highest precision among `dtypes` when that is higher."""
    dtype = torch.float32
    for d in dtypes:
        dtype = torch.promote_types(dtype, d)
    return dtype


def z_loss(logits_TE: torch.Tensor, partition=None) -> torch.Tensor:
    """Router z-loss (ST-MoE): mean squared log-partition of the router logits (the mean over the
    tokens of all ranks of a `partition`, see `balance_losses`)."""
    logits_TE = logits_TE.to(routing_dtype(logits_TE.dtype))
    _, T = summed_over(partition, logits_TE.new_zeros(0), logits_TE.shape[0])
    if T == 0:
        return logits_TE.sum() * 0.0
    return torch.logsumexp(logits_TE, dim=-1).square().sum() / T


def keep_at_least_fp32(fn):
    """Wrap a `Module._apply` function so floating tensors it would cast below fp32 keep their
    dtype (moving device still applies): routing decisions are sensitive to rounding."""
    def apply(t):
        out = fn(t)
        if t.is_floating_point() and out.is_floating_point() and out.dtype.itemsize < 4 <= t.dtype.itemsize:
            return t.to(device=out.device)
        return out
    return apply


def _defined_in(cls: type, name: str) -> type:
    return next(k for k in cls.__mro__ if name in k.__dict__)


class BaseGate(ForgetsLastForward, nn.Module):
    """Base of all gates.

    fmoe calls `routing(x_TD) -> Routing`. `forward(x_TD)` returns FastMoE's
    `(topk_idx, topk_val)` tuple. Two ways to write a gate:

    - fmoe's: `BaseGate(d_model, num_expert, world_size, top_k, capacity, z_loss_coef)` and
      implement `route(x_TD) -> (expert_idx_TK, weight_TK, score_TK, logits_TE, aux)`, where
      `score_TK` ranks slots for capacity drops (higher is kept first). The base adds the
      z-loss, applies the capacity and keeps the last logits in `last_logits_TE`.
    - FastMoE's: `BaseGate(num_expert, world_size)` (two positional arguments), implement
      `forward(inp) -> (topk_idx, topk_val)` and call `self.set_loss(...)`; `routing` wraps the
      tuple (weights `topk_val`, aux loss `get_loss()` or 0, -1 slots counted as dropped).
    """

    keeps_fp32 = False       # fmoe's own gates keep their parameters at least fp32
    drop_by = "score"        # capacity keeps each expert's best slots; "order" keeps the first ones
    unroute_before_capacity = False
    _routes_by_forward = False   # set per subclass by __init_subclass__
    # Ranks holding parts of the same tokens (Megatron's sequence-parallel tensor ranks): the balance
    # losses and the z-loss count over all their tokens; set by fmoe.megatron.MegatronMLP.
    token_partition = None
    loss = None                 # FastMoE's: the aux loss of the last forward
    last_logits_TE = None
    last_forward_attrs = ("loss", "last_logits_TE")
    per_micro_batch_attrs = ("loss", "last_logits_TE", "replayed_TK")    # fmoe.distributed.interleave
    # Router replay (fmoe.replay): "record" or "replay" while fmoe.record_routing / replay_routing is on,
    # the gate's key to its tape there, and during a replayed route() the recorded experts [T, K].
    routing_mode = None
    routing_key = None
    replayed_TK = None

    def __init__(self, *args, **kwargs):
        super().__init__()
        if len(args) == 2 and "d_model" not in kwargs or not args and "d_model" not in kwargs:
            self._init_fastmoe(*args, **kwargs)
        else:
            self._init_fmoe(*args, **kwargs)

    def _init_fastmoe(self, num_expert: int, world_size: int = 1):
        self.d_model = None
        self.num_expert = check_int("num_expert", num_expert)
        self.world_size = check_int("world_size", world_size)
        self.tot_expert = self.num_expert * self.world_size
        self.top_k = None
        self.capacity = None
        self.z_loss_coef = 0.0

    def _init_fmoe(self, d_model: int, num_expert: int, world_size: int = 1, top_k: int = 2,
                   capacity: CapacityArg = None, z_loss_coef: float = 0.0):
        self.d_model = check_int("d_model", d_model)
        self.num_expert = check_int("num_expert", num_expert)
        self.world_size = check_int("world_size", world_size)
        self.tot_expert = num_expert * world_size
        self.top_k = check_top_k(top_k, self.tot_expert)
        self.capacity = check_capacity(capacity)
        self.z_loss_coef = check_float("z_loss_coef", z_loss_coef)

    def _apply(self, fn, *args, **kwargs):
        return super()._apply(keep_at_least_fp32(fn) if self.keeps_fp32 else fn, *args, **kwargs)

    def hold_fp32(self) -> "BaseGate":
        """A gate that keeps fp32 with parameters made below it (under `torch.set_default_dtype(torch.bfloat16)`)
        brings them to fp32: routing decisions are sensitive to rounding. The layer calls it when it takes the gate."""
        if self.keeps_fp32:
            for tensor in list(self.parameters()) + list(self.buffers()):
                if tensor.is_floating_point() and tensor.dtype.itemsize < 4:
                    tensor.data = tensor.data.float()
        return self

    def route(self, x_TD: torch.Tensor):
        raise NotImplementedError(f"{type(self).__name__} implements neither route() nor forward()")

    def forward(self, x_TD: torch.Tensor, return_all_scores: bool = False):
        """FastMoE's convention: `(topk_idx, topk_val)`, plus the router logits if asked."""
        if not self._overrides("route"):
            raise NotImplementedError(f"{type(self).__name__} implements neither route() nor forward()")
        routing = self.routing_by_route(x_TD)
        weight_TK = routing.weight_TK.to(x_TD.dtype)     # FastMoE's scores come in the input's dtype
        if return_all_scores:
            return routing.expert_idx_TK, weight_TK, self.last_logits_TE
        return routing.expert_idx_TK, weight_TK

    def _overrides(self, name: str) -> bool:
        return getattr(type(self), name) is not getattr(BaseGate, name)

    def __init_subclass__(cls, **kwargs):
        # Decided once per class, where the class is defined: Dynamo before torch 2.5 cannot trace
        # the class `__dict__` lookups in the forward.
        super().__init_subclass__(**kwargs)
        forward_cls, route_cls = _defined_in(cls, "forward"), _defined_in(cls, "route")
        cls._routes_by_forward = (forward_cls is not BaseGate and forward_cls is not route_cls
                                  and issubclass(forward_cls, route_cls))

    def routing(self, x_TD: torch.Tensor) -> Routing:
        """The full routing decision; `FMoE` and every fmoe component call this, never `forward`.
        A FastMoE-style `forward` is used when it is defined below the class that defines `route`
        (a forward-only gate, or FastMoE's pattern of subclassing NaiveGate and overriding forward)."""
        if self._routes_by_forward:
            routing = self._routing_from_forward(x_TD)
        elif not isinstance(x_TD, torch.Tensor):
            raise TypeError(f"{type(self).__name__} routes one tensor of rows [T, d_model], but the input is a "
                            f"{type(x_TD).__name__} of tensors: a tree input needs a gate that takes the tree "
                            "(a FastMoE-style gate whose forward(inp) reads it)")
        else:
            routing = self.routing_by_route(x_TD)
        if self.routing_mode == "record":
            routing.expert_idx_TK = recorded_choice(routing.expert_idx_TK, self.routing_key)
        return routing

    def routes_by_forward(self) -> bool:
        """Whether routing() reads a FastMoE-style forward (decided once per class)."""
        return self._routes_by_forward

    def choose(self, choice_TE: torch.Tensor, k: int):
        """The selection step of every gate: (values, indices) of the k best experts of `choice_TE` per
        token; under `fmoe.replay_routing`, the recorded experts and their values (a -1 slot's value is
        the lowest finite number, so a softmax over the slots leaves it out)."""
        if self.replayed_TK is None:
            return torch.topk(choice_TE, k, dim=-1)
        return slot_values(choice_TE, self.replayed_TK, torch.finfo(choice_TE.dtype).min), self.replayed_TK

    def replayed_experts(self, x_TD: torch.Tensor) -> torch.Tensor:
        """Under `fmoe.replay_routing`: the recorded experts `[T, K]` of this forward (the tape's next entry)."""
        return replayed_choice(x_TD.detach(), self.routing_key, self.top_k)

    def routing_by_route(self, x_TD: torch.Tensor) -> Routing:
        replaying = self.routing_mode == "replay"
        if replaying:
            self.replayed_TK = self.replayed_experts(x_TD)
        expert_idx_TK, weight_TK, score_TK, logits_TE, aux = self.route(x_TD)
        self.last_logits_TE = logits_TE
        if self.z_loss_coef:
            aux = aux + self.z_loss_coef * z_loss(logits_TE, self.token_partition)
        if replaying:
            # The recorded experts, whatever route() made of them; no capacity, no random routing: the
            # trace already holds the slots that reached no expert, and they count as unrouted.
            expert_idx_TK, self.replayed_TK = self.replayed_TK, None
            unrouted_TK = expert_idx_TK < 0
            self.set_loss(aux)
            return Routing(expert_idx_TK, weight_TK.masked_fill(unrouted_TK, 0.0), aux, unrouted_TK.sum(),
                           unrouted_TK.sum())
        num_dropped = torch.zeros((), dtype=torch.long, device=x_TD.device)
        if self.unroute_before_capacity:
            expert_idx_TK, weight_TK, num_unrouted = self.unroute(expert_idx_TK, weight_TK)
        factor = self.capacity_factor
        if factor is not None:
            cap = self.expert_capacity(factor, x_TD.shape[0])
            if self.drop_by == "order":
                score_TK = torch.zeros_like(weight_TK)      # stable sorts keep slot order
            expert_idx_TK, weight_TK, num_dropped = drop_over_capacity(
                expert_idx_TK, weight_TK, score_TK, self.tot_expert, cap
            )
        if not self.unroute_before_capacity:
            expert_idx_TK, weight_TK, num_unrouted = self.unroute(expert_idx_TK, weight_TK)
        self.set_loss(aux)
        return Routing(expert_idx_TK, weight_TK, aux, num_dropped + num_unrouted, num_unrouted)

    def expert_capacity(self, factor: float, num_tokens: int) -> int:
        """Slots each expert may take from this rank's `num_tokens` tokens."""
        return expert_capacity(factor, num_tokens, self.top_k, self.tot_expert)

    def unroute(self, expert_idx_TK, weight_TK):
        """Slots a gate leaves unrouted after the capacity (GShard's random routing); none here."""
        return expert_idx_TK, weight_TK, torch.zeros((), dtype=torch.long, device=expert_idx_TK.device)

    def _routing_from_forward(self, x_TD: torch.Tensor) -> Routing:
        return routing_from_fastmoe_gate(self, x_TD)

    @property
    def capacity_factor(self) -> Optional[float]:
        if self.capacity is None:
            return None
        return self.capacity[0] if self.training else self.capacity[1]

    # FastMoE's loss interface.
    def set_loss(self, loss):
        self.loss = loss

    def get_loss(self, clear: bool = True):
        loss = self.loss
        if clear:
            self.loss = None
        return loss

    @property
    def has_loss(self) -> bool:
        return self.loss is not None


def slot_values(values_TE: torch.Tensor, expert_idx_TK: torch.Tensor, fill: float) -> torch.Tensor:
    """values_TE at each slot's expert, `fill` where the slot has none (-1)."""
    return values_TE.gather(1, expert_idx_TK.clamp_min(0)).masked_fill(expert_idx_TK < 0, fill)


def router_logits(x_TD, weight, bias=None):
    """x @ weight^T + bias in fp32, or in the input's precision when higher, under torch.autocast too (it would
    round the logits to 16 bits)."""
    dtype = routing_dtype(x_TD.dtype, weight.dtype)
    with autocast_off(x_TD):
        return F.linear(x_TD.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))


class LinearRouter(nn.Module):
    """The router projection d_model -> experts (`proj.weight` [E, D]). It computes in fp32, or
    in the input's precision when higher, under torch.autocast too, and keeps its parameters at least fp32."""

    def __init__(self, d_model: int, tot_expert: int, bias: bool = True):
        super().__init__()
        self.proj = nn.Linear(d_model, tot_expert, bias=bias)

    @property
    def weight(self):
        """FastMoE's `gate.gate.weight` (its router is a plain nn.Linear)."""
        return self.proj.weight

    @property
    def bias(self):
        return self.proj.bias

    def forward(self, x_TD):
        return router_logits(x_TD, self.proj.weight, self.proj.bias)

    def _apply(self, fn, *args, **kwargs):
        return super()._apply(keep_at_least_fp32(fn), *args, **kwargs)


def accepts_keyword(cls, name: str) -> bool:
    """Whether `cls(...)` takes `name` as a keyword (FastMoE gates name top-k `topk` or `top_k`)."""
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return False
    return name in params and params[name].kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                    inspect.Parameter.KEYWORD_ONLY)


def routing_from_fastmoe_gate(gate: nn.Module, inp) -> Routing:
    """The Routing of a FastMoE-style gate, from its `(topk_idx, topk_val)` tuple (any shape holding
    T*K slots); `inp` may be a tree of tensors (FMoE passes multi-input gates their whole tree)."""
    topk_idx, topk_val = gate(inp)[:2]
    T = torch.utils._pytree.tree_leaves(inp)[0].shape[0]
    expert_idx_TK = topk_idx.reshape(T, -1).long()
    weight_TK = topk_val.reshape(T, -1)
    if expert_idx_TK.shape != weight_TK.shape:
        raise ValueError(f"{type(gate).__name__}.forward returned topk_idx and topk_val of different sizes: "
                         f"{tuple(topk_idx.shape)} and {tuple(topk_val.shape)}")
    dropped_TK = expert_idx_TK < 0
    aux = gate.get_loss(clear=False) if hasattr(gate, "get_loss") else None
    if aux is None:
        aux = torch.zeros((), device=weight_TK.device)
    elif aux.numel() == 1:
        aux = aux.reshape(())
    return Routing(expert_idx_TK, weight_TK.masked_fill(dropped_TK, 0.0), aux, dropped_TK.sum())
