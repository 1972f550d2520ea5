"""A small Megatron-Core training harness, on CPUs with gloo or GPUs with NCCL.

    initialize(tensor_parallel_size, expert_parallel_size, seed)
    model = GPTModel(config, get_gpt_layer_with_fmoe_spec(...), ...)   # or fmoefy(model, ...)
    model, optimizer = wrap(model, lr=...)
    loss, grad_norm = train_step(model, optimizer, [(tokens_BT, labels_BT), ...])
    log_moe_metrics(model, iteration, num_microbatches, writer, wandb_writer)
    save_checkpoint(path, model, optimizer, iteration); load_checkpoint(path, model, optimizer)

It uses Megatron's own DistributedDataParallel, optimizer, schedule and distributed checkpointing,
so expert parameters go through Megatron's gradient reduction and checkpoint sharding.
"""
import os
from typing import Iterator, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.moe.moe_utils import track_moe_metrics

from fmoe.load_balancing import register_bias_update_if_needed
from fmoe.megatron import cpu_compat


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def initialize(tensor_parallel_size: int = 1, expert_parallel_size: int = 1, seed: int = 1234,
               backend: Optional[str] = None):
    """torch.distributed (from torchrun's environment), Megatron's parallel state and RNG seeds.

    Without CUDA, Megatron-Core is adapted by `cpu_compat` and the backend is gloo.
    """
    on_cpu = cpu_compat.apply()
    if not dist.is_initialized():
        if not on_cpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend or ("gloo" if on_cpu else "nccl"))
    world = dist.get_world_size()
    if world % tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} must divide the world size {world}")
    if world % expert_parallel_size:
        raise ValueError(f"expert_parallel_size={expert_parallel_size} must divide the world size {world}")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel_size,
                                             expert_model_parallel_size=expert_parallel_size,
                                             expert_tensor_parallel_size=1)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def shutdown():
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def wrap(model: torch.nn.Module, lr: float = 1e-3, weight_decay: float = 0.0, clip_grad: float = 1.0):
    """Megatron's DistributedDataParallel around `model` and its Adam optimizer (not the distributed
    optimizer: its checkpoints need options this harness does not set)."""
    config = model.config
    model.to(device())
    ddp = DistributedDataParallel(config=config, module=model, ddp_config=DistributedDataParallelConfig())
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=lr, weight_decay=weight_decay, clip_grad=clip_grad,
                        params_dtype=config.params_dtype), [ddp])
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    register_bias_update_if_needed(model, optimizer)      # the gate is replicated on every rank: "world"
    return ddp, optimizer


def gpt_forward_step(batches: Iterator[Tuple[torch.Tensor, torch.Tensor]], model):
    """Megatron's forward_step for a GPT: next (tokens_BT, labels_BT) -> per-token loss and its mean."""
    tokens_BT, labels_BT = (t.to(device()) for t in next(batches))
    position_ids_BT = torch.arange(tokens_BT.shape[1], device=tokens_BT.device).expand_as(tokens_BT)
    loss_BT = model(tokens_BT, position_ids_BT, None, labels=labels_BT)

    def loss_func(output_BT):
        loss = output_BT.float().mean()
        # A copy: the schedule divides the returned loss by the number of microbatches in place.
        return loss, {"lm loss": loss.detach().clone()}

    return loss_BT, loss_func


def train_step(model, optimizer, microbatches: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> Tuple[float, float]:
    """One optimizer step over `microbatches` of (tokens_BT, labels_BT); returns (the loss averaged over
    microbatches and data-parallel ranks, the grad norm)."""
    model.zero_grad_buffer()
    optimizer.zero_grad()
    tokens_BT = microbatches[0][0]
    losses = get_forward_backward_func()(forward_step_func=gpt_forward_step, data_iterator=iter(microbatches),
                                         model=model, num_microbatches=len(microbatches),
                                         seq_length=tokens_BT.shape[1], micro_batch_size=tokens_BT.shape[0],
                                         forward_only=False)
    _, grad_norm, _ = optimizer.step()
    loss = torch.stack([d["lm loss"] for d in losses]).mean().reshape(1)
    dist.all_reduce(loss, group=parallel_state.get_data_parallel_group())
    return loss.item() / parallel_state.get_data_parallel_world_size(), float(grad_norm)


def log_moe_metrics(model, iteration: int, num_microbatches: int, writer=None, wandb_writer=None):
    """What Megatron-Core's MoE tracker gathered over the last step, averaged over its micro-batches
    (the balance loss and, with `moe_per_layer_logging`, fmoe's routing statistics of each layer), to
    a TensorBoard `writer` and a W&B run as Megatron-LM's training loop logs them (`<name>` averaged
    over the layers, `moe/<name>_layer_<i>` per layer); the tracker then starts afresh. Every rank
    calls it (the pipeline stages' layers are gathered)."""
    config = _unwrap(model).config
    track_moe_metrics(loss_scale=1 / num_microbatches, iteration=iteration, writer=writer, wandb_writer=wandb_writer,
                      per_layer_logging=config.moe_per_layer_logging, num_layers=config.num_layers)


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state(), "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict):
    torch.set_rng_state(state["cpu"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def _rng_entry(data=None) -> ShardedObject:
    # One entry per global rank: a resumed run continues each rank's random streams (dropout, gate noise).
    return ShardedObject("rng_state", data, (dist.get_world_size(),), (dist.get_rank(),), replica_id=0)


def _unwrap(model):
    """The model inside Megatron's DDP wrapper, whose state keys carry no `module.` prefix."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def _sharded_state(model, optimizer, is_loading: bool, rng: bool) -> dict:
    state = {"model": _unwrap(model).sharded_state_dict()}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state["model"], is_loading=is_loading)
    if rng:
        state["rng_state"] = _rng_entry(None if is_loading else _rng_state())
    return state


LATEST = "latest_checkpointed_iteration.txt"


def save_checkpoint(path: str, model, optimizer, iteration: int) -> str:
    """Megatron distributed checkpoint of the model, the optimizer and every rank's RNG, in
    `path/iter_<iteration>`; `path/latest_checkpointed_iteration.txt` names the newest. Returns the folder."""
    folder = os.path.join(path, f"iter_{iteration:07d}")
    if dist.get_rank() == 0:
        os.makedirs(folder, exist_ok=True)
    dist.barrier()
    state = _sharded_state(model, optimizer, is_loading=False, rng=True)
    state["iteration"] = iteration
    dist_checkpointing.save(state, folder)
    if dist.get_rank() == 0:
        with open(os.path.join(path, LATEST), "w") as f:
            f.write(str(iteration))
    dist.barrier()
    return folder


def load_checkpoint(path: str, model, optimizer=None, rng: bool = True) -> int:
    """Load the newest checkpoint `save_checkpoint` wrote under `path`, at this run's parallel sizes
    (experts are stored by global id, so the expert parallel size may differ); returns its iteration.

    `rng=False` skips the RNG states, which only load at the saving run's world size.
    """
    latest = os.path.join(path, LATEST)
    if not os.path.isfile(latest):
        raise ValueError(f"checkpoint {path!r}: no {LATEST} there; is it a folder save_checkpoint wrote?")
    with open(latest) as f:
        folder = os.path.join(path, f"iter_{int(f.read()):07d}")
    loaded = dist_checkpointing.load(_sharded_state(model, optimizer, is_loading=True, rng=rng), folder)
    _unwrap(model).load_state_dict(loaded["model"])
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
    if rng:
        _set_rng_state(loaded["rng_state"])
    return loaded["iteration"]
