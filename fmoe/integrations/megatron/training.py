"""A small Megatron-Core training harness, on CPUs with gloo or GPUs with NCCL.

    initialize(tensor_parallel_size, expert_parallel_size, seed, pipeline_parallel_size=...,
               virtual_pipeline_parallel_size=..., num_layers=..., num_experts=...)   # layout checked
    config = TransformerConfig(..., **parallel_config())
    model = GPTModel(config, get_gpt_layer_with_fmoe_spec(...), ...)   # or fmoefy(model, ...)
    # with pipeline stages: model = model_chunks(lambda **stage: GPTModel(..., **stage))
    model, optimizer = wrap(model, lr=...)
    loss, grad_norm = train_step(model, optimizer, [(tokens_BT, labels_BT), ...])
    log_moe_metrics(model, iteration, num_microbatches, writer, wandb_writer)
    save_checkpoint(path, model, optimizer, iteration); load_checkpoint(path, model, optimizer)

It uses Megatron's own DistributedDataParallel, optimizer, schedules (1F1B, interleaved with
virtual stages) and distributed checkpointing, so expert parameters go through Megatron's gradient
reduction and checkpoint sharding, and checkpoints reshard between layouts.
"""
import os
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.moe.moe_utils import track_moe_metrics

from fmoe.distributed import safe_load
from fmoe.integrations.megatron import cpu_compat
from fmoe.load_balancing import register_bias_update_if_needed


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def check_layout(world_size: int, tensor_parallel_size: int = 1, expert_parallel_size: int = 1,
                 pipeline_parallel_size: int = 1, virtual_pipeline_parallel_size: Optional[int] = None,
                 context_parallel_size: int = 1, num_layers: Optional[int] = None,
                 num_experts: Optional[int] = None):
    """Refuse, with the sizes named, a layout Megatron cannot build or fmoe cannot fill.

    data parallel = world / (tensor x pipeline x context); the experts of a pipeline stage are
    spread over expert_parallel_size of its world / pipeline ranks (experts whole on each rank)."""
    sizes = {"tensor_parallel_size": tensor_parallel_size, "expert_parallel_size": expert_parallel_size,
             "pipeline_parallel_size": pipeline_parallel_size, "context_parallel_size": context_parallel_size}
    if virtual_pipeline_parallel_size is not None:
        sizes["virtual_pipeline_parallel_size"] = virtual_pipeline_parallel_size
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    tp, ep, pp, cp = tensor_parallel_size, expert_parallel_size, pipeline_parallel_size, context_parallel_size
    model_parallel = tp * pp * cp
    if world_size % model_parallel:
        raise ValueError(f"the world size {world_size} is not a multiple of tensor_parallel_size={tp} x "
                         f"pipeline_parallel_size={pp} x context_parallel_size={cp} = {model_parallel}")
    stage_ranks = world_size // pp
    if stage_ranks % ep:
        raise ValueError(f"expert_parallel_size={ep} must divide the {stage_ranks} ranks of a pipeline stage "
                         f"(world size {world_size} / pipeline_parallel_size={pp})")
    if virtual_pipeline_parallel_size is not None and virtual_pipeline_parallel_size > 1 and pp < 2:
        raise ValueError(f"virtual_pipeline_parallel_size={virtual_pipeline_parallel_size} needs "
                         f"pipeline_parallel_size >= 2, got {pp}")
    chunks = pp * (virtual_pipeline_parallel_size or 1)
    if num_layers is not None and num_layers % chunks:
        raise ValueError(f"num_layers={num_layers} is not divisible by pipeline_parallel_size={pp} x "
                         f"virtual_pipeline_parallel_size={virtual_pipeline_parallel_size or 1} = {chunks} "
                         "model chunks")
    if num_experts is not None and num_experts % ep:
        raise ValueError(f"num_experts={num_experts} is not divisible by expert_parallel_size={ep}")


def initialize(tensor_parallel_size: int = 1, expert_parallel_size: int = 1, seed: int = 1234,
               backend: Optional[str] = None, pipeline_parallel_size: int = 1,
               virtual_pipeline_parallel_size: Optional[int] = None, context_parallel_size: int = 1,
               num_layers: Optional[int] = None, num_experts: Optional[int] = None):
    """torch.distributed (from torchrun's environment), Megatron's parallel state and RNG seeds.

    Data parallel size = world / (tensor x pipeline x context parallel sizes). `num_layers` and
    `num_experts`, when given, are checked against the pipeline chunks and the expert parallel
    size (`check_layout`); every rank raises the same error, before any collective.
    Without CUDA, Megatron-Core is adapted by `cpu_compat` and the backend is gloo.
    """
    on_cpu = cpu_compat.apply()
    if not dist.is_initialized():
        if not on_cpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend or ("gloo" if on_cpu else "nccl"))
    check_layout(dist.get_world_size(), tensor_parallel_size, expert_parallel_size, pipeline_parallel_size,
                 virtual_pipeline_parallel_size, context_parallel_size, num_layers, num_experts)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel_size,
                                             pipeline_model_parallel_size=pipeline_parallel_size,
                                             virtual_pipeline_model_parallel_size=virtual_pipeline_parallel_size,
                                             context_parallel_size=context_parallel_size,
                                             expert_model_parallel_size=expert_parallel_size,
                                             expert_tensor_parallel_size=1)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def parallel_config() -> dict:
    """The TransformerConfig fields that must agree with Megatron's parallel state (sizes,
    sequence parallelism with tensor parallelism, the pipeline's dtype): `TransformerConfig(...,
    **parallel_config())`."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    return dict(tensor_model_parallel_size=tp, sequence_parallel=tp > 1,
                pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
                # With 2 stages and virtual ones, a rank's previous and next stage are the same rank: in one
                # batch of p2p ops its activation and its gradient (same shape) would be matched in posting
                # order, crossed. Unbatched, Megatron sends them on two process groups.
                batch_p2p_comm=not (pp == 2 and vpp is not None and vpp > 1),
                context_parallel_size=parallel_state.get_context_parallel_world_size(),
                expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
                expert_tensor_parallel_size=1, pipeline_dtype=torch.float32)


def model_chunks(build: Callable[..., torch.nn.Module]) -> List[torch.nn.Module]:
    """This rank's model chunks: `build(pre_process=, post_process=, vp_stage=)` once per virtual
    pipeline stage (once without virtual stages), pre/post processing on the first/last stage."""
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if vpp is None:
        return [build(pre_process=parallel_state.is_pipeline_first_stage(),
                      post_process=parallel_state.is_pipeline_last_stage(), vp_stage=None)]
    return [build(pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=i),
                  post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=i), vp_stage=i)
            for i in range(vpp)]


def shutdown():
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _chunks(model) -> list:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def wrap(model, lr: float = 1e-3, weight_decay: float = 0.0, clip_grad: float = 1.0):
    """Megatron's DistributedDataParallel around `model` (or around each chunk of a list, the virtual
    pipeline stages of `model_chunks`) and one Adam optimizer over them all (not the distributed
    optimizer: its checkpoints need options this harness does not set). Returns (the wrapped model,
    or the list of wrapped chunks, and the optimizer)."""
    chunks = _chunks(model)
    config = chunks[0].config
    ddps = []
    for chunk in chunks:
        chunk.to(device())
        ddps.append(DistributedDataParallel(config=config, module=chunk, ddp_config=DistributedDataParallelConfig()))
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=lr, weight_decay=weight_decay, clip_grad=clip_grad,
                        params_dtype=config.params_dtype), ddps)
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    for chunk in chunks:
        # Each gate's replicas are the ranks of its pipeline stage (MegatronMLP sets that group).
        register_bias_update_if_needed(chunk, optimizer)
    return (ddps if isinstance(model, (list, tuple)) else ddps[0]), optimizer


def gpt_forward_step(batches: Iterator[Tuple[torch.Tensor, torch.Tensor]], model):
    """Megatron's forward_step for a GPT: next (tokens_BT, labels_BT) -> per-token loss and its mean.
    Every pipeline stage draws its micro-batch (a middle stage's model reads its input from the
    previous stage and ignores the tokens)."""
    tokens_BT, labels_BT = (t.to(device()) for t in next(batches))
    position_ids_BT = torch.arange(tokens_BT.shape[1], device=tokens_BT.device).expand_as(tokens_BT)
    loss_BT = model(tokens_BT, position_ids_BT, None, labels=labels_BT)

    def loss_func(output_BT):
        loss = output_BT.float().mean()
        # A copy: the schedule divides the returned loss by the number of microbatches in place.
        return loss, {"lm loss": loss.detach().clone()}

    return loss_BT, loss_func


def train_step(model, optimizer, microbatches: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> Tuple[float, float]:
    """One optimizer step over `microbatches` of (tokens_BT, labels_BT), through Megatron's schedule
    for this layout (1F1B with pipeline stages, interleaved with virtual ones); `model` is what `wrap`
    returned. Returns (the loss averaged over microbatches and data-parallel ranks, on every rank, the
    grad norm)."""
    chunks = _chunks(model)
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    tokens_BT = microbatches[0][0]
    data = [iter(microbatches) for _ in chunks] if len(chunks) > 1 else iter(microbatches)
    losses = get_forward_backward_func()(forward_step_func=gpt_forward_step, data_iterator=data,
                                         model=chunks if len(chunks) > 1 else chunks[0],
                                         num_microbatches=len(microbatches), seq_length=tokens_BT.shape[1],
                                         micro_batch_size=tokens_BT.shape[0], forward_only=False)
    _, grad_norm, _ = optimizer.step()
    loss = torch.zeros(1, device=device())
    if parallel_state.is_pipeline_last_stage():
        loss += torch.stack([d["lm loss"] for d in losses]).mean()
    dist.all_reduce(loss, group=parallel_state.get_data_parallel_group())
    dist.all_reduce(loss, group=parallel_state.get_pipeline_model_parallel_group())     # from the last stage
    return loss.item() / parallel_state.get_data_parallel_world_size(), float(grad_norm)


def log_moe_metrics(model, iteration: int, num_microbatches: int, writer=None, wandb_writer=None):
    """What Megatron-Core's MoE tracker gathered over the last step, averaged over its micro-batches
    (the balance loss and, with `moe_per_layer_logging`, fmoe's routing statistics of each layer), to
    a TensorBoard `writer` and a W&B run as Megatron-LM's training loop logs them (`<name>` averaged
    over the layers, `moe/<name>_layer_<i>` per layer); the tracker then starts afresh. Every rank
    calls it (the pipeline stages' layers are gathered)."""
    config = _unwrap(_chunks(model)[0]).config
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


def _model_keys(model) -> List[str]:
    """Megatron's names for the model chunks in a checkpoint: "model", or "model0", "model1", ..."""
    chunks = _chunks(model)
    return ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]


def _sharded_state(model, optimizer, is_loading: bool, rng: bool) -> dict:
    state = {key: _unwrap(chunk).sharded_state_dict() for key, chunk in zip(_model_keys(model), _chunks(model))}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(dict(state), is_loading=is_loading)
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
    safe_load.verify_folder(folder)      # Megatron unpickles the folder plainly: refuse a hostile one first
    loaded = dist_checkpointing.load(_sharded_state(model, optimizer, is_loading=True, rng=rng), folder)
    for key, chunk in zip(_model_keys(model), _chunks(model)):
        _unwrap(chunk).load_state_dict(loaded[key])
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
    if rng:
        _set_rng_state(loaded["rng_state"])
    return loaded["iteration"]
