"""Worker bodies for the exchanges (one row per slot, per rank, per node): the bytes each rank
sends against formulas computed from the global routing, and shadowing on the deduplicated ones."""
import contextlib

import torch
import torch.distributed as dist

import fmoe
from tests.dist_workers import check_layer_matches_single_process, expect_disagreement
from tests.shadow_workers import FixedShadow, TinyExpert, assert_same_results, build, compare_variants

D, H = 8, 16


@contextlib.contextmanager
def counted_rows(width: int):
    """Bytes this rank sends to other ranks through all_to_all_single in tensors of `width`
    columns (the token rows and the expert outputs and their gradients), counted at
    torch.distributed, apart from the layer's own counter."""
    sent = {"bytes": 0}
    real = dist.all_to_all_single

    def counting(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        if input.dim() == 2 and input.shape[1] == width:
            me, world = dist.get_rank(group), dist.get_world_size(group)
            splits = input_split_sizes or [input.shape[0] // world] * world
            sent["bytes"] += sum(n for w, n in enumerate(splits) if w != me) * width * input.element_size()
        return real(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    dist.all_to_all_single = counting
    try:
        yield sent
    finally:
        dist.all_to_all_single = real


def gather_routing(idx_TK: torch.Tensor, world: int):
    """Every rank's expert ids, as a list indexed by rank."""
    sizes = [None] * world
    dist.all_gather_object(sizes, idx_TK.tolist())
    return [torch.tensor(s, dtype=torch.long).reshape(-1, idx_TK.shape[1]) for s in sizes]


def expected_rows(idx_by_rank, e: int, world: int, per_node: int, exchange: str):
    """Rows each rank sends to other ranks in the forward, by (kind, locality), from the routing
    alone: slot: one per slot; rank: one per (token, other rank); node: one per (token, other
    node) to the rank with the sender's local index there, then one per (token, other rank)
    inside the node from that rank. The backward sends the same numbers the other way:
    dispatch's gradient as many rows as combine, combine's as many as dispatch."""
    node = lambda r: r // per_node  # noqa: E731
    out = [{(k, loc): 0 for k in ("dispatch", "combine") for loc in ("intra_node", "inter_node")}
           for _ in range(world)]

    def send(src, dst, rows=1):
        if src != dst:
            loc = "intra_node" if node(src) == node(dst) else "inter_node"
            out[src][("dispatch", loc)] += rows
            out[dst][("combine", loc)] += rows

    for src, idx_TK in enumerate(idx_by_rank):
        for row in idx_TK.tolist():
            experts = [x for x in row if x >= 0]
            if exchange == "slot":
                for x in experts:
                    send(src, x // e)
            elif exchange == "rank":
                for dst in {x // e for x in experts}:
                    send(src, dst)
            else:
                for n in {x // e // per_node for x in experts}:
                    gateway = n * per_node + src % per_node
                    send(src, gateway)
                    for dst in {x // e for x in experts if x // e // per_node == n}:
                        send(gateway, dst)
    return out


def check_traffic_matches_formula(rank, world, exchange, per_node, top_k):
    e = 2
    torch.manual_seed(0)
    layer = fmoe.FMoETransformerMLP(num_expert=e, d_model=D, d_hidden=H, top_k=top_k, world_size=world,
                                    exchange=exchange, ranks_per_node=per_node).eval()
    g = torch.Generator().manual_seed(5 + rank)
    x = torch.randn(7 + 2 * rank, D, generator=g, requires_grad=True)
    idx_by_rank = gather_routing(layer.gate.routing(x).expert_idx_TK, world)
    with counted_rows(D) as counted:
        out = layer(x)
        forward_bytes = counted["bytes"]
        (out * torch.randn(out.shape, generator=g)).sum().backward()
    rows = expected_rows(idx_by_rank, e, world, per_node, exchange)[rank]
    traffic = layer.traffic_bytes
    row = D * 4
    ctx = f"{exchange} exchange, rank {rank}/{world}, {per_node} a node, top-{top_k}"
    for kind, other in (("dispatch", "combine"), ("combine", "dispatch")):
        for loc in ("intra_node", "inter_node"):
            assert traffic[kind]["forward"][loc] == rows[(kind, loc)] * row, (ctx, kind, loc, traffic, rows)
            assert traffic[kind]["backward"][loc] == rows[(other, loc)] * row, (ctx, kind, loc, traffic, rows)
    total = sum(rows.values()) * row
    assert forward_bytes == total, (ctx, forward_bytes, total)
    assert counted["bytes"] == 2 * total, (ctx, counted["bytes"], 2 * total)
    if exchange == "node" and per_node < world:
        assert traffic["dispatch"]["forward"]["inter_node"] > 0, ctx      # the routing reaches other nodes
    if exchange == "rank":
        # The routing's own traffic: split counts, K expert ids (int64) and K weights (fp32) a row,
        # the weights' gradients back.
        sent = rows[("dispatch", "intra_node")] + rows[("dispatch", "inter_node")]
        back = rows[("combine", "intra_node")] + rows[("combine", "inter_node")]
        routing = traffic["routing"]
        assert sum(routing["forward"].values()) == (world - 1) * 8 + sent * top_k * (8 + 4), (ctx, routing)
        assert sum(routing["backward"].values()) == back * top_k * 4, (ctx, routing)
    totals = torch.tensor([forward_bytes], dtype=torch.long)
    dist.all_reduce(totals)
    return int(totals)


def check_dedup_sends_fewer_rows(rank, world):
    """On the same routing, the rank exchange sends at most the slot exchange's rows, and fewer
    when a token has two experts on one rank (top-4 over 2 experts a rank always has)."""
    sent = {ex: check_traffic_matches_formula(rank, world, ex, world, 4) for ex in ("slot", "rank")}
    assert sent["rank"] < sent["slot"], sent


def check_shadowing_on_dedup_equals_slot(rank, world, exchange, per_node):
    E = 2 * world
    kw = dict(exchange=exchange, ranks_per_node=per_node)
    for top_k, hot in ((1, [0]), (2, [0, E - 1]), (3, [1, 0])):
        compare_variants(rank, world, top_k, hot, lambda w, e, k, h: build(w, e, k, h, shadow=FixedShadow(h), **kw))
        compare_variants(rank, world, top_k, hot, lambda w, e, k, h: build(w, e, k, h, **kw))
    # User experts (a module list) and a gated activation, shadowed.
    compare_variants(rank, world, 2, [0], lambda w, e, k, h: build(w, e, k, h, expert=TinyExpert,
                                                                   shadow=FixedShadow(h), **kw),
                     make_plain=lambda w, e, k, h: build(w, e, k, h, expert=TinyExpert))
    compare_variants(rank, world, 2, [E - 1], lambda w, e, k, h: build(w, e, k, h, activation="swiglu",
                                                                       shadow=FixedShadow(h), **kw),
                     make_plain=lambda w, e, k, h: build(w, e, k, h, activation="swiglu"))


def node_limited_pair(rank, world, per_node, max_nodes, top_k, e=2):
    """One process with the groups given as n_group / topk_group, and the expert-parallel layer
    with max_nodes (its groups laid on its nodes): the same routing."""
    torch.manual_seed(0)
    kw = dict(d_model=D, d_hidden=H, top_k=top_k, gate="router")
    full = fmoe.FMoETransformerMLP(num_expert=e * world, gate_kwargs={"n_group": world // per_node,
                                                                       "topk_group": max_nodes}, **kw)
    ep = fmoe.FMoETransformerMLP(num_expert=e, world_size=world, exchange="node", ranks_per_node=per_node,
                                 gate_kwargs={"max_nodes": max_nodes}, **kw)
    ep.gate.load_state_dict(full.gate.state_dict())
    with torch.no_grad():
        for name, p in ep.experts.named_parameters():
            p.copy_(getattr(full.experts, name)[rank * e:(rank + 1) * e])
    return full, ep


def check_node_limited_routing(rank, world, per_node, max_nodes, top_k):
    e = 2
    full, ep = node_limited_pair(rank, world, per_node, max_nodes, top_k, e)
    assert (ep.gate.n_group, ep.gate.topk_group) == (world // per_node, max_nodes)
    g = torch.Generator().manual_seed(11)
    T = 6
    x_all = torch.randn(T * world, D, generator=g, requires_grad=True)
    probe = torch.randn(T * world, D, generator=g)
    lo, hi = rank * T, (rank + 1) * T
    out_all = full(x_all)
    (out_all * probe).sum().backward()
    x = x_all.detach()[lo:hi].clone().requires_grad_(True)
    idx_by_rank = gather_routing(ep.gate.routing(x).expert_idx_TK, world)
    out = ep(x)
    (out * probe[lo:hi]).sum().backward()
    torch.testing.assert_close(out, out_all[lo:hi], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x.grad, x_all.grad[lo:hi], atol=1e-5, rtol=1e-5)
    for name, p in ep.experts.named_parameters():
        torch.testing.assert_close(p.grad, getattr(full.experts, name).grad[rank * e:(rank + 1) * e],
                                   atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")
    grad = ep.gate.gate.proj.weight.grad.clone()
    dist.all_reduce(grad)
    torch.testing.assert_close(grad, full.gate.gate.proj.weight.grad, atol=1e-5, rtol=1e-5)
    nodes_per_token = [len({x // e // per_node for x in row}) for idx in idx_by_rank for row in idx.tolist()]
    assert max(nodes_per_token) <= max_nodes, nodes_per_token
    inter = ep.traffic_bytes["dispatch"]["forward"]["inter_node"]
    assert inter <= max_nodes * T * D * 4, inter
    rows = expected_rows(idx_by_rank, e, world, per_node, "node")[rank]
    assert inter == rows[("dispatch", "inter_node")] * D * 4
    # Without the limit, this routing reaches more nodes for some token: the limit is what held it.
    unlimited = fmoe.FMoETransformerMLP(num_expert=e, world_size=world, d_model=D, d_hidden=H, top_k=top_k,
                                        gate="router")
    unlimited.gate.load_state_dict(full.gate.state_dict())
    free = gather_routing(unlimited.gate.routing(x).expert_idx_TK, world)
    assert max(len({x // e // per_node for x in row}) for idx in free for row in idx.tolist()) > max_nodes


def check_overflow_is_reported_on_every_rank(rank, world, exchange, per_node, bound):
    """Past `max_tokens_per_rank` the pairs are dropped and counted: the count, summed over the
    ranks, equals the routing's (first hop: per sender and destination, the pairs past the bound),
    every rank reports it and warns; the output equals one process without those pairs' slots."""
    import warnings
    e, top_k, T = 2, 3, 6
    torch.manual_seed(0)
    kw = dict(d_model=D, d_hidden=H, top_k=top_k)
    full = fmoe.FMoETransformerMLP(num_expert=e * world, **kw)
    layer = fmoe.FMoETransformerMLP(num_expert=e, world_size=world, exchange=exchange, ranks_per_node=per_node,
                                    sync_free=True, max_tokens_per_rank=bound, **kw)
    layer.gate.load_state_dict(full.gate.state_dict())
    with torch.no_grad():
        for name, p in layer.experts.named_parameters():
            p.copy_(getattr(full.experts, name)[rank * e:(rank + 1) * e])
    g = torch.Generator().manual_seed(3)
    x_all = torch.randn(T * world, D, generator=g)
    x = x_all[rank * T:(rank + 1) * T]
    idx_by_rank = gather_routing(layer.gate.routing(x).expert_idx_TK, world)
    out = layer(x)
    expected, dropped = 0, []
    for src, idx_TK in enumerate(idx_by_rank):
        seen = {}
        for t, row in enumerate(idx_TK.tolist()):
            dests = {x // e if exchange == "rank" else x // e // per_node * per_node + src % per_node for x in row}
            for d in dests:
                seen[d] = seen.get(d, 0) + 1
                if seen[d] > bound:
                    expected += 1
                    dropped.append((src, t, d))
    assert expected > 0, "the case must overflow"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert layer.num_overflowed == expected, (layer.num_overflowed, expected)
    assert any("exceeded max_tokens_per_rank" in str(w.message) for w in caught), caught
    # One process, each dropped pair's slots masked out (their experts' outputs absent).
    idx_all = torch.cat(idx_by_rank)
    weight_all = full.gate.routing(x_all).weight_TK
    for src, t, d in dropped:
        for k, x_ in enumerate(idx_by_rank[src][t].tolist()):
            on = x_ // e if exchange == "rank" else x_ // e // per_node * per_node + src % per_node
            if on == d:
                idx_all[src * T + t, k] = -1
    ref = torch.zeros(T * world, D)
    for t in range(T * world):
        for k in range(top_k):
            if idx_all[t, k] >= 0:
                ref[t] += weight_all[t, k] * full.experts.expert_forward(int(idx_all[t, k]), x_all[t:t + 1])[0]
    torch.testing.assert_close(out, ref[rank * T:(rank + 1) * T], atol=1e-5, rtol=1e-5)


class NoHostSync:
    """Within: reading a tensor on the host (`item`, `tolist`, `__bool__`, `__int__`, `__float__`,
    `__index__`) raises."""
    NAMES = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")

    def __enter__(self):
        self.saved = {n: getattr(torch.Tensor, n) for n in self.NAMES}

        def refuse(name):
            def raising(t, *a, **k):
                raise AssertionError(f"host sync: Tensor.{name} called")
            return raising
        for n in self.NAMES:
            setattr(torch.Tensor, n, refuse(n))
        return self

    def __exit__(self, *exc):
        for n, f in self.saved.items():
            setattr(torch.Tensor, n, f)


def check_sync_free_never_reads_the_device(rank, world, exchange, per_node):
    """After a first forward (the layer's one-time agreement with its peers), a sync-free layer's
    forward and backward read nothing on the host; and they equal the exchange that does."""
    torch.manual_seed(0)
    kw = dict(num_expert=2, d_model=D, d_hidden=H, top_k=3, world_size=world, exchange=exchange,
              ranks_per_node=per_node)
    layer = fmoe.FMoETransformerMLP(sync_free=True, max_tokens_per_rank=8, **kw)
    plain = fmoe.FMoETransformerMLP(**kw)
    plain.load_state_dict(layer.state_dict())
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(8, D, generator=g, requires_grad=True)
    probe = torch.randn(8, D, generator=g)
    (layer(x) * probe).sum().backward()
    layer.zero_grad()
    x.grad = None
    with NoHostSync():
        out = layer(x)
        (out * probe).sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    dx = x.grad.clone()
    x.grad = None
    ref = plain(x)
    (ref * probe).sum().backward()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dx, x.grad, atol=1e-5, rtol=1e-5)
    for n, p in plain.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, atol=1e-5, rtol=1e-5, msg=lambda m: f"{n}: {m}")
    assert layer.num_overflowed == 0


def check_sync_free_compiles_whole(rank, world, exchange, per_node):
    """torch.compile(fullgraph=True) traces the sync-free expert-parallel layer (after its first,
    eager forward, which agrees with the peers); outputs, every gradient and the counted bytes
    equal the eager layer's."""
    import copy
    torch.manual_seed(0)
    layer = fmoe.FMoETransformerMLP(num_expert=2, d_model=D, d_hidden=H, top_k=3, world_size=world,
                                    exchange=exchange, ranks_per_node=per_node, sync_free=True,
                                    max_tokens_per_rank=8)
    with torch.no_grad():
        layer(torch.zeros(1, D))
    eager = copy.deepcopy(layer)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(8, D, generator=g)
    probe = torch.randn(8, D, generator=g)
    results = []
    for module, run in ((eager, eager), (layer, compiled)):
        x_in = x.clone().requires_grad_(True)
        out = run(x_in)
        (out * probe).sum().backward()
        results.append((out, x_in.grad, {n: p.grad for n, p in module.named_parameters()}, module.traffic_bytes))
    (out_e, dx_e, grads_e, bytes_e), (out_c, dx_c, grads_c, bytes_c) = results
    torch.testing.assert_close(out_c, out_e, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dx_c, dx_e, atol=1e-5, rtol=1e-5)
    for n in grads_e:
        torch.testing.assert_close(grads_c[n], grads_e[n], atol=1e-5, rtol=1e-5, msg=lambda m: f"{n}: {m}")
    # The bounded buffers' bytes: 8 rows of D fp32 to each other rank (ranks on one node, or each its own).
    where = "intra_node" if per_node is None else "inter_node"
    assert bytes_c == bytes_e and bytes_e["dispatch"]["forward"][where] == (world - 1) * 8 * D * 4, bytes_e


def check_capacity_on_dedup_equals_slot(rank, world, exchange, per_node):
    """A capacity limit (GShard's, per rank) drops slots before any exchange: the deduplicated
    exchanges equal one row per slot on the same drops, outputs and every gradient."""
    kw = dict(gate="gshard", gate_kwargs={"capacity": (0.5, 0.5), "random_routing": False})
    for top_k, hot in ((2, [0]), (2, [0, 1])):
        layer = compare_variants(rank, world, top_k, hot,
                                 lambda w, e, k, h: build(w, e, k, h, exchange=exchange, ranks_per_node=per_node,
                                                          **kw),
                                 make_plain=lambda w, e, k, h: build(w, e, k, h, **kw))
        dropped = torch.tensor([layer.num_dropped])
        dist.all_reduce(dropped)
        assert int(dropped) > 0, "the capacity must drop slots for the case to test anything"


def check_schedule_on_rank_equals_slot(rank, world):
    """FasterMoE's smart schedule pipelining the rank exchange (groups of 1 and 2 ranks, with and
    without shadowing, module-list experts too) equals one row per slot, unscheduled."""
    E = 2 * world
    for group_size in (1, 2):
        for top_k, hot, shadow in ((3, [], False), (1, [0], False), (2, [0, E - 1], True)):
            def make(w, e, k, h):
                return build(w, e, k, h, schedule=True, schedule_group_size=group_size, exchange="rank",
                             shadow=FixedShadow(h) if shadow else False)
            compare_variants(rank, world, top_k, hot, make)
    compare_variants(rank, world, 2, [], lambda w, e, k, h: build(w, e, k, h, expert=TinyExpert, schedule=True,
                                                                  exchange="rank"),
                     make_plain=lambda w, e, k, h: build(w, e, k, h, expert=TinyExpert))


def check_tree_inputs_on_rank_equal_slot(rank, world):
    """FastMoE's multi-input experts (a dict of tensors following x's routing) over the rank
    exchange equal them over one row per slot: outputs and every gradient."""
    from fmoe.layer import FMoE
    from tests.test_fastmoe_compat import DictExperts, DictGate
    results = []
    for exchange in ("slot", "rank"):
        torch.manual_seed(0)
        moe = FMoE(num_expert=2, d_model=D, gate=DictGate, top_k=3, world_size=world, exchange=exchange)
        torch.manual_seed(1 + rank)
        moe.experts = DictExperts(2, D, H)
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(5, D, generator=g, requires_grad=True)
        z = torch.randn(5, D, generator=g, requires_grad=True)
        out = moe({"x": x, "y": z})
        (out["x"] * 2 + out["y"] ** 2).sum().backward()
        results.append(([out["x"], out["y"], x.grad, z.grad], {n: p.grad for n, p in moe.named_parameters()}))
    assert_same_results(*results, f"rank {rank}")


def check_disagreeing_exchanges_raise_on_every_rank(rank, world):
    expect_disagreement(fmoe.FMoETransformerMLP(num_expert=2, d_model=D, d_hidden=H, top_k=2, world_size=world,
                                                exchange="rank" if rank else "slot"), "exchange")


def check_megatron_rank_exchange_equals_slot(rank, world):
    """A Megatron-Core GPT with fmoe MLPs (expert parallel = world) trained two steps with Megatron's
    DDP and Adam: exchange="rank" gives the losses and parameters of exchange="slot"."""
    from megatron.core import parallel_state

    from fmoe.integrations.megatron import training
    from tests.test_megatron import batch, gpt

    runs = []
    for exchange in ("slot", "rank"):
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        training.initialize(1, world, seed=7)
        model, optimizer = training.wrap(gpt(world, gate="naive", aux_loss_coeff=0.0, exchange=exchange), lr=1e-2)
        assert model.module.decoder.layers[0].mlp.moe.exchange == exchange
        losses = [training.train_step(model, optimizer, [batch(step, rank)]) for step in range(2)]
        runs.append((losses, {n: p.detach().clone() for n, p in model.named_parameters()}))
    parallel_state.destroy_model_parallel()
    (l0, p0), (l1, p1) = runs
    assert torch.allclose(torch.tensor(l1), torch.tensor(l0), atol=1e-5, rtol=1e-5), (rank, l0, l1)
    for n in p0:
        # Adam turns last-bit differences of near-zero gradients into +-lr steps: a mean bound too.
        diff = (p1[n] - p0[n]).abs()
        assert diff.max() <= 1.1e-2 and diff.mean() <= 1e-4, (rank, n, diff.max().item(), diff.mean().item())


def check_disagreeing_recompute_raises_on_every_rank(rank, world):
    expect_disagreement(fmoe.FMoETransformerMLP(num_expert=2, d_model=D, d_hidden=H, top_k=2, world_size=world,
                                                recompute="none" if rank else "activation"), "recompute")


def check_nodes_not_dividing_the_world_bind_only_the_node_exchange(rank, world):
    """LOCAL_WORLD_SIZE=2 on 3 ranks: the slot and rank exchanges need no nodes and equal one
    process; the node exchange refuses on every rank."""
    import os
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    for exchange in ("slot", "rank"):
        check_layer_matches_single_process(rank, world, exchange)
    try:
        fmoe.FMoETransformerMLP(num_expert=2, d_model=D, d_hidden=H, world_size=world, exchange="node")
    except ValueError as err:
        assert "LOCAL_WORLD_SIZE must be a positive int dividing the expert-parallel world size 3" in str(err), err
    else:
        raise AssertionError("exchange='node' built with LOCAL_WORLD_SIZE=2 on 3 ranks")

