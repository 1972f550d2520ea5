"""Workers for tests/test_megatron_parallel.py: one small GPT with fmoe MoE layers trained at a
Megatron layout (pipeline, virtual pipeline, tensor + sequence, expert, context, data parallel)
from one initial checkpoint, on one global batch a step, writing its losses and its final
checkpoint for the test to hold against the single-process run."""
import json
import os
from typing import Optional

import torch

VOCAB, SEQ, HIDDEN, FFN, EXPERTS, LAYERS = 64, 32, 32, 64, 4, 4
MICRO_ROWS, GLOBAL_MICROBATCHES, STEPS = 2, 4, 3
# A DeepSeek-V3-like router: sigmoid scores, a balancing bias moved once per step, and a Switch loss.
GATE = dict(gate="router", gate_kwargs=dict(score="sigmoid", norm_topk_prob=True, selection_bias="updated",
                                            bias_update_speed=0.05, aux_loss="switch", aux_loss_coef=0.1),
            aux_loss_coeff=1.0)


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
    "pp2_tp2_ep2": (8, layout(pp=2, tp=2, ep=2)),
}


def batch(step: int, micro: int):
    """A learnable token stream: every other token is a function of the one before."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    t = torch.randint(0, VOCAB, (MICRO_ROWS, SEQ + 1), generator=g)
    t[:, 1::2] = (t[:, 0:-1:2] * 3 + 1) % VOCAB
    return t[:, :-1], t[:, 1:]


def build_gpt(gate=GATE):
    """This rank's model chunks of the 4-layer GPT at the initialised layout."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from fmoe.megatron import get_gpt_layer_with_fmoe_spec, training

    config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=FFN,
                               num_moe_experts=EXPERTS, moe_ffn_hidden_size=FFN, moe_router_topk=2,
                               add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                               use_cpu_initialization=True, moe_per_layer_logging=True,
                               **training.parallel_config())
    spec = get_gpt_layer_with_fmoe_spec(**gate)
    return training.model_chunks(lambda **stage: GPTModel(config=config, transformer_layer_spec=spec,
                                                         vocab_size=VOCAB, max_sequence_length=SEQ, **stage))


def my_microbatches(step: int):
    """This data-parallel rank's share of the step's global batch (micro-batches dealt round robin)."""
    from megatron.core import parallel_state

    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    return [batch(step, m) for m in range(GLOBAL_MICROBATCHES) if m % dp_size == dp_rank]


def bias_moves(chunks) -> list:
    return [m.moe.gate.e_score_correction_bias.clone() for c in chunks for m in c.modules() if hasattr(m, "moe")]


def run_layout(name: str, out_dir: str, init_ckpt: Optional[str]):
    """Train STEPS steps at layout `name` (from `init_ckpt` if given, else saving the initial weights
    there); rank 0 writes the losses; the final weights go to out_dir/<name>/final."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from fmoe.megatron import training

    _, sizes = LAYOUTS[name]
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    training.initialize(seed=5, num_layers=LAYERS, num_experts=EXPERTS, **sizes)
    model, optimizer = training.wrap(build_gpt(), lr=1e-2)
    if init_ckpt is None:
        init_ckpt = os.path.join(out_dir, "init")
        training.save_checkpoint(init_ckpt, model, None, 0)
    else:
        training.load_checkpoint(init_ckpt, model, None, rng=False)
    losses, biases_moved, logged = [], [], []
    for step in range(STEPS):
        before = bias_moves(model)
        micro = my_microbatches(step)
        losses.append(training.train_step(model, optimizer, micro)[0])
        biases_moved.append([sorted(set((a - b).abs().flatten().tolist())) for a, b in zip(bias_moves(model), before)])
        writer = RecordingWriter()
        training.log_moe_metrics(model, step + 1, len(micro), writer=writer)
        logged.append(writer.scalars)
    training.save_checkpoint(os.path.join(out_dir, name, "final"), model, optimizer, STEPS)
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, name, "result.json"), "w") as f:
            json.dump({"losses": losses, "bias_moves": biases_moved, "logged": logged}, f)


class RecordingWriter:
    """A TensorBoard writer that keeps what it is given."""

    def __init__(self):
        self.scalars = {}

    def add_scalar(self, tag, value, step):
        self.scalars[tag] = float(value)


def worker(rank, world_size, out_dir, names, init_ckpt):
    from megatron.core import parallel_state

    for name in names:
        run_layout(name, out_dir, init_ckpt)
    parallel_state.destroy_model_parallel()


def bad_layout_worker(rank, world_size, out_dir):
    """Every rank calls initialize with layouts that cannot work (2 ranks) and writes the errors."""
    from fmoe.megatron import training

    errors = {}
    for name, kwargs in {"experts": dict(expert_parallel_size=2, num_experts=3, num_layers=4),
                         "layers": dict(pipeline_parallel_size=2, num_layers=3, num_experts=4)}.items():
        try:
            training.initialize(**kwargs)
            errors[name] = "no error"
        except ValueError as err:
            errors[name] = str(err)
    with open(os.path.join(out_dir, f"bad{rank}.json"), "w") as f:
        json.dump(errors, f)
