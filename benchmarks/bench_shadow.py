"""Shadowing policies side by side: 2 ranks (gloo, one thread each), d_model 1024, d_hidden 4096.

    python benchmarks/bench_shadow.py [--tokens 2048] [--num-expert 16] [--reps 5] [--keep-freed-memory] [--out FILE]

Cases (fixed top-1 routing): `uniform`, `half_to_one_expert` (expert 0 takes half of all tokens,
the rest spread evenly), `eighty_to_one_expert` (80%), and any `--extra` distribution of
`fmoe simulate` (`hot:P`, `zipf:S`) for the simulator's validation. Per case, the median
forward+backward time per step (the variants take turns step by step, each step from no
gradients) with: shadowing off; the dynamic policy (FasterMoE's model, constants calibrated
here); static replication (DeepSeek EPLB style: the top `--static-replicas` experts by load over
the last `--static-window` steps are replicated for the next ones); and the hottest expert
always shadowed. `ideal_speedup` is the busiest rank's rows before over after free shadowing,
from the measured counts; `balanced_bound_speedup` is the shadowing-off step over the balanced
(uniform) step scaled to the busiest rank's rows after free shadowing: the ideal once the step's
fixed costs are counted. Every case's variants and the calibration's probes (fmoe.perf.calibration)
take turns step by step; the probes' fit is the run's `model`, which `fmoe simulate --compare`
predicts the steps with; the dynamic policy uses constants calibrated before the first step
(`policy_model`). Writes JSON only with `--out` (the committed
figure is benchmarks/results/shadow-cpu.json, run on a quiet machine).
"""
import argparse
import os
import statistics
import sys
from collections import deque
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fmoe  # noqa: E402
from fmoe.observe import cpu_memory  # noqa: E402
from common import machine, run_on_ranks  # noqa: E402
from fmoe.app.files import write_json  # noqa: E402
from fmoe.distributed.shadow import ShadowPolicy  # noqa: E402
from fmoe.gates.base import BaseGate, LinearRouter  # noqa: E402
from fmoe.perf.calibration import Calibration, calibrate, time_in_turns  # noqa: E402
from fmoe.perf.perfmodel import PerfModel  # noqa: E402
from fmoe.perf.simulate import constants_of, describe, expert_shares  # noqa: E402

CASES = {"uniform": "uniform", "half_to_one_expert": "hot:0.5", "eighty_to_one_expert": "hot:0.8"}
VARIANTS = ("off", "dynamic", "static", "forced")


class PresetGate(BaseGate):
    """Top-1 routing fixed by a distribution of `fmoe simulate`; weights from a real router so its
    gradient flows. Tokens go to experts in contiguous runs of the distribution's counts."""

    def __init__(self, d_model, num_expert, world_size=1, top_k=1, distribution="uniform", **_):
        super().__init__(d_model, num_expert, world_size, 1)
        self.gate = LinearRouter(d_model, self.tot_expert)
        self.distribution = distribution

    def route(self, x_TD):
        T, E = x_TD.shape[0], self.tot_expert
        counts_E = (expert_shares(self.distribution, E) * T).floor().long()
        counts_E[torch.arange(T - int(counts_E.sum())) % E] += 1          # the remainder, round robin
        idx_TK = torch.repeat_interleave(torch.arange(E, device=x_TD.device), counts_E.to(x_TD.device))[:, None]
        logits_TE = self.gate(x_TD)
        weight_TK = torch.sigmoid(logits_TE.gather(1, idx_TK).float())
        return idx_TK, weight_TK, weight_TK, logits_TE, logits_TE.new_zeros(())


class AlwaysShadowHottest(ShadowPolicy):
    """Shadows the most loaded expert whatever the model says: what the mechanism itself buys."""

    def choose(self, counts_E, world_size, group=None):
        return [int(self.gather_counts(counts_E, world_size, group).sum(0).argmax())]


class StaticReplication(ShadowPolicy):
    """EPLB-style static replication: every `window` steps, the `replicas` experts with the most
    load over the last `window` steps are replicated (shadowed) for the next `window` steps."""

    def __init__(self, model, replicas: int = 1, window: int = 4):
        super().__init__(model)
        self.replicas, self.window = replicas, window
        self.history = deque(maxlen=window)
        self.steps = 0
        self.current = []

    def choose(self, counts_E, world_size, group=None):
        if self.steps % self.window == 0 and self.history:
            load_E = torch.stack(list(self.history)).sum(0)
            self.history.clear()
            dist.all_reduce(load_E, group=group)                         # every rank picks the same
            self.current = torch.topk(load_E, self.replicas).indices.tolist()
        self.history.append(counts_E.detach().clone())
        self.steps += 1
        return list(self.current)


def step_times(layers: dict, cases: dict, statics: dict, x, reps: int, probes: dict, static_window: int) -> dict:
    """Forward+backward seconds of every (case, variant) step and of the calibration's probes, all
    taking turns step by step: a drift of this shared VM's speed then hits every case, every
    variant and the constants that predict them alike. A case is the layer's gate routing by its
    distribution (and, for the static baseline, that case's own load history); each step starts
    from no gradients, as after an optimizer's zero_grad. Keys: "case/variant" and the probes'."""
    def step_of(case, variant):
        layer = layers[variant]

        def step():
            layer.gate.distribution = cases[case]
            if variant == "static":
                layer.shadow_policy = statics[case]
            layer.zero_grad(set_to_none=True)
            layer(x).sum().backward()
        return step
    steps = {f"{case}/{v}": step_of(case, v) for case in cases for v in layers}
    for case in cases:                  # each static baseline fills its load history first
        for _ in range(static_window):
            steps[f"{case}/static"]()
    return time_in_turns({**steps, **probes}, reps)


def ideal_speedup(counts_WE: torch.Tensor, d_model: int, d_hidden: int) -> tuple:
    """The busiest rank's rows (in balanced shares) before and after free shadowing, and their ratio."""
    free = PerfModel(d_model, d_hidden, flops=1.0, net_bandwidth=float("inf"))
    before_W = free.worker_rows(counts_WE)
    after_W = free.worker_rows(counts_WE, free.choose_shadowed(counts_WE))
    balanced = float(counts_WE.sum()) / counts_WE.shape[0]
    return float(before_W.max()) / balanced, float(after_W.max()) / balanced, float(before_W.max() / after_W.max())


def worker(rank, world, args):
    if args.keep_freed_memory:
        cpu_memory.keep_freed_memory()
    e = args.num_expert // world
    shapes = dict(size=args.tokens, tokens=args.tokens, num_expert=e)
    # The policy's constants, measured before any case; the simulator's are timed in turns with the
    # cases' steps (`beside`), as a 5-step calibration ahead of them was 7-11% off their speed.
    model = calibrate(PerfModel(args.d_model, args.d_hidden), reps=max(5, args.reps), **shapes)
    beside = Calibration(PerfModel(args.d_model, args.d_hidden), **shapes)
    cases = dict(CASES, **{d: d for d in args.extra})
    statics = {case: StaticReplication(model, args.static_replicas, args.static_window) for case in cases}
    policies = {"off": False, "dynamic": ShadowPolicy(model), "forced": AlwaysShadowHottest(model),
                "static": next(iter(statics.values()))}
    layers = {}
    for variant in VARIANTS:
        torch.manual_seed(0)
        layers[variant] = fmoe.FMoETransformerMLP(
            num_expert=e, d_model=args.d_model, d_hidden=args.d_hidden, top_k=1, world_size=world,
            gate=PresetGate, gate_kwargs={"distribution": "uniform"}, shadow=policies[variant])
    x = torch.randn(args.tokens, args.d_model, requires_grad=True)
    times = step_times(layers, cases, statics, x, args.reps, beside.probes(), args.static_window)
    probe_times = {name: times[name] for name in beside.probes()}
    results = {}
    for case, distribution in cases.items():
        row = {"distribution": distribution}
        for v in VARIANTS:
            steps = times[f"{case}/{v}"]
            row[f"{v}_s"], row[f"{v}_steps_s"] = statistics.median(steps), steps
        layers["off"].gate.distribution = distribution
        layers["off"](x)                                  # its counts, untimed
        counts_WE = ShadowPolicy(model).gather_counts(layers["off"].last_counts_E, world)
        row["counts_WE"] = counts_WE.tolist()
        row["rank_loads_before"], row["rank_loads_after_free_shadowing"], row["ideal_speedup"] = \
            ideal_speedup(counts_WE, args.d_model, args.d_hidden)
        row["shadowed_experts"] = model.choose_shadowed(counts_WE)     # what the dynamic layer shadowed
        row["speedup"] = row["off_s"] / row["dynamic_s"]
        row["static_speedup"] = row["off_s"] / row["static_s"]
        row["forced_speedup"] = row["off_s"] / row["forced_s"]
        row["fraction_of_ideal"] = row["speedup"] / row["ideal_speedup"]
        # The ideal assumes a step's time is its busiest rank's rows; the balanced (uniform) step
        # measured here says what a step of that many rows takes, fixed costs included.
        if "uniform" in results:
            row["balanced_bound_speedup"] = row["off_s"] / (results["uniform"]["off_s"]
                                                            * row["rank_loads_after_free_shadowing"])
            row["fraction_of_balanced_bound"] = row["speedup"] / row["balanced_bound_speedup"]
        results[case] = row
    # The simulator's constants, from the probes timed in turns with every case's steps.
    simulator = beside.fit_times(probe_times)
    for row in results.values():
        counts_WE = torch.tensor(row["counts_WE"], dtype=torch.double)
        row["predicted_off_s"] = simulator.layer_time(counts_WE)
        row["predicted_dynamic_s"] = simulator.layer_time(counts_WE, row["shadowed_experts"])
    return {"results": results, "model": constants_of(simulator), "policy_model": constants_of(model),
            "probes_s": probe_times}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--d-hidden", type=int, default=4096)
    p.add_argument("--num-expert", type=int, default=16, help="experts in all")
    p.add_argument("--reps", type=int, default=5, help="timed steps per variant (median); the calibration takes as many (at least 5)")
    p.add_argument("--static-replicas", type=int, default=1, help="experts the static baseline replicates")
    p.add_argument("--static-window", type=int, default=4, help="steps of load history per static re-plan")
    p.add_argument("--extra", nargs="*", default=[],
                   help="more distributions (hot:P, zipf:S), e.g. for `fmoe simulate --compare`")
    p.add_argument("--keep-freed-memory", action="store_true",
                   help="each rank's malloc keeps freed blocks (fmoe.observe.cpu_memory): no page faults per fresh "
                        "tensor")
    p.add_argument("--out", help="write the results as JSON here (e.g. benchmarks/results/shadow-cpu.json)")
    args = p.parse_args(argv)
    for d in args.extra:
        expert_shares(d, args.num_expert)           # a bad distribution fails before any rank starts
    if args.num_expert % 2 or args.static_replicas < 1 or args.static_window < 1:
        raise ValueError("--num-expert must be even (2 ranks); --static-replicas and --static-window >= 1")
    out = run_on_ranks(worker, 2, args)
    m = out["model"]
    allocator = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_") or k == "LD_PRELOAD"}
    out["allocator_env"] = allocator
    print(f"2 ranks x 1 thread, gloo; {args.tokens} tokens/rank, D={args.d_model} F={args.d_hidden}, "
          f"{args.num_expert} experts, top-1;\n  the policy's model (calibrated first): {describe(out['policy_model'])}"
          f"\n  the simulator's (its probes timed in turns with the steps): {describe(m)}")
    print(f"{'case':22s}{'off ms':>8s}{'dynamic':>9s}{'static':>8s}{'forced':>8s}{'speedup':>9s}{'ideal':>7s}"
          f"{'of ideal':>9s}{'bound':>7s}{'of bound':>9s}{'static x':>9s}{'forced x':>9s}  shadowed")
    for name, r in out["results"].items():
        bound = (f"{r['balanced_bound_speedup']:6.2f}x{r['fraction_of_balanced_bound']:8.0%}"
                 if "balanced_bound_speedup" in r else f"{'-':>7s}{'-':>9s}")
        print(f"{name:22s}{r['off_s'] * 1e3:8.1f}{r['dynamic_s'] * 1e3:9.1f}{r['static_s'] * 1e3:8.1f}"
              f"{r['forced_s'] * 1e3:8.1f}{r['speedup']:8.2f}x{r['ideal_speedup']:6.2f}x{r['fraction_of_ideal']:8.0%}"
              f"{bound}{r['static_speedup']:8.2f}x{r['forced_speedup']:8.2f}x  {r['shadowed_experts']}")
    if args.out:
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, {"config": vars(args), "machine": machine(), **out}, indent=2)
        print(f"wrote {path}")
    else:
        print("not written (pass --out FILE to keep the results)")


if __name__ == "__main__":
    main()
