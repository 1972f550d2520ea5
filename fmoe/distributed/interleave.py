"""Two micro-batches whose steps interleave, so one's exchanges travel while the other computes.

    results = fmoe.interleave_micro_batches(model, step, [batch_a, batch_b])

runs `step(batch)` (a forward and its backward; gradients accumulate as they would one after the
other) for each micro-batch, two at a time: each in a thread of its own, taking turns. A micro-batch
runs until it waits for one of fmoe's collectives (a dispatch, a combine, a count exchange, a
shadow pull, forward or backward: every `fmoe.distributed.link.Pending.wait`), and hands the turn to
the other, which computes (its attention, its shared and routed experts, its backward) while the
first's rows travel; then the turn comes back. DualPipe and Megatron-Core's 1F1B all-to-all overlap
pair micro-batches the same way, there by hand-written stages; here the stages are wherever a
collective is waited for, so any model of fmoe layers interleaves without being cut up.

Exact: only one micro-batch runs at a time, and the turns pass at the same points on every rank
(never by timing), so every rank issues the same collectives in the same order, each layer sees
micro-batch A before B (forwards, recomputes, backwards), and the gradients are those of running
A then B (two fp32 additions per parameter commute), with one exception: random draws (dropout, a
gate's random routing or noise). The first micro-batch draws from the caller's random stream, as it
would alone; the second from a stream of its own, seeded from the caller's (which it leaves as it is),
so its draws differ from the loop's second micro-batch's, reproducibly. What a forward leaves on a module
(`per_micro_batch_attrs`: the aux loss, the routing counts, the bytes sent) is kept per
micro-batch, so each step sees its own, and the model ends with the last micro-batch's, as after
running them one after the other. On a GPU each micro-batch runs on a CUDA stream of its own.

Not for DDP's own reducer (its hooks fire from both backwards at once): reduce after the step, as
`DistributedGroupedDataParallel.allreduce_params()` does.
"""
import contextlib
import threading
from typing import Any, Callable, List, Sequence

import torch
import torch.nn as nn

from fmoe.distributed import link


def per_micro_batch_state(modules: Sequence[nn.Module]) -> List[tuple]:
    """(module, attribute) pairs whose value a forward leaves for its own step."""
    return [(m, name) for m in modules for name in getattr(m, "per_micro_batch_attrs", ())]


def read(key):
    module, name = key
    return getattr(module, name, None)


def fresh(value):
    """What a micro-batch starts with: a counter of its own (`fresh()`), else the value as it is."""
    return value.fresh() if hasattr(value, "fresh") else value


def random_states() -> tuple:
    """torch's global random states: the CPU generator's, and the GPUs' when CUDA is in use."""
    return torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None


def set_random_states(states: tuple):
    cpu, gpus = states
    torch.set_rng_state(cpu)
    if gpus is not None:
        torch.cuda.set_rng_state_all(gpus)


def second_stream_states() -> tuple:
    """States of a stream seeded by the next draw of the caller's streams (which are left as they are)."""
    cpu = torch.Generator()
    cpu.set_state(torch.get_rng_state())
    seed = int(torch.randint(2**62, (1,), generator=cpu))
    return torch.Generator().manual_seed(seed).get_state(), None if not torch.cuda.is_initialized() else \
        [torch.Generator(device=f"cuda:{i}").manual_seed(seed + i).get_state() for i in range(torch.cuda.device_count())]


class Turns:
    """Two workers, one running at a time: each hands the turn on when it waits for a collective and
    takes it back once the other hands it on (or ends). What each forward leaves on the modules is
    swapped in and out with the turn."""

    def __init__(self, state: List[tuple]):
        self.state = state
        self.views = [{key: read(key) for key in state}, {key: fresh(read(key)) for key in state}]
        # Random draws: the first micro-batch continues the caller's stream, the second draws from a
        # stream of its own, seeded from the caller's state without consuming it.
        self.rngs = [random_states(), second_stream_states()]
        self.cond = threading.Condition()
        self.turn, self.done = 0, [False, False]

    def _save(self, me: int):
        self.views[me] = {key: read(key) for key in self.state}
        self.rngs[me] = random_states()

    def install(self, worker: int):
        """The modules hold what `worker`'s forwards left, and the random streams are its."""
        for (module, name), value in self.views[worker].items():
            setattr(module, name, value)
        set_random_states(self.rngs[worker])

    def _switch(self, me: int):
        """Called holding the condition: my view saved, the other's installed, the turn is theirs."""
        self._save(me)
        self.install(1 - me)
        self.turn = 1 - me
        self.cond.notify_all()

    def take(self, me: int):
        with self.cond:
            self.cond.wait_for(lambda: self.turn == me)

    @contextlib.contextmanager
    def waiting(self, me: int):
        """Around a wait for a collective: the other worker runs meanwhile (if it has not ended)."""
        with self.cond:
            handed = not self.done[1 - me]
            if handed:
                self._switch(me)
        try:
            yield
        finally:
            if handed:
                self.take(me)

    def end(self, me: int):
        with self.cond:
            self.done[me] = True
            if not self.done[1 - me]:
                self._switch(me)
            else:
                self._save(me)


class _Worker(threading.Thread):
    def __init__(self, turns: Turns, me: int, step: Callable, batch, settings):
        super().__init__(name=f"fmoe micro-batch {me}", daemon=True)
        self.turns, self.me, self.step, self.batch, self.settings = turns, me, step, batch, settings
        self.result, self.error = None, None

    def run(self):
        link.set_waiting(lambda: self.turns.waiting(self.me))
        try:
            self.turns.take(self.me)
            with self.settings():
                self.result = self.step(self.batch)
        except BaseException as err:      # noqa: B902 - handed to the caller, which raises it
            self.error = err
        finally:
            link.set_waiting(None)
            self.turns.end(self.me)


def _callers_settings(device_streams: bool):
    """A context that gives a worker thread the caller's grad mode, autocast and intra-op threads
    (thread-local in torch and OpenMP), and on a GPU a CUDA stream of its own."""
    grad, threads = torch.is_grad_enabled(), torch.get_num_threads()
    casts = [(dev, torch.get_autocast_dtype(dev)) for dev in ("cpu", "cuda") if torch.is_autocast_enabled(dev)]
    device = torch.cuda.current_device() if device_streams else None

    @contextlib.contextmanager
    def settings():
        torch.set_num_threads(threads)
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(grad))
            for dev, dtype in casts:
                stack.enter_context(torch.autocast(dev, dtype=dtype))
            if device is not None:
                torch.cuda.set_device(device)
                stack.enter_context(torch.cuda.stream(torch.cuda.Stream(device)))
            yield
    return settings


def run_pair(model: nn.Module, step: Callable[[Any], Any], first, second) -> tuple:
    """`step(first)` and `step(second)` interleaved; their results."""
    turns = Turns(per_micro_batch_state(list(model.modules())))
    on_gpu = torch.cuda.is_available() and any(p.is_cuda for p in model.parameters())
    settings = _callers_settings(on_gpu)
    workers = [_Worker(turns, i, step, batch, settings) for i, batch in enumerate((first, second))]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    turns.install(1)
    if on_gpu:
        torch.cuda.synchronize()        # both streams' work done before the caller's stream reads the gradients
    for worker in workers:
        if worker.error is not None:
            raise worker.error
    return workers[0].result, workers[1].result


def interleave_micro_batches(model: nn.Module, step: Callable[[Any], Any], micro_batches: Sequence) -> list:
    """`[step(b) for b in micro_batches]`, two micro-batches at a time interleaved (an odd last one alone).

    `step(batch)` runs the forward and backward of one micro-batch (gradients accumulate) and returns
    what the caller wants of it (a loss); `model` is the module whose layers it runs (what their
    forwards leave is kept per micro-batch). Exact: the same outputs, gradients, routing counts and
    traffic as the loop."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be the torch.nn.Module the step runs, got {type(model).__name__}")
    if not callable(step):
        raise TypeError(f"step must be a callable step(micro_batch), got {type(step).__name__}")
    micro_batches = list(micro_batches)
    results = []
    for i in range(0, len(micro_batches) - 1, 2):
        results.extend(run_pair(model, step, micro_batches[i], micro_batches[i + 1]))
    if len(micro_batches) % 2:
        results.append(step(micro_batches[-1]))
    return results
