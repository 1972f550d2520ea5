"""`fmoe train --hf-model PATH`: fine-tune a transformers MoE checkpoint with fmoe's expert parallelism.

The checkpoint is loaded and converted with `fmoe.integrations.hf.load` (the ep_size ranks of an
expert-parallel group take turns, each keeping its slice of every block's experts), trained on fmoe's
byte corpus (the token ids are the bytes, 0-255) with `fmoe train`'s optimizer, learning-rate
schedule and gradient clipping, the gradients synced by DistributedGroupedDataParallel, and
exported with `fmoe.integrations.hf.export` to `out`, which plain transformers then loads. There is no
checkpoint to resume from: the exported model, written at the end, is the run's output.
"""
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import transformers

import fmoe.integrations.hf
from fmoe.app.data import BatchSampler, load_corpus
from fmoe.app.evaluation import open_dashboards
from fmoe.app.files import write_json
from fmoe.app.runtime import (TrainConfig, end_with_parent, init_distributed, launched_by_torchrun, mean_over_ranks,
                              resolve_device)
from fmoe.app.train import lr_at, make_optimizer
from fmoe.distributed.ddp import DistributedGroupedDataParallel, clip_grad_norm_
from fmoe.load_balancing import register_bias_update_if_needed
from fmoe.observe.dashboards import Dashboards

BYTES = 256     # the corpus's token ids


def small_config(family: str = "qwen3_moe"):
    """A small random-init Qwen3-MoE or DeepSeek-V3 config over byte tokens (8 experts, top-2)."""
    common = dict(vocab_size=BYTES, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                                           head_dim=16, norm_topk_prob=True)
    if family == "deepseek_v3":
        return transformers.DeepseekV3Config(**common, intermediate_size=128, moe_intermediate_size=64,
                                             n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                                             first_k_dense_replace=1, n_group=2, topk_group=1, kv_lora_rank=16,
                                             q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
    raise ValueError(f"family must be 'qwen3_moe' or 'deepseek_v3', got {family!r}")


def small_model(family: str = "qwen3_moe", seed: int = 0):
    """small_config's causal LM with seeded random weights (save it with save_pretrained to fine-tune it)."""
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(small_config(family))


@dataclass
class FinetuneResult:
    step: int
    first_loss: float
    last_loss: float        # mean over the last `last_window` steps
    last_window: int
    seconds: float
    exported: Path
    history: Path


def load_checkpoint(path: str, seq_len: int, ep_size: int = 1, moe_group=None):
    """The local transformers checkpoint at `path` in fp32, converted to fmoe layers (each EP rank
    loading in turn and keeping its own experts), checked against the byte corpus."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ValueError(f"--hf-model {path!r}: expected a local transformers checkpoint folder with a config.json")
    model = fmoe.integrations.hf.load(folder, ep_size=ep_size, moe_group=moe_group, dtype=torch.float32)
    vocab = model.get_output_embeddings().weight.shape[0]
    if vocab < BYTES:
        raise ValueError(f"--hf-model {path!r}: the model's vocabulary ({vocab}) must hold the corpus's {BYTES} "
                         "byte tokens")
    positions = getattr(model.config, "max_position_embeddings", None)
    if positions is not None and seq_len + 1 > positions:
        raise ValueError(f"--seq-len {seq_len}: a window of seq_len + 1 tokens must fit the model's "
                         f"max_position_embeddings ({positions})")
    return model


def finetune(hf_model: str, cfg: TrainConfig, seq_len: int = 128,
             log: Callable[[str], None] = print) -> FinetuneResult:
    """Fine-tune the checkpoint folder `hf_model` for cfg.steps steps (one process, or a rank of
    torchrun with cfg.ep_size-way expert parallelism) and export it to cfg.out."""
    if cfg.resume:
        raise ValueError("--resume does not apply to --hf-model runs: they save no checkpoint to resume from, "
                         "only the exported model at the end (fine-tune that with --hf-model OUT)")
    if launched_by_torchrun():
        end_with_parent()
    groups = init_distributed(cfg) if launched_by_torchrun() else None
    dashboards = Dashboards(cfg.log, Path(cfg.out), {"hf_model": str(hf_model), "train": asdict(cfg)},
                            write=not groups or dist.get_rank() == 0)
    try:
        return _finetune(hf_model, cfg, seq_len, groups, dashboards, log)
    finally:
        dashboards.close()
        if groups:
            dist.destroy_process_group()


def _finetune(hf_model, cfg, seq_len, groups, dashboards, log) -> FinetuneResult:
    rank = dist.get_rank() if groups else 0
    world = dist.get_world_size() if groups else 1
    log = log if rank == 0 else (lambda message: None)
    device = resolve_device(cfg.device)
    out = Path(cfg.out)
    corpus = load_corpus(cfg.data, seq_len)
    log(f"corpus: {corpus.source}: {corpus.num_files} files, {corpus.num_bytes / 2**20:.2f} MiB"
        f"{' (capped)' if corpus.truncated else ''}")

    model = load_checkpoint(hf_model, seq_len, ep_size=groups.ep_size if groups else 1,
                            moe_group=groups.moe_group if groups else None)
    model.to(device)
    synced = DistributedGroupedDataParallel(model, groups=groups) if groups else None
    optimizer = make_optimizer(model, cfg)
    register_bias_update_if_needed(model, optimizer)
    sampler = BatchSampler(corpus.train_N, cfg.batch_size, seq_len + 1, cfg.seed + 1000 * rank)   # every rank its own
    log(f"model: {type(model).__name__} from {hf_model}, "
        f"{len(fmoe.integrations.hf.converted_blocks(model))} MoE blocks "
        f"converted, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters on this rank, device {device}"
        + (f"; {world} processes, expert-parallel size {groups.ep_size}" if groups else ""))
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    open_dashboards(dashboards)         # the model loaded: what is left is training

    history = {"hf_model": str(hf_model), "train_config": asdict(cfg), "seq_len": seq_len, "step": [], "loss": [],
               "lr": [], "grad_norm": []}
    start = time.perf_counter()
    every = max(1, cfg.steps // 10)
    model.train()
    for step in range(cfg.steps):
        lr = lr_at(step, cfg.steps, cfg.lr)
        for group in optimizer.param_groups:
            group["lr"] = lr
        window_BT = sampler.next()[0].to(device)       # seq_len + 1 bytes: seq_len next-byte predictions
        loss = model(input_ids=window_BT, labels=window_BT).loss      # transformers shifts the labels
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if groups:
            synced.allreduce_params()
            grad_norm = clip_grad_norm_(model, cfg.grad_clip, groups.moe_group)
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        mean = mean_over_ranks(loss.item())
        if not math.isfinite(mean):
            raise FloatingPointError(f"loss became {mean} at step {step + 1}; try a lower --lr")
        optimizer.step()
        for key, value in (("step", step + 1), ("loss", mean), ("lr", lr), ("grad_norm", grad_norm.item())):
            history[key].append(value)
        dashboards.log_step(step + 1, model, {"loss": mean, "lr": lr, "grad_norm": history["grad_norm"][-1]})
        if step % every == 0 or step == cfg.steps - 1:
            log(f"step {step + 1:4d}  loss {mean:.3f}  lr {lr:.2e}")
    seconds = time.perf_counter() - start

    model.eval()
    fmoe.integrations.hf.export(model, out)     # atomic per file; every rank sends its experts
    history_path = out / "history.json"
    if rank == 0:
        write_json(history_path, history)
    losses = history["loss"]
    return FinetuneResult(step=cfg.steps, first_loss=losses[0], last_loss=sum(losses[-10:]) / len(losses[-10:]),
                          last_window=len(losses[-10:]), seconds=seconds, exported=out, history=history_path)
