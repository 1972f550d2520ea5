"""Expert parallelism with real processes (gloo) against the single-process layer."""
import pytest

from tests import dist_workers
from tests.dist_utils import run_ranks


@pytest.mark.parametrize("world", [2, 4])
def test_layer_equals_single_process(world):
    run_ranks(dist_workers.check_layer_matches_single_process, world)


@pytest.mark.parametrize("world,ep_size,mode", [(2, 2, "dgdp"), (2, 2, "ddp"), (4, 2, "dgdp"), (4, 2, "ddp")])
def test_training_equals_single_process(world, ep_size, mode):
    run_ranks(dist_workers.check_training_matches_single_process, world, ep_size, mode)


def test_mismatched_ranks_raise_on_every_rank():
    run_ranks(dist_workers.check_mismatch_raises, 2)


def test_checkpoint_reshards_4_2_1_4(tmp_path):
    run_ranks(dist_workers.reshard_stage, 4, 0, str(tmp_path))
    run_ranks(dist_workers.reshard_stage, 2, 1, str(tmp_path))
    dist_workers.reshard_stage(0, 1, 2, str(tmp_path))
    run_ranks(dist_workers.reshard_stage, 4, 3, str(tmp_path))


def test_missing_rank_fails_with_a_message_not_a_hang():
    run_ranks(dist_workers.check_missing_rank_times_out, 2)


def test_balanced_gate_bias_agrees_across_ranks():
    run_ranks(dist_workers.check_balanced_gate_bias_follows_global_load, 2)
