"""Micro-batches whose steps interleave two at a time, so one's exchanges travel while the other computes.

    results = fmoe.interleave_micro_batches(model, step, [batch_a, batch_b])          # lockstep
    results = fmoe.interleave_micro_batches(model, step, batches, schedule="1f1b")    # forward beside backward

runs `step(batch)` (a forward and its backward; gradients accumulate as they would one after the
other) for each micro-batch, two at a time: each in a thread of its own, taking turns (`Turns` says
when the next one is admitted: at once, or once the one before waits in its backward). A micro-batch
runs until it waits for one of fmoe's collectives (a dispatch, a combine, a count exchange, a
shadow pull, forward or backward: every `fmoe.distributed.link.Pending.wait`), and hands the turn to
the other, which computes (its attention, its shared and routed experts, its backward) while the
first's rows travel; then the turn comes back. It does not pass where the other waits for a
collective started after the one waited for (a link carries them in that order, so the other's
would arrive later: the routing weights' wait right after the rows' keeps the turn). DualPipe and
Megatron-Core's 1F1B all-to-all overlap pair micro-batches the same way, there by hand-written
stages; here the stages are wherever a collective is waited for, so any model of fmoe layers
interleaves without being cut up.

Exact: only one micro-batch runs at a time, and the turns pass at the same points on every rank
(never by timing), so every rank issues the same collectives in the same order, each layer sees
micro-batch A before B (forwards, recomputes, backwards), and the gradients are those of running
A then B (each micro-batch's backward reaches a layer after the one before's), with one exception:
random draws (dropout, a gate's random routing or noise). The first micro-batch draws from the
caller's random stream, as it would alone; the k-th from a stream of its own, seeded from the caller's
(which it leaves as it is), so its draws differ from the loop's, reproducibly. A wait that autograd
reaches at different places on different ranks (the shadowed experts' gradient push) keeps the turn.
What a forward leaves on a module (`per_micro_batch_attrs`: the aux loss, the routing counts, the
bytes sent) is kept per micro-batch, so each step sees its own, and the model ends with the last
micro-batch's, as after running them one after the other. On a GPU each micro-batch runs on a CUDA stream of its own.

Not for DDP's own reducer (its hooks fire from both backwards at once): reduce after the step, as
`DistributedGroupedDataParallel.allreduce_params()` does.
"""
import contextlib
import threading
from typing import Any, Callable, List, Optional, Sequence

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


def stream_states(k: int) -> tuple:
    """States of the k-th (k >= 1) stream seeded by the next draw of the caller's streams (which are left
    as they are): the k-th micro-batch's own random stream."""
    cpu = torch.Generator()
    cpu.set_state(torch.get_rng_state())
    seed = int(torch.randint(2**62, (1,), generator=cpu)) + k - 1
    return torch.Generator().manual_seed(seed).get_state(), None if not torch.cuda.is_initialized() else \
        [torch.Generator(device=f"cuda:{i}").manual_seed(seed + i).get_state() for i in range(torch.cuda.device_count())]


def in_backward() -> bool:
    """Whether this thread is running a backward (autograd's graph task); on a CPU the engine runs it in
    the thread that called backward()."""
    return torch._C._current_graph_task_id() != -1


SCHEDULES = ("lockstep", "1f1b")


class Turns:
    """Micro-batches in workers of their own, at most two admitted at a time and one running: a worker
    hands the turn on when it waits for a collective, and takes it back once the other hands it on
    (or ends). What each forward leaves on the modules is swapped in and out with the turn.

    Admission: "lockstep" admits the next micro-batch as soon as fewer than two run (two forwards side
    by side, then two backwards); "1f1b" once the newest, its forward done, first waits inside its
    backward (and no older one still runs), so one's forward goes beside the other's backward, as in
    Megatron-Core's 1F1B all-to-all overlap and DualPipe. Admission and turns depend only on the order of
    the workers' starts and waits, never on timing: every rank passes them at the same points."""

    def __init__(self, state: List[tuple], count: int, schedule: str = "lockstep"):
        self.state, self.count, self.schedule = state, count, schedule
        here = {key: read(key) for key in state}
        self.views = [here] + [{key: fresh(value) for key, value in here.items()} for _ in range(count - 1)]
        # Random draws: the first micro-batch continues the caller's stream, the others draw from
        # streams of their own, seeded from the caller's state without consuming it.
        self.rngs = [random_states()] + [stream_states(k) for k in range(1, count)]
        self.cond = threading.Condition()
        self.turn, self.done, self.admitted = 0, [False] * count, 1
        self.backward_seen = [False] * count
        self.waiting_on: List[Optional[int]] = [None] * count   # per worker: the order of the collective it waits for
        self.passes: List[tuple] = []       # where the turn passed: (worker, the collective it waits for)
        self._admit()

    def running(self) -> List[int]:
        return [w for w in range(self.admitted) if not self.done[w]]

    def _admit(self):
        """Admit the next micro-batch where the schedule allows it (called holding the condition)."""
        running = self.running()
        if self.admitted == self.count or len(running) >= 2:
            return
        if self.schedule == "lockstep" or not running or self.backward_seen[running[-1]]:
            self.admitted += 1

    def _other(self, me: int):
        others = [w for w in self.running() if w != me]
        return others[0] if others else None

    def _save(self, me: int):
        self.views[me] = {key: read(key) for key in self.state}
        self.rngs[me] = random_states()

    def install(self, worker: int):
        """The modules hold what `worker`'s forwards left, and the random streams are its."""
        for (module, name), value in self.views[worker].items():
            setattr(module, name, value)
        set_random_states(self.rngs[worker])

    def _switch(self, me: int, to: int):
        """Called holding the condition: my view saved, `to`'s installed, the turn is theirs."""
        self._save(me)
        self.install(to)
        self.turn = to
        self.cond.notify_all()

    def take(self, me: int):
        with self.cond:
            self.cond.wait_for(lambda: self.turn == me)

    @contextlib.contextmanager
    def waiting(self, me: int, pending):
        """Around a wait for the collective `pending` (a `fmoe.distributed.link.Pending`): another admitted
        worker (if one has not ended) runs meanwhile, unless it waits itself for a collective started
        after mine: a link carries transfers in the order they start, so mine arrives first (and
        passing would stall both; this keeps the turn at the routing weights' wait, which follows the
        rows'). Where the turn passes depends only on the order of starts and waits, the same on every
        rank, never on timing."""
        with self.cond:
            if not self.backward_seen[me] and in_backward():
                self.backward_seen[me] = True
            self._admit()
            other = self._other(me)
            if other is not None and self.waiting_on[other] is not None and self.waiting_on[other] > pending.order:
                other = None
            self.waiting_on[me] = pending.order
            if other is not None:
                self.passes.append((me, pending.what))
                self._switch(me, other)
        try:
            yield
        finally:
            if other is not None:
                self.take(me)
            self.waiting_on[me] = None

    def end(self, me: int):
        with self.cond:
            self.done[me] = True
            self._admit()
            other = self._other(me)
            if other is not None:
                self._switch(me, other)
            else:
                self._save(me)


class _Worker(threading.Thread):
    def __init__(self, turns: Turns, me: int, step: Callable, batch, settings):
        super().__init__(name=f"fmoe micro-batch {me}", daemon=True)
        self.turns, self.me, self.step, self.batch, self.settings = turns, me, step, batch, settings
        self.result, self.error = None, None

    def run(self):
        link.set_waiting(lambda pending: self.turns.waiting(self.me, pending))
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


def interleave_micro_batches(model: nn.Module, step: Callable[[Any], Any], micro_batches: Sequence,
                             schedule: str = "lockstep") -> list:
    """`[step(b) for b in micro_batches]`, two micro-batches at a time interleaved.

    `step(batch)` runs the forward and backward of one micro-batch (gradients accumulate) and returns
    what the caller wants of it (a loss); `model` is the module whose layers it runs (what their
    forwards leave is kept per micro-batch). `schedule="lockstep"` (the default) starts the next
    micro-batch at the first one's first wait, so two forwards go side by side, then two backwards;
    `"1f1b"` starts it once the one before waits in its backward, so a forward's exchanges hide behind
    a backward's compute and the other way round (a backward with no wait of fmoe's, as with the
    sync-free exchange, then runs the micro-batches one after the other). Exact: the same outputs,
    gradients, routing counts and traffic as the loop."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be the torch.nn.Module the step runs, got {type(model).__name__}")
    if not callable(step):
        raise TypeError(f"step must be a callable step(micro_batch), got {type(step).__name__}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    micro_batches = list(micro_batches)
    if len(micro_batches) < 2:
        return [step(batch) for batch in micro_batches]
    turns = Turns(per_micro_batch_state(list(model.modules())), len(micro_batches), schedule)
    on_gpu = torch.cuda.is_available() and any(p.is_cuda for p in model.parameters())
    settings = _callers_settings(on_gpu)
    workers = [_Worker(turns, i, step, batch, settings) for i, batch in enumerate(micro_batches)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    turns.install(len(workers) - 1)
    if on_gpu:
        torch.cuda.synchronize()        # every stream's work done before the caller's stream reads the gradients
    for worker in workers:
        if worker.error is not None:
            raise worker.error
    return [worker.result for worker in workers]
