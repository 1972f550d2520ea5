"""Collectives in flight, and a simulated link that makes them as slow as a real network.

Every collective fmoe issues is started asynchronously and handed back as a `Pending` (`start`);
its `wait()` waits for the collective, bounded by FMOE_COLLECTIVE_TIMEOUT (`fmoe.distributed.timeout`),
so the layer may put independent work between the two. `complete` is start-then-wait, for the
collectives that have nothing to overlap with.

A simulated link (`FMOE_SIMULATED_LINK="gbps=G,latency_us=L"`, or `with simulated_link(G, L):`)
shows here, on gloo between processes of one machine, what a slower network costs and how much of
it overlap hides: a collective that moves B bytes on this rank completes no earlier than its start
+ L microseconds + B / (G Gbit/s), and no earlier than that after the rank's previous transfer (one
link a rank: collectives in flight together queue on it, as on a real link). The delay is paid in
`wait()` by sleeping (no CPU burnt), so work done between start and wait runs meanwhile, exactly as
it would beside a real transfer. B is what
this rank's side of the link carries: for an all-to-all the larger of the bytes it sends to and
receives from other ranks (a full-duplex link), for a broadcast or reduce the tensor's bytes, for
a ring all-reduce 2 (W-1)/W of them, for an all-gather the (W-1) parts received. Same code on gloo
and NCCL (on a GPU the host waits; the stream order is unchanged). Traced collectives (torch.compile)
are not delayed: the link is a tool of eager runs.
"""
import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Optional

from fmoe.distributed.timeout import wait
from fmoe.env import env_raw

ENV = "FMOE_SIMULATED_LINK"


@dataclass(frozen=True)
class Link:
    """A link of `gbps` Gbit/s (each direction) with `latency_us` microseconds per collective."""
    gbps: float
    latency_us: float = 0.0

    def __post_init__(self):
        if not (isinstance(self.gbps, (int, float)) and self.gbps > 0 and self.gbps != float("inf")):
            raise ValueError(f"simulated link: gbps must be a positive finite number, got {self.gbps!r}")
        if not (isinstance(self.latency_us, (int, float)) and 0 <= self.latency_us < float("inf")):
            raise ValueError(f"simulated link: latency_us must be a finite number >= 0, got {self.latency_us!r}")

    def seconds(self, nbytes: int) -> float:
        """How long a collective moving `nbytes` on this rank takes on this link."""
        return self.latency_us * 1e-6 + nbytes * 8 / (self.gbps * 1e9)


def parse_link(spec: str) -> Link:
    """`"gbps=G,latency_us=L"` (latency optional) -> Link; a bad spec names the variable and the field."""
    fields = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, value = part.partition("=")
        if not sep or name.strip() not in ("gbps", "latency_us"):
            raise ValueError(f"{ENV} must read 'gbps=G,latency_us=L', got {spec!r} (unknown part {part!r})")
        try:
            fields[name.strip()] = float(value)
        except ValueError:
            raise ValueError(f"{ENV}: {name.strip()} must be a number, got {value!r}") from None
    if "gbps" not in fields:
        raise ValueError(f"{ENV} must give gbps=G (Gbit/s), got {spec!r}")
    return Link(**fields)


_override: list = []        # the innermost `simulated_link` context's Link (None: explicitly no link)


def active_link() -> Optional[Link]:
    """The simulated link in force: the innermost `simulated_link` context, else FMOE_SIMULATED_LINK."""
    if _override:
        return _override[-1]
    spec = env_raw(ENV)
    return parse_link(spec) if spec and spec.strip() else None


@contextlib.contextmanager
def simulated_link(gbps: Optional[float], latency_us: float = 0.0):
    """Collectives issued inside complete no earlier than start + latency + bytes / gbps
    (`gbps=None`: no simulated link inside, whatever FMOE_SIMULATED_LINK says)."""
    _override.append(None if gbps is None else Link(gbps, latency_us))
    try:
        yield _override[-1]
    finally:
        _override.pop()


_waiting = threading.local()    # this thread's turn-taking around waits (fmoe.distributed.interleave)


def set_waiting(context):
    """`context(pending)` (a context manager) surrounds every wait of this thread for a collective (the
    `Pending`): an interleaved micro-batch hands the turn on there (None: nothing)."""
    _waiting.context = context


def _around_wait(pending):
    context = getattr(_waiting, "context", None)
    return context(pending) if context is not None else contextlib.nullcontext()


_link_free_at = [0.0]       # when this rank's simulated link has carried everything started so far
_started = [0]              # collectives started so far whose waits hand the turn on (their order)


class Pending:
    """A collective in flight: `wait()` returns once it is done and, under a simulated link, once
    its simulated transfer has arrived. Waiting twice is waiting once."""

    def __init__(self, works, what: str, nbytes: int, link: Optional[Link], hands_turn: bool = True):
        self.works, self.what, self.hands_turn = works, what, hands_turn
        # Where it stands among the collectives started (those whose waits hand the turn on: the others
        # start at places that may differ between ranks). A link carries them in this order.
        self.order = None
        if hands_turn:
            _started[0] += 1
            self.order = _started[0]
        self.ready_at, self.waited = None, False
        if link is not None:
            self.ready_at = max(time.monotonic(), _link_free_at[0]) + link.seconds(nbytes)
            _link_free_at[0] = self.ready_at

    def arrived(self) -> bool:
        """Whether waiting now would return at once: the collectives done, the simulated transfer there."""
        if self.ready_at is not None and self.ready_at > time.monotonic():
            return False
        return all(work.is_completed() for work in self.works if hasattr(work, "is_completed"))

    def wait(self):
        if self.waited:
            return
        self.waited = True
        # Every first wait hands an interleaved micro-batch's turn on, empty or not: where turns pass
        # must not depend on the data, so that every rank issues its collectives in the same order
        # (`hands_turn=False`: a wait whose place in the backward differs between ranks keeps the turn).
        # Weight gradients left for this moment (the exchange's backward first) compute while this travels.
        from fmoe.kernels.deferred import run_late, run_pending     # here: fmoe.kernels imports this module
        run_pending()
        if not self.arrived() and getattr(_waiting, "context", None) is None:
            run_late()      # this thread would idle (no interleaved micro-batch takes the turn): fill it
        with _around_wait(self) if self.hands_turn else contextlib.nullcontext():
            for work in self.works:
                wait(work, self.what)
            self.works = []
            if self.ready_at is not None:
                late = self.ready_at - time.monotonic()
                if late > 0:
                    time.sleep(late)
                self.ready_at = None


def start(work, what: str, nbytes: int, hands_turn: bool = True) -> Pending:
    """The async collective(s) `work` (a work handle, a list of them, or None), moving `nbytes` on
    this rank, as a `Pending`; `what` names the layer and the collective for the timeout message.
    `hands_turn=False`: its wait does not hand an interleaved micro-batch's turn on (for a wait that
    autograd reaches at different places on different ranks)."""
    works = [] if work is None else list(work) if isinstance(work, (list, tuple)) else [work]
    return Pending(works, what, nbytes, active_link(), hands_turn)


def complete(work, what: str, nbytes: int):
    """Start-then-wait: a collective nothing overlaps with."""
    start(work, what, nbytes).wait()


def all_to_all_bytes(send_splits, recv_splits, row_bytes: int, rank: int) -> int:
    """What an all-to-all carries on this rank's link: the larger of the rows out and in, own rows aside."""
    sent = sum(n for w, n in enumerate(send_splits) if w != rank)
    received = sum(n for w, n in enumerate(recv_splits) if w != rank)
    return max(sent, received) * row_bytes


def all_reduce_bytes(nbytes: int, world_size: int) -> int:
    """A ring all-reduce's bytes on each rank's link: 2 (W-1)/W of the tensor."""
    return 2 * (world_size - 1) * nbytes // max(world_size, 1)
