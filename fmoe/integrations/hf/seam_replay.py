"""Router replay at the experts seam: a seam-converted layer (`fmoe.integrations.hf.seam.SeamMoE`) is routed by
its family's router, which fmoe does not own, so under `fmoe.replay_routing` the family's block runs under
`ReplayedTopK`: the router's own top-k returns the recorded experts and the router weighs them."""
from typing import Optional

import torch
from torch.overrides import TorchFunctionMode

from fmoe.gates.base import BaseGate

TOPK = (torch.topk, torch.Tensor.topk)
TOPK_ARGS = ("input", "k", "dim", "largest", "sorted")


class ReplayedTopK(TorchFunctionMode):
    """Router replay at the seam: while the family's block runs under `fmoe.replay_routing`, its router's
    selection (the top-k over a [tokens, experts] score tensor, k = the layer's top-k, along the experts)
    returns the recorded experts and the scores at them, so the router weighs them by its own code:
    a softmax over the chosen logits, a normalisation of the chosen probabilities, a scaling factor.
    A slot the trace left empty (-1: dropped by a capacity) is filled with the token's best-scored
    expert that its other slots do not name (the one the router chose there when it was recorded), so
    the router normalises over the top-k it normalised over then; the slot itself reaches no expert.
    Any other top-k of the block (a group-limited router's group choice) runs as it is.

    A router that chooses otherwise (hash routing from token ids, a sampled choice, a top-k over more
    classes than experts) cannot be steered: its replay holds where its own choice is the trace's (the
    recorded tokens again) and refuses, naming the layer, where it is not."""

    def __init__(self, recorded_TK: torch.Tensor, num_experts: int, layer_name: str, router_name: str):
        super().__init__()
        self.recorded_TK = recorded_TK
        self.num_experts = num_experts
        self.layer_name = layer_name
        self.router_name = router_name
        self.chosen_TK: Optional[torch.Tensor] = None      # what the router's selection returned

    def recorded(self) -> torch.Tensor:
        return self.recorded_TK

    def check_handed(self, top_k_index: torch.Tensor):
        """The experts the block hands the layer must be the replayed ones."""
        where = f"replay_routing cannot replay {self.layer_name}: {self.router_name}"
        handed_TK = top_k_index.long()
        if self.chosen_TK is not None:
            if handed_TK.shape != self.chosen_TK.shape or not torch.equal(handed_TK, self.chosen_TK):
                raise ValueError(f"{where} changed the experts after its top-k, so the replayed ones do not "
                                 "reach the experts")
            return
        recorded_TK = self.recorded_TK.to(handed_TK.device)
        kept_TK = recorded_TK >= 0
        if handed_TK.shape != recorded_TK.shape or not torch.equal(handed_TK[kept_TK], recorded_TK[kept_TK]):
            differ = int(((handed_TK != recorded_TK) & kept_TK).sum()) if handed_TK.shape == recorded_TK.shape \
                else "all"
            raise ValueError(f"{where} chooses its experts without a top-k over [tokens, {self.num_experts}] "
                             f"scores (hash or sampled routing), which fmoe cannot steer, and its choice differs "
                             f"from the trace in {differ} slots")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in TOPK:
            bound = {**dict(zip(TOPK_ARGS, args)), **kwargs}
            scores = bound.get("input")
            if self.is_selection(scores, bound):
                idx_TK = filled_choice(scores, self.recorded_TK.to(scores.device))
                self.chosen_TK = idx_TK
                return torch.return_types.topk((scores.gather(1, idx_TK), idx_TK))
        return func(*args, **kwargs)

    def is_selection(self, scores, bound) -> bool:
        T, K = self.recorded_TK.shape
        return (isinstance(scores, torch.Tensor) and tuple(scores.shape) == (T, self.num_experts)
                and bound.get("k") == K and bound.get("dim", -1) in (-1, 1) and bound.get("largest", True)
                and bound.get("out") is None)


def filled_choice(scores_TE: torch.Tensor, recorded_TK: torch.Tensor) -> torch.Tensor:
    """`recorded_TK` with each -1 slot given the token's best expert of `scores_TE` that no slot names
    (a token's empty slots take them best first, in slot order)."""
    empty_TK = recorded_TK < 0
    if not bool(empty_TK.any()):
        return recorded_TK
    named_TE = torch.zeros(scores_TE.shape, dtype=torch.long, device=scores_TE.device)
    named_TE = named_TE.scatter_add(1, recorded_TK.clamp_min(0), (~empty_TK).long()) > 0
    best_TK = scores_TE.detach().masked_fill(named_TE, float("-inf")).topk(recorded_TK.shape[1], dim=1).indices
    nth_empty_TK = (empty_TK.long().cumsum(dim=1) - 1).clamp_min(0)
    return torch.where(empty_TK, best_TK.gather(1, nth_empty_TK), recorded_TK)


def begin_replay(gate, block, router_name: str, args, kwargs):
    """The block's forward begins under replay: this forward's recorded experts taken from the tape (the
    hidden states, the block's first argument, give the token count) and `ReplayedTopK` entered."""
    x = kwargs.get("hidden_states", args[0] if args else None)
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        raise ValueError(f"replay_routing: {type(block).__name__} (holding {gate.layer_name}) must take the "
                         f"hidden states [..., width] first, got {type(x).__name__}")
    recorded_TK = BaseGate.replayed_experts(gate, x.reshape(-1, x.shape[-1]))
    gate.replay = ReplayedTopK(recorded_TK, gate.tot_expert, gate.layer_name, router_name)
    gate.replay.__enter__()


def end_replay(gate):
    """The block's forward ended (or raised): `ReplayedTopK` left."""
    replay, gate.replay = gate.replay, None
    if replay is not None:
        replay.__exit__(None, None, None)
