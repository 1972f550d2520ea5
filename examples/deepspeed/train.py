"""Train fmoe's byte-level MoE GPT under DeepSpeed (ZeRO 0/1/2), with expert parallelism.

    deepspeed --num_gpus 2 --no_local_rank examples/deepspeed/train.py --ep-size 2     # 2 CPU ranks or 2 GPUs

See README.md beside this file.
"""
import argparse
import json
import os
import time
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fmoe.integrations.deepspeed as fds
from fmoe.app.data import BatchSampler, load_corpus
from fmoe.app.gpt import GPT, GPTConfig
from fmoe.distributed.checkpoint import save_checkpoint
from fmoe.transformer import FMoETransformerMLP

HERE = Path(__file__).resolve().parent


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ds-config", default=str(HERE / "ds_config.json"), help="DeepSpeed config JSON")
    p.add_argument("--zero-stage", type=int, choices=(0, 1, 2), help="override the config's ZeRO stage")
    p.add_argument("--ep-size", type=int, default=2, help="expert-parallel ranks (divides the world size)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--experts", type=int, default=8, help="experts per layer in all (divisible by --ep-size)")
    p.add_argument("--gate", default="gshard", choices=("naive", "noisy", "gshard", "switch", "balanced"))
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--d-hidden", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--data", help="a text file or folder (default: the Python standard library)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/deepspeed", help="where the fmoe checkpoint goes")
    return p.parse_args()


def load_ds_config(args, world: int) -> dict:
    cfg = json.loads(Path(args.ds_config).read_text())
    if args.zero_stage is not None:
        cfg.setdefault("zero_optimization", {})["stage"] = args.zero_stage
    if torch.cuda.is_available():
        cfg.setdefault("bf16", {"enabled": True})
    micro = cfg["train_micro_batch_size_per_gpu"]
    cfg["train_batch_size"] = micro * cfg.get("gradient_accumulation_steps", 1) * world
    return cfg


@torch.no_grad()
def shard_experts(model: GPT, cfg: GPTConfig, groups) -> GPT:
    """Swap each block's MoE for an expert-parallel one holding this rank's share of the same
    experts, so the model is the same at every ep size."""
    rank = dist.get_rank(groups.moe_group)
    per_rank = cfg.num_expert // groups.ep_size
    for block in model.blocks:
        full = block.moe
        sharded = FMoETransformerMLP(num_expert=per_rank, d_model=cfg.d_model, d_hidden=cfg.d_hidden,
                                     top_k=cfg.top_k, gate=cfg.gate, world_size=groups.ep_size,
                                     moe_group=groups.moe_group)
        sharded.gate.load_state_dict(full.gate.state_dict())
        for name, p in sharded.experts.named_parameters():
            p.copy_(getattr(full.experts, name)[rank * per_rank:(rank + 1) * per_rank])
        block.moe = sharded
    return model


def param_groups(model: GPT, weight_decay: float):
    """Decay matrices and expert stacks only; DeepSpeed's MoE split then puts experts in groups of their own."""
    params = [p for p in model.parameters() if p.requires_grad]
    return fds.moe_param_groups(model, [
        {"name": "decay", "params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"name": "no_decay", "params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ])


@torch.no_grad()
def evaluate(engine, sampler: BatchSampler, batches: int = 10) -> float:
    """Mean validation cross-entropy over all ranks (all of them run the forward: the experts are spread)."""
    engine.eval()
    total = torch.zeros((), device=engine.device)
    for _ in range(batches):
        x_BT, y_BT = (t.to(engine.device) for t in sampler.next())
        logits_BTV, _ = engine(x_BT)
        total += F.cross_entropy(logits_BTV.float().flatten(0, 1), y_BT.flatten())
    engine.train()
    dist.all_reduce(total)
    return total.item() / (batches * dist.get_world_size())


def main():
    args = parse_args()
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    elif "OMP_NUM_THREADS" not in os.environ:
        # the ranks share this machine's cores: one pool each, not all of them each
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_SIZE", "1"))))
    deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    if args.experts % args.ep_size:
        raise ValueError(f"--experts ({args.experts}) must be divisible by --ep-size ({args.ep_size})")
    groups = fds.setup_expert_parallel(args.ep_size)
    ds_config = load_ds_config(args, world)

    torch.manual_seed(args.seed)     # the same initial model on every rank
    cfg = GPTConfig(seq_len=args.seq_len, d_model=args.d_model, n_layer=args.layers, num_expert=args.experts,
                    gate=args.gate, d_hidden=args.d_hidden)
    model = GPT(cfg)
    if args.ep_size > 1:
        model = shard_experts(model, cfg, groups)
    fds.mark_expert_params(model)
    weight_decay = ds_config.get("optimizer", {}).get("params", {}).get("weight_decay", 0.0)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model, weight_decay),
                                      config=ds_config)

    corpus = load_corpus(args.data, seq_len=args.seq_len)
    micro = ds_config["train_micro_batch_size_per_gpu"]
    train = BatchSampler(corpus.train_N, micro, args.seq_len, seed=args.seed + rank)
    val = BatchSampler(corpus.val_N, micro, args.seq_len, seed=args.seed + 10_000 + rank)
    if rank == 0:
        stage = ds_config.get("zero_optimization", {}).get("stage", 0)
        print(f"world {world}, ep_size {args.ep_size}, ZeRO stage {stage}, {args.experts} experts/layer, "
              f"{sum(p.numel() for p in model.parameters())} parameters on rank 0, "
              f"corpus {corpus.num_bytes} bytes from {corpus.source}", flush=True)

    start, first = time.time(), None
    for step in range(1, args.steps + 1):
        x_BT, y_BT = (t.to(engine.device) for t in train.next())
        _, loss = engine(x_BT, y_BT)
        engine.backward(loss)
        engine.step()
        first = first if first is not None else loss.item()
        if rank == 0 and (step % 10 == 0 or step == args.steps):
            tokens = step * ds_config["train_batch_size"] * args.seq_len
            print(f"step {step:4d}  loss {loss.item():.3f}  {tokens / (time.time() - start):,.0f} tokens/s",
                  flush=True)

    val_loss = evaluate(engine, val)
    path = Path(args.out) / "checkpoint"
    os.makedirs(path.parent, exist_ok=True)
    save_checkpoint(str(path), engine.module)
    if rank == 0:
        print(f"first loss {first:.3f}, validation loss {val_loss:.3f}; fmoe checkpoint in {path}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
