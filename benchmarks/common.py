"""Shared pieces of the benchmarks: timing, balanced routing, the machine's description, JSON out."""
import os
import platform
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from fmoe.app.files import write_json as write_json_atomic
from fmoe.gates.round_robin import RoundRobinGate  # noqa: F401  (the benchmarks import it from here)

RESULTS = Path(__file__).resolve().parent / "results"


def time_call(fn, warmup: int = 2, reps: int = 5) -> float:
    """Median wall time of fn() in seconds (CUDA-synchronised when on a GPU)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_interleaved(fns: dict, warmup: int = 1, reps: int = 9) -> dict:
    """Median wall time in seconds of each fn, the fns taking turns one call at a time."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def machine() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def write_json(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    write_json_atomic(path, payload, indent=2)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(rank, world, port, worker, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result = worker(rank, world, args)
    if rank == 0:
        queue.put(result)
        queue.close()
        queue.join_thread()
    dist.destroy_process_group()
    # gloo may abort in its own teardown at interpreter exit after the work is done: skip it.
    os._exit(0)


def run_on_ranks(worker, world: int, args):
    """worker(rank, world, args) on `world` processes (gloo, one thread each); rank 0's return value."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_entry, args=(r, world, port, worker, args, queue)) for r in range(world)]
    for proc in procs:
        proc.start()
    result = queue.get()
    for proc in procs:
        proc.join()
    return result


class SwiGLU(nn.Module):
    """A dense SwiGLU MLP of hidden width `hidden` (gate and up in one matmul): the benchmarks'
    dense FFN of equal FLOPs, and the expert module DeepSpeed-MoE copies per expert."""

    def __init__(self, d_model, hidden):
        super().__init__()
        self.gate_up = nn.Linear(d_model, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(nn.functional.silu(gate) * up)
