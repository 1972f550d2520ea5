"""Weight gradients computed while the input gradients travel (#48): the backward's exchange first.

In the backward of an expert-parallel layer the experts' input gradient must travel back to the
ranks the rows came from, while their weight gradient stays here. So the lean MLP's backward
computes the input gradient (and the routing weights' and the biases') and leaves its two weight
gradient GEMMs as a job; the exchange starts sending the input gradient, and the jobs run at the
next wait for a collective (`fmoe.distributed.link.Pending.wait`): the weight GEMMs compute while
the rows travel.

The weights reach the experts through `_Sink`, an identity node made before the exchange starts: it
is older than the exchange's nodes, so autograd runs it after them (among ready nodes the newest
runs first), and its backward hands the weights their gradients, running any job no wait ran yet.
The jobs are the same GEMMs on the same operands, and a weight used by several calls (the pipelined
exchange's chunks) gets their sum in the order autograd would have added them: bit-identical to
computing them in line.

The shared experts' weight gradients may wait longer (`late`): their backward comes first (autograd
reaches it while the output gradients travel out), where their input gradient alone may cover that
leg. Their jobs run at the first wait that would otherwise idle (the output gradients still under way:
they fill it), else at the wait for the routed experts' input gradients (`run_late`, which the exchange's
backward calls there): the end of the layer's backward, which only the routed weight GEMMs covered.
"""
import threading
import weakref
from typing import Callable, List, Optional, Sequence

import torch

_current = threading.local()        # the deferral the experts' call on this thread runs under
_by_alias: "weakref.WeakValueDictionary[int, DeferredWeightGrads]" = weakref.WeakValueDictionary()


class _Sink(torch.autograd.Function):
    """Aliases of the weights whose gradients the deferral supplies."""

    @staticmethod
    def forward(ctx, deferral, *weights):
        ctx.deferral = deferral
        ctx.set_materialize_grads(False)
        return tuple(w.view_as(w) for w in weights)

    @staticmethod
    def backward(ctx, *grads):
        deferral, ctx.deferral = ctx.deferral, None
        deferral.run()
        # A use of an alias that did not defer (its gradient came through autograd) adds to the jobs' sums.
        return (None, *(g if s is None else s if g is None else g + s for g, s in zip(grads, deferral.sums)))


class DeferredWeightGrads:
    """Weight-gradient jobs of one layer's backward, run while its exchange travels."""

    def __init__(self, weights: Sequence[torch.Tensor], late: bool = False):
        self.weights, self.late = tuple(weights), late
        self.aliases = _Sink.apply(self, *weights)
        for alias in self.aliases:
            _by_alias[id(alias)] = self
        self.jobs: List[Callable[[], tuple]] = []
        self.sums: List[Optional[torch.Tensor]] = [None] * len(weights)

    def weights_of(self, experts) -> bool:
        """Whether these are `experts`' w1 and w2 (the deferral was made for them)."""
        return len(self.weights) == 2 and self.weights[0] is experts.w1_eDF and self.weights[1] is experts.w2_eFD

    def add(self, job: Callable[[], tuple]):
        """`job()` gives the weights' gradients (in the aliases' order), to be run before the next wait
        (`late`: before a wait that would idle, or the wait for an input gradient's exchange)."""
        self.jobs.append(job)
        (_late() if self.late else _pending()).append(self)

    def run(self):
        while self.jobs:
            for i, grad in enumerate(self.jobs.pop(0)()):
                if grad is not None:
                    self.sums[i] = grad if self.sums[i] is None else self.sums[i] + grad
        # Run by its sink before a wait did: the queue lets it go.
        for queue in (_pending(), _late()):
            while self in queue:
                queue.remove(self)


def _pending() -> List[DeferredWeightGrads]:
    """This thread's deferrals with jobs left, oldest first (interleaved micro-batches each have theirs)."""
    if not hasattr(_current, "pending"):
        _current.pending = []
    return _current.pending


def _late() -> List[DeferredWeightGrads]:
    """This thread's late deferrals with jobs left, oldest first."""
    if not hasattr(_current, "late"):
        _current.late = []
    return _current.late


def run_pending():
    """This thread's deferred weight-gradient jobs so far (before a wait for a collective)."""
    queue = _pending()
    while queue:
        queue[0].run()


def run_late():
    """This thread's late jobs (before a wait that would idle, or for an input gradient; the wait itself
    runs the others)."""
    queue = _late()
    while queue:
        queue[0].run()


def deferral_of(weight: torch.Tensor) -> Optional[DeferredWeightGrads]:
    """The deferral whose alias `weight` is (the lean MLP's backward then defers its weight GEMMs)."""
    found = _by_alias.get(id(weight))
    return found if found is not None and any(a is weight for a in found.aliases) else None


class deferring:
    """Within it, this thread's experts call (`GroupedExperts.weighted`) takes `deferral`'s weights."""

    def __init__(self, deferral: Optional[DeferredWeightGrads]):
        self.deferral = deferral

    def __enter__(self):
        self.previous = getattr(_current, "deferral", None)
        _current.deferral = self.deferral
        return self.deferral

    def __exit__(self, *exc):
        _current.deferral = self.previous


def current() -> Optional[DeferredWeightGrads]:
    return getattr(_current, "deferral", None)
