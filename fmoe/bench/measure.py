"""Time forward and backward apart, count the bytes autograd keeps for backward, and peak GPU memory."""
import statistics
import time
from typing import Callable, Dict, Iterable, Optional

import torch


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _clear_grads(tensors: Iterable[torch.Tensor]):
    # Accumulating into an existing .grad is an extra pass that no competitor should be charged for.
    for t in tensors:
        t.grad = None


def time_once(fn: Callable, x: torch.Tensor, grad: torch.Tensor, params: list) -> tuple:
    """(seconds of the forward fn(x), seconds of backward(grad) on its output)."""
    _clear_grads(params + [x])
    _sync(x.device)
    start = time.perf_counter()
    y = fn(x)
    _sync(x.device)
    mid = time.perf_counter()
    y.backward(grad)
    _sync(x.device)
    return mid - start, time.perf_counter() - mid


def time_interleaved(runs: Dict[str, tuple], warmup: int = 1, reps: int = 5,
                     max_seconds: Optional[float] = None) -> Dict[str, dict]:
    """Median forward, backward and total seconds of each `runs[name] = (fn, x, grad, params)`.

    Runs go in rounds, each competitor once per round, so a change in the machine's load (other
    users of a shared machine) hits every competitor alike rather than whichever ran then. A
    competitor whose timed runs passed `max_seconds` sits out the remaining rounds.
    """
    if reps < 1 or warmup < 0:
        raise ValueError(f"reps must be >= 1 and warmup >= 0, got reps={reps!r}, warmup={warmup!r}")
    samples = {name: [] for name in runs}
    for i in range(warmup + reps):
        for name, run in runs.items():
            done = samples[name]
            if max_seconds is not None and done and sum(f + b for f, b in done) > max_seconds:
                continue
            fwd, bwd = time_once(*run)
            if i >= warmup:
                done.append((fwd, bwd))
    return {name: {"forward": statistics.median(f for f, _ in done), "backward": statistics.median(b for _, b in done),
                   "total": statistics.median(f + b for f, b in done), "reps": len(done)}
            for name, done in samples.items()}


def saved_bytes(fn: Callable, x: torch.Tensor, params: list) -> tuple:
    """(bytes of the tensors autograd saves for backward during fn(x), fn(x)).

    Counted once per storage, so views and tensors saved twice count once; parameters are left
    out, as they live whether or not a backward is coming.
    """
    param_storages = {p.untyped_storage().data_ptr() for p in params}
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in param_storages:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fn(x)
    return sum(storages.values()), y


def peak_memory(fn: Callable, x: torch.Tensor, grad: torch.Tensor, params: list) -> Optional[int]:
    """Peak bytes allocated on the GPU during fn(x) and its backward, above what was allocated
    before; None off the GPU. The gradients exist beforehand, as in training from the second step,
    so the figure is activations and temporaries, not the size of the weights."""
    if x.device.type != "cuda":
        return None
    fn(x).backward(grad)
    _sync(x.device)
    torch.cuda.reset_peak_memory_stats(x.device)
    before = torch.cuda.memory_allocated(x.device)
    fn(x).backward(grad)
    _sync(x.device)
    return torch.cuda.max_memory_allocated(x.device) - before
