"""Pretrain a small Megatron-Core GPT whose MLPs are fmoe MoE layers, on bytes of text.

CPU (gloo), 2 processes, expert parallel size 2:
    torchrun --nproc-per-node 2 examples/megatron/pretrain_gpt_moe.py --expert-parallel-size 2 --steps 50
CPU, 4 processes, 2 pipeline stages of 2 virtual stages each, expert parallel 2 (data parallel 2):
    torchrun --nproc-per-node 4 examples/megatron/pretrain_gpt_moe.py --pipeline-parallel-size 2 \
        --virtual-pipeline-parallel-size 2 --expert-parallel-size 2 --num-layers 4 --num-microbatches 4
GPU (NCCL), 8 GPUs, tensor parallel 2, expert parallel 4 (data parallel = 8 / 2 = 4):
    torchrun --nproc-per-node 8 examples/megatron/pretrain_gpt_moe.py --tensor-parallel-size 2 \\
        --expert-parallel-size 4 --hidden-size 1024 --num-layers 12 --num-attention-heads 16 --num-experts 16
Save every 20 steps, then resume:
    ... --steps 40 --save ckpt --save-interval 20;  ... --steps 60 --load ckpt --save ckpt
The loss and each layer's routing statistics (rank 0's tokens) to TensorBoard:
    ... --tensorboard runs/megatron-moe
"""
import argparse
import json
import time
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")

from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from fmoe.integrations.megatron import fmoefy, get_gpt_layer_with_fmoe_spec, training  # noqa: E402

VOCAB_SIZE = 256    # bytes


def add_model_args(p: argparse.ArgumentParser):
    """Parallel sizes, the model and its data: what pretraining and compare.py share."""
    g = p.add_argument_group("parallelism (data parallel size = world size / (tensor x pipeline x context))")
    g.add_argument("--tensor-parallel-size", type=int, default=1)
    g.add_argument("--expert-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-parallel-size", type=int, default=1)
    g.add_argument("--virtual-pipeline-parallel-size", type=int, default=None,
                   help="model chunks per pipeline rank (interleaved 1F1B schedule)")
    g.add_argument("--context-parallel-size", type=int, default=1)
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=2)
    g.add_argument("--hidden-size", type=int, default=64)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--ffn-hidden-size", type=int, default=128, help="width of each expert")
    g.add_argument("--seq-len", type=int, default=64)
    g.add_argument("--num-experts", type=int, default=4, help="experts per layer, over all expert-parallel ranks")
    g.add_argument("--top-k", type=int, default=2)
    g.add_argument("--aux-loss-coeff", type=float, default=0.01)
    g = p.add_argument_group("data and optimizer")
    g.add_argument("--micro-batch-size", type=int, default=8)
    g.add_argument("--num-microbatches", type=int, default=1)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--data", default=None, help="a text file or folder (default: the Python standard library)")
    g.add_argument("--mock-data", action="store_true", help="random bytes instead of text")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--gate", default="gshard", help="naive, noisy, gshard, switch or balanced")
    p.add_argument("--fmoefy", action="store_true",
                   help="build a dense GPT and convert it with fmoefy() instead of using the fmoe layer spec")
    p.add_argument("--steps", type=int, default=50, help="train until this iteration")
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--save", default=None, help="checkpoint folder to write")
    p.add_argument("--save-interval", type=int, default=0, help="0: save only at the end (with --save)")
    p.add_argument("--load", default=None, help="checkpoint folder to resume from")
    p.add_argument("--log-json", default=None, help="write the losses to this JSON file (rank 0)")
    p.add_argument("--tensorboard", default=None, metavar="DIR",
                   help="log the loss and Megatron's MoE metrics with each layer's routing statistics here (rank 0)")
    return p.parse_args(argv)


def gpt_config(args, dense: bool = False, **overrides) -> TransformerConfig:
    """The GPT's TransformerConfig; `dense` leaves the MoE fields for fmoefy() to set."""
    moe = {} if dense else dict(num_moe_experts=args.num_experts, moe_router_topk=args.top_k,
                                moe_ffn_hidden_size=args.ffn_hidden_size, moe_aux_loss_coeff=args.aux_loss_coeff,
                                # Megatron checks this for its own top-1 router; fmoe's gates ignore it.
                                moe_router_pre_softmax=args.top_k == 1)
    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=not torch.cuda.is_available(), **training.parallel_config(), **moe, **overrides)


def build_model(args) -> list:
    """This rank's model chunks (one per virtual pipeline stage; one without them)."""
    config = gpt_config(args, dense=args.fmoefy, moe_per_layer_logging=args.tensorboard is not None)

    def chunk(**stage) -> GPTModel:
        if args.fmoefy:
            model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                             vocab_size=VOCAB_SIZE, max_sequence_length=args.seq_len, **stage)
            return fmoefy(model, num_experts=args.num_experts, top_k=args.top_k, gate=args.gate,
                          aux_loss_coeff=args.aux_loss_coeff)
        return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_with_fmoe_spec(gate=args.gate),
                        vocab_size=VOCAB_SIZE, max_sequence_length=args.seq_len, **stage)

    return training.model_chunks(chunk)


def load_bytes(args) -> torch.Tensor:
    if args.mock_data:
        return torch.randint(0, VOCAB_SIZE, (1 << 20,), generator=torch.Generator().manual_seed(args.seed),
                             dtype=torch.uint8)
    from fmoe.app.data import load_corpus

    return load_corpus(args.data, seq_len=args.seq_len).train_N


def microbatches(bytes_N: torch.Tensor, args, step: int):
    """This data-parallel rank's windows for `step`, drawn from (seed, step, rank): a resumed run sees
    the same batches as an uninterrupted one."""
    rank = parallel_state.get_data_parallel_rank()
    generator = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1_009 + rank)
    out = []
    for _ in range(args.num_microbatches):
        starts_B = torch.randint(bytes_N.numel() - args.seq_len, (args.micro_batch_size,), generator=generator)
        window_BT = bytes_N[starts_B[:, None] + torch.arange(args.seq_len + 1)].long()
        out.append((window_BT[:, :-1], window_BT[:, 1:]))
    return out


def main(argv=None):
    args = parse_args(argv)
    training.initialize(args.tensor_parallel_size, args.expert_parallel_size, seed=args.seed,
                        pipeline_parallel_size=args.pipeline_parallel_size,
                        virtual_pipeline_parallel_size=args.virtual_pipeline_parallel_size,
                        context_parallel_size=args.context_parallel_size, num_layers=args.num_layers,
                        num_experts=args.num_experts)
    rank = dist.get_rank()
    model, optimizer = training.wrap(build_model(args), lr=args.lr)
    start = training.load_checkpoint(args.load, model, optimizer) if args.load else 0
    bytes_N = load_bytes(args)
    if rank == 0:
        print(f"world {dist.get_world_size()}: tensor parallel {args.tensor_parallel_size}, pipeline parallel "
              f"{args.pipeline_parallel_size} (virtual {args.virtual_pipeline_parallel_size or 1}), context parallel "
              f"{args.context_parallel_size}, expert parallel {args.expert_parallel_size}, data parallel "
              f"{parallel_state.get_data_parallel_world_size()}; "
              f"{args.num_experts} experts, top-{args.top_k}, {args.gate} gate; from step {start}", flush=True)
    log = {"step": [], "loss": []}
    writer = None
    if args.tensorboard and rank == 0:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(args.tensorboard)
    tick, since_log = time.perf_counter(), 0
    for step in range(start, args.steps):
        loss, grad_norm = training.train_step(model, optimizer, microbatches(bytes_N, args, step))
        log["step"].append(step + 1)
        log["loss"].append(loss)
        if args.tensorboard:
            training.log_moe_metrics(model, step + 1, args.num_microbatches, writer)
            if writer is not None:
                writer.add_scalar("lm loss", loss, step + 1)
        since_log += 1
        if rank == 0 and ((step + 1) % args.log_interval == 0 or step + 1 == args.steps):
            ms = (time.perf_counter() - tick) * 1e3 / since_log
            print(f"step {step + 1:5d}  loss {loss:.4f}  grad norm {grad_norm:.3f}  {ms:.0f} ms/step", flush=True)
            tick, since_log = time.perf_counter(), 0
        if args.save and args.save_interval and (step + 1) % args.save_interval == 0:
            training.save_checkpoint(args.save, model, optimizer, step + 1)
    if args.save and (not args.save_interval or args.steps % args.save_interval):
        training.save_checkpoint(args.save, model, optimizer, args.steps)
    if writer is not None:
        writer.close()
    if rank == 0 and args.log_json:
        with open(args.log_json, "w") as f:
            json.dump(log, f)
    training.shutdown()
    return log


if __name__ == "__main__":
    main()
