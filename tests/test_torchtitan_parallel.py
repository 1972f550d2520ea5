"""fmoe inside torchtitan's own parallelism on 2 gloo ranks (ParallelDims dp_shard=2 with ep=2: FSDP2 and
expert parallelism from torchtitan's device mesh), against one process and torchtitan's DCP checkpoints.
Runs where torchtitan is installed (`make test-torchtitan`); the workers say what torchtitan needs on a CPU."""
import pytest

pytest.importorskip("torchtitan")

from tests import torchtitan_workers  # noqa: E402
from tests.dist_utils import run_ranks  # noqa: E402


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3"])
def test_torchtitan_ep_two_ranks_equals_one_process(family, tmp_path):
    run_ranks(torchtitan_workers.fmoe_ep_equals_one_process, 2, family, str(tmp_path))


def test_torchtitan_ep_under_torchtitans_activation_checkpointing(tmp_path):
    run_ranks(torchtitan_workers.fmoe_ep_equals_one_process, 2, "qwen3", str(tmp_path), True)


def test_torchtitan_dcp_round_trip_both_ways(tmp_path):
    run_ranks(torchtitan_workers.dcp_round_trips, 2, "qwen3", str(tmp_path))


def test_torchtitan_ep_without_torchtitans_parallelize(tmp_path):
    run_ranks(torchtitan_workers.fmoe_ep_on_a_plain_model, 2, "deepseek_v3", str(tmp_path))
