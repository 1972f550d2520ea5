"""Fine-tune a transformers Qwen3-MoE (or DeepSeek-V3) model with fmoe's expert parallelism on CPU
processes, then export it back to a checkpoint plain transformers loads.

    python examples/hf/finetune_qwen3_moe.py --steps 30 --out /tmp/qwen3-moe-fmoe
    python examples/hf/finetune_qwen3_moe.py --family deepseek_v3 --steps 30 --out /tmp/dsv3-fmoe
    python examples/hf/finetune_qwen3_moe.py --model PATH_TO_A_LOCAL_CHECKPOINT --out /tmp/ft

Without --model the model is a small random-init one. Each of the --nproc gloo processes keeps
1/nproc of every MoE block's experts (ep_size = nproc), trains on its own batches of a learnable
token pattern, and the shared parameters' gradients are averaged with fmoe's
DistributedGroupedDataParallel. The loss printed is the mean over the ranks.
"""
import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers

import fmoe.hf
from fmoe.distributed.ddp import DistributedGroupedDataParallel

VOCAB = 128


def small_config(family: str):
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=128, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                                           head_dim=16, norm_topk_prob=True)
    return transformers.DeepseekV3Config(**common, intermediate_size=128, moe_intermediate_size=64, n_routed_experts=8,
                                         num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                                         n_group=2, topk_group=1, kv_lora_rank=16, q_lora_rank=16,
                                         qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)


def batch(generator, batch_size=8, length=32):
    """Counting sequences with a random start and stride: the next token is learnable."""
    start = torch.randint(VOCAB, (batch_size, 1), generator=generator)
    stride = torch.randint(1, 4, (batch_size, 1), generator=generator)
    return (start + stride * torch.arange(length)) % VOCAB


def worker(rank, world, store, args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.manual_seed(0)        # every rank builds the same model, then keeps its own experts
    if args.model:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    else:
        model = transformers.AutoModelForCausalLM.from_config(small_config(args.family))
    fmoe.hf.convert(model, ep_size=world)
    ddp = DistributedGroupedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data = torch.Generator().manual_seed(1000 + rank)
    model.train()
    for step in range(args.steps):
        ids = batch(data)
        loss = ddp(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        ddp.allreduce_params()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {mean.item() / world:.3f}", flush=True)
    model.eval()
    fmoe.hf.export(model, args.out)     # every rank takes part: the experts are gathered to rank 0
    ids = batch(torch.Generator().manual_seed(7))
    with torch.no_grad():
        ours = model(ids).logits        # a collective too: the experts live on all ranks
    if rank == 0:
        plain = transformers.AutoModelForCausalLM.from_pretrained(args.out).eval()
        with torch.no_grad():
            diff = (plain(ids).logits - ours).abs().max().item()
        print(f"exported to {args.out}; plain transformers reloads it, max |logit difference| {diff:.2e}")
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", choices=["qwen3_moe", "deepseek_v3"], default="qwen3_moe")
    parser.add_argument("--model", help="a local transformers checkpoint folder instead of a random small model")
    parser.add_argument("--nproc", type=int, default=2, help="processes = expert-parallel ranks")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--out", required=True, help="folder for the exported checkpoint")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fmoe-hf-") as folder:
        mp.spawn(worker, args=(args.nproc, os.path.join(folder, "store"), args), nprocs=args.nproc, join=True)


if __name__ == "__main__":
    main()
