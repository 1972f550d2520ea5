"""Measure the performance model's constants (fmoe.perf.perfmodel) on this machine.

The calibration is a set of *probes*, small steps each timed alone: the layer's experts' MLP step
at a few rows per expert (the expert curve: how one expert's time grows with its rows, from no
rows up past the balanced ones; its slope around the balanced rows also gives FasterMoE's FLOP/s
and a time per expert), an all-to-all, the broadcast and the push of one expert's parameters, a
layer step of width-1 experts (the fixed time per routed row) and a layer step with a few
experts shadowed and without (what shadowing an expert adds while the ranks compute).
`Calibration.fit` turns the probes' median seconds into a PerfModel; `Calibration.fit_times`
takes the probes' seconds run by run, as `time_in_turns` gives them.

`calibrate` times the probes taking turns and fits them. A benchmark can instead time the probes
in turns with its own steps (`benchmarks/bench_shadow.py` does) and fit them afterwards, so that
a drift of a shared machine's speed hits the constants and the steps they predict alike.

Every probe is timed the same way: barrier, step, barrier (`time_in_turns`); a probe's collectives
run in the same order on every rank, so all ranks must time the same probes in the same order.
"""
import random
import statistics
import time
from dataclasses import replace
from typing import Callable, Dict, List, Optional, Tuple

import torch

from fmoe.perf.perfmodel import PerfModel

SHADOW_PROBE_EXPERTS = 4      # experts it shadows (at most a rank's): their sum stands well above the noise


def _distributed(group) -> bool:
    import torch.distributed as dist
    return dist.is_initialized() and dist.get_world_size(group) > 1


def time_in_turns(steps: Dict[str, Callable[[], None]], reps: int, warmup: int = 1, group=None,
                  times: Dict[str, List[float]] = None) -> Dict[str, List[float]]:
    """Seconds of each step's `reps` timed runs, the steps taking turns run by run (a change in a
    shared machine's speed then hits every step alike), each between two barriers when
    distributed (so a step takes as long as its slowest rank). Each round runs the steps in its
    own order (shuffled by the round's number, so the same on every rank): a step that leaves
    the allocator or the caches in some state does not always hand it to the same neighbour.
    Appends to `times` if given."""
    import torch.distributed as dist
    distributed = _distributed(group)
    times = {} if times is None else times
    for name, step in steps.items():
        times.setdefault(name, [])
        for _ in range(warmup):
            step()
    for round_ in range(reps):
        order = list(steps.items())
        random.Random(round_).shuffle(order)
        for name, step in order:
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

    `num_expert` experts per rank (a rank's own, so the working set is the layer's) and `size`
    rows per rank: the expert curve is probed at no rows, at a quarter of the balanced rows per
    expert (b = size / num_expert), at b, 4 b, size and 2 size (a hot expert's rows), each level given
    to as many of the experts as `size` rows fill (at least one; the rest get none). A model linear
    in rows cannot follow this CPU: 8 experts of 256 rows and one of 2048 take different times,
    and a hot expert's rows run faster per row than 8 x 512. When distributed, the transfers, the
    shadowing probe and, with `tokens` > 0, a layer step over `tokens` tokens of width-1 experts."""

    def __init__(self, model: PerfModel, group=None, size: int = 1024, tokens: int = 0, num_expert: int = 1):
        import torch.distributed as dist

        from fmoe.experts import GroupedExperts
        self.model, self.group, self.tokens, self.num_expert = model, group, tokens, num_expert
        self.probe_shadowed = list(range(min(SHADOW_PROBE_EXPERTS, num_expert)))   # rank 0's first experts
        self.distributed = _distributed(group)
        self.size, self.balanced = size, max(1, size // num_expert)
        self.levels = expert_levels(size, num_expert)
        self.experts = GroupedExperts(num_expert, model.d_model, model.d_hidden, "gelu", bias=True)
        self._probes = {f"expert_rows_{rows}": self._expert_step(rows, given)
                        for rows, given in [(0, num_expert)] + self.levels}
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

    def _expert_step(self, rows: int, given: int) -> Callable[[], None]:
        """The experts' step with `rows` rows for each of the first `given` experts, none for the rest."""
        counts = torch.zeros(self.num_expert, dtype=torch.long)
        counts[:given] = rows
        x = torch.randn(rows * given, self.model.d_model, requires_grad=True)

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

    def _shadow_steps(self) -> tuple:
        """The layer of `model`'s shapes over `size` tokens per rank with rank 0's first
        experts (`probe_shadowed`) shadowed and without. The tokens go round robin to the other
        experts: shadowing then moves no rows, and the difference is what shadowing itself costs
        while the ranks compute (the transfers, their copies, the shadowed copies' gradients)."""
        import torch.distributed as dist

        import fmoe
        from fmoe.distributed.shadow import ShadowPolicy
        from fmoe.gates.round_robin import RoundRobinGate
        shadowed = self.probe_shadowed

        class ShadowFirst(ShadowPolicy):
            def choose(self, counts_E, world_size, group=None):
                self.gather_counts(counts_E, world_size, group)     # the collective of real use
                return shadowed

        world = dist.get_world_size(self.group)
        x = torch.randn(self.size, self.model.d_model, requires_grad=True)

        def step_of(shadow):
            layer = fmoe.FMoETransformerMLP(num_expert=self.num_expert, d_model=self.model.d_model,
                                            d_hidden=self.model.d_hidden, top_k=1, world_size=world,
                                            moe_group=self.group, gate=RoundRobinGate,
                                            gate_kwargs={"first_expert": len(shadowed)}, shadow=shadow)

            def step():
                layer.zero_grad(set_to_none=True)
                layer(x).sum().backward()
            return step
        return step_of(False), step_of(ShadowFirst(self.model))

    def fit_times(self, times: Dict[str, List[float]]) -> PerfModel:
        """`fit` of each probe's seconds run by run, as `time_in_turns` gives them: the medians,
        and what shadowing adds as the median of the shadowed probe less the unshadowed one of
        the same round (`paired_difference`)."""
        added = (paired_difference(times["shadow_on"], times["shadow_off"])
                 if "shadow_on" in times and "shadow_off" in times else None)
        return self.fit(medians(times), shadow_added=added)

    def fit(self, seconds: Dict[str, float], shadow_added: Optional[float] = None) -> PerfModel:
        """`model` with the constants the probes' (median) seconds give; when distributed, the same
        on every rank (the slowest rank's: least throughput, most fixed time). `shadow_added`:
        the seconds shadowing the probe's experts adds, if not the difference of the medians."""
        import torch.distributed as dist
        model = self.model
        missing = sorted(set(self._probes) - set(seconds))
        if missing:
            raise ValueError(f"Calibration.fit: seconds has no time for the probes {missing}")
        curve = self._expert_curve(seconds)
        if self.distributed:                # the slowest rank's curve, the same on every rank
            slowest = torch.tensor([t for _, t in curve], dtype=torch.double)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=self.group)
            curve = tuple((rows, t) for (rows, _), t in zip(curve, slowest.tolist()))
        # FasterMoE's FLOP/s and a time per expert: the line through the curve from the balanced
        # rows per expert to the next level, where a busiest rank's experts lie.
        at = [rows for rows, _ in curve].index(self.balanced)
        (r0, t0), (r1, t1) = curve[at], curve[at + 1]
        per_row = max(t1 - t0, 1e-3 * t1) / (r1 - r0)
        flops = 3 * 4 * model.alpha * model.d_model ** 2 / per_row
        per_expert = max(0.0, t0 - per_row * r0)
        if not self.distributed:
            return replace(model, flops=flops, time_per_expert=per_expert, expert_seconds=curve)
        bandwidth = self.exchange.numel() * self.exchange.element_size() / seconds["all_to_all"]
        pull, push = model.expert_bytes / seconds["pull"], model.expert_bytes / seconds["push"]
        measured = replace(model, flops=flops, net_bandwidth=bandwidth, time_per_expert=per_expert,
                           pull_bandwidth=pull, push_bandwidth=push, expert_seconds=curve)
        world = dist.get_world_size(self.group)
        overhead = model.overhead_per_row
        if self.tokens > 0:                 # the width-1 layer was probed
            counts_WE = torch.full((world, world), self.tokens / world, dtype=torch.double)
            tiny = replace(measured, d_hidden=1, time_per_expert=0.0, expert_seconds=None)
            overhead = max(0.0, seconds["width_one_layer"] - tiny.layer_time(counts_WE)) / self.tokens
        # What a shadowed expert adds beyond what the model already counts (the idle copies the
        # other ranks then run), measured while the ranks compute: the transfers' and copies' time is taken
        # from the compute where they share the cores or the memory. Never below the modelled
        # transfers: a noisy difference must not make shadowing look free.
        k = len(self.probe_shadowed)
        counts_WE = torch.full((world, world * self.num_expert), self.size / (world * self.num_expert - k),
                               dtype=torch.double)
        counts_WE[:, :k] = 0                # the probe's routing: none to the shadowed experts
        unshadowed = replace(measured, shadow_time_per_expert=0.0)
        modelled = unshadowed.layer_time(counts_WE, self.probe_shadowed) - unshadowed.layer_time(counts_WE)
        added = seconds["shadow_on"] - seconds["shadow_off"] if shadow_added is None else shadow_added
        shadow = max((added - modelled) / k, replace(measured, shadow_time_per_expert=None).shadow_cost(1))
        rates = torch.tensor([flops, bandwidth, pull, push], dtype=torch.double)
        dist.all_reduce(rates, op=dist.ReduceOp.MIN, group=self.group)
        costs = torch.tensor([overhead, per_expert, shadow], dtype=torch.double)
        dist.all_reduce(costs, op=dist.ReduceOp.MAX, group=self.group)
        flops, bandwidth, pull, push = rates.tolist()
        overhead, per_expert, shadow = costs.tolist()
        return replace(measured, flops=flops, net_bandwidth=bandwidth, overhead_per_row=overhead,
                       time_per_expert=per_expert, pull_bandwidth=pull, push_bandwidth=push,
                       shadow_time_per_expert=shadow)

    def _expert_curve(self, seconds: Dict[str, float]) -> tuple:
        """(rows, seconds) of one expert: an expert with no rows costs the no-rows step's share;
        at a level, the step less its idle experts' share, over the experts given rows."""
        idle = seconds["expert_rows_0"] / self.num_expert
        return ((0, idle),) + tuple((rows, (seconds[f"expert_rows_{rows}"] - (self.num_expert - given) * idle) / given)
                                    for rows, given in self.levels)


def expert_levels(size: int, num_expert: int) -> List[Tuple[int, int]]:
    """(rows per expert, experts given them) of the expert curve's probes, rows ascending: a
    quarter of the balanced rows per expert b, b, 4 b (if below 2 size), size (an expert holding a
    rank's whole batch) and 2 size; each level to as many experts as `size` rows fill, at least one."""
    balanced = max(1, size // num_expert)
    rows = sorted({max(1, balanced // 4), balanced, min(4 * balanced, 2 * size), size, 2 * size})
    return [(r, min(num_expert, max(1, size // r))) for r in rows]


def medians(times: Dict[str, List[float]]) -> Dict[str, float]:
    return {name: statistics.median(ts) for name, ts in times.items()}


def paired_difference(with_: List[float], without: List[float]) -> float:
    """The median of the differences of two steps timed in the same rounds, round by round. A shared
    machine's slow phase then slows both sides of a difference alike; the difference of the two
    medians can take one side's median from a slow round and the other's from a fast one."""
    if len(with_) != len(without) or not with_:
        raise ValueError(f"paired_difference: needs one time per round on both sides, got {len(with_)} "
                         f"and {len(without)}")
    return statistics.median(a - b for a, b in zip(with_, without))


def calibrate(model: PerfModel, group=None, size: int = 1024, reps: int = 5, tokens: int = 0,
              num_expert: int = 1) -> PerfModel:
    """`model` with this machine's constants for its shapes: the probes of `Calibration(model,
    group, size, tokens, num_expert)` timed `reps` times each, taking turns, and fitted."""
    calibration = Calibration(model, group, size, tokens, num_expert)
    return calibration.fit_times(time_in_turns(calibration.probes(), reps, group=group))
