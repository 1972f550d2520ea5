"""Expert parallelism: exchange, process groups, gradient sync, checks and sharded checkpoints.

The submodules are imported on demand (`fmoe.distributed.groups`, `.ddp`, `.checkpoint`) except
the exchange, which the core layer uses.
"""


def __getattr__(name):
    # FastMoE's `fmoe.distributed.DistributedGroupedDataParallel`, imported lazily: the core layer
    # imports this package for the exchange, and ddp sits above the layer.
    if name == "DistributedGroupedDataParallel":
        from fmoe.distributed.ddp import DistributedGroupedDataParallel
        return DistributedGroupedDataParallel
    raise AttributeError(f"module 'fmoe.distributed' has no attribute {name!r}")
