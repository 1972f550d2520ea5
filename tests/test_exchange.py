"""The exchanges across real processes (gloo): one row per slot, per rank ("rank") or per node
("node"); equal to one process, and the bytes each rank sends equal to formulas of the routing."""
import pytest

from tests import dist_workers, exchange_workers
from tests.dist_utils import run_ranks


@pytest.mark.parametrize("world,exchange,per_node", [(2, "rank", None), (4, "rank", None), (4, "node", 2),
                                                     (8, "node", 4)])
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
