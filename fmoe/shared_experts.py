"""Shared experts: dense MLPs every token passes through, beside the routed ones (Qwen2-MoE's,
DeepSeek's); optionally gated per token by sigmoid(x @ w)."""
from typing import Callable, Dict, Optional

import torch
from torch import nn

from fmoe.experts import GroupedExperts
from fmoe.kernels import deferred


def make_shared_experts(shared_expert, d_model: int, activation, bias: bool,
                        recompute: str = "activation") -> Optional[nn.ModuleList]:
    """FMoE's `shared_expert` argument as a ModuleList (None when there are none)."""
    if shared_expert is None:
        return None
    if isinstance(shared_expert, nn.Module):
        shared_expert = [shared_expert]
    elif isinstance(shared_expert, int) and not isinstance(shared_expert, bool):
        if shared_expert < 1:
            raise ValueError(f"shared_expert as a d_hidden must be a positive int, got {shared_expert!r}")
        shared_expert = [SharedExpertMLP(d_model, shared_expert, activation, bias, recompute)]
    if not isinstance(shared_expert, (list, tuple, nn.ModuleList)) or not shared_expert or \
            not all(isinstance(m, nn.Module) for m in shared_expert):
        raise ValueError("shared_expert must be a module, a non-empty list of modules or a d_hidden int, "
                         f"got {shared_expert!r}")
    return nn.ModuleList(shared_expert)


class SharedExpertMLP(nn.Module):
    """One dense MLP, the routed experts' MLP without the routing (one expert of a GroupedExperts)."""

    def __init__(self, d_model: int, d_hidden: int, activation="gelu", bias: bool = True,
                 recompute: str = "activation"):
        super().__init__()
        self.mlp = GroupedExperts(1, d_model, d_hidden, activation, bias=bias, recompute=recompute)

    def forward(self, x_TD):
        if not self.mlp.lean:
            return self.mlp.expert_forward(0, x_TD)
        # Every token is one row of the single expert: it keeps x and the pre-activation only.
        return self.mlp(x_TD, torch.full((1,), x_TD.shape[0], dtype=torch.int64, device=x_TD.device), lean=True)

class SharedTerm:
    """The shared experts' term of one forward: their summed output on x_TD, scaled by sigmoid(gate(x))
    per token when there is a gate (nothing without shared experts). It needs nothing of the
    exchange, so a dispatcher may compute it while its rows travel (`run`, overlap="shared"); else it
    is computed when the layer adds it to the routed output (`add_to`). Either way once."""

    def __init__(self, x=None, x_TD: Optional[torch.Tensor] = None, shared_experts: Optional[nn.ModuleList] = None,
                 gate: Optional[nn.Linear] = None):
        if shared_experts is not None and not isinstance(x, torch.Tensor):
            raise ValueError("shared_expert needs a single input tensor, not a tree of them")
        self.x_TD, self.shared_experts, self.gate = x_TD, shared_experts, gate
        self.shared_TD: Optional[torch.Tensor] = None
        # Per shared expert (by id): the deferral its lean MLP's weight gradients go to (`defer_weight_grads`)
        self.deferrals: Dict[int, deferred.DeferredWeightGrads] = {}

    @property
    def empty(self) -> bool:
        return self.shared_experts is None

    def run(self):
        if self.shared_experts is None or self.shared_TD is not None:
            return
        x_TD = self.x_TD
        out_TD = sum(self._through(expert, x_TD) for expert in self.shared_experts)
        self.shared_TD = out_TD if self.gate is None else torch.sigmoid(self.gate(x_TD)) * out_TD

    def _through(self, expert: nn.Module, x_TD):
        deferral = self.deferrals.get(id(expert))
        if deferral is None:
            return expert(x_TD)
        with deferred.deferring(deferral):
            return expert(x_TD)

    def defer_weight_grads(self, deferrable: Callable[[nn.Module], bool]):
        """fmoe's own shared MLPs (those whose stacked MLP is `deferrable`) leave their weight gradients for
        a wait that would idle or the wait for the routed experts' input gradients (`fmoe.kernels.deferred`,
        `late`). Called before the exchange starts: the deferral's sink must be older than its nodes."""
        for expert in self.shared_experts or ():
            mlp = getattr(expert, "mlp", None)
            if isinstance(expert, SharedExpertMLP) and deferrable(mlp):
                self.deferrals[id(expert)] = deferred.DeferredWeightGrads((mlp.w1_eDF, mlp.w2_eFD),
                                                                          late=True)

    def add_to(self, y_TD):
        if self.shared_experts is None:
            return y_TD
        self.run()
        return y_TD + self.shared_TD


NO_SHARED_TERM = SharedTerm()
