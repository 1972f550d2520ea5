"""torchtitan's Qwen3-MoE debug model trained on the CPU twice from the same weights and batches: once with
torchtitan's own MoE, once with fmoe's layer in its place (`fmoe.integrations.torchtitan.convert`); prints
both loss curves side by side, then fmoe's routing statistics.

    python examples/torchtitan/train_qwen3_debug.py --steps 20
    python examples/torchtitan/train_qwen3_debug.py --steps 20 --level experts --json /tmp/curves.json

`--level moe` (the default) replaces each MoE module whole (router, experts, shared experts carried over);
`--level experts` keeps torchtitan's MoE and runs only its experts on fmoe's kernels (`use_fmoe_experts`).
torchtitan's experts compute in bfloat16 whatever the model's dtype; so do fmoe's here (`experts_dtype=
torch.bfloat16`; `--experts-fp32` runs them in the model's float32), and the curves agree to the rounding of
sums taken in another order, which `--tolerance` bounds (relative). Routing is discontinuous: such a rounding
difference moves a token near a tie to another expert, and from then on the runs part slowly (by step 30
they differ by about 2e-2), so the check holds for the first steps. The model is torchtitan's `debugmodel_moe` flavor (64 experts, top-8)
with `--layers` of its 8 layers, SDPA attention (FlexAttention has no backward on a CPU), random weights;
the data are sequences over 64 of its tokens from a fixed random bigram table, so there is something to learn.
"""
import argparse
import copy
import json
import time

import torch
import torch.nn.functional as F

from fmoe.integrations import torchtitan as fmoe_titan
from fmoe.integrations.torchtitan import models
from fmoe.observe.stats import routing_stats


def bigram_batches(vocab: int, steps: int, batch: int, seq: int, seed: int = 0):
    """`steps` batches [batch, seq + 1] walked over `vocab` tokens from a random bigram table (each token has
    4 successors, equally likely: the best loss is ln 4)."""
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(vocab, (vocab, 4), generator=g)
    out = []
    for _ in range(steps):
        tokens = torch.empty(batch, seq + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(vocab, (batch,), generator=g)
        for t in range(seq):
            pick = torch.randint(4, (batch,), generator=g)
            tokens[:, t + 1] = successors[tokens[:, t], pick]
        out.append(tokens)
    return out


def train(model, batches, lr: float):
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for tokens in batches:
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        logits = models.forward(model, inputs)
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=2, help="how many of the debug model's 8 layers")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--data-vocab", type=int, default=64, help="tokens the data use (of the model's 2048)")
    parser.add_argument("--level", choices=("moe", "experts"), default="moe")
    parser.add_argument("--experts-fp32", action="store_true",
                        help="fmoe's experts in the model's float32 (torchtitan's stay in bfloat16)")
    parser.add_argument("--tolerance", type=float, default=1e-2,
                        help="largest relative difference of the two curves accepted (exit 1 beyond)")
    parser.add_argument("--json", help="write both curves and fmoe's routing statistics here")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    theirs = models.debug_model("qwen3", n_layers=args.layers, seed=0)
    ours = copy.deepcopy(theirs)
    if args.level == "moe":
        fmoe_titan.convert(ours, experts_dtype=None if args.experts_fp32 else torch.bfloat16)
    else:
        fmoe_titan.use_fmoe_experts(ours)
    batches = bigram_batches(args.data_vocab, args.steps, args.batch, args.seq)
    timings = {}
    curves = {}
    for name, model in (("torchtitan", theirs), ("fmoe", ours)):
        start = time.perf_counter()
        curves[name] = train(model, batches, args.lr)
        timings[name] = time.perf_counter() - start
    print(f"torchtitan qwen3 debugmodel_moe, {args.layers} layers, {args.steps} steps of {args.batch}x{args.seq} "
          f"tokens, fmoe at the {args.level} level")
    print(f"{'step':>4}  {'torchtitan':>10}  {'fmoe':>10}  {'rel diff':>9}")
    worst = 0.0
    for step, (a, b) in enumerate(zip(curves["torchtitan"], curves["fmoe"])):
        rel = abs(a - b) / abs(a)
        worst = max(worst, rel)
        print(f"{step:>4}  {a:>10.5f}  {b:>10.5f}  {rel:>9.2e}")
    print(f"largest relative difference {worst:.2e} (tolerance {args.tolerance:.0e}); "
          f"time torchtitan {timings['torchtitan']:.1f} s, fmoe {timings['fmoe']:.1f} s")
    stats = routing_stats(ours) if args.level == "moe" else {}
    for layer, s in stats.items():
        print(f"{layer}: max_load {s['max_load']:.0f}, mean_load {s['mean_load']:.1f}, load_cv {s['load_cv']:.2f}, "
              f"empty_experts {s['empty_experts']:.0f}, router_entropy {s['router_entropy']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"level": args.level, "layers": args.layers, "steps": args.steps, "curves": curves,
                       "largest_relative_difference": worst, "routing_stats": stats}, f, indent=1)
    if worst > args.tolerance:
        raise SystemExit(f"the curves differ by {worst:.2e} > {args.tolerance:.0e}")


if __name__ == "__main__":
    main()
