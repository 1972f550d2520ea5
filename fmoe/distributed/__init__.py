"""Expert parallelism: exchange, process groups, gradient sync, checks, bounded waits and sharded
checkpoints, one module a job (`fmoe.distributed.groups`, `.ddp`, `.checkpoint`, ...).

`DistributedGroupedDataParallel` is here too, where FastMoE users import it from.
"""
from fmoe.distributed.ddp import DistributedGroupedDataParallel

__all__ = ["DistributedGroupedDataParallel"]
