"""What each overlap mode makes of a step: a timeline of one MoE layer's forward and backward.

A step is the compute of its parts (seconds, forward + backward, a third of each in the forward):
`other` (the gate, the permutes and sums, the bookkeeping), `shared` (the shared experts) and
`experts` (the routed experts' GEMMs), and the seconds its four legs take on the link (`link`: rows
out and back, then their gradients back and out, a quarter each). One link a rank: transfers queue
on it in the order they start (as `fmoe.distributed.link` simulates it). Each mode is a list of
operations as the layer runs them; `step_seconds` plays them:

    none       other, dispatch, experts, combine, shared; backward likewise, all in line
    shared     the shared experts while the experts' outputs travel back (the combine), their
               backward while the output gradients travel out (autograd runs them first)
    pipeline   "shared", and the exchange in n chunks: every dispatch starts at once, each chunk's
               experts when its rows are there, its combine started as the next chunk computes
               (the shared experts after the last); in the backward each chunk's input gradients
               start back as the next one computes
    (shared and pipeline, `defer_weight_grads`): the experts' backward sends its input gradients
               first and computes its weight gradients (half its GEMMs) while they travel; the shared
               experts' weight gradients (half their backward) run at the first wait that would idle
               (a worker alone), else at the wait for the input gradients (`fmoe.kernels.deferred`, late)
    two micro-batches (`micro_batches=2`): two such lists, each of half the compute and bytes,
               taking turns (`fmoe.interleave_micro_batches`): the one whose turn it is runs until
               it waits, then the other runs unless it waits for a transfer started later (the link
               carries them in order: this one's arrives first); the first takes the turn back and
               waits what is left of its transfer. `schedule="lockstep"`: the second starts at the
               first's first wait; "1f1b": at the first's first wait in its backward; "loop": once
               the first has ended (one after the other, nothing interleaved)

`predict(components, link, mode, chunks, micro_batches)`; `fmoe simulate --overlap FILE` holds it
against `benchmarks/bench_overlap.py`'s measurements.
"""
from dataclasses import dataclass
from typing import List, Tuple

MODES = ("none", "shared", "pipeline")


@dataclass(frozen=True)
class Components:
    """Seconds of a step's compute, forward + backward."""
    other: float
    shared: float
    experts: float

    @property
    def total(self) -> float:
        return self.other + self.shared + self.experts

    def scaled(self, factor: float) -> "Components":
        return Components(self.other * factor, self.shared * factor, self.experts * factor)


def operations(c: Components, link: float, mode: str, chunks: int = 1, defer_weight_grads: bool = True) -> List[Tuple]:
    """The layer's step as ("compute", s), ("send", name, s), ("wait", name), and ("late", s): compute
    that may run at any later wait that would idle, and at ("flush",) at the latest."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    fwd, bwd = 1 / 3, 2 / 3
    leg = link / 4
    o_f, s_f, x_f = c.other * fwd, c.shared * fwd, c.experts * fwd
    o_b, s_b, x_b = c.other * bwd, c.shared * bwd, c.experts * bwd
    if mode == "none":
        return [("compute", o_f / 2), ("send", "d", leg), ("wait", "d"), ("compute", x_f), ("send", "c", leg),
                ("wait", "c"), ("compute", s_f + o_f / 2),
                ("compute", s_b), ("send", "gy", leg), ("wait", "gy"), ("compute", x_b), ("send", "gx", leg),
                ("wait", "gx"), ("compute", o_b)]
    n = chunks if mode == "pipeline" else 1
    ops = [("compute", o_f / 2)] + [("send", f"d{i}", leg / n) for i in range(n)]
    for i in range(n):
        ops += [("wait", f"d{i}"), ("compute", x_f / n), ("send", f"c{i}", leg / n)]
    # The shared experts run while the outputs travel back; so their backward (autograd takes them first)
    # while the output gradients travel out.
    ops += [("compute", s_f)] + [("wait", f"c{i}") for i in range(n)] + [("compute", o_f / 2)]
    # Deferred, the shared experts' weight gradients (half their backward) wait: "late".
    shared_weight_part = s_b / 2 if defer_weight_grads else 0.0
    ops += [("send", f"gy{i}", leg / n) for i in range(n)] + [("compute", s_b - shared_weight_part)]
    if shared_weight_part:
        ops += [("late", shared_weight_part)]
    # The experts' backward: input gradient (two of its four GEMMs) and weight gradient (the other two),
    # the latter after the input gradient has started back when deferred (it runs at the next wait).
    weight_part = x_b / (2 * n) if defer_weight_grads else 0.0
    for i in range(n):
        ops += [("wait", f"gy{i}"), ("compute", x_b / n - weight_part), ("send", f"gx{i}", leg / n),
                ("compute", weight_part)]
    return ops + [("flush",)] + [("wait", f"gx{i}") for i in range(n)] + [("compute", o_b)]


def backward_begins(ops: List[Tuple]) -> int:
    """Where a worker's operations enter the backward: its first send of output gradients."""
    return next(i for i, op in enumerate(ops) if op[0] == "send" and op[1].startswith("gy"))


def step_seconds(workers: List[List[Tuple]], admit_at: int = 0) -> float:
    """Plays one worker's operations, or two taking turns (`fmoe.interleave_micro_batches`); one link,
    first come first served. At a wait the turn passes to the other unless the other waits itself
    for a transfer started after this one (which then arrives first). The second worker starts at the
    first's first wait at or after operation `admit_at`."""
    now = link_free = 0.0
    ready = [{} for _ in workers]           # per worker: transfer -> when it has arrived
    order = [{} for _ in workers]           # per worker: transfer -> its place among the transfers started
    position = [0] * len(workers)
    late = [0.0] * len(workers)             # per worker: "late" compute not run yet
    turn = started = 0

    def waits_for(w: int):
        """The place of the transfer worker w stands waiting for (None: it has not begun)."""
        op = workers[w][position[w]]
        return order[w][op[1]] if op[0] == "wait" and position[w] > 0 else None

    while any(position[w] < len(ops) for w, ops in enumerate(workers)):
        if position[turn] >= len(workers[turn]):
            turn = 1 - turn                 # it ended: the other runs alone
            continue
        op = workers[turn][position[turn]]
        if op[0] == "wait":
            other = 1 - turn
            admitted = turn == 1 or position[0] >= admit_at
            if len(workers) == 2 and admitted and position[other] < len(workers[other]):
                theirs = waits_for(other)
                if theirs is None or theirs < order[turn][op[1]]:
                    turn = other
                    continue
            if len(workers) == 1 and ready[turn][op[1]] > now:
                now, late[turn] = now + late[turn], 0.0     # alone, it would idle: the late work fills it
            now = max(now, ready[turn][op[1]])
        elif op[0] == "send":
            link_free = max(now, link_free) + op[2]
            ready[turn][op[1]] = link_free
            started += 1
            order[turn][op[1]] = started
        elif op[0] == "late":
            late[turn] += op[1]
        elif op[0] == "flush":
            now, late[turn] = now + late[turn], 0.0
        else:
            now += op[1]
        position[turn] += 1
    return now


SCHEDULES = ("lockstep", "1f1b", "loop")


def work_conserving_seconds(workers: List[List[Tuple]], admit_at: int = 0) -> float:
    """A what-if beside `step_seconds`: two workers whose turns follow the transfers, not the waits. At
    a wait whose transfer has arrived a worker goes on; else the other runs if it can (it is not itself
    waiting for a transfer still under way); else the first of the two transfers to arrive decides.
    fmoe's turns cannot look at the clock (both micro-batches issue their collectives on the same
    process groups, whose order every rank must keep); they follow the order the transfers started
    in instead, which on a link that carries them in that order is the order they arrive in, so they
    mostly agree with this (they differ where a worker would run on past a wait of its own)."""
    now = link_free = 0.0
    ready = [{} for _ in workers]
    position = [0] * len(workers)
    late = [0.0] * len(workers)
    turn = 0

    def runnable(w: int) -> bool:
        if position[w] >= len(workers[w]) or (w == 1 and position[0] < admit_at):
            return False
        op = workers[w][position[w]]
        return op[0] != "wait" or ready[w][op[1]] <= now

    while any(position[w] < len(ops) for w, ops in enumerate(workers)):
        if not runnable(turn):
            other = 1 - turn if len(workers) == 2 else turn
            if other != turn and runnable(other):
                turn = other
                continue
            # neither can run: time passes to the first transfer either waits for
            now = min(ready[w][workers[w][position[w]][1]] for w in range(len(workers))
                      if position[w] < len(workers[w]) and not (w == 1 and position[0] < admit_at))
            continue
        op = workers[turn][position[turn]]
        if op[0] == "send":
            link_free = max(now, link_free) + op[2]
            ready[turn][op[1]] = link_free
        elif op[0] == "compute":
            now += op[1]
        elif op[0] == "late":
            late[turn] += op[1]
        elif op[0] == "flush":
            now, late[turn] = now + late[turn], 0.0
        position[turn] += 1
    return now


def predict(components: Components, link: float, mode: str, chunks: int = 1, micro_batches: int = 1,
            defer_weight_grads: bool = True, schedule: str = "lockstep", work_conserving: bool = False) -> float:
    """Seconds of a step in `mode` (micro_batches 1, or 2, each half the compute and bytes, run as
    `schedule` says: interleaved "lockstep" or "1f1b", or one after the other, "loop";
    `work_conserving`: interleaved turns that follow the transfers, `work_conserving_seconds`)."""
    if micro_batches not in (1, 2):
        raise ValueError(f"micro_batches must be 1 or 2, got {micro_batches!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if micro_batches == 1:
        return step_seconds([operations(components, link, mode, chunks, defer_weight_grads)])
    half = operations(components.scaled(0.5), link / 2, mode, chunks, defer_weight_grads)
    if schedule == "loop":
        return 2 * step_seconds([half])
    play = work_conserving_seconds if work_conserving else step_seconds
    return play([half, half], backward_begins(half) if schedule == "1f1b" else 0)


# The modes a layer runs (`overlap=`), and the step as two interleaved micro-batches
PREDICTED = ("none", "shared", "pipeline", "two micro-batches", "two micro-batches, 1f1b")


def cluster_modes(model, rows: float, tokens: int, shared_hidden: int, max_chunks: int,
                  latency_s: float = 20e-6) -> dict:
    """Each mode's modelled step seconds for a worker whose experts take `rows` rows (and send as
    many), with `tokens` tokens through a shared expert of `shared_hidden` (0: none): the experts'
    and the link's time from the performance model `model` (`fmoe.perf.perfmodel.PerfModel`)."""
    from fmoe.perf.perfmodel import pipeline_chunks
    parts = Components(other=model.overhead_per_row * rows, experts=model.compute_time(rows),
                       shared=model.compute_time(tokens) * shared_hidden / model.d_hidden)
    link = model.traffic_time(rows) + 4 * latency_s
    chunks = pipeline_chunks(model, int(rows), max_chunks, latency_s)
    return {"chunks": chunks, "seconds": {
        "none": predict(parts, link, "none"), "shared": predict(parts, link, "shared"),
        "pipeline": predict(parts, link, "pipeline", chunks),
        "two micro-batches": predict(parts, link, "pipeline", chunks, micro_batches=2),
        "two micro-batches, 1f1b": predict(parts, link, "pipeline", chunks, micro_batches=2, schedule="1f1b")}}


def compare_with_bench(bench: dict) -> list:
    """`benchmarks/bench_overlap.py`'s measured step of each mode beside the timeline's prediction from
    that run's own parts: the compute parts measured without a link (scaled to the mode's own step
    without it), the link's seconds (none with it minus none without), the chunks it ran."""
    rows = []
    for result in bench["results"]:
        parts = Components(**result["components_s"])
        for name, measured in result["modes"].items():
            if measured.get("schedule") or measured["overlap"] not in MODES:
                continue                    # FasterMoE's smart schedule: its own model (fmoe simulate)
            if measured.get("exchange", "slot") != "slot":
                continue                    # the rank exchange: other bytes and parts than the run measured
            chunks = result.get("pipeline_chunks", 1) if measured["overlap"] == "pipeline" else 1
            own = parts.scaled(measured["step_s_without_link"] / parts.total)
            schedule = measured.get("micro_batch_schedule") or "lockstep"
            predicted = predict(own, result["link_s"], measured["overlap"], chunks, measured.get("micro_batches", 1),
                                measured.get("defer_weight_grads", False), schedule)
            what_if = {}
            if measured.get("micro_batches", 1) == 2 and schedule != "loop":
                what_if["work_conserving_predicted_s"] = predict(
                    own, result["link_s"], measured["overlap"], chunks, 2, measured.get("defer_weight_grads", False),
                    schedule, work_conserving=True)
            rows.append({"world": result["world"], "mode": name, "overlap": measured["overlap"], "chunks": chunks,
                         "micro_batches": measured.get("micro_batches", 1),
                         "micro_batch_schedule": measured.get("micro_batch_schedule"), "measured_s": measured["step_s"],
                         "predicted_s": predicted, "error": predicted / measured["step_s"] - 1, **what_if})
    return rows
