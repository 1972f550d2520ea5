"""The exchanges across real processes (gloo): one row per slot, per rank ("rank") or per node
("node"); equal to one process, and the bytes each rank sends equal to formulas of the routing."""
import math
import os

import pytest

from tests import dist_workers, exchange_workers
from tests.dist_utils import run_ranks

# The 8-rank cases (about a minute together on 2 cores) run with FMOE_TEST_8_RANKS=1: `make test-8-ranks`,
# which CI runs after `make test`.
EIGHT_RANKS = pytest.mark.skipif(os.environ.get("FMOE_TEST_8_RANKS") != "1",
                                 reason="8 gloo ranks: FMOE_TEST_8_RANKS=1 (make test-8-ranks)")


def at_8_ranks(*case):
    return pytest.param(*case, marks=EIGHT_RANKS)


@pytest.mark.parametrize("world,exchange,per_node", [(2, "rank", None), (4, "rank", None), (4, "node", 2),
                                                     at_8_ranks(8, "rank", None), at_8_ranks(8, "node", 4)])
def test_dedup_layer_equals_single_process(world, exchange, per_node):
    run_ranks(dist_workers.check_layer_matches_single_process, world, exchange, per_node)


@pytest.mark.parametrize("world,exchange,per_node,top_k", [(2, "slot", 2, 2), (4, "slot", 2, 3), (2, "rank", 2, 3),
                                                           (4, "rank", 2, 4), (4, "node", 2, 4), (4, "node", 1, 3),
                                                           (4, "node", 4, 2)])
def test_bytes_sent_equal_the_formula(world, exchange, per_node, top_k):
    run_ranks(exchange_workers.check_traffic_matches_formula, world, exchange, per_node, top_k)


def test_rank_exchange_sends_fewer_rows_than_slot():
    run_ranks(exchange_workers.check_dedup_sends_fewer_rows, 4)


@pytest.mark.parametrize("world,exchange,per_node", [(2, "rank", None), (4, "node", 2)])
def test_shadowing_on_the_deduplicated_exchange(world, exchange, per_node):
    run_ranks(exchange_workers.check_shadowing_on_dedup_equals_slot, world, exchange, per_node)


@pytest.mark.parametrize("world,per_node,max_nodes,top_k", [(4, 2, 1, 3), at_8_ranks(8, 2, 2, 4)])
def test_node_limited_routing(world, per_node, max_nodes, top_k):
    run_ranks(exchange_workers.check_node_limited_routing, world, per_node, max_nodes, top_k)


def test_bad_options_name_the_argument():
    import fmoe
    from fmoe.gates import RouterGate
    gate = RouterGate(8, 2, world_size=4, top_k=2, max_nodes=1, ranks_per_node=2)
    assert (gate.n_group, gate.topk_group) == (2, 1)
    with pytest.raises(ValueError, match="max_nodes=3 exceeds the 2 nodes"):
        RouterGate(8, 2, world_size=4, top_k=2, max_nodes=3, ranks_per_node=2)
    with pytest.raises(ValueError, match="max_nodes=1 lays the expert groups on the nodes"):
        RouterGate(8, 2, world_size=4, top_k=2, max_nodes=1, ranks_per_node=2, n_group=2)
    with pytest.raises(ValueError, match="ranks_per_node must be a positive int dividing"):
        RouterGate(8, 2, world_size=4, top_k=2, max_nodes=1, ranks_per_node=3)
    with pytest.raises(ValueError, match="pass max_nodes too"):
        RouterGate(8, 2, world_size=4, top_k=2, ranks_per_node=2)
    with pytest.raises(ValueError, match="exchange must be one of"):
        fmoe.FMoETransformerMLP(num_expert=2, d_model=8, d_hidden=16, exchange="token")
    with pytest.raises(ValueError, match="exchange='node' does not run under the smart schedule"):
        fmoe.FMoETransformerMLP(num_expert=2, d_model=8, d_hidden=16, exchange="node", schedule=True)
    with pytest.raises(ValueError, match="max_tokens_per_rank must be a positive int"):
        fmoe.FMoETransformerMLP(num_expert=2, d_model=8, d_hidden=16, exchange="rank", sync_free=True)
    with pytest.raises(ValueError, match="sync_free=True needs exchange='rank' or 'node'"):
        fmoe.FMoETransformerMLP(num_expert=2, d_model=8, d_hidden=16, sync_free=True, max_tokens_per_rank=4)
    with pytest.raises(ValueError, match="pass sync_free=True with it"):
        fmoe.FMoETransformerMLP(num_expert=2, d_model=8, d_hidden=16, exchange="rank", max_tokens_per_rank=4)


# The bound: the most tokens a rank has in dist_workers.layer_cases (9, or 4 + world), so nothing overflows.
@pytest.mark.parametrize("world,exchange,per_node", [(2, "rank", None), (4, "node", 2), at_8_ranks(8, "node", 4)])
def test_sync_free_layer_equals_single_process(world, exchange, per_node):
    run_ranks(dist_workers.check_layer_matches_single_process, world, exchange, per_node, max(9, 4 + world))


@pytest.mark.parametrize("world,exchange,per_node,bound", [(2, "rank", 2, 2), (4, "node", 2, 3)])
def test_sync_free_overflow_is_counted_and_reported(world, exchange, per_node, bound):
    run_ranks(exchange_workers.check_overflow_is_reported_on_every_rank, world, exchange, per_node, bound)


@pytest.mark.parametrize("exchange", ["rank", "node"])
def test_sync_free_forward_backward_never_read_the_device(exchange):
    run_ranks(exchange_workers.check_sync_free_never_reads_the_device, 2, exchange, 1)


@pytest.mark.parametrize("exchange,per_node", [("rank", None), ("node", 1)])
def test_sync_free_layer_compiles_with_fullgraph(exchange, per_node):
    run_ranks(exchange_workers.check_sync_free_compiles_whole, 2, exchange, per_node)


def test_perfmodel_reads_the_deduplicated_rows():
    import torch
    from fmoe.perf.perfmodel import PerfModel, dedup_row_share
    from fmoe.perf.simulate import simulate_one
    uniform = torch.full((128,), 1 / 128, dtype=torch.double)
    assert torch.equal(dedup_row_share(uniform, 1, 8), torch.ones(8, dtype=torch.double))     # top-1: no repeats
    # Qwen3-30B-A3B's layout: 128 experts on 8 ranks, top-8 (8 distinct experts) reaches
    # 8 (1 - C(112, 8) / C(128, 8)) = 5.34 distinct ranks for 8 slots (5.25 if drawn with replacement).
    exact = 1 - math.comb(112, 8) / math.comb(128, 8)
    assert dedup_row_share(uniform, 8, 8).mean().item() == pytest.approx(exact, abs=0.005)
    # DeepSeek-V3's: 256 experts on 64 ranks, 64 (1 - C(252, 8) / C(256, 8)) = 7.68 distinct ranks.
    assert dedup_row_share(torch.full((256,), 1 / 256, dtype=torch.double), 8, 64).mean().item() == \
        pytest.approx(8 * (1 - math.comb(252, 8) / math.comb(256, 8)), abs=0.005)
    m = PerfModel(1024, 4096, flops=1e14, net_bandwidth=1e9)
    counts = torch.full((8, 128), 64.0, dtype=torch.double)
    share = dedup_row_share(uniform, 8, 8)
    assert m.layer_time(counts, row_share_W=torch.ones(8, dtype=torch.double)) == pytest.approx(m.layer_time(counts))
    # Traffic dominates here: the time falls nearly as the rows do.
    assert m.layer_time(counts, row_share_W=share) / m.layer_time(counts) == pytest.approx(exact, abs=0.03)
    row = simulate_one(m, 8, 16, 4096, 8, "uniform", 4, exchange="rank")
    assert row["rows_vs_slot"] == pytest.approx(exact, abs=0.005)
    assert simulate_one(m, 8, 16, 4096, 8, "uniform", 4)["rows_vs_slot"] == 1.0


@pytest.mark.parametrize("world,exchange,per_node", [(2, "rank", None), (4, "node", 2)])
def test_capacity_on_the_deduplicated_exchange(world, exchange, per_node):
    run_ranks(exchange_workers.check_capacity_on_dedup_equals_slot, world, exchange, per_node)


@pytest.mark.parametrize("world", [2, 4])
def test_smart_schedule_on_the_rank_exchange(world):
    run_ranks(exchange_workers.check_schedule_on_rank_equals_slot, world)


def test_tree_inputs_on_the_rank_exchange():
    run_ranks(exchange_workers.check_tree_inputs_on_rank_equal_slot, 2)


def test_disagreeing_exchanges_raise_on_every_rank():
    run_ranks(exchange_workers.check_disagreeing_exchanges_raise_on_every_rank, 2)


def test_disagreeing_recompute_modes_raise_on_every_rank():
    run_ranks(exchange_workers.check_disagreeing_recompute_raises_on_every_rank, 2)


def test_only_the_node_exchange_needs_local_world_size_to_divide_the_ranks():
    run_ranks(exchange_workers.check_nodes_not_dividing_the_world_bind_only_the_node_exchange, 3)


def test_megatron_mlp_takes_the_rank_exchange():
    pytest.importorskip("megatron.core")
    run_ranks(exchange_workers.check_megatron_rank_exchange_equals_slot, 2)
