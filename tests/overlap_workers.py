"""Rank functions for tests/test_overlap.py (run by tests.dist_utils.run_ranks)."""
import json
import time

import torch
import torch.distributed as dist

from fmoe.distributed import exchange, link


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
