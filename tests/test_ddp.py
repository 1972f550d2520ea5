"""DistributedGroupedDataParallel on real gloo ranks: FastMoE's semantics (buckets by `dp_comm`
tag and dtype, each reduced over its group) and fmoe's scaling (`groups=`)."""
import pytest

import fmoe
import fmoe.distributed
from tests import dist_workers
from tests.dist_utils import run_ranks


def test_fastmoe_import_paths():
    from fmoe.distributed.ddp import DistributedGroupedDataParallel
    assert fmoe.DistributedGroupedDataParallel is DistributedGroupedDataParallel
    assert fmoe.distributed.DistributedGroupedDataParallel is DistributedGroupedDataParallel


def test_replicated_experts_recipe_keeps_replicas_bit_equal():
    """world_size=1, expert_dp_comm="dp", DGDP(model), allreduce_params(): replicas stay bit-equal
    step after step and equal one process on the global batch."""
    run_ranks(dist_workers.check_dgdp_replicas_stay_equal, 2)


def test_groups_and_fastmoe_keywords_agree():
    run_ranks(dist_workers.check_dgdp_groups_and_keywords_agree, 2)


def test_reduce_after_no_scale_fp32_and_auto_allreduce():
    run_ranks(dist_workers.check_dgdp_options, 2)


def test_each_tag_reduced_over_its_own_group():
    """FastMoE's test_fmoe_local_ddp scenario: "mp", "dp" and "world" tags on 4 ranks (2 x 2)."""
    run_ranks(dist_workers.check_dgdp_local_ddp, 4, 2)


@pytest.mark.parametrize("world, ep_size", [(2, 2), (4, 2)])
def test_gradient_accumulation_equals_one_process(world, ep_size):
    """4 micro-batches a step, auto (with and without no_sync) and manual (once, and after each);
    on 4 ranks the sharded experts are also reduced over the 2 ranks holding the same ones."""
    run_ranks(dist_workers.check_dgdp_gradient_accumulation, world, ep_size)
