"""FasterMoE's performance model (PPoPP'22, section 4.1) and its shadowing policy.

With H = d_model, alpha = d_hidden / d_model, P the compute throughput (FLOP/s) and W_net the
network bandwidth per worker (bytes/s), a worker that processes B rows spends

    compute(B) = 3 * 4 * B * alpha * H^2 / P       (two GEMMs of 2*B*H*alpha*H FLOPs; x3 fwd+bwd)
    traffic(B) = 4 * B * H * s / W_net             (rows out and back, forward and backward)

with s the bytes per element. The layer takes as long as its slowest worker. Shadowing r
experts moves their rows home (loads B -> B') and costs a broadcast of their parameters and a
reduction of their gradients: 2 * r * 2 * alpha * H^2 * s / W_net.

Besides, every worker spends a fixed time per routed row of its own tokens (the gate, the
permutes, the exchange's bookkeeping): `overhead_per_row`, 0 unless calibrated. It is the same
on every worker and does not change the policy, but it is there in a measured step.

The smart schedule splits the exchange into `steps` chunks and pipelines the three stages of
each pass (rows out, compute, rows back; forward, then backward with twice the compute): a
pipeline of stages a, b, c over n chunks takes (a + b + c) / n + (n - 1) * max(a, b, c) / n.
"""
import time
from dataclasses import dataclass, replace
from typing import List, Sequence

import torch

from fmoe.env import env_float


@dataclass(frozen=True)
class PerfModel:
    d_model: int
    d_hidden: int
    flops: float = 11.5e12          # P: compute throughput, FLOP/s
    net_bandwidth: float = 50e9 / 8  # W_net: bytes/s per worker
    bytes_per_element: int = 4
    overhead_per_row: float = 0.0   # seconds per routed row of a worker's own tokens, fwd + bwd

    @property
    def alpha(self) -> float:
        return self.d_hidden / self.d_model

    @classmethod
    def from_env(cls, d_model: int, d_hidden: int, bytes_per_element: int = 4) -> "PerfModel":
        """FastMoE's environment knobs: FMOE_FASTER_GLBPLC_GPUTP (FLOP/s), FMOE_FASTER_GLBPLC_NETBW (bytes/s)."""
        return cls(d_model, d_hidden, flops=env_float("FMOE_FASTER_GLBPLC_GPUTP", 11.5e12),
                   net_bandwidth=env_float("FMOE_FASTER_GLBPLC_NETBW", 50e9 / 8),
                   bytes_per_element=bytes_per_element)

    def compute_time(self, rows) -> float:
        return 3 * 4 * rows * self.alpha * self.d_model ** 2 / self.flops

    def traffic_time(self, rows) -> float:
        return 4 * rows * self.d_model * self.bytes_per_element / self.net_bandwidth

    def shadow_cost(self, num_shadowed: int) -> float:
        """Broadcast of the parameters and reduction of the gradients of the shadowed experts."""
        return 2 * num_shadowed * 2 * self.alpha * self.d_model ** 2 * self.bytes_per_element / self.net_bandwidth

    def worker_time(self, rows: float, schedule_steps: int = 1) -> float:
        """One worker's compute and traffic; pipelined over `schedule_steps` chunks (1: in turn)."""
        compute, traffic = self.compute_time(rows), self.traffic_time(rows)
        forward = pipeline_time([traffic / 4, compute / 3, traffic / 4], schedule_steps)
        backward = pipeline_time([traffic / 4, 2 * compute / 3, traffic / 4], schedule_steps)
        return forward + backward

    def worker_rows(self, counts_WE: torch.Tensor, shadowed: Sequence[int] = ()) -> torch.Tensor:
        """Rows each worker processes: its experts' rows from everyone, plus its own rows for the
        shadowed experts (which then no longer come to their owner)."""
        W, E = counts_WE.shape
        home_E = torch.zeros(E, dtype=torch.bool, device=counts_WE.device)
        home_E[list(shadowed)] = True
        return self._rows(counts_WE.double(), home_E[None])[0]

    @staticmethod
    def _rows(counts_WE: torch.Tensor, home_RE: torch.Tensor) -> torch.Tensor:
        """rows_RW for each of R shadow sets (home_RE: expert e computed at home in set r)."""
        W, E = counts_WE.shape
        owner_E = torch.arange(E, device=counts_WE.device) // (E // W)
        owned_WE = owner_E[None] == torch.arange(W, device=counts_WE.device)[:, None]
        load_E = counts_WE.sum(0)
        remote_RW = (~home_RE).double() * load_E @ owned_WE.double().t()
        local_RW = home_RE.double() @ counts_WE.t()
        return remote_RW + local_RW

    def layer_time(self, counts_WE: torch.Tensor, shadowed: Sequence[int] = (), schedule_steps: int = 1) -> float:
        """Modelled time of the layer: Lat_imbl with no shadowed experts, Lat_shadow(r) otherwise."""
        rows_W = self.worker_rows(counts_WE, shadowed)
        slowest = max(self.worker_time(float(b), schedule_steps) for b in rows_W)
        own_rows = float(counts_WE.sum(1).max())
        return slowest + self.shadow_cost(len(shadowed)) + self.overhead_per_row * own_rows

    def choose_shadowed(self, counts_WE: torch.Tensor, schedule_steps: int = 1) -> List[int]:
        """Algorithm 1: hottest experts first, shadowed one by one while the modelled time falls.

        Vectorised over the E + 1 prefixes of the hottest-first order (a worker's time is linear
        in its rows), so the only host transfer is the chosen ids."""
        counts_WE = counts_WE.double()
        E = counts_WE.shape[1]
        order_E = torch.argsort(counts_WE.sum(0), descending=True, stable=True)
        prefix_RE = torch.arange(E + 1, device=counts_WE.device)[:, None] > torch.arange(E, device=counts_WE.device)
        home_RE = torch.zeros_like(prefix_RE).scatter(1, order_E.expand(E + 1, E), prefix_RE)
        rows_R = self._rows(counts_WE, home_RE).max(1).values
        r_R = torch.arange(E + 1, device=counts_WE.device, dtype=torch.double)
        time_R = rows_R * self.worker_time(1.0, schedule_steps) + r_R * self.shadow_cost(1)
        falls_R = time_R[1:] < time_R[:-1]
        num_shadowed = torch.cumprod(falls_R.long(), 0).sum()
        return order_E[:num_shadowed].tolist()


def pipeline_time(stages: Sequence[float], steps: int) -> float:
    """Stages run one after another per chunk; chunks overlap (a pipeline over `steps` chunks)."""
    return sum(stages) / steps + (steps - 1) * max(stages) / steps


def _median_time(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def calibrate(model: PerfModel, group=None, size: int = 1024, reps: int = 5, tokens: int = 0) -> PerfModel:
    """Measure this machine's constants for `model`'s shapes: the FLOP/s of one expert's MLP
    (forward and backward over `size` rows, fmoe's own kernels), and, when distributed, the
    all-to-all bytes/s and, with `tokens` > 0, the fixed time per routed row (a layer step over
    `tokens` tokens with experts of width 1, less its modelled compute and traffic)."""
    import torch.distributed as dist

    from fmoe.experts import GroupedExperts
    experts = GroupedExperts(1, model.d_model, model.d_hidden, "gelu", bias=True)
    x = torch.randn(size, model.d_model, requires_grad=True)
    counts = torch.tensor([size])

    def expert_step():
        experts.zero_grad(set_to_none=True)
        experts(x, counts).sum().backward()
    flops = 3 * 4 * size * model.alpha * model.d_model ** 2 / _median_time(expert_step, reps)
    bandwidth, overhead = model.net_bandwidth, model.overhead_per_row
    distributed = dist.is_initialized() and dist.get_world_size(group) > 1
    if distributed:
        buf = torch.randn(2 ** 20)      # 4 MiB: the size of a dispatch, past the latency-bound sizes
        out = torch.empty_like(buf)
        dist.all_to_all_single(out, buf, group=group)
        start = time.perf_counter()
        for _ in range(reps):
            dist.all_to_all_single(out, buf, group=group)
        bandwidth = buf.numel() * buf.element_size() * reps / (time.perf_counter() - start)
    measured = replace(model, flops=flops, net_bandwidth=bandwidth)
    if distributed and tokens > 0:
        overhead = _overhead_per_row(measured, group, tokens, reps)
    if distributed:
        both = torch.tensor([flops, bandwidth, overhead], dtype=torch.double)
        dist.all_reduce(both, op=dist.ReduceOp.MIN, group=group)   # everyone must use the same model
        flops, bandwidth, _ = both.tolist()
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        overhead = both[2].item()
    return replace(model, flops=flops, net_bandwidth=bandwidth, overhead_per_row=overhead)


def _overhead_per_row(model: PerfModel, group, tokens: int, reps: int) -> float:
    """A layer step's time beyond the modelled expert compute and traffic, per routed row: one
    expert per worker of width 1, top-1, a uniform round-robin routing, same d_model."""
    import torch.distributed as dist

    import fmoe
    from fmoe.gates.round_robin import RoundRobinGate

    world = dist.get_world_size(group)
    layer = fmoe.FMoETransformerMLP(num_expert=1, d_model=model.d_model, d_hidden=1, top_k=1, world_size=world,
                                    moe_group=group, gate=RoundRobinGate)
    x = torch.randn(tokens, model.d_model, requires_grad=True)

    def layer_step():
        dist.barrier(group=group)
        layer(x).sum().backward()
    seconds = _median_time(layer_step, reps)
    counts_WE = torch.full((world, world), tokens / world, dtype=torch.double)
    tiny = replace(model, d_hidden=1)
    return max(0.0, seconds - tiny.layer_time(counts_WE)) / tokens
