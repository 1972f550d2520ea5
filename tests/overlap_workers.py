"""Rank functions for tests/test_overlap.py (run by tests.dist_utils.run_ranks)."""
import contextlib
import json
import time

import torch
import torch.distributed as dist

import fmoe
from fmoe.distributed import exchange, link
from tests.shadow_workers import FixedShadow


def time_an_all_to_all(rank, world, rows, width, gbps, latency_us, out_file):
    """One dispatch all-to-all of `rows` x `width` fp32 rows to each other rank under a simulated link:
    the seconds it took, and the bytes this rank's link carried."""
    x = torch.randn(rows * world, width)
    splits = [rows] * world
    dist.barrier()
    with link.simulated_link(gbps, latency_us):
        began = time.monotonic()
        exchange.AllToAll.apply(x, splits, splits, None, "test all-to-all")
        took = time.monotonic() - began
    if rank == 0:
        nbytes = link.all_to_all_bytes(splits, splits, width * 4, rank)
        with open(out_file, "w") as f:
            json.dump({"seconds": took, "bytes": nbytes}, f)


def wait_pays_the_delay(rank, world, seconds_of_work, gbps, rows, width, out_file):
    """A collective started, `seconds_of_work` of other work (sleeping), then the wait: the elapsed time."""
    x = torch.randn(rows * world, width)
    out = torch.empty_like(x)
    dist.barrier()
    with link.simulated_link(gbps):
        began = time.monotonic()
        pending = link.start(dist.all_to_all_single(out, x, async_op=True), "test all-to-all",
                             link.all_to_all_bytes([rows] * world, [rows] * world, width * 4, rank))
        time.sleep(seconds_of_work)
        pending.wait()
        took = time.monotonic() - began
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump({"seconds": took}, f)


D, H, E_PER_RANK = 8, 12, 2
# (name, layer options): every exchange, shadowing, capacity, the recompute modes, the sync-free bound
OVERLAP_CASES = [
    ("slot", dict(exchange="slot")),
    ("rank", dict(exchange="rank")),
    ("node", dict(exchange="node", ranks_per_node=1)),
    ("slot-shadow", dict(exchange="slot", shadow=(0,))),
    ("rank-shadow", dict(exchange="rank", shadow=(1,))),
    ("slot-capacity", dict(exchange="slot", gate="gshard")),
    ("rank-recompute-none", dict(exchange="rank", recompute="none")),
    ("slot-recompute-experts", dict(exchange="slot", recompute="experts")),
    ("rank-sync-free", dict(exchange="rank", sync_free=True, max_tokens_per_rank=16)),
    ("slot-no-shared", dict(exchange="slot", shared_expert=None, shared_expert_gate=False)),
    ("rank-replay", dict(exchange="rank", replay=True)),
    ("slot-data-parallel", dict(exchange="slot", data_parallel=True)),
]


def layer_options(options):
    """A case's options -> (the layer's keyword arguments, replay?, data-parallel?)."""
    kw = dict(d_model=D, d_hidden=H, top_k=2, gate="naive", shared_expert=H, shared_expert_gate=True)
    kw.update(options)
    replay, data_parallel = kw.pop("replay", False), kw.pop("data_parallel", False)
    if "shadow" in kw:
        kw["shadow"] = FixedShadow(kw["shadow"])
    return kw, replay, data_parallel


def overlap_run(rank, world, overlap, options, steps=2):
    """Two forward+backward passes (gradients accumulate) of one layer: everything each gives.
    `replay`: the steps replay a routing recorded beforehand (router replay); `data_parallel`: the
    layer is wrapped in DistributedGroupedDataParallel, whose reduction follows the backward."""
    import contextlib
    kw, replay, data_parallel = layer_options(options)
    torch.manual_seed(0)
    layer = fmoe.FMoETransformerMLP(num_expert=E_PER_RANK, world_size=world, overlap=overlap, **kw)
    model = fmoe.DistributedGroupedDataParallel(layer) if data_parallel else layer
    inputs = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * rank + step)
        inputs.append((torch.randn(6 + rank, D, generator=g), torch.randn(6 + rank, D, generator=g)))
    replaying = contextlib.nullcontext()
    if replay:
        routing = torch.Generator().manual_seed(7 + rank)     # another routing than the gate's
        trace = fmoe.RoutingTrace({name: [torch.randperm(E_PER_RANK * world, generator=routing)[:2].repeat(len(x), 1)
                                          for x, _ in inputs] for name in ("",)})
        replaying = fmoe.replay_routing(layer, trace)
    seen = {"overlap": layer.overlap}
    with replaying:
        for step, (x, probe) in enumerate(inputs):
            x = x.clone().requires_grad_(True)
            y = model(x)
            (y * probe).sum().add(layer.aux_loss or 0).backward()
            seen[f"y{step}"], seen[f"dx{step}"] = y.detach(), x.grad
            seen[f"dropped{step}"], seen[f"counts{step}"] = layer.num_dropped, layer.last_counts_E.clone()
            seen[f"traffic{step}"] = layer.traffic_bytes
    if data_parallel:
        model.allreduce_params()
    seen.update({f"grad.{n}": p.grad for n, p in layer.named_parameters()})
    return seen


# The rank and node exchanges that overlap="pipeline" chunks (not shadowed, not bounded)
CHUNKED_DEDUP_CASES = ("rank", "node", "rank-recompute-none", "rank-replay")


def check_overlap_modes_equal_none(rank, world):
    import os
    os.environ["FMOE_PIPELINE_CHUNKS"] = "2"        # every local expert a chunk of its own
    for name, options in OVERLAP_CASES:
        plain = overlap_run(rank, world, "none", options)
        assert plain.pop("overlap") == "none"
        for mode in ("shared", "pipeline", "auto"):
            other = overlap_run(rank, world, mode, options)
            resolved = mode if mode != "auto" else "pipeline" if options.get("exchange") == "slot" else "shared"
            assert other.pop("overlap") == resolved, (name, mode)
            assert other.keys() == plain.keys(), (name, mode)
            differ = [key for key, value in plain.items()
                      if not (torch.equal(value, other[key]) if isinstance(value, torch.Tensor) else value == other[key])]
            # The rank exchange with shadowing: x feeds the gate, the exchange, the shadowed experts at
            # home and the shared experts, and autograd sums their gradients in the order it runs them,
            # which overlap changes: x's gradient is equal to fp32 rounding, everything else bit for bit.
            rounded = [key for key in differ if key.startswith("dx") and "shadow" in name and "rank" in name]
            if resolved == "pipeline" and name in CHUNKED_DEDUP_CASES:
                # the rank and node exchanges' last hop in chunks: an expert's rows in several GEMMs, so
                # the outputs and gradients to rounding; the counts, drops and bytes bit for bit
                rounded += [key for key in differ if isinstance(plain[key], torch.Tensor) and plain[key].is_floating_point()
                            and key not in rounded]
            for key in rounded:
                torch.testing.assert_close(other[key], plain[key], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} {key}: {m}")
            assert not set(differ) - set(rounded), f"rank {rank}, {name}, overlap={mode}: {differ} differ from 'none'"


def check_overlap_compiled_equals_eager_none(rank, world):
    """overlap="shared" compiled equals eager overlap="none": the exchange's graph breaks (aot_eager),
    and the sync-free rank exchange traced whole (fullgraph=True)."""
    import copy
    cases = [(dict(exchange="slot"), False), (dict(exchange="rank", sync_free=True, max_tokens_per_rank=16), True)]
    for options, fullgraph in cases:
        layers = {}
        for overlap in ("none", "shared"):
            torch.manual_seed(0)
            layers[overlap] = fmoe.FMoETransformerMLP(num_expert=E_PER_RANK, world_size=world, d_model=D, d_hidden=H,
                                                      top_k=2, shared_expert=H, overlap=overlap, **options)
            with torch.no_grad():
                layers[overlap](torch.zeros(1, D))      # the first forward agrees with the peers, eagerly
        compiled = torch.compile(copy.deepcopy(layers["shared"]), fullgraph=fullgraph, backend="aot_eager")
        g = torch.Generator().manual_seed(rank)
        x, probe = torch.randn(8, D, generator=g), torch.randn(8, D, generator=g)
        results = []
        for module, run in ((layers["none"], layers["none"]), (compiled._orig_mod, compiled)):
            x_in = x.clone().requires_grad_(True)
            out = run(x_in)
            (out * probe).sum().backward()
            results.append((out, x_in.grad, {n: p.grad for n, p in module.named_parameters()}))
        (out_e, dx_e, grads_e), (out_c, dx_c, grads_c) = results
        torch.testing.assert_close(out_c, out_e, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(dx_c, dx_e, atol=1e-5, rtol=1e-5)
        for n in grads_e:
            torch.testing.assert_close(grads_c[n], grads_e[n], atol=1e-5, rtol=1e-5, msg=lambda m: f"{n}: {m}")


def stop_rank_one():
    import os
    import signal
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGSTOP)


class StopsRankOne(torch.nn.Module):
    """A shared expert that, armed, stops rank 1 (SIGSTOP) in its forward: under overlap="shared" it
    runs while the dispatch is in flight."""

    def __init__(self):
        super().__init__()
        self.linear, self.armed = torch.nn.Linear(D, D), False

    def forward(self, x):
        if self.armed:
            stop_rank_one()
        return self.linear(x)


def stop_rank_while_in_flight(rank, world, phase, result_file):
    """Rank 1 stops while its dispatch is in flight ("forward"), or as its backward begins ("backward"),
    with rank 0's exchanges started: rank 0 raises the timeout naming the layer, never hangs."""
    import os
    os.environ["FMOE_COLLECTIVE_TIMEOUT"] = "3"
    torch.manual_seed(0)
    shared = StopsRankOne()
    layer = fmoe.FMoETransformerMLP(num_expert=E_PER_RANK, world_size=world, d_model=D, d_hidden=H, top_k=2,
                                    shared_expert=shared, overlap="shared")
    x = torch.randn(6, D, requires_grad=True)
    layer(x).sum().backward()           # one good step: the check with the peers and every collective pass
    shared.armed = phase == "forward"
    try:
        y = layer(x)
        if phase == "backward":
            y.register_hook(lambda grad: stop_rank_one())
        y.sum().backward()
    except RuntimeError as err:
        with open(result_file, "w") as f:
            f.write(str(err))
        return
    raise AssertionError(f"rank {rank} went through a step with a stopped peer")


def two_in_flight_queue(rank, world, gbps, rows, width, out_file):
    """Two all-to-alls started together and then waited: they queue on the one link (about twice one)."""
    x = torch.randn(rows * world, width)
    outs = [torch.empty_like(x) for _ in range(2)]
    nbytes = link.all_to_all_bytes([rows] * world, [rows] * world, width * 4, rank)
    dist.barrier()
    with link.simulated_link(gbps):
        began = time.monotonic()
        pendings = [link.start(dist.all_to_all_single(out, x, async_op=True), "test all-to-all", nbytes)
                    for out in outs]
        for pending in pendings:
            pending.wait()
        took = time.monotonic() - began
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump({"seconds": took, "one": link.Link(gbps).seconds(nbytes)}, f)


class TwoLayers(torch.nn.Module):
    """A dense layer (the attention's stand-in), an MoE layer, a dense layer, an MoE layer."""

    def __init__(self, world, overlap, kw):
        super().__init__()
        self.dense1, self.dense2 = torch.nn.Linear(D, D), torch.nn.Linear(D, D)
        self.moe1 = fmoe.FMoETransformerMLP(num_expert=E_PER_RANK, world_size=world, overlap=overlap, **kw)
        self.moe2 = fmoe.FMoETransformerMLP(num_expert=E_PER_RANK, world_size=world, overlap=overlap, **kw)

    def forward(self, x):
        return self.moe2(self.dense2(self.moe1(self.dense1(x)).tanh()))


def micro_batch_run(rank, world, options, interleave, overlap="auto", micro_batches=4):
    """`micro_batches` forward+backward passes of a two-layer model accumulating gradients, one after
    the other (`interleave` False) or two at a time interleaved (fmoe.interleave_micro_batches; True:
    its default schedule, else the schedule named): everything each gives."""
    import contextlib
    kw, replay, data_parallel = layer_options(options)
    torch.manual_seed(0)
    model = TwoLayers(world, overlap, kw)
    synced = fmoe.DistributedGroupedDataParallel(model) if data_parallel else None
    batches = []
    for i in range(micro_batches):
        g = torch.Generator().manual_seed(100 * rank + i)
        batches.append((i, torch.randn(5 + rank + i, D, generator=g), torch.randn(5 + rank + i, D, generator=g)))
    seen, order = {}, []

    def step(batch):
        i, x, probe = batch
        order.append(f"begin {i}")
        x = x.clone().requires_grad_(True)
        y = model(x)
        aux = fmoe.collect_aux_loss(model)
        (y * probe).sum().add(aux).backward()
        order.append(f"end {i}")
        seen[f"y{i}"], seen[f"dx{i}"], seen[f"aux{i}"] = y.detach(), x.grad, aux.detach()
        for name in ("moe1", "moe2"):
            layer = getattr(model, name)
            seen[f"{name}.counts{i}"] = layer.last_counts_E.clone()
            seen[f"{name}.dropped{i}"] = layer.num_dropped
        return i

    replaying = contextlib.nullcontext()
    if replay:
        routing = torch.Generator().manual_seed(7 + rank)
        trace = fmoe.RoutingTrace({name: [torch.randperm(E_PER_RANK * world, generator=routing)[:2].repeat(len(x), 1)
                                          for _, x, _ in batches] for name in ("moe1", "moe2")})
        replaying = fmoe.replay_routing(model, trace)
    with replaying:
        if interleave:
            schedule = {} if interleave is True else {"schedule": interleave}
            assert fmoe.interleave_micro_batches(model, step, batches, **schedule) == list(range(micro_batches))
        else:
            for batch in batches:
                step(batch)
    if synced is not None:
        synced.allreduce_params()
    for name in ("moe1", "moe2"):
        layer = getattr(model, name)
        seen[f"{name}.traffic"] = layer.traffic_bytes
        seen[f"{name}.last_counts"] = layer.last_counts_E
    seen.update({f"grad.{n}": p.grad for n, p in model.named_parameters()})
    return seen, order


# The overlap matrix, its capacity gate without random routing (random draws are per micro-batch; below)
INTERLEAVE_CASES = [(name, dict(options, gate_kwargs={"random_routing": False}) if name == "slot-capacity" else options)
                    for name, options in OVERLAP_CASES]


def check_interleaved_micro_batches_equal_one_after_the_other(rank, world, cases=None, schedule="lockstep"):
    for name, options in INTERLEAVE_CASES if cases is None else [c for c in INTERLEAVE_CASES if c[0] in cases]:
        for overlap in ("none", "auto"):
            plain, _ = micro_batch_run(rank, world, options, False, overlap)
            mixed, order = micro_batch_run(rank, world, options, schedule, overlap)
            # Each micro-batch began while the one before ran (it ran while the other's rows travelled):
            # under "1f1b" once the one before waited in its backward, which the sync-free exchange never
            # does (its backward's functional collectives are waited for as they are read).
            # ("lockstep": micro-batch 2 may begin only once 1 has ended, if 1 waits no more after 0 ends.)
            if not (schedule == "1f1b" and name == "rank-sync-free"):
                followers = (1, 3) if schedule == "lockstep" else (1, 2, 3)
                assert all(order.index(f"begin {i}") < order.index(f"end {i - 1}") for i in followers), (name, overlap, order)
            assert mixed.keys() == plain.keys(), name
            differ = [key for key, value in plain.items()
                      if not (torch.equal(value, mixed[key]) if isinstance(value, torch.Tensor) else value == mixed[key])]
            assert not differ, f"rank {rank}, {name}, overlap={overlap}: {differ} differ from one after the other"


def check_interleaved_random_draws_are_the_first_micro_batchs_and_reproducible(rank, world):
    """GShard's random routing: the first micro-batch draws what it draws alone; the second from its
    own stream, the same on every run."""
    options = dict(exchange="slot", gate="gshard")
    plain, _ = micro_batch_run(rank, world, options, False, micro_batches=2)
    mixed = [micro_batch_run(rank, world, options, True, micro_batches=2)[0] for _ in range(2)]
    for key, value in mixed[0].items():
        same = torch.equal(value, mixed[1][key]) if isinstance(value, torch.Tensor) else value == mixed[1][key]
        assert same, f"rank {rank}: {key} differs between two interleaved runs"
    for key in ("y0", "moe1.counts0", "moe2.counts0"):
        assert torch.equal(plain[key], mixed[0][key]), key


def check_overlap_modes_equal_none_under_fsdp2(rank, world, ep_size):
    """FSDP2 (fmoe.distributed.fsdp.shard_model: the experts sharded over the ranks that hold the same
    ones, the rest over all): each overlap mode's outputs and gradients (gathered) equal "none" bit
    for bit, over two steps."""
    import os
    from fmoe.distributed.fsdp import shard_model
    from fmoe.distributed.groups import make_groups
    os.environ["FMOE_PIPELINE_CHUNKS"] = "2"
    groups = make_groups(ep_size)
    runs = {}
    for overlap in ("none", "shared", "pipeline", "auto"):
        kw, _, _ = layer_options(dict(exchange="slot"))
        torch.manual_seed(0)
        model = TwoLayers(ep_size, overlap, dict(kw, moe_group=groups.moe_group))
        shard_model(model, groups)
        if overlap in ("pipeline", "auto"):
            # experts FSDP shards (ep_size < world) would be gathered again by each chunk: "shared" then
            assert model.moe1.dispatcher.pipelining(torch.zeros(1, D)) == (ep_size == world), (overlap, ep_size)
        seen = {}
        for step in range(2):
            g = torch.Generator().manual_seed(100 * rank + step)
            x, probe = torch.randn(6 + rank, D, generator=g), torch.randn(6 + rank, D, generator=g)
            y = model(x)
            (y * probe).sum().backward()
            seen[f"y{step}"] = y.detach()
        seen.update({n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                     for n, p in model.named_parameters()})
        runs[overlap] = seen
    for overlap in ("shared", "pipeline", "auto"):
        differ = [k for k, v in runs["none"].items() if not torch.equal(v, runs[overlap][k])]
        assert not differ, f"rank {rank}, FSDP2, overlap={overlap}: {differ} differ from 'none'"


def check_interleaved_compiled_equals_one_after_the_other(rank, world):
    """A compiled model (aot_eager: its exchanges run eagerly between graphs) takes turns too, equal to the loop."""
    runs = {}
    for interleave in (False, True):
        kw, _, _ = layer_options(dict(exchange="slot"))
        torch.manual_seed(0)
        model = TwoLayers(world, "auto", kw)
        with torch.no_grad():
            model(torch.zeros(1, D))        # the first forward agrees with the peers, eagerly
        model.compile(backend="aot_eager")
        order = []

        def step(i):
            order.append(f"begin {i}")
            g = torch.Generator().manual_seed(10 * rank + i)
            y = model(torch.randn(5 + i, D, generator=g))
            y.sum().backward()
            order.append(f"end {i}")
            return y.detach()
        ys = fmoe.interleave_micro_batches(model, step, [0, 1]) if interleave else [step(0), step(1)]
        runs[interleave] = (ys, {n: p.grad for n, p in model.named_parameters()}, order)
    (ys, grads, _), (ys_i, grads_i, order) = runs[False], runs[True]
    assert order.index("begin 1") < order.index("end 0"), order
    assert all(torch.equal(a, b) for a, b in zip(ys, ys_i))
    assert all(torch.equal(grads[n], grads_i[n]) for n in grads), [n for n in grads if not torch.equal(grads[n], grads_i[n])]


def check_overlap_weight_grads_run_while_the_input_gradient_travels(rank, world):
    """The backward's order under each overlapping mode: the experts' input gradient starts back (`_Arrive`'s
    backward), their weight-gradient GEMMs run (the deferral's jobs), then a collective is waited for (the
    first real wait after the trip started); the shared experts' weight-gradient GEMMs wait longer: they run
    once every input gradient has started back, before the wait for them, unless a wait before would idle
    (then there); with `defer_weight_grads = False` no job is deferred; all bit-identical."""
    from fmoe.kernels import deferred
    events = []

    def logged(name, fn):
        def run(*args, **kwargs):
            events.append(name)
            return fn(*args, **kwargs)
        return staticmethod(run) if name != "wgrad" else run

    arrive, wait, run_jobs = exchange._Arrive.backward, link.wait, deferred.DeferredWeightGrads.run
    arrived = link.Pending.arrived

    def run_logged(self):
        if self.jobs:
            events.append("shared wgrad" if self.late else "wgrad")
        return run_jobs(self)

    exchange._Arrive.backward = logged("trip", arrive)

    def wait_logged(*args, **kwargs):
        events.append("wait")
        return wait(*args, **kwargs)
    link.wait = wait_logged
    deferred.DeferredWeightGrads.run = run_logged
    try:
        for overlap, idle in [("shared", False), ("pipeline", False), ("shared", True), ("pipeline", True)]:
            # idle: every wait finds its collective still under way (else every one finds it there)
            link.Pending.arrived = lambda self: not idle
            results = {}
            for defer in (True, False):
                torch.manual_seed(0)
                layer = fmoe.FMoETransformerMLP(num_expert=E_PER_RANK, world_size=world, d_model=D, d_hidden=H,
                                                top_k=2, gate="naive", shared_expert=H, overlap=overlap)
                layer.defer_weight_grads = defer
                g = torch.Generator().manual_seed(rank)
                x = torch.randn(8, D, generator=g).requires_grad_(True)
                y = layer(x)
                events.clear()
                (y * torch.randn(8, D, generator=g)).sum().backward()
                results[defer] = [y.detach(), x.grad] + [p.grad for p in layer.parameters()]
                if defer:       # the jobs ran at a wait (not left to the end), after a gradient started back
                    wgrad = events.index("wgrad")
                    then = next(e for e in events[wgrad:] if not e.endswith("wgrad"))
                    assert "trip" in events[:wgrad] and then == "wait", (overlap, events)
                    # the shared experts' jobs: after the last trip (every input gradient on its way), before a
                    # wait; where the waits would idle, at the first (the output gradients' still under way)
                    shared, last_trip = events.index("shared wgrad"), len(events) - 1 - events[::-1].index("trip")
                    if idle:
                        assert events[shared + 1:].index("wait") <= 1 and shared < last_trip, (overlap, events)
                        assert "wait" not in events[:shared], (overlap, events)
                    else:
                        assert shared > last_trip and "wait" not in events[last_trip:shared], (overlap, events)
                    assert events.count("shared wgrad") == 1, (overlap, events)
                else:
                    assert not [e for e in events if e.endswith("wgrad")], (overlap, events)
            for a, b in zip(results[True], results[False]):
                assert torch.equal(a, b), overlap
    finally:
        exchange._Arrive.backward, link.wait = staticmethod(arrive), wait
        deferred.DeferredWeightGrads.run, link.Pending.arrived = run_jobs, arrived


# Under this link the performance model picks 1 chunk for the first row count, 2 for the second
LINK, ROWS_PICKING_OTHER_CHUNKS = (1.0, 10.0), (4, 400)


def check_pipeline_chunks_the_rank_and_node_exchanges(rank, world):
    """overlap="pipeline" on the rank and node exchanges: the last hop's rows go in the chunks the ranks
    agree on (the performance model's picks, which differ here: every rank has other rows), each chunk a
    dispatch, a weights and a combine all-to-all; and x's gradient flows."""
    from fmoe.distributed import link
    cases = [("rank", dict(exchange="rank")), ("node", dict(exchange="node", ranks_per_node=2 if world == 4 else 1))]
    for name, options in cases:
        kw, _, _ = layer_options(options)
        torch.manual_seed(0)
        layer = fmoe.FMoETransformerMLP(num_expert=E_PER_RANK, world_size=world, overlap="pipeline", **kw)
        started = []
        original = link.start

        def counting(work, what, nbytes, hands_turn=True):
            started.append(what)
            return original(work, what, nbytes, hands_turn)
        link.start = counting
        try:
            from fmoe.distributed.pipeline import pipeline_chunks_for
            x = torch.randn(ROWS_PICKING_OTHER_CHUNKS[rank % 2], D, requires_grad=True)
            with link.simulated_link(*LINK):
                picks = pipeline_chunks_for(layer, x.new_empty(x.shape[0] * 2, 0), agree=False)
                started.clear()
                layer(x).sum().backward()
        finally:
            link.start = original
        pipelined = [what for what in started if "pipelined dispatch" in what and "(backward)" not in what]
        everyone = [None] * world
        dist.all_gather_object(everyone, (len(pipelined), picks))
        assert len({n for n, _ in everyone}) == 1, (name, everyone)        # every rank issued as many
        assert {p for _, p in everyone} == {1, 2}, (name, everyone)      # the ranks' own picks differ
        assert everyone[0][0] == 2, (name, everyone)                     # all took the largest
        assert x.grad is not None and torch.isfinite(x.grad).all(), name


def check_interleaved_turns_pass_at_the_same_collectives_on_every_rank(rank, world):
    """Two micro-batches through two slot-exchange layers, overlap="auto": the turn passes at the same
    collectives, in the same order, on every rank; never at the routing weights' wait in the forward
    (started right after the rows, they arrive right after them: the other micro-batch then waits for
    rows it started later); and where it passes, the other waits for a collective started earlier
    than the one this micro-batch waits for, or has not begun."""
    from fmoe.distributed import interleave
    made, checked = [], []
    original_init, original_waiting = interleave.Turns.__init__, interleave.Turns.waiting

    def remember(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        made.append(self)

    def waiting(self, me, pending):
        other = self._other(me)
        theirs = None if other is None else self.waiting_on[other]
        passes = len(self.passes)
        with original_waiting(self, me, pending):
            if len(self.passes) > passes:
                checked.append((theirs, pending.order))
            yield
    interleave.Turns.__init__, interleave.Turns.waiting = remember, contextlib.contextmanager(waiting)
    try:
        micro_batch_run(rank, world, dict(exchange="slot"), True, "auto", micro_batches=2)
    finally:
        interleave.Turns.__init__, interleave.Turns.waiting = original_init, original_waiting
    (turns,) = made
    assert turns.passes and len(checked) == len(turns.passes), (turns.passes, checked)
    assert not [what for _, what in turns.passes if what.endswith("routing all-to-all")], turns.passes
    assert all(theirs is None or theirs < mine for theirs, mine in checked), checked
    everyone = [None] * world
    dist.all_gather_object(everyone, turns.passes)
    assert all(passes == turns.passes for passes in everyone), everyone
