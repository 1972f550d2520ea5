"""Routing statistics (fmoe.observe.stats): every statistic held to a plain loop over the routed slots."""
import json
import math
import os
import statistics

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import fmoe
from fmoe.observe.stats import RoutingStatsMeter, scalars
from tests.dist_utils import run_ranks
from tests.test_compile import no_host_reads

D, H, E = 8, 16, 4


def assert_approx(got: dict, expected: dict, rel: float):
    """Leaf by leaf: pytest.approx takes no nested dicts from pytest 9.2 on."""
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        if isinstance(value, dict):
            assert_approx(got[key], value, rel)
        else:
            assert got[key] == pytest.approx(value, rel=rel), key


def layer_with_hook(gate="naive", top_k=2, seed=0, **gate_kwargs):
    """A layer and the list its gate hook fills with each forward's expert_idx_TK (-1: no expert)."""
    torch.manual_seed(seed)
    seen = []
    layer = fmoe.FMoETransformerMLP(num_expert=E, d_model=D, d_hidden=H, top_k=top_k, gate=gate,
                                    gate_kwargs=gate_kwargs, gate_hook=lambda idx, w, _: seen.append(idx.clone()))
    return layer, seen


def reference(idx_TK, logits_TE, unrouted_by_gate: bool):
    """The statistics by a loop over slots and tokens. A -1 slot is dropped by capacity, or, for a gate
    that only unroutes (no capacity), unrouted."""
    counts = [0] * E
    no_expert = 0
    for row in idx_TK.tolist():
        for e in row:
            if e < 0:
                no_expert += 1
            else:
                counts[e] += 1
    entropies = []
    for row in logits_TE.tolist():
        z = sum(math.exp(v) for v in row)
        entropies.append(-sum(math.exp(v) / z * math.log(math.exp(v) / z) for v in row))
    mean = statistics.mean(counts)
    return {"tokens_per_expert": counts, "max_load": max(counts), "mean_load": mean,
            "load_cv": statistics.pstdev(counts) / mean, "empty_experts": sum(c == 0 for c in counts),
            "dropped_slots": 0 if unrouted_by_gate else no_expert, "unrouted_slots": no_expert if unrouted_by_gate else 0,
            "router_entropy": statistics.mean(entropies)}


def skew_router(layer):
    """Every token picks experts 0 and 1: experts 2 and 3 get nothing."""
    with torch.no_grad():
        layer.gate.gate.proj.weight.zero_()
        layer.gate.gate.proj.bias.copy_(torch.tensor([2.0, 1.0, -1.0, -1.0]))


@pytest.mark.parametrize("gate,top_k,gate_kwargs,happens", [
    ("naive", 2, {}, set()),
    ("naive", 2, {"capacity": 0.5}, {"dropped"}),
    ("gshard", 2, {"capacity": None}, {"unrouted"}),            # random routing leaves second slots unrouted
    ("switch", 1, {}, {"dropped"}),                             # capacity (1.2, 2.4) and logit noise
    ("naive", 2, {}, {"empty"}),                                # skewed: two experts get nothing
])
def test_each_statistic_equals_a_plain_loop(gate, top_k, gate_kwargs, happens):
    layer, seen = layer_with_hook(gate, top_k, **gate_kwargs)
    if "empty" in happens:
        skew_router(layer)
    layer.train()(torch.randn(40, D, generator=torch.Generator().manual_seed(1)))
    stats = fmoe.routing_stats(layer)["moe"]
    expected = reference(seen[-1], layer.gate.last_logits_TE, unrouted_by_gate="unrouted" in happens)
    assert stats.keys() == expected.keys()
    assert_approx(stats, expected, rel=1e-5)
    assert stats["dropped_slots"] + stats["unrouted_slots"] == layer.num_dropped
    seen_happen = {"dropped": stats["dropped_slots"] > 0, "unrouted": stats["unrouted_slots"] > 0,
                   "empty": stats["empty_experts"] > 0}
    assert {k for k, v in seen_happen.items() if v} == happens


def test_gshard_counts_drops_and_unrouted_slots_apart():
    layer, seen = layer_with_hook("gshard", 2, capacity=0.5)
    layer.train()(torch.randn(40, D, generator=torch.Generator().manual_seed(1)))
    stats = layer.routing_stats
    no_expert = int((seen[-1] < 0).sum())
    assert int(stats["dropped_slots"]) > 0 and int(stats["unrouted_slots"]) > 0
    assert int(stats["dropped_slots"] + stats["unrouted_slots"]) == no_expert == layer.num_dropped


class RoundRobin(nn.Module):
    """A FastMoE-style gate: a plain module returning (topk_idx, topk_val), keeping no logits."""

    def __init__(self, d_model, num_expert, world_size, top_k):
        super().__init__()
        self.num_expert, self.top_k = num_expert, top_k

    def forward(self, x):
        idx_TK = torch.arange(x.shape[0] * self.top_k).reshape(-1, self.top_k) % self.num_expert
        return idx_TK, torch.full(idx_TK.shape, 1.0 / self.top_k)


def test_a_gate_without_logits_has_no_entropy():
    layer = fmoe.FMoETransformerMLP(num_expert=E, d_model=D, d_hidden=H, gate=RoundRobin)
    assert layer.routing_stats == {} and fmoe.routing_stats(layer) == {}
    layer(torch.randn(6, D))
    stats = fmoe.routing_stats(layer)["moe"]
    assert "router_entropy" not in stats
    assert stats["tokens_per_expert"] == [3, 3, 3, 3] and stats["load_cv"] == 0 and stats["empty_experts"] == 0


def test_forward_and_reading_the_stats_read_nothing_on_the_host(monkeypatch):
    monkeypatch.setenv("FMOE_SYNC_FREE", "1")
    layer, _ = layer_with_hook("naive", 2, capacity=0.5)
    with no_host_reads():
        layer.train()(torch.randn(6, D))
        stats = layer.routing_stats
    assert all(isinstance(v, torch.Tensor) for v in stats.values())


def test_compiled_layer_keeps_the_same_stats():
    torch._dynamo.reset()
    layer, _ = layer_with_hook("naive", 2, capacity=0.5)
    x = torch.randn(8, D, generator=torch.Generator().manual_seed(2))
    layer.train()(x)
    eager = fmoe.routing_stats(layer)["moe"]
    layer.last_counts_E = layer.last_num_dropped = layer.last_num_unrouted = None
    torch.compile(layer, fullgraph=True, backend="aot_eager")(x)
    assert_approx(fmoe.routing_stats(layer)["moe"], eager, rel=1e-6)


def test_model_stats_name_each_layer_and_flatten_for_loggers():
    torch.manual_seed(0)
    model = nn.Sequential(fmoe.FMoETransformerMLP(num_expert=E, d_model=D, d_hidden=H), nn.GELU(),
                          fmoe.FMoETransformerMLP(num_expert=E, d_model=D, d_hidden=H, gate="gshard"))
    model(torch.randn(5, D))
    stats = fmoe.routing_stats(model)
    assert list(stats) == ["0", "2"]
    assert fmoe.routing_stats(model, over="world") == stats        # one process is the world
    flat = scalars(stats)
    assert flat["routing/2/tokens_per_expert/3"] == stats["2"]["tokens_per_expert"][3]
    assert flat["routing/0/load_cv"] == stats["0"]["load_cv"]
    assert len(flat) == 2 * (E + 7)
    with pytest.raises(ValueError, match="over must be 'rank', 'world' or a process group"):
        fmoe.routing_stats(model, over="node")


def test_meter_sums_training_forwards_once_each():
    """Counted: 3 training forwards, one of them under activation checkpointing (recomputed in the
    backward, not counted again). Not counted: an eval forward."""
    layer, seen = layer_with_hook("naive", 2)
    model = nn.Sequential(layer)
    meter = RoutingStatsMeter(model)
    xs = [torch.randn(7, D, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    logits = []
    model.train()
    for x in xs[:2]:
        model(x)
        logits.append(layer.gate.last_logits_TE.detach())
    out = checkpoint(model, xs[2].requires_grad_(True), use_reentrant=False)
    logits.append(layer.gate.last_logits_TE.detach())
    out.sum().backward()
    assert len(seen) == 4, "the recompute ran the layer again"
    model.eval()(torch.randn(5, D))
    stats = meter.read()["0"]
    expected = reference(torch.cat(seen[:3]), torch.cat(logits), unrouted_by_gate=False)
    assert_approx(stats, expected, rel=1e-5)
    assert meter.read() == {}, "a read starts afresh"
    meter.close()
    model.train()(xs[0])
    assert meter.read() == {}


def world_worker(rank, world_size, out_dir):
    """Expert parallel over 2 ranks, each routing its own tokens: this rank's stats and the world's."""
    torch.manual_seed(0)
    layer = fmoe.FMoETransformerMLP(num_expert=E // 2, d_model=D, d_hidden=H, world_size=2, gate="naive",
                                    gate_kwargs={"capacity": 0.5})
    layer.train()(torch.randn(6 + 4 * rank, D, generator=torch.Generator().manual_seed(rank)))
    result = {"rank": fmoe.routing_stats(layer), "world": fmoe.routing_stats(layer, over="world"),
              "tokens": 6 + 4 * rank}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def test_world_stats_sum_every_ranks_tokens(tmp_path):
    run_ranks(world_worker, 2, str(tmp_path))
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    mine = [r["rank"]["moe"] for r in ranks]
    world = ranks[0]["world"]["moe"]
    assert ranks[1]["world"] == ranks[0]["world"]
    counts = [a + b for a, b in zip(mine[0]["tokens_per_expert"], mine[1]["tokens_per_expert"])]
    assert world["tokens_per_expert"] == counts
    assert world["max_load"] == max(counts) and world["mean_load"] == pytest.approx(statistics.mean(counts))
    assert world["load_cv"] == pytest.approx(statistics.pstdev(counts) / statistics.mean(counts), rel=1e-5)
    assert world["empty_experts"] == sum(c == 0 for c in counts)
    for key in ("dropped_slots", "unrouted_slots"):
        assert world[key] == mine[0][key] + mine[1][key]
    tokens = [r["tokens"] for r in ranks]
    entropy = (mine[0]["router_entropy"] * tokens[0] + mine[1]["router_entropy"] * tokens[1]) / sum(tokens)
    assert world["router_entropy"] == pytest.approx(entropy, rel=1e-5)
