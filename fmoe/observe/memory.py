"""What a forward keeps for its backward, counted exactly, and the peak of a forward + backward.

`SavedTensors` counts through `torch.autograd.graph.saved_tensors_hooks`, by unique storage (a
view keeps its whole base alive, and two saves of one tensor cost it once), leaving out the
given parameters: the bytes that stay allocated between the forward and the backward because
autograd holds them. `peak_bytes` replays a step under the profiler's memory events, which see
every allocation on the CPU (inside custom ops too), and on CUDA reads the caching allocator.
"""
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, Tuple

import torch


@dataclass
class SavedTensors:
    """A context manager; inside it, every tensor autograd saves is counted once by its storage."""

    exclude: Iterable[torch.Tensor] = ()
    storages: Dict[Tuple[str, int], Tuple[int, torch.dtype, tuple]] = field(default_factory=dict)

    def __post_init__(self):
        self._excluded = {self._key(t) for t in self.exclude}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    @staticmethod
    def _key(t: torch.Tensor):
        return str(t.device), t.untyped_storage().data_ptr()

    def _pack(self, t: torch.Tensor):
        key = self._key(t)
        if key not in self._excluded and t.untyped_storage().nbytes():
            self.storages[key] = (t.untyped_storage().nbytes(), t.dtype, tuple(t.shape))
        return t

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)

    @property
    def nbytes(self) -> int:
        return sum(n for n, _, _ in self.storages.values())

    def by_kind(self) -> Dict[str, int]:
        """Bytes kept per (floating or integer) dtype: which part is activations, which routing."""
        kinds: Dict[str, int] = {}
        for n, dtype, _ in self.storages.values():
            kind = "float" if dtype.is_floating_point else "int"
            kinds[kind] = kinds.get(kind, 0) + n
        return kinds


def saved_bytes(module: torch.nn.Module, x: torch.Tensor) -> SavedTensors:
    """The storages `module(x)` keeps for its backward (its parameters left out); the output is dropped."""
    with SavedTensors(exclude=list(module.parameters())) as saved:
        module(x)
    return saved


def peak_bytes(step: Callable[[], None], device: torch.device) -> int:
    """The most memory allocated at once while `step()` runs, above what was allocated before it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    # Each allocation and free is one "[memory]" event carrying its signed size.
    changes = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]")
    live = peak = 0
    for _, delta in changes:
        live += delta
        peak = max(peak, live)
    return peak
