"""FastMoE path `fmoe.utils`: process-group helpers."""
import torch
import torch.distributed as dist


def get_torch_default_comm():
    """The default process group (FastMoE dug its NCCL communicator out of it)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("torch.distributed is not initialised: call init_process_group first")
    return dist.distributed_c10d._get_default_group()


def get_rank_0_in_comm(comm):
    """The global rank of `comm`'s first member."""
    return dist.get_global_rank(comm, 0) if comm is not None else 0


__all__ = ["get_torch_default_comm", "get_rank_0_in_comm"]
