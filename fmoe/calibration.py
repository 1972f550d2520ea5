"""Measure the performance model's constants (fmoe.perfmodel) on this machine.

The calibration is a set of *probes*, small steps each timed alone: an expert MLP step over
the balanced rows and over twice as many (whose slope gives the FLOP/s and whose intercept the
time per expert), an all-to-all, the broadcast and the push of one expert's parameters, a layer
step of width-1 experts (the fixed time per routed row) and a small layer step with one expert
shadowed and without (what shadowing one expert adds). `Calibration.fit` turns the probes' median seconds into
a PerfModel.

`calibrate` times the probes taking turns and fits them. A benchmark can instead time the probes
in turns with its own steps (`benchmarks/bench_shadow.py` does) and fit them afterwards, so that
a drift of a shared machine's speed hits the constants and the steps they predict alike.

Every probe is timed the same way: barrier, step, barrier (`time_in_turns`); a probe's collectives
run in the same order on every rank, so all ranks must time the same probes in the same order.
"""
import statistics
import time
from dataclasses import replace
from typing import Callable, Dict, List

import torch

from fmoe.perfmodel import PerfModel


def _distributed(group) -> bool:
    import torch.distributed as dist
    return dist.is_initialized() and dist.get_world_size(group) > 1


def time_in_turns(steps: Dict[str, Callable[[], None]], reps: int, warmup: int = 1, group=None,
                  times: Dict[str, List[float]] = None) -> Dict[str, List[float]]:
    """Seconds of each step's `reps` timed runs, the steps taking turns run by run (a change in a
    shared machine's speed then hits every step alike), each between two barriers when
    distributed (so a step takes as long as its slowest rank). Appends to `times` if given."""
    import torch.distributed as dist
    distributed = _distributed(group)
    times = {} if times is None else times
    for name, step in steps.items():
        times.setdefault(name, [])
        for _ in range(warmup):
            step()
    for _ in range(reps):
        for name, step in steps.items():
            if distributed:
                dist.barrier(group=group)
            start = time.perf_counter()
            step()
            if distributed:
                dist.barrier(group=group)
            times[name].append(time.perf_counter() - start)
    return times


class Calibration:
    """The probes for `model`'s shapes, and the fit of their times into `model`'s constants.

    `num_expert` experts per rank (a rank's own, so the working set is the layer's), the expert
    step over `size` and `2 * size` rows shared evenly: the rows a busiest rank holds lie above
    the balanced ones, and on a CPU a row costs more there (measured here: 0.28 ms per row below
    2048 rows, 0.33 above, one expert's activations no longer in cache), so the slope is taken
    where the model is used. When distributed, the transfers, the shadowing probe and, with
    `tokens` > 0, a layer step over `tokens` tokens of width-1 experts."""

    def __init__(self, model: PerfModel, group=None, size: int = 1024, tokens: int = 0, num_expert: int = 1):
        import torch.distributed as dist

        from fmoe.experts import GroupedExperts
        self.model, self.group, self.tokens, self.num_expert = model, group, tokens, num_expert
        self.distributed = _distributed(group)
        self.small, self.large = max(num_expert, size), max(num_expert + 1, 2 * size)
        self.experts = GroupedExperts(num_expert, model.d_model, model.d_hidden, "gelu", bias=True)
        self._probes = {"expert_small": self._expert_step(self.small), "expert_large": self._expert_step(self.large)}
        if not self.distributed:
            return
        from fmoe.distributed.groups import global_rank
        from fmoe.distributed.shadow import GradientPush
        src = global_rank(group, 0)
        self.exchange = torch.randn(2 ** 20)     # 4 MiB: the size of a dispatch, past the latency-bound sizes
        received = torch.empty_like(self.exchange)
        params = torch.randn(int(model.expert_bytes // 4))  # one expert, as shadowing sends it
        self._probes["all_to_all"] = lambda: dist.all_to_all_single(received, self.exchange, group=group)
        self._probes["pull"] = lambda: dist.broadcast(params, src=src, group=group)
        self._probes["push"] = lambda: GradientPush([params], [0], group).wait()
        if tokens > 0:
            self._probes["width_one_layer"] = self._width_one_layer_step()
        self._probes["shadow_off"], self._probes["shadow_on"] = self._shadow_steps()

    def probes(self) -> Dict[str, Callable[[], None]]:
        """name -> one step of the probe (forward and backward from no gradients, or one transfer)."""
        return dict(self._probes)

    def _expert_step(self, rows: int) -> Callable[[], None]:
        counts = torch.full((self.num_expert,), rows // self.num_expert)
        counts[: rows % self.num_expert] += 1
        x = torch.randn(rows, self.model.d_model, requires_grad=True)

        def step():
            self.experts.zero_grad(set_to_none=True)
            self.experts(x, counts).sum().backward()
        return step

    def _width_one_layer_step(self) -> Callable[[], None]:
        """A layer step beyond the modelled expert compute and traffic: one expert per worker of
        width 1, top-1, a uniform round-robin routing, same d_model."""
        import torch.distributed as dist

        import fmoe
        from fmoe.gates.round_robin import RoundRobinGate
        layer = fmoe.FMoETransformerMLP(num_expert=1, d_model=self.model.d_model, d_hidden=1, top_k=1,
                                        world_size=dist.get_world_size(self.group), moe_group=self.group,
                                        gate=RoundRobinGate)
        x = torch.randn(self.tokens, self.model.d_model, requires_grad=True)

        def step():
            layer.zero_grad(set_to_none=True)
            layer(x).sum().backward()
        return step

    def _shadow_steps(self, tokens: int = 64) -> tuple:
        """The same layer of `model`'s shapes over a few uniformly routed tokens (so the rows cost
        next to nothing) with expert 0 shadowed and without."""
        import torch.distributed as dist

        import fmoe
        from fmoe.distributed.shadow import ShadowPolicy
        from fmoe.gates.round_robin import RoundRobinGate

        class ShadowFirst(ShadowPolicy):
            def choose(self, counts_E, world_size, group=None):
                self.gather_counts(counts_E, world_size, group)     # the collective of real use
                return [0]

        world = dist.get_world_size(self.group)
        x = torch.randn(tokens, self.model.d_model, requires_grad=True)

        def step_of(shadow):
            layer = fmoe.FMoETransformerMLP(num_expert=self.num_expert, d_model=self.model.d_model,
                                            d_hidden=self.model.d_hidden, top_k=1, world_size=world,
                                            moe_group=self.group, gate=RoundRobinGate, shadow=shadow)

            def step():
                layer.zero_grad(set_to_none=True)
                layer(x).sum().backward()
            return step
        return step_of(False), step_of(ShadowFirst(self.model))

    def fit(self, seconds: Dict[str, float]) -> PerfModel:
        """`model` with the constants the probes' (median) seconds give; when distributed, the same
        on every rank (the slowest rank's: least throughput, most fixed time)."""
        import torch.distributed as dist
        model = self.model
        missing = sorted(set(self._probes) - set(seconds))
        if missing:
            raise ValueError(f"Calibration.fit: seconds has no time for the probes {missing}")
        t_small, t_large = seconds["expert_small"], seconds["expert_large"]
        per_row = max(t_large - t_small, 1e-3 * t_large) / (self.large - self.small)
        flops = 3 * 4 * model.alpha * model.d_model ** 2 / per_row
        per_expert = max(0.0, t_large - per_row * self.large) / self.num_expert
        if not self.distributed:
            return replace(model, flops=flops, time_per_expert=per_expert)
        bandwidth = self.exchange.numel() * self.exchange.element_size() / seconds["all_to_all"]
        pull, push = model.expert_bytes / seconds["pull"], model.expert_bytes / seconds["push"]
        measured = replace(model, flops=flops, net_bandwidth=bandwidth, time_per_expert=per_expert,
                           pull_bandwidth=pull, push_bandwidth=push)
        overhead = model.overhead_per_row
        if self.tokens > 0:                 # the width-1 layer was probed
            world = dist.get_world_size(self.group)
            counts_WE = torch.full((world, world), self.tokens / world, dtype=torch.double)
            tiny = replace(measured, d_hidden=1, time_per_expert=0.0)
            overhead = max(0.0, seconds["width_one_layer"] - tiny.layer_time(counts_WE)) / self.tokens
        # The shadowed step runs one expert more, which the model counts in time_per_expert; never
        # below the modelled transfers: a noisy difference must not make shadowing look free.
        shadow = max(seconds["shadow_on"] - seconds["shadow_off"] - per_expert,
                     replace(measured, shadow_time_per_expert=None).shadow_cost(1))
        rates = torch.tensor([flops, bandwidth, pull, push], dtype=torch.double)
        dist.all_reduce(rates, op=dist.ReduceOp.MIN, group=self.group)
        costs = torch.tensor([overhead, per_expert, shadow], dtype=torch.double)
        dist.all_reduce(costs, op=dist.ReduceOp.MAX, group=self.group)
        flops, bandwidth, pull, push = rates.tolist()
        overhead, per_expert, shadow = costs.tolist()
        return replace(model, flops=flops, net_bandwidth=bandwidth, overhead_per_row=overhead,
                       time_per_expert=per_expert, pull_bandwidth=pull, push_bandwidth=push,
                       shadow_time_per_expert=shadow)


def medians(times: Dict[str, List[float]]) -> Dict[str, float]:
    return {name: statistics.median(ts) for name, ts in times.items()}


def calibrate(model: PerfModel, group=None, size: int = 1024, reps: int = 5, tokens: int = 0,
              num_expert: int = 1) -> PerfModel:
    """`model` with this machine's constants for its shapes: the probes of `Calibration(model,
    group, size, tokens, num_expert)` timed `reps` times each, taking turns, and fitted."""
    calibration = Calibration(model, group, size, tokens, num_expert)
    return calibration.fit(medians(time_in_turns(calibration.probes(), reps, group=group)))
