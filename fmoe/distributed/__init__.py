"""Expert parallelism: exchange, process groups, gradient sync, checks, bounded waits and sharded
checkpoints, one module a job (`fmoe.distributed.groups`, `.ddp`, `.checkpoint`, ...).

`DistributedGroupedDataParallel` is here too, where FastMoE users import it from.
"""


def __getattr__(name):
    # FastMoE's `fmoe.distributed.DistributedGroupedDataParallel`, imported lazily: the core layer
    # imports this package for the exchange, and ddp sits above the layer.
    if name == "DistributedGroupedDataParallel":
        from fmoe.distributed.ddp import DistributedGroupedDataParallel
        return DistributedGroupedDataParallel
    raise AttributeError(f"module 'fmoe.distributed' has no attribute {name!r}")
