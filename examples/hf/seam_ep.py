"""A family outside fmoe's table (a tiny Qwen3.5-MoE by default), converted at the experts seam and trained
a few steps with fmoe's expert parallelism on 2 CPU processes, its routing statistics printed; then saved
with every expert gathered, and reloaded by plain transformers.

    python examples/hf/seam_ep.py --steps 5 --out /tmp/qwen3_5_moe-seam
    python examples/hf/seam_ep.py --family glm4_moe --steps 5 --out /tmp/glm4_moe-seam

The model is the family's tiny model from `fmoe.hf.discover()` (built from its own config class, random
weights, 64 tokens). `convert(model, ep_size=2, seam=True)` keeps the family's block, router and shared
experts and gives each rank half of every experts module; DistributedGroupedDataParallel averages the
gradients over the ranks, each of which trains on its own random batches.
"""
import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers

import fmoe.integrations.hf
from fmoe.distributed.ddp import DistributedGroupedDataParallel
from fmoe.distributed.groups import make_groups


def train(rank, world_size, family, steps, out, store_path):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size)
    groups = make_groups(ep_size=world_size)
    model = fmoe.integrations.hf.discover([family])[0].build(seed=0)     # the same weights on every rank
    fmoe.integrations.hf.convert(model, ep_size=world_size, moe_group=groups.moe_group, seam=True)
    model.train()
    synced = DistributedGroupedDataParallel(model, groups=groups)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    vocab = model.config.get_text_config().vocab_size
    batches = torch.Generator().manual_seed(100 + rank)                  # every rank its own batches
    for step in range(steps):
        ids = torch.randint(vocab, (4, 32), generator=batches)
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        synced.allreduce_params()
        optimizer.step()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}")
    if rank == 0:
        for name, layer in fmoe.integrations.hf.seam_layers(model):
            stats = layer.routing_stats         # this rank's last forward
            print(f"{name}: tokens per expert {stats['tokens_per_expert'].tolist()}, "
                  f"load cv {float(stats['load_cv']):.2f}, dropped slots {int(stats['dropped_slots'])}")
    model.save_pretrained(out)              # every rank: the experts are gathered, rank 0 writes
    dist.barrier()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", default="qwen3_5_moe", help="a transformers model folder, e.g. glm4_moe")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", required=True, help="folder for the saved model (the family's own layout)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        mp.spawn(train, args=(2, args.family, args.steps, args.out, os.path.join(scratch, "store")), nprocs=2)
    plain = transformers.AutoModelForCausalLM.from_pretrained(args.out)
    print(f"reloaded by plain transformers: {type(plain).__name__}, "
          f"{sum(p.numel() for p in plain.parameters())} parameters")


if __name__ == "__main__":
    main()
