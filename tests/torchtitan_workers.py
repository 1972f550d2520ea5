"""Workers for tests/test_torchtitan_parallel.py: torchtitan's own parallelism (ParallelDims, its parallelize
function with FSDP2 and expert parallelism, its DCP ModelWrapper) on gloo ranks, with fmoe's layer converted
in, held to one process and to torchtitan's own modules.

torchtitan on a CPU needs three things its trainer does not do there (see `torchtitan_on_cpu` and
`parallel_model`): its device set to "cpu", its "partial_dtensor" SPMD backend (the default "spmd_types"
sends uneven all-to-alls gloo refuses, and torch 2.13's FSDP2 refuses its plain-tensor parameters), and
FSDP's reduce-scatter as a plain sum (torchtitan sets a gradient divide factor of 1.0, which FSDP sends as
ReduceOp.PREMUL_SUM, which gloo does not have)."""
import copy
import os
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.torchtitan_reference import torchtitan_in_input_dtype, torchtitan_on_cpu

B, L = 4, 16            # the global batch: each data-parallel rank takes B / dp of its sequences
N_LAYERS = 2


def reference_model(family, seed):
    from fmoe.integrations.torchtitan import models
    return models.debug_model(family, n_layers=N_LAYERS, seed=seed)


def batch(model, seed=5):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model.tok_embeddings.num_embeddings, (B, L + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_of(model, inputs, labels):
    """torchtitan's loss: the sum of the token losses over the global token count."""
    from fmoe.integrations.torchtitan import models
    logits = models.forward(model, inputs)
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(0, 1), reduction="sum") / (B * L)


def parallel_model(family, dp_shard, ep, folder, ac=False):
    """torchtitan's debug model of `family` under ParallelDims(dp_shard, ep) and its own parallelize function
    (FSDP2 over the data-parallel ranks, experts sharded over the expert-parallel ones; `ac`: its full
    activation checkpointing of every block), as its trainer builds it: on the meta device, then
    materialised and initialised."""
    import importlib

    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.activation_checkpoint import FullAC

    from fmoe.integrations.torchtitan import models

    torchtitan_on_cpu()
    dist_utils.set_spmd_backend("partial_dtensor")
    parallelism = ParallelismConfig(data_parallel_shard_degree=dp_shard, expert_parallel_degree=ep,
                                    spmd_backend="partial_dtensor")
    dims = ParallelDims.from_config(parallelism, dist.get_world_size())
    dims.build_mesh()
    config = models.debug_config(family, n_layers=N_LAYERS)
    config.update_from_config(config=SimpleNamespace(parallelism=parallelism))
    with torch.device("meta"):
        model = config.build()
    spec = importlib.import_module(f"torchtitan.models.{family}").model_registry(models.FAMILIES[family])
    model = spec.parallelize_fn(model, parallel_dims=dims,
                                training=TrainingConfig(mixed_precision_param="float32",
                                                        mixed_precision_reduce="float32"),
                                parallelism=parallelism, compile_config=CompileConfig(enable=False),
                                ac_config=FullAC.Config() if ac else None,
                                dump_folder=folder)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_states(buffer_device=None)
    model.train()
    return model, dims


def copy_weights(model, source):
    """`source`'s whole tensors into `model`'s (DTensor) shards, by name, through load_state_dict (torchtitan's
    fused QKV projection is one tensor under three state-dict names, which its load hook fuses back)."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    whole_tensors = dict(source.state_dict())
    state = {}
    for name, t in model.state_dict().items():
        full = whole_tensors[name].detach()
        state[name] = (distribute_tensor(full, t.device_mesh, t.placements, src_data_rank=None)
                       if isinstance(t, DTensor) else full.clone())
    model.load_state_dict(state)


def whole(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def my_rows(dims, inputs, labels):
    rank, n = dims.get_mesh("batch").get_local_rank(), dims.dp_shard
    rows = slice(rank * B // n, (rank + 1) * B // n)
    return inputs[rows], labels[rows]


def step(model, dims, inputs, labels):
    """Forward and backward on this rank's sequences; the global loss."""
    x, y = my_rows(dims, inputs, labels)
    with torchtitan_in_input_dtype():
        loss = loss_of(model, x, y)
        loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total


def fmoe_ep_equals_one_process(rank, world, family, folder, ac=False):
    """fmoe's layer converted into torchtitan's FSDP2 + expert-parallel model (`ac`: under its activation
    checkpointing too): the global loss and every gradient (whole) equal torchtitan's own model in one
    process."""
    from fmoe.integrations import torchtitan as fmoe_titan
    torch.manual_seed(0)
    reference = reference_model(family, seed=0)
    inputs, labels = batch(reference)
    with torchtitan_in_input_dtype():
        want = loss_of(reference, inputs, labels)
        want.backward()
    model, dims = parallel_model(family, dp_shard=world, ep=world, folder=folder, ac=ac)
    copy_weights(model, reference)
    fmoe_titan.convert(model, ep_mesh=dims.get_mesh("ep"))
    layers = fmoe_titan.titan_layers(model)
    assert layers and all(layer.world_size == world for _, layer in layers)
    got = step(model, dims, inputs, labels)
    torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
    want_grads = {n: p.grad for n, p in reference.named_parameters()}
    for name, p in model.named_parameters():
        torch.testing.assert_close(whole(p.grad), want_grads[name.replace("_checkpoint_wrapped_module.", "")],
                                   rtol=1e-4, atol=1e-6, msg=lambda m: f"rank {rank} {name}: {m}")
    # each rank routed its own tokens; together they are the one process's (counted again by the recompute
    # under activation checkpointing, as torchtitan's MoE counts them, and its balancing hook halves)
    tokens = torch.stack([layer.tokens_per_expert_E for _, layer in layers])
    dist.all_reduce(tokens)
    counted = torch.stack([m.tokens_per_expert_E for m in moe_modules(reference)])
    assert torch.equal(tokens, counted * (2 if ac else 1))
    traffic = layers[0][1].traffic_bytes
    assert traffic["dispatch"]["forward"], traffic      # the rows did travel between the ranks


def moe_modules(model):
    from torchtitan.models.common.moe import MoE
    return [m for m in model.modules() if isinstance(m, MoE)]


def dcp_round_trips(rank, world, family, folder):
    """torchtitan's DCP (its ModelWrapper, as its CheckpointManager saves a model) both ways at 2 ranks: a
    model trained a step with fmoe's MoE loads into torchtitan's own and computes the same loss, and one
    trained a step with torchtitan's MoE loads into fmoe's."""
    import torch.distributed.checkpoint as dcp
    from torchtitan.components.checkpoint import ModelWrapper

    from fmoe.integrations import torchtitan as fmoe_titan
    reference = reference_model(family, seed=0)
    inputs, labels = batch(reference)

    def make(seed, with_fmoe):
        model, dims = parallel_model(family, dp_shard=world, ep=world, folder=folder)
        copy_weights(model, reference_model(family, seed=seed))
        if with_fmoe:
            fmoe_titan.convert(model, ep_mesh=dims.get_mesh("ep"))
        return model, dims

    def train_step(model, dims):
        step(model, dims, inputs, labels)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-0.5)
            model.zero_grad(set_to_none=True)

    def evaluate(model, dims):
        with torch.no_grad():
            x, y = my_rows(dims, inputs, labels)
            with torchtitan_in_input_dtype():
                loss = loss_of(model, x, y)
        dist.all_reduce(loss)
        return loss

    for saver_fmoe in (True, False):
        saver, dims = make(seed=1, with_fmoe=saver_fmoe)
        train_step(saver, dims)
        path = os.path.join(folder, f"ckpt-from-{'fmoe' if saver_fmoe else 'torchtitan'}")
        dcp.save(ModelWrapper(saver).state_dict(), checkpoint_id=path)
        loader, dims = make(seed=2, with_fmoe=not saver_fmoe)
        state = ModelWrapper(loader).state_dict()
        dcp.load(state, checkpoint_id=path)
        ModelWrapper(loader).load_state_dict(state)
        saved = saver.state_dict()
        for name, t in loader.state_dict().items():
            assert torch.equal(whole(t), whole(saved[name])), (saver_fmoe, name)
        torch.testing.assert_close(evaluate(loader, dims), evaluate(saver, dims), rtol=1e-5, atol=1e-6)
    dist.barrier()


def fmoe_ep_on_a_plain_model(rank, world, family, folder):
    """convert(model, ep_mesh=...) on a model torchtitan did not parallelize: fmoe shards the whole experts
    over the mesh (DTensors, Shard(0)) and exchanges the rows itself; each rank feeds its own sequences. The
    loss, the experts' gradients (whole) and the others' (summed over the ranks) equal one process."""
    from torch.distributed.device_mesh import init_device_mesh

    from fmoe.integrations import torchtitan as fmoe_titan
    reference = reference_model(family, seed=0)
    inputs, labels = batch(reference)
    with torchtitan_in_input_dtype():
        want = loss_of(reference, inputs, labels)
        want.backward()
    model = reference_model(family, seed=0)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    fmoe_titan.convert(model, ep_mesh=mesh)
    experts = fmoe_titan.titan_layers(model)[0][1].experts
    assert experts.num_expert == reference.layers["1"].moe.router.num_experts // world
    rows = slice(rank * B // world, (rank + 1) * B // world)
    loss = loss_of(model, inputs[rows], labels[rows])
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    torch.testing.assert_close(total, want.detach(), rtol=1e-5, atol=1e-6)
    want_grads = {n: p.grad for n, p in reference.named_parameters()}
    for name, p in model.named_parameters():
        grad = p.grad
        if hasattr(grad, "full_tensor"):
            grad = grad.full_tensor()
        else:
            grad = grad.clone()
            dist.all_reduce(grad)
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
