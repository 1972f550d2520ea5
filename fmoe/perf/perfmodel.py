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

A step's GEMMs are not linear in rows: an expert's rows per call set how well its GEMMs use the
machine (small calls pay their fixed costs, large ones run out of cache). Calibrated with
`expert_seconds`, the measured forward+backward seconds of one expert at a few row counts, a
worker's compute is instead the sum, over the experts it runs, of that curve at their rows
(linear between the measured points and along the end segments beyond them); it then replaces
compute(B) and `time_per_expert`.

The deduplicated exchange (`exchange="rank"`) moves one row per token and destination rank, not
one per routed slot: a worker's traffic is then `row_share_W` times its rows, that share (at
most 1) the rows it would receive deduplicated over the rows it receives one per slot
(`dedup_row_share` estimates it from the routing's distribution). Shadowing a set of experts
is taken to shrink the deduplicated rows in the same proportion as the slots.

The smart schedule splits the exchange into `steps` chunks and pipelines the three stages of
each pass (rows out, compute, rows back; forward, then backward with twice the compute): a
pipeline of stages a, b, c over n chunks takes (a + b + c) / n + (n - 1) * max(a, b, c) / n.
"""
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from fmoe.env import env_float


@dataclass(frozen=True)
class PerfModel:
    """FasterMoE's time model of one MoE layer step for `d_model` x `d_hidden` experts (the module
    docstring has the formulas); `from_env` reads FastMoE's `FMOE_FASTER_GLBPLC_*` constants and
    `fmoe.calibration.calibrate` measures them."""

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
    expert_seconds: Optional[Tuple[Tuple[float, float], ...]] = None  # measured (rows, s) of one expert, fwd + bwd

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

    def worker_time(self, rows, schedule_steps: int = 1, compute=None, row_share=1.0):
        """One worker's compute and traffic; pipelined over `schedule_steps` chunks (1: in turn).
        `compute`: the compute time when known otherwise (the expert curve); else compute(rows).
        `row_share`: the part of the rows that travel (the deduplicated exchange's).
        Floats or tensors of the same shape."""
        compute = self.compute_time(rows) if compute is None else compute
        traffic = self.traffic_time(rows * row_share)
        forward = pipeline_time([traffic / 4, compute / 3, traffic / 4], schedule_steps)
        backward = pipeline_time([traffic / 4, 2 * compute / 3, traffic / 4], schedule_steps)
        return forward + backward

    def expert_time(self, rows: torch.Tensor) -> torch.Tensor:
        """Seconds of one expert's forward+backward over `rows` rows, from `expert_seconds`."""
        points = torch.tensor(sorted(self.expert_seconds), dtype=torch.double, device=rows.device)
        if points.shape[0] < 2:
            raise ValueError(f"PerfModel.expert_seconds needs at least 2 (rows, seconds) points, got {self.expert_seconds}")
        rows = rows.double()
        segment = torch.searchsorted(points[1:-1, 0].contiguous(), rows, right=True)   # 0 .. len - 2
        (r0, s0), (r1, s1) = points[segment].unbind(-1), points[segment + 1].unbind(-1)
        return s0 + (rows - r0) * (s1 - s0) / (r1 - r0)

    def worker_rows(self, counts_WE: torch.Tensor, shadowed: Sequence[int] = ()) -> torch.Tensor:
        """Rows each worker processes: its experts' rows from everyone, plus its own rows for the
        shadowed experts (which then no longer come to their owner)."""
        return self._rows(counts_WE.double(), self._home(counts_WE, [shadowed]))[0]

    @staticmethod
    def _home(counts_WE: torch.Tensor, shadow_sets: Sequence[Sequence[int]]) -> torch.Tensor:
        """home_RE: expert e computed at home (shadowed) in set r."""
        home_RE = torch.zeros(len(shadow_sets), counts_WE.shape[1], dtype=torch.bool, device=counts_WE.device)
        for r, shadowed in enumerate(shadow_sets):
            home_RE[r, list(shadowed)] = True
        return home_RE

    @staticmethod
    def _owned(counts_WE: torch.Tensor) -> torch.Tensor:
        """owned_WE: expert e lives on worker w (experts laid out in equal consecutive blocks)."""
        W, E = counts_WE.shape
        owner_E = torch.arange(E, device=counts_WE.device) // (E // W)
        return owner_E[None] == torch.arange(W, device=counts_WE.device)[:, None]

    @classmethod
    def _rows(cls, counts_WE: torch.Tensor, home_RE: torch.Tensor) -> torch.Tensor:
        """rows_RW for each of R shadow sets (home_RE: expert e computed at home in set r)."""
        owned_WE = cls._owned(counts_WE)
        load_E = counts_WE.sum(0)
        remote_RW = (~home_RE).double() * load_E @ owned_WE.double().t()
        local_RW = home_RE.double() @ counts_WE.t()
        return remote_RW + local_RW

    def _compute(self, counts_WE: torch.Tensor, home_RE: torch.Tensor) -> torch.Tensor:
        """compute_RW: each worker's expert compute in each shadow set. Without the expert curve,
        compute(rows) plus `time_per_expert` per expert run (its own and the shadowed ones); with
        it, the curve summed over the experts run at their rows there."""
        owned_WE = self._owned(counts_WE)
        if self.expert_seconds is None:
            runs_RW = owned_WE.sum(1) + home_RE.double() @ (~owned_WE).double().t()
            return self.compute_time(self._rows(counts_WE, home_RE)) + self.time_per_expert * runs_RW
        runs_RWE = owned_WE[None] | home_RE[:, None, :]
        rows_RWE = torch.where(home_RE[:, None, :], counts_WE[None], owned_WE[None] * counts_WE.sum(0))
        return torch.where(runs_RWE, self.expert_time(rows_RWE), 0.0).sum(-1)

    def _times(self, counts_WE: torch.Tensor, home_RE: torch.Tensor, schedule_steps: int,
               row_share_W: Optional[torch.Tensor] = None) -> torch.Tensor:
        """time_R: the slowest worker's time in each shadow set, plus the sets' shadowing costs."""
        rows_RW = self._rows(counts_WE, home_RE)
        share = 1.0 if row_share_W is None else row_share_W.to(rows_RW)
        workers_RW = self.worker_time(rows_RW, schedule_steps, compute=self._compute(counts_WE, home_RE),
                                      row_share=share)
        return workers_RW.max(1).values + self.shadow_cost(1) * home_RE.sum(1)

    def layer_time(self, counts_WE: torch.Tensor, shadowed: Sequence[int] = (), schedule_steps: int = 1,
                   row_share_W: Optional[torch.Tensor] = None) -> float:
        """Modelled time of the layer: Lat_imbl with no shadowed experts, Lat_shadow(r) otherwise;
        `row_share_W`: the deduplicated exchange's share of each worker's rows that travel."""
        counts_WE = counts_WE.double()
        own_rows = float(counts_WE.sum(1).max())
        return float(self._times(counts_WE, self._home(counts_WE, [shadowed]), schedule_steps, row_share_W)[0]) \
            + self.overhead_per_row * own_rows

    def choose_shadowed(self, counts_WE: torch.Tensor, schedule_steps: int = 1,
                        row_share_W: Optional[torch.Tensor] = None) -> List[int]:
        """Algorithm 1: hottest experts first, shadowed one by one while the modelled time falls.

        Vectorised over the E + 1 prefixes of the hottest-first order, in chunks of them when the
        workers x experts grid is large (then a host check per chunk decides whether to go on);
        otherwise the only host transfer is the chosen ids."""
        counts_WE = counts_WE.double()
        W, E = counts_WE.shape
        order_E = torch.argsort(counts_WE.sum(0), descending=True, stable=True)
        # The expert curve works on a prefixes x workers x experts grid: bound it.
        chunk = E + 1 if self.expert_seconds is None else max(2, (1 << 22) // (W * E))
        times = []
        for start in range(0, E + 1, chunk):
            r_R = torch.arange(start, min(E + 1, start + chunk), device=counts_WE.device)
            prefix_RE = r_R[:, None] > torch.arange(E, device=counts_WE.device)
            home_RE = torch.zeros_like(prefix_RE).scatter(1, order_E.expand(len(r_R), E), prefix_RE)
            times.append(self._times(counts_WE, home_RE, schedule_steps, row_share_W))
            if start + chunk <= E and bool((times[-1][1:] >= times[-1][:-1]).any()):
                break                                   # the time already stopped falling in this chunk
        time_R = torch.cat(times)
        falls_R = time_R[1:] < time_R[:-1]
        num_shadowed = torch.cumprod(falls_R.long(), 0).sum()
        return order_E[:num_shadowed].tolist()


def dedup_row_share(shares_E: torch.Tensor, top_k: int, workers: int, samples: int = 4096,
                    seed: int = 0) -> torch.Tensor:
    """row_share_W: rows each worker receives one per (token, worker) over those it receives one
    per slot, for tokens choosing `top_k` distinct experts from `shares_E` (a Gumbel top-k
    sample of `samples` tokens; experts in equal consecutive blocks per worker)."""
    E = shares_E.numel()
    if E % workers or not 1 <= top_k <= E:
        raise ValueError(f"dedup_row_share: {E} experts over {workers} workers, top_k={top_k}")
    g = torch.Generator().manual_seed(seed)
    gumbel = -torch.log(-torch.log(torch.rand(samples, E, generator=g, dtype=torch.double).clamp_min(1e-300)))
    experts_SK = torch.topk(shares_E.double().log() + gumbel, top_k, dim=-1).indices
    owner_SK = experts_SK // (E // workers)
    slots_W = torch.bincount(owner_SK.reshape(-1), minlength=workers).double()
    reached_SW = torch.zeros(samples, workers, dtype=torch.double).scatter_(1, owner_SK, 1.0)
    return torch.where(slots_W > 0, reached_SW.sum(0) / slots_W.clamp_min(1), 1.0)


def pipeline_time(stages: Sequence, steps: int):
    """Stages run one after another per chunk; chunks overlap (a pipeline over `steps` chunks).
    Floats, or tensors of one shape (elementwise)."""
    longest = stages[0]
    for stage in stages[1:]:
        longest = torch.maximum(longest, stage) if torch.is_tensor(longest) else max(longest, stage)
    return sum(stages) / steps + (steps - 1) * longest / steps


def pipeline_chunks(model: PerfModel, rows: int, max_chunks: int, latency_s: float = 20e-6,
                    net_bandwidth: Optional[float] = None) -> int:
    """overlap="pipeline": how many chunks of local experts (1 .. max_chunks) the worker's `rows`
    are best split into: the pipeline of rows out, the experts, rows back (forward and backward,
    `worker_time`) over n chunks, plus `latency_s` for each of the 4 n collectives that then run.
    `net_bandwidth`: the link's bytes/s when known (a simulated link), else the model's."""
    if net_bandwidth is not None:
        model = PerfModel(model.d_model, model.d_hidden, model.flops, net_bandwidth, model.bytes_per_element)
    times = {n: model.worker_time(rows, n) + 4 * n * latency_s for n in range(1, max(1, max_chunks) + 1)}
    return min(times, key=times.get)
