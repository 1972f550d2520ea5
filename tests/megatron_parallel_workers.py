"""Workers for tests/test_megatron_parallel.py: one small GPT with fmoe MoE layers trained at a
Megatron layout (pipeline, virtual pipeline, tensor + sequence, expert, data parallel) from one
initial checkpoint, on one global batch a step, writing its losses and its final checkpoint for
the test to hold against the single-process run; then the same GPT with Megatron-Core's own
MoELayer (TopKRouter, alltoall dispatcher, SequentialMLP experts, local spec) from the same
weights, at the same layout, on the same batches, with SGD (see PEER_LR)."""
import json
import os
from typing import Optional
from unittest import mock

import torch

VOCAB, SEQ, HIDDEN, FFN, EXPERTS, LAYERS = 64, 32, 32, 64, 4, 4
MICRO_ROWS, GLOBAL_MICROBATCHES, STEPS = 2, 4, 3
# Megatron-Core router options, each routed by fmoe's gate="megatron" (fmoe.integrations.megatron.router) and by
# Megatron's TopKRouter. The layouts train "deepseek": sigmoid scores, group-limited, scaled, an expert
# bias moved once per global batch, the sequence-wise balance loss and the z-loss.
ROUTINGS = {
    "deepseek": dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                     moe_router_bias_update_rate=0.05, moe_router_num_groups=2, moe_router_group_topk=1,
                     moe_router_topk_scaling_factor=2.0, moe_router_load_balancing_type="seq_aux_loss",
                     moe_aux_loss_coeff=0.1, moe_z_loss_coeff=1e-3),
    "softmax_topk_logits": dict(moe_router_score_function="softmax", moe_router_pre_softmax=False,
                                moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.1),
    "softmax_pre_groups": dict(moe_router_score_function="softmax", moe_router_pre_softmax=True,
                               moe_router_num_groups=2, moe_router_group_topk=2,
                               moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.1,
                               moe_z_loss_coeff=1e-3),
    "sigmoid_global": dict(moe_router_score_function="sigmoid", moe_router_load_balancing_type="global_aux_loss",
                           moe_aux_loss_coeff=0.1),
}
RESUME_AT = 1          # every layout saves a checkpoint after this many steps
# Megatron's MoE is held to fmoe under plain SGD, not Adam. Adam steps each weight by about lr * g / |g|: a
# gradient near 0 whose last bits round otherwise (another CPU's kernels, another reduction order) moves its
# weight by up to 2 * lr, so the losses after a step differ by far more than fp32 rounding (8.9e-5 at step 3
# on another x86 CPU), and a gradient wrong by a constant factor goes unseen. SGD steps each weight by
# lr * g: gradients that differ by rounding (relative ~1e-7, |g| ~0.7, below the clip of 1) move the weights
# apart by lr * 0.7 * 1e-7 ~ 4e-8 and the next loss by ~|g| * 4e-8 ~ 3e-8, under one ulp of the ~4.1 loss
# (4.8e-7). So every step's loss is only the forward pass's fp32 rounding apart, as the first step's is (same
# weights): 2e-5 (40 ulps) leaves room for another CPU's kernels. An expert gradient 10% too large moves step
# 3's loss by 1.5e-3 (Adam's comparison passed it), a router gradient of 0 by 2.3e-4.
PEER_LR = 0.5
BIAS_SPEED = ROUTINGS["deepseek"]["moe_router_bias_update_rate"]


def layout(tp=1, pp=1, vpp=None, ep=1, cp=1) -> dict:
    return dict(tensor_parallel_size=tp, pipeline_parallel_size=pp, virtual_pipeline_parallel_size=vpp,
                expert_parallel_size=ep, context_parallel_size=cp)


LAYOUTS = {
    "single": (1, layout()),
    "pp2_vpp2": (2, layout(pp=2, vpp=2)),
    "pp2": (2, layout(pp=2)),
    "pp2_ep2": (4, layout(pp=2, ep=2)),
    "pp2_tp2_sp": (4, layout(pp=2, tp=2, ep=2)),
    "pp2_vpp2_ep2": (4, layout(pp=2, vpp=2, ep=2)),
    # FasterMoE's shadowing (the first and the last expert, every forward) under 1F1B.
    "pp2_ep2_shadow": (4, layout(pp=2, ep=2)),
    "pp2_tp2_ep2": (8, layout(pp=2, tp=2, ep=2)),
}


def batch(step: int, micro: int):
    """A learnable token stream: every other token is a function of the one before."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    t = torch.randint(0, VOCAB, (MICRO_ROWS, SEQ + 1), generator=g)
    t[:, 1::2] = (t[:, 0:-1:2] * 3 + 1) % VOCAB
    return t[:, :-1], t[:, 1:]


def gpt_config(routing: str):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from fmoe.integrations.megatron import training

    return TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=FFN,
                             num_moe_experts=EXPERTS, moe_ffn_hidden_size=FFN, moe_router_topk=2,
                             moe_token_dispatcher_type="alltoall", add_bias_linear=False, hidden_dropout=0.0,
                             attention_dropout=0.0, use_cpu_initialization=True, moe_per_layer_logging=True,
                             **ROUTINGS[routing], **training.parallel_config())


def build_gpt(routing: str = "deepseek", megatron_moe: bool = False, shadow: bool = False):
    """This rank's model chunks of the 4-layer GPT at the initialised layout: fmoe's MLP routing as
    Megatron's router would, or (`megatron_moe`) Megatron-Core's own MoELayer."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    from fmoe.integrations.megatron import get_gpt_layer_with_fmoe_spec, training

    config = gpt_config(routing)
    if megatron_moe:
        spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False)
    elif shadow:
        from tests.shadow_workers import FixedShadow

        spec = get_gpt_layer_with_fmoe_spec(gate="megatron", shadow=FixedShadow([0, EXPERTS - 1]))
    else:
        spec = get_gpt_layer_with_fmoe_spec(gate="megatron")
    return training.model_chunks(lambda **stage: GPTModel(config=config, transformer_layer_spec=spec,
                                                         vocab_size=VOCAB, max_sequence_length=SEQ, **stage))


def wrap_sgd(chunks):
    """training.wrap with Megatron's SGD (lr PEER_LR, no momentum) where it builds Adam."""
    from megatron.core.optimizer import OptimizerConfig

    from fmoe.integrations.megatron import training

    def sgd(**options):
        return OptimizerConfig(**{**options, "optimizer": "sgd", "sgd_momentum": 0.0})

    with mock.patch.object(training, "OptimizerConfig", sgd):
        model, optimizer = training.wrap(chunks, lr=PEER_LR)
    assert all(type(o.optimizer) is torch.optim.SGD for o in optimizer.chained_optimizers), optimizer
    return model, optimizer


@torch.no_grad()
def copy_into_megatron_moe(fmoe_chunks, megatron_chunks):
    """fmoe's weights into Megatron's MoE model at the same layout: dense ones by name, the router,
    its expert bias and each local expert's two matrices (transposed: fmoe keeps x @ w)."""
    for fmoe_chunk, meg_chunk in zip(fmoe_chunks, megatron_chunks):
        source = dict(fmoe_chunk.named_parameters())
        for name, p in meg_chunk.named_parameters():
            if ".mlp." not in name:
                p.copy_(source[name])
        for f_layer, m_layer in zip(fmoe_chunk.decoder.layers, meg_chunk.decoder.layers):
            moe, router, experts = f_layer.mlp.moe, m_layer.mlp.router, m_layer.mlp.experts.local_experts
            router.weight.copy_(moe.gate.gate.proj.weight)
            if getattr(moe.gate, "e_score_correction_bias", None) is not None:
                router.expert_bias.copy_(moe.gate.e_score_correction_bias)
            assert len(experts) == moe.experts.w1_eDF.shape[0]
            for e, expert in enumerate(experts):
                expert.linear_fc1.weight.copy_(moe.experts.w1_eDF[e].t())
                expert.linear_fc2.weight.copy_(moe.experts.w2_eFD[e].t())


def my_microbatches(step: int):
    """This data-parallel rank's share of the step's global batch (micro-batches dealt round robin)."""
    from megatron.core import parallel_state

    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    return [batch(step, m) for m in range(GLOBAL_MICROBATCHES) if m % dp_size == dp_rank]


def bias_moves(chunks) -> list:
    """Every MoE layer's balancing bias (fmoe's selection bias or Megatron's expert bias)."""
    biases = []
    for chunk in chunks:
        for module in chunk.modules():
            if getattr(getattr(module, "moe", None), "gate", None) is not None:
                if hasattr(module.moe.gate, "e_score_correction_bias"):
                    biases.append(module.moe.gate.e_score_correction_bias.clone())
            elif getattr(module, "expert_bias", None) is not None:
                biases.append(module.expert_bias.clone())
    return biases


def train(model, optimizer, steps=range(STEPS), save_after: Optional[tuple] = None) -> dict:
    """The steps; each step's loss, how far each bias entry moved, what Megatron's MoE tracker logged.
    `save_after` (step, folder): a checkpoint after that many steps."""
    from fmoe.integrations.megatron import training

    losses, biases_moved, logged = [], [], []
    for step in steps:
        if save_after is not None and step == save_after[0]:
            training.save_checkpoint(save_after[1], model, optimizer, step)
        before = bias_moves(model)
        micro = my_microbatches(step)
        losses.append(training.train_step(model, optimizer, micro)[0])
        biases_moved.append([sorted(set((a - b).abs().flatten().tolist())) for a, b in zip(bias_moves(model), before)])
        writer = RecordingWriter()
        training.log_moe_metrics(model, step + 1, len(micro), writer=writer)
        logged.append(writer.scalars)
    return {"losses": losses, "bias_moves": biases_moved, "logged": logged}


def count_shadow_rows(chunks) -> list:
    """A list that gathers the rows every fmoe layer computes on shadowed experts (only a dispatcher
    that exchanges one row per slot can shadow; the others compute none)."""
    from fmoe.dispatch import SlotExchange
    from fmoe.layer import FMoE

    rows = []
    for chunk in chunks:
        for moe in [m for m in chunk.modules() if isinstance(m, FMoE) and isinstance(m.dispatcher, SlotExchange)]:
            def counting(x_ND, plan, run=moe.dispatcher.run_rows):
                rows.append(int(plan.num_shadow_rows))
                return run(x_ND, plan)
            moe.dispatcher.run_rows = counting
    return rows


def start(name: str):
    from megatron.core import parallel_state

    from fmoe.integrations.megatron import training

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    training.initialize(seed=5, num_layers=LAYERS, num_experts=EXPERTS, **LAYOUTS[name][1])


def run_layout(name: str, out_dir: str, init_ckpt: Optional[str], routings=("deepseek",)):
    """Train STEPS steps at layout `name` (from `init_ckpt` if given, else saving the initial weights
    there) with fmoe's MLP, its final state to out_dir/<name>/final; then, for each routing, Megatron's
    MoE from the initial weights with SGD (and, in one process, fmoe's MLP alike: the layouts' Megatron
    runs are held to it). Rank 0 writes the results."""
    import torch.distributed as dist

    from fmoe.integrations.megatron import training

    start(name)
    model, optimizer = training.wrap(build_gpt(shadow=name.endswith("_shadow")), lr=1e-2)
    shadow_rows = count_shadow_rows(model)
    if init_ckpt is None:
        init_ckpt = os.path.join(out_dir, "init")
        training.save_checkpoint(init_ckpt, model, None, 0)
    else:
        training.load_checkpoint(init_ckpt, model, None, rng=False)
    result = train(model, optimizer, save_after=(RESUME_AT, os.path.join(out_dir, name, "resume")))
    result["shadow_rows"] = sum(shadow_rows)
    training.save_checkpoint(os.path.join(out_dir, name, "final"), model, optimizer, STEPS)
    result["megatron"], result["fmoe_sgd"] = {}, {}
    for routing in routings:
        fmoe_chunks = build_gpt(routing)
        training.load_checkpoint(init_ckpt, fmoe_chunks, None, rng=False)
        megatron_chunks = build_gpt(routing, megatron_moe=True)
        copy_into_megatron_moe(fmoe_chunks, megatron_chunks)
        if name == "single":
            result["fmoe_sgd"][routing] = train(*wrap_sgd(fmoe_chunks))
        result["megatron"][routing] = train(*wrap_sgd(megatron_chunks))
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, name, "result.json"), "w") as f:
            json.dump(result, f)


class RecordingWriter:
    """A TensorBoard writer that keeps what it is given."""

    def __init__(self):
        self.scalars = {}

    def add_scalar(self, tag, value, step):
        self.scalars[tag] = float(value)


def run_resumed(name: str, source: str, out_dir: str):
    """Layout `name` resumes (model, optimizer, balancing biases) from the checkpoint layout `source` wrote
    after RESUME_AT steps, and trains the remaining steps."""
    import torch.distributed as dist

    from fmoe.integrations.megatron import training

    start(name)
    model, optimizer = training.wrap(build_gpt(), lr=1e-2)
    resumed_at = training.load_checkpoint(os.path.join(out_dir, source, "resume"), model, optimizer, rng=False)
    result = train(model, optimizer, steps=range(resumed_at, STEPS))
    folder = os.path.join(out_dir, f"{name}_from_{source}")
    training.save_checkpoint(os.path.join(folder, "final"), model, optimizer, STEPS)
    if dist.get_rank() == 0:
        with open(os.path.join(folder, "result.json"), "w") as f:
            json.dump(result, f)


def worker(rank, world_size, out_dir, names, init_ckpt, routings=("deepseek",)):
    """Each of `names`: a layout to train, or "<layout>_from_<layout>" to resume one from another."""
    from megatron.core import parallel_state

    for name in names:
        if "_from_" in name:
            run_resumed(*name.split("_from_"), out_dir)
        else:
            run_layout(name, out_dir, init_ckpt, routings)
    parallel_state.destroy_model_parallel()


def bad_layout_worker(rank, world_size, out_dir):
    """Every rank calls initialize with layouts that cannot work (2 ranks) and writes the errors."""
    from fmoe.integrations.megatron import training

    errors = {}
    for name, kwargs in {"experts": dict(expert_parallel_size=2, num_experts=3, num_layers=4),
                         "layers": dict(pipeline_parallel_size=2, num_layers=3, num_experts=4)}.items():
        try:
            training.initialize(**kwargs)
            errors[name] = "no error"
        except ValueError as err:
            errors[name] = str(err)
    # Context parallelism: Megatron-Core's local spec (no Transformer Engine) refuses it in its attention.
    training.initialize(context_parallel_size=2, num_layers=LAYERS, num_experts=EXPERTS)
    try:
        build_gpt()
        errors["context_parallel"] = "no error"
    except AssertionError as err:
        errors["context_parallel"] = f"{type(err).__name__}: {err}"
    with open(os.path.join(out_dir, f"bad{rank}.json"), "w") as f:
        json.dump(errors, f)
