"""FasterMoE's performance model (PPoPP'22, section 4.1) and its shadowing policy.

With H = d_model, alpha = d_hidden / d_model, P the compute throughput (FLOP/s) and W_net the
network bandwidth per worker (bytes/s), a worker that processes B rows spends

    compute(B) = 3 * 4 * B * alpha * H^2 / P       (two GEMMs of 2*B*H*alpha*H FLOPs; x3 fwd+bwd)
    traffic(B) = 4 * B * H * s / W_net             (rows out and back, forward and backward)

with s the bytes per element. The layer takes as long as its slowest worker. Shadowing r
experts moves their rows home (loads B -> B') and costs a broadcast of their parameters and a
reduction of their gradients: r * 2 * alpha * H^2 * s * (1 / W_pull + 1 / W_push), which is
FasterMoE's 2 * r * 2 * alpha * H^2 * s / W_net while the two bandwidths are left at W_net.
Calibrated, it is r times `shadow_time_per_expert`, what shadowing one expert adds to a small
layer step here beyond the one more expert a rank then runs (the transfers, their packing and
the fresh buffers they need).

Two fixed costs, 0 unless calibrated, complete a measured step: each worker spends
`overhead_per_row` per routed row of its own tokens (the gate, the permutes, the exchange's
bookkeeping), and `time_per_expert` per expert it runs, its own and the shadowed ones alike (the
expert's fresh gradient and the part of its GEMMs that does not scale with rows: the intercept
of an expert's step time against its rows).

The smart schedule splits the exchange into `steps` chunks and pipelines the three stages of
each pass (rows out, compute, rows back; forward, then backward with twice the compute): a
pipeline of stages a, b, c over n chunks takes (a + b + c) / n + (n - 1) * max(a, b, c) / n.
"""
from dataclasses import dataclass
from typing import List, Optional, Sequence

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
    time_per_expert: float = 0.0    # seconds per expert a worker runs, fwd + bwd, whatever its rows
    pull_bandwidth: Optional[float] = None   # bytes/s of a shadowed expert's broadcast (None: W_net)
    push_bandwidth: Optional[float] = None   # bytes/s of its gradients' reduction (None: W_net)
    shadow_time_per_expert: Optional[float] = None  # measured seconds a shadowed expert adds (None: modelled)

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

    @property
    def expert_bytes(self) -> float:
        """One expert's parameters: two d_model x d_hidden matrices."""
        return 2 * self.alpha * self.d_model ** 2 * self.bytes_per_element

    def shadow_cost(self, num_shadowed: int) -> float:
        """Broadcast of the parameters and reduction of the gradients of the shadowed experts
        (measured whole, packing and fresh buffers included, when calibrated)."""
        if self.shadow_time_per_expert is not None:
            return num_shadowed * self.shadow_time_per_expert
        pull = self.pull_bandwidth or self.net_bandwidth
        push = self.push_bandwidth or self.net_bandwidth
        return num_shadowed * self.expert_bytes * (1 / pull + 1 / push)

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
        W, E = counts_WE.shape
        rows_W = self.worker_rows(counts_WE, shadowed)
        owner_S = [e // (E // W) for e in shadowed]
        experts_W = [E // W + sum(o != w for o in owner_S) for w in range(W)]
        slowest = max(self.worker_time(float(b), schedule_steps) + self.time_per_expert * n
                      for b, n in zip(rows_W, experts_W))
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
        time_R = rows_R * self.worker_time(1.0, schedule_steps) + r_R * (self.shadow_cost(1) + self.time_per_expert)
        falls_R = time_R[1:] < time_R[:-1]
        num_shadowed = torch.cumprod(falls_R.long(), 0).sum()
        return order_E[:num_shadowed].tolist()


def pipeline_time(stages: Sequence[float], steps: int) -> float:
    """Stages run one after another per chunk; chunks overlap (a pipeline over `steps` chunks)."""
    return sum(stages) / steps + (steps - 1) * max(stages) / steps
