"""Routing statistics of MoE layers, for dashboards.

After a forward, `FMoE.routing_stats` describes what the layer's router did with this rank's tokens,
as tensors on the layer's device, computed when read and never copied to the host by the layer:

    tokens_per_expert  [E]  slots routed to each expert (a token counts once per expert it chose)
    max_load, mean_load     the largest and the mean entry of tokens_per_expert
    load_cv                 their coefficient of variation, population std / mean (0: balanced)
    empty_experts           experts that got no slot
    dropped_slots           slots a capacity limit dropped
    unrouted_slots          slots the gate chose to send nowhere (GShard's random routing); together
                            with dropped_slots, the layer's `num_dropped`
    router_entropy          mean over the tokens of the entropy (nats) of the softmax of their router
                            logits; absent when the gate keeps no logits (FastMoE-style gates)

The counts are this rank's tokens, sent to the experts of every rank. `routing_stats(model)` collects
every layer's as Python numbers, summed over the ranks first with `over="world"` (or a process group):
the counts of the whole batch, all-reduced then and only then. `RoutingStatsMeter` sums them over the
training forwards between two reads (micro-batches, several steps).
"""
from dataclasses import dataclass, fields
from typing import Dict, Optional

import torch
import torch.distributed as dist
from torch import nn

from fmoe.gates.load_state import in_recompute


@dataclass
class RoutingTally:
    """What routing did with some tokens, as sums that add over forwards and over ranks."""

    tokens_per_expert: torch.Tensor         # [E] int64
    dropped_slots: torch.Tensor             # 0-dim int64
    unrouted_slots: torch.Tensor            # 0-dim int64
    scored_tokens: torch.Tensor             # 0-dim int64: the tokens `entropy_sum` covers
    entropy_sum: Optional[torch.Tensor]     # 0-dim float: their router entropies summed; None without logits

    @classmethod
    def of_forward(cls, counts_E, num_dropped, num_unrouted, logits_TE: Optional[torch.Tensor]) -> "RoutingTally":
        """One forward's: the plan's counts, the Routing's drop counts and the router logits (if any)."""
        counts_E = counts_E.detach()
        entropy_sum = None
        if logits_TE is not None:
            logits_TE = logits_TE.detach()
            entropy_sum = torch.special.entr(torch.softmax(logits_TE.float(), dim=-1)).sum()
        return cls(tokens_per_expert=counts_E,
                   dropped_slots=(num_dropped - num_unrouted).detach().reshape(()),
                   unrouted_slots=num_unrouted.detach().reshape(()),
                   # A fill on the device, not a copy from the host.
                   scored_tokens=torch.full((), 0 if logits_TE is None else logits_TE.shape[0], dtype=torch.int64,
                                            device=counts_E.device),
                   entropy_sum=entropy_sum)

    def __add__(self, other: "RoutingTally") -> "RoutingTally":
        return RoutingTally(*(None if a is None else a + b for a, b in zip(self.parts(), other.parts())))

    def parts(self):
        return [getattr(self, f.name) for f in fields(self)]

    def stats(self) -> Dict[str, torch.Tensor]:
        """The statistics of the module docstring, as tensors."""
        load_E = self.tokens_per_expert.float()
        mean = load_E.mean()
        std = load_E.std(correction=0)
        stats = {"tokens_per_expert": self.tokens_per_expert, "max_load": load_E.max(), "mean_load": mean,
                 "load_cv": torch.where(mean > 0, std / mean.clamp_min(1e-30), torch.zeros_like(mean)),
                 "empty_experts": (self.tokens_per_expert == 0).sum(),
                 "dropped_slots": self.dropped_slots, "unrouted_slots": self.unrouted_slots}
        if self.entropy_sum is not None:
            stats["router_entropy"] = self.entropy_sum / self.scored_tokens.clamp_min(1)
        return stats


def stats_as_numbers(tallies: Dict[str, RoutingTally], over) -> Dict[str, dict]:
    """Each tally's statistics as Python numbers (a list for tokens_per_expert), summed `over` ranks first."""
    return {name: {k: v.tolist() for k, v in t.stats().items()} for name, t in reduce_tallies(tallies, over).items()}


def moe_layers(model: nn.Module):
    """(name, layer) of every module that keeps a routing tally (FMoE and its subclasses); a bare layer is "moe"."""
    return [(name or "moe", m) for name, m in model.named_modules() if hasattr(type(m), "routing_tally")]


def all_reduced(tensors, group):
    """`tensors` summed over the ranks of `group`, in one all-reduce (float64 holds the counts exactly)."""
    flat = torch.cat([t.reshape(-1).double() for t in tensors])
    dist.all_reduce(flat, group=group)
    return [piece.reshape(t.shape).to(t.dtype) for piece, t in zip(flat.split([t.numel() for t in tensors]), tensors)]


def reduce_tallies(tallies: Dict[str, RoutingTally], over) -> Dict[str, RoutingTally]:
    """`over`: "rank" (as they are), "world", or a process group to sum them over."""
    if isinstance(over, str) and over not in ("rank", "world"):
        raise ValueError(f"over must be 'rank', 'world' or a process group, got {over!r}")
    if over == "rank" or not tallies or not dist.is_initialized():
        return tallies
    parts = [p for t in tallies.values() for p in t.parts() if p is not None]
    summed = iter(all_reduced(parts, None if over == "world" else over))
    return {name: RoutingTally(*(None if p is None else next(summed) for p in t.parts()))
            for name, t in tallies.items()}


def routing_stats(model: nn.Module, over="rank") -> Dict[str, dict]:
    """{layer name: statistics as Python numbers} of every MoE layer in `model` from its last forward.

    `over="rank"`: this rank's tokens. `"world"` or a process group: the tokens of all those ranks
    (one all-reduce now; every rank of the group must call). Layers not run yet are left out.
    """
    tallies = {name: m.routing_tally for name, m in moe_layers(model)}
    return stats_as_numbers({name: t for name, t in tallies.items() if t is not None}, over)


def scalars(stats_by_layer: Dict[str, dict], prefix: str = "routing") -> Dict[str, float]:
    """Flat `{prefix/layer/stat: number}` for loggers; tokens_per_expert becomes `.../tokens_per_expert/<e>`."""
    out = {}
    for layer, stats in stats_by_layer.items():
        for key, value in stats.items():
            if isinstance(value, list):
                out.update({f"{prefix}/{layer}/{key}/{e}": float(v) for e, v in enumerate(value)})
            else:
                out[f"{prefix}/{layer}/{key}"] = float(value)
    return out


class RoutingStatsMeter:
    """Sums every MoE layer's routing over the training forwards since the last `read` (all the
    micro-batches of the steps in between), on the device. Forwards in eval mode, and forwards that
    activation checkpointing recomputes in the backward, are not counted."""

    def __init__(self, model: nn.Module):
        self.sums: Dict[str, RoutingTally] = {}
        self.handles = [layer.register_forward_hook(self.hook(name)) for name, layer in moe_layers(model)]

    def hook(self, name: str):
        def add(layer, args, output):
            if layer.training and not in_recompute():
                tally = layer.routing_tally
                self.sums[name] = tally if name not in self.sums else self.sums[name] + tally
        return add

    def read(self, over="rank") -> Dict[str, dict]:
        """routing_stats' dict over the counted forwards (as `routing_stats(model, over)`), then start afresh."""
        sums, self.sums = self.sums, {}
        return stats_as_numbers(sums, over)

    def close(self):
        for handle in self.handles:
            handle.remove()
        self.handles = []
