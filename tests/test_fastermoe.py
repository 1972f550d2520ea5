"""FasterMoE: performance model, shadowing policy, shadowing (real processes)."""
import pytest
import torch

from fmoe.perfmodel import PerfModel
from tests import shadow_workers
from tests.dist_utils import run_ranks


def test_model_times_match_hand_computation():
    m = PerfModel(d_model=4, d_hidden=8, flops=100.0, net_bandwidth=10.0, bytes_per_element=1)
    counts = torch.tensor([[3, 1, 0, 0], [5, 0, 1, 2]])       # 2 workers, experts 0-1 on w0, 2-3 on w1
    # w0 processes experts 0, 1: 8 + 1 = 9 rows; w1 processes 2, 3: 1 + 2 = 3 rows.
    assert m.worker_rows(counts).tolist() == [9.0, 3.0]
    per_row = 3 * 4 * 2 * 16 / 100 + 4 * 4 / 10               # compute + traffic of one row
    assert m.layer_time(counts) == pytest.approx(9 * per_row)
    # Shadowing expert 0: w0 keeps its own 3 rows of it + 1 of expert 1; w1 its own 5 + 3.
    assert m.worker_rows(counts, [0]).tolist() == [4.0, 8.0]
    assert m.layer_time(counts, [0]) == pytest.approx(8 * per_row + 2 * 1 * 2 * 2 * 16 / 10)


def test_policy_uniform_shadows_nothing_and_hot_expert_is_shadowed():
    m = PerfModel(d_model=1024, d_hidden=4096, flops=1e12, net_bandwidth=10e9)
    uniform = torch.full((4, 8), 500)
    assert m.choose_shadowed(uniform) == []
    hot = torch.full((4, 8), 100)
    hot[:, 3] = 4000
    assert m.choose_shadowed(hot) == [3]
    # Mild skew on a fast GPU: moving the parameters costs more than the imbalance.
    mild = torch.full((4, 8), 100)
    mild[:, 3] = 400
    assert m.choose_shadowed(mild) == [3]
    assert PerfModel(1024, 4096, flops=1e15, net_bandwidth=10e9).choose_shadowed(mild) == []


@pytest.mark.parametrize("world", [2, 4])
def test_shadowing_equals_plain_expert_parallelism(world):
    run_ranks(shadow_workers.check_shadowing_equals_plain, world)


def test_real_policy_shadows_the_hot_expert():
    run_ranks(shadow_workers.check_policy_shadows_a_hot_expert, 2)


@pytest.mark.parametrize("world", [2, 4])
def test_scheduling_equals_plain_expert_parallelism(world):
    run_ranks(shadow_workers.check_schedule_equals_plain, world)
