"""One benchmark point: the layer's shape, a routing of chosen skew, the fmoe layer and its inputs."""
from dataclasses import asdict, dataclass

import torch

import fmoe
from fmoe.gates.base import BaseGate, LinearRouter


@dataclass(frozen=True)
class Point:
    tokens: int
    d_model: int
    d_hidden: int
    num_expert: int
    top_k: int
    skew: float = 0.0

    def __post_init__(self):
        for name in ("tokens", "d_model", "d_hidden", "num_expert", "top_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.top_k > self.num_expert:
            raise ValueError(f"top_k must be at most num_expert={self.num_expert}, got {self.top_k}")
        if not self.skew >= 0:
            raise ValueError(f"skew must be >= 0, got {self.skew!r}")

    def as_dict(self) -> dict:
        return asdict(self)

    def label(self) -> str:
        return (f"T={self.tokens} D={self.d_model} F={self.d_hidden} E={self.num_expert} top-{self.top_k} "
                f"skew={self.skew:g}")


def skewed_routing(tokens: int, num_expert: int, top_k: int, skew: float, seed: int = 0) -> torch.Tensor:
    """expert_idx_TK: K distinct experts per token. skew 0 is perfectly balanced (slot s to expert
    s mod E); above 0, experts are drawn with Zipf probabilities p_e ~ (e+1)^-skew, expert 0 the hottest."""
    if skew == 0:
        return (torch.arange(tokens * top_k) % num_expert).view(tokens, top_k)
    p_E = (torch.arange(num_expert, dtype=torch.float64) + 1) ** -skew
    g = torch.Generator().manual_seed(seed)
    return torch.multinomial(p_E.expand(tokens, num_expert), top_k, replacement=False, generator=g)


class SkewedGate(BaseGate):
    """A fixed routing table (see `skewed_routing`) with weights from a real router: the softmax
    of its logits at the chosen experts, so the router is trained like any gate's. A batch of
    n <= `tokens` tokens gets the first n rows of the table, so a prefix of the batch is routed
    the same as in the whole batch."""

    def __init__(self, d_model: int, num_expert: int, tokens: int, top_k: int = 2, skew: float = 0.0, seed: int = 0):
        super().__init__(d_model, num_expert, 1, top_k)
        self.gate = LinearRouter(d_model, num_expert)
        self.register_buffer("expert_idx_TK", skewed_routing(tokens, num_expert, top_k, skew, seed), persistent=False)

    def route(self, x_TD):
        T, built_for = x_TD.shape[0], self.expert_idx_TK.shape[0]
        if T > built_for:
            raise ValueError(f"x_TD has {T} tokens, more than the {built_for} this gate was built for")
        logits_TE = self.gate(x_TD)
        idx_TK = self.expert_idx_TK[:T]
        weight_TK = torch.softmax(logits_TE.gather(1, idx_TK).float(), dim=-1)
        return idx_TK, weight_TK, weight_TK, logits_TE, logits_TE.new_zeros((), dtype=torch.float32)


def imbalance(point: Point, seed: int = 0) -> float:
    """Rows of the busiest expert over the mean: 1.0 is balanced."""
    idx = skewed_routing(point.tokens, point.num_expert, point.top_k, point.skew, seed)
    counts = torch.bincount(idx.reshape(-1), minlength=point.num_expert).double()
    return float(counts.max() / counts.mean())


@dataclass
class Workload:
    point: Point
    layer: fmoe.FMoETransformerMLP
    x_TD: torch.Tensor          # the input, a leaf that requires grad
    grad_TD: torch.Tensor       # the gradient every competitor's backward starts from


def make_workload(point: Point, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Workload:
    torch.manual_seed(seed)
    gate = SkewedGate(point.d_model, point.num_expert, point.tokens, point.top_k, point.skew, seed)
    layer = fmoe.FMoETransformerMLP(num_expert=point.num_expert, d_model=point.d_model, d_hidden=point.d_hidden,
                                    top_k=point.top_k, gate=gate, activation="gelu")
    layer.to(device=device, dtype=dtype)
    g = torch.Generator().manual_seed(seed + 1)
    x_TD = torch.randn(point.tokens, point.d_model, generator=g).to(device=device, dtype=dtype).requires_grad_()
    grad_TD = torch.randn(point.tokens, point.d_model, generator=g).to(device=device, dtype=dtype)
    return Workload(point, layer, x_TD, grad_TD)
