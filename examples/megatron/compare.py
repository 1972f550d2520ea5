"""The same GPT with Megatron-Core's own MoE and with fmoe's, side by side in one run.

Both: the same experts (count, top-k, width, GELU, no biases), the same router (fmoe's
gate="megatron" routes as the config's TopKRouter: softmax over the top-k logits, no capacity,
Megatron's aux_loss), the same initial weights (copied from Megatron's model into fmoe's) and the
same batches; Megatron's MoE uses its alltoall dispatcher. Steps alternate between the two models
so both see the same machine load.

    torchrun --nproc-per-node 2 examples/megatron/compare.py --expert-parallel-size 2
writes benchmarks/results/megatron-compare-cpu.json (on a GPU: megatron-compare-gpu.json).
"""
import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP
from megatron.core.transformer.moe.grouped_gemm_util import grouped_gemm_is_available

from fmoe.integrations.megatron import get_gpt_layer_with_fmoe_spec, training
from pretrain_gpt_moe import VOCAB_SIZE, add_model_args, gpt_config, load_bytes, microbatches

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
# fmoe's RouterGate with the options of Megatron's TopKRouter in the config (fmoe.integrations.megatron.router).
FMOE_GATE = dict(gate="megatron")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p)
    p.set_defaults(hidden_size=128, ffn_hidden_size=256, seq_len=128, num_experts=8)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the timing")
    p.add_argument("--out", default=None, help="JSON file (default: benchmarks/results/megatron-compare-<device>.json)")
    return p.parse_args(argv)


def megatron_moe_model(args) -> GPTModel:
    grouped = torch.cuda.is_available() and grouped_gemm_is_available()
    config = gpt_config(args, moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="aux_loss",
                        moe_grouped_gemm=grouped)
    return GPTModel(config=config, vocab_size=VOCAB_SIZE, max_sequence_length=args.seq_len,
                    transformer_layer_spec=get_gpt_layer_local_spec(num_experts=args.num_experts,
                                                                    moe_grouped_gemm=grouped))


def fmoe_model(args) -> GPTModel:
    return GPTModel(config=gpt_config(args), transformer_layer_spec=get_gpt_layer_with_fmoe_spec(**FMOE_GATE),
                    vocab_size=VOCAB_SIZE, max_sequence_length=args.seq_len)


@torch.no_grad()
def copy_weights(megatron: GPTModel, fmoe: GPTModel):
    """Dense weights by name; router and experts into fmoe's stacked layout."""
    target = dict(fmoe.named_parameters())
    for name, p in megatron.named_parameters():
        if ".mlp." not in name:
            target[name].copy_(p)
    for m_layer, f_layer in zip(megatron.decoder.layers, fmoe.decoder.layers):
        moe, experts = f_layer.mlp.moe, m_layer.mlp.experts
        moe.gate.gate.proj.weight.copy_(m_layer.mlp.router.weight)
        w1_eDF, w2_eFD = moe.experts.w1_eDF, moe.experts.w2_eFD
        if isinstance(experts, SequentialMLP):
            for e, expert in enumerate(experts.local_experts):
                w1_eDF[e].copy_(expert.linear_fc1.weight.t())
                w2_eFD[e].copy_(expert.linear_fc2.weight.t())
        elif isinstance(experts, GroupedMLP):
            w1_eDF.copy_(experts.weight1.view_as(w1_eDF))
            w2_eFD.copy_(experts.weight2.view_as(w2_eFD))
        else:
            raise TypeError(f"compare.py copies SequentialMLP or GroupedMLP experts, not {type(experts).__name__}")


def timed_step(model, optimizer, batches):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    loss, _ = training.train_step(model, optimizer, batches)
    return loss, time.perf_counter() - start


def machine() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "megatron_core": __import__("megatron.core").core.__version__}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def main(argv=None):
    args = parse_args(argv)
    training.initialize(args.tensor_parallel_size, args.expert_parallel_size, seed=args.seed)
    megatron = megatron_moe_model(args)
    fmoe = fmoe_model(args)
    copy_weights(megatron, fmoe)
    expert_impl = type(megatron.decoder.layers[0].mlp.experts).__name__
    runs = {"megatron": training.wrap(megatron, lr=args.lr), "fmoe": training.wrap(fmoe, lr=args.lr)}
    bytes_N = load_bytes(args)
    log = {name: {"loss": [], "step_s": []} for name in runs}
    for step in range(args.steps):
        batches = microbatches(bytes_N, args, step)
        for name, (model, optimizer) in runs.items():
            loss, seconds = timed_step(model, optimizer, batches)
            log[name]["loss"].append(loss)
            log[name]["step_s"].append(seconds)
    if dist.get_rank() == 0:
        summary = {}
        for name, entry in log.items():
            entry["median_step_ms"] = 1e3 * statistics.median(entry["step_s"][args.warmup:])
            entry["final_loss"] = entry["loss"][-1]
            summary[name] = entry
        summary["megatron"]["experts"] = f"{expert_impl}, alltoall dispatcher"
        summary["fmoe"]["experts"] = "fmoe GroupedExperts (grouped GEMM), gate=\"megatron\""
        result = {
            "config": {k: v for k, v in vars(args).items() if k != "out"},
            "world_size": dist.get_world_size(),
            "data_parallel_size": parallel_state.get_data_parallel_world_size(),
            "machine": machine(),
            **summary,
            "megatron_ms_over_fmoe_ms": summary["megatron"]["median_step_ms"] / summary["fmoe"]["median_step_ms"],
            "max_abs_loss_difference": max(abs(a - b) for a, b in zip(log["megatron"]["loss"], log["fmoe"]["loss"])),
        }
        device = "gpu" if torch.cuda.is_available() else "cpu"
        out = Path(args.out) if args.out else RESULTS / f"megatron-compare-{device}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        for name in ("megatron", "fmoe"):
            print(f"{name:9s} loss {summary[name]['loss'][0]:.4f} -> {summary[name]['final_loss']:.4f} after "
                  f"{args.steps} steps, {summary[name]['median_step_ms']:.1f} ms/step ({summary[name]['experts']})")
        print(f"megatron / fmoe time per step: {result['megatron_ms_over_fmoe_ms']:.2f}x; "
              f"largest loss difference {result['max_abs_loss_difference']:.2e}; written to {out}")
    training.shutdown()


if __name__ == "__main__":
    main()
