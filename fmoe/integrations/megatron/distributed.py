"""FastMoE path `fmoe.megatron.distributed`: its DistributedDataParallel for Megatron, which is
DistributedGroupedDataParallel over Megatron's groups (from Megatron-Core's parallel_state)."""
from megatron.core import parallel_state

from fmoe.distributed.ddp import DistributedGroupedDataParallel


class DistributedDataParallel(DistributedGroupedDataParallel):
    """FastMoE's Megatron DDP wrapper. Megatron-Core's own DistributedDataParallel also works
    with fmoe (MegatronMLP tags its experts `allreduce = False`)."""

    def __init__(self, module, accumulate_allreduce_grads_in_fp32=False, use_contiguous_buffers_in_ddp=False):
        if accumulate_allreduce_grads_in_fp32 or use_contiguous_buffers_in_ddp:
            raise ValueError("fmoe.megatron.DistributedDataParallel (FastMoE's) supports neither "
                             "accumulate_allreduce_grads_in_fp32 nor use_contiguous_buffers_in_ddp; use "
                             "megatron.core.distributed.DistributedDataParallel for those")
        if not parallel_state.model_parallel_is_initialized():
            raise ValueError("fmoe.megatron.DistributedDataParallel needs Megatron's parallel state: call "
                             "megatron.core.parallel_state.initialize_model_parallel(...) first")
        super().__init__(module, dp_group=parallel_state.get_data_parallel_group(),
                         moe_group=parallel_state.get_data_parallel_group())

    def set_input_tensor(self, *args, **kwargs):
        return self.module.set_input_tensor(*args, **kwargs)

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def state_dict_for_save_checkpoint(self, *args, **kwargs):
        return self.module.state_dict_for_save_checkpoint(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        return self.module.load_state_dict(*args, **kwargs)
