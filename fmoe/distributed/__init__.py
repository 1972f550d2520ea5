"""Expert parallelism: exchange, process groups, gradient sync, checks and sharded checkpoints.

The submodules are imported on demand (`fmoe.distributed.groups`, `.ddp`, `.checkpoint`) except
the exchange, which the core layer uses.
"""
