"""Megatron-Core on a machine without CUDA: what lets it train on CPUs with gloo.

Megatron-Core (tested with the versions in `fmoe.integrations.megatron.TESTED_MEGATRON_CORE`) assumes CUDA in
places that have nothing to do with the model's maths. `apply()` adapts them, once per process,
and does nothing where CUDA is available:

- RNG: Megatron forks named CUDA RNG states ("model-parallel-rng" for tensor-parallel init and
  dropout, "expert-parallel-rng" for experts), even in eval. `CpuRNGStatesTracker` keeps the same
  names and seeds and forks the CPU generator; `model_parallel_cuda_manual_seed` seeds it.
- Devices: buffers and scalars made with `device="cuda"` or `torch.cuda.current_device()` (the
  attention score buffer, the causal mask, the loss-token counter, optimizer scalars, the grad
  norm) are made on the CPU by `CudaAsCpu`, a torch function mode entered for the process. It also
  names CPU tensors by their CUDA type in `Tensor.type()`, which the optimizer asserts.
- Streams and the current device: `torch.cuda.current_device/Stream/current_stream/stream/synchronize`,
  which can only raise without CUDA, answer for the CPU (the CPU device, streams that do nothing).
- The alltoall token dispatcher makes its split sizes numpy arrays only from CUDA tensors, and
  gloo's all-to-all does not take them as CPU tensors.
- The router calls `te_general_gemm`, a name left undefined when Transformer Engine is absent.
- Sequence parallelism (which Megatron's MoE needs with tensor parallelism) is refused by the torch
  LayerNorm that stands in for apex's; built with it, the norm's parameters are tagged
  `sequence_parallel` as apex's are, so Megatron sums their gradients over tensor-parallel ranks.
- Checkpoint saving keeps its result queue in a spawned manager process, which re-imports the
  training script (seconds on a CPU). The synchronous saves put their results in that queue and
  read them back in the same process, so an in-process `queue.Queue` serves them (a
  multiprocessing queue's `put` returns before its feeder thread delivers, and the
  `get_nowait` right after it failed now and then with "results_queue should not be empty").

Not adapted: activation recomputation, CUDA graphs, fused kernels and the distributed
optimizer's overlapped communication.
"""
import contextlib
import queue

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.tensor_parallel import random as megatron_random
from megatron.core.tensor_parallel.random import CudaRNGStatesTracker
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from torch.overrides import TorchFunctionMode

_applied = False


def _is_cuda_device(device) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True     # a bare index names a CUDA device
    if isinstance(device, (str, torch.device)):
        return torch.device(device).type == "cuda"
    return False


class CudaAsCpu(TorchFunctionMode):
    """Tensors asked for on a CUDA device are made on the CPU; `Tensor.type()` names them as CUDA's."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_cuda_device(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to:
            args = tuple("cpu" if i > 0 and _is_cuda_device(a) else a for i, a in enumerate(args))
        out = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and out.startswith("torch."):
            return out if ".cuda." in out else "torch.cuda." + out[len("torch."):]
        return out


class CpuStream:
    """Stands in for a CUDA stream or event: work on a CPU is already ordered."""

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return self

    def synchronize(self):
        pass

    def wait(self, stream=None):
        pass


_CPU_STREAM = CpuStream()


def _patch_torch_cuda():
    # A device, not an index: it also serves the backward of Megatron's autograd functions, outside the mode.
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.Stream = lambda *args, **kwargs: CpuStream()
    torch.cuda.current_stream = lambda device=None: _CPU_STREAM
    torch.cuda.default_stream = lambda device=None: _CPU_STREAM
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()


def _patch_rng():
    megatron_random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    megatron_random.model_parallel_cuda_manual_seed = model_parallel_cpu_manual_seed
    tensor_parallel.model_parallel_cuda_manual_seed = model_parallel_cpu_manual_seed


def _patch_moe():
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    token_dispatcher.maybe_move_tensor_to_cpu = _host_copy


def _host_copy(tensor, as_numpy: bool = False, record_stream: bool = False):
    """The dispatcher's device-to-host copy, for tensors already on the host."""
    if as_numpy and torch.is_tensor(tensor):
        return tensor.numpy()
    return tensor


def _patch_torch_norm():
    build = WrappedTorchNorm.__new__

    def build_for_sequence_parallel(cls, config, hidden_size, *args, **kwargs):
        if not config.sequence_parallel:
            return build(cls, config, hidden_size, *args, **kwargs)
        config.sequence_parallel = False
        try:
            norm = build(cls, config, hidden_size, *args, **kwargs)
        finally:
            config.sequence_parallel = True
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm

    WrappedTorchNorm.__new__ = build_for_sequence_parallel


def _patch_checkpoint_queue():
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def apply() -> bool:
    """Adapt Megatron-Core to this CUDA-less process; returns whether anything was done."""
    global _applied
    if torch.cuda.is_available():
        return False
    if not _applied:
        _patch_torch_cuda()
        _patch_rng()
        _patch_moe()
        _patch_torch_norm()
        _patch_checkpoint_queue()
        CudaAsCpu().__enter__()     # for the rest of the process
        _applied = True
    return True


class CpuRNGStatesTracker(CudaRNGStatesTracker):
    """Megatron's named RNG states, kept as CPU generator states."""

    def add(self, name, seed):
        if seed in self.seeds_:
            raise ValueError(f"RNG seed {seed} is already tracked")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise ValueError(f"RNG state {name!r} is not tracked: seed it with model_parallel_cuda_manual_seed")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def model_parallel_cpu_manual_seed(seed: int, te_rng_tracker: bool = False, inference_rng_tracker: bool = False,
                                   use_cudagraphable_rng: bool = False, tp_rank=None, ep_rank=None, etp_rank=None,
                                   force_reset_rng: bool = False):
    """Megatron's `model_parallel_cuda_manual_seed` for the CPU generator: the same seeds per rank."""
    if te_rng_tracker or use_cudagraphable_rng:
        raise ValueError("te_rng_tracker and use_cudagraphable_rng need CUDA; leave them False on a CPU")
    tp_rank = parallel_state.get_tensor_model_parallel_rank() if tp_rank is None else tp_rank
    ep_rank = parallel_state.get_expert_model_parallel_rank() if ep_rank is None else ep_rank
    etp_rank = parallel_state.get_expert_tensor_parallel_rank() if etp_rank is None else etp_rank
    tracker = CpuRNGStatesTracker()
    megatron_random._CUDA_RNG_STATE_TRACKER = tracker
    torch.manual_seed(seed)
    tracker.add(megatron_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(megatron_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(megatron_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)
