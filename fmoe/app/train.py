"""`fmoe train`: train the byte-level MoE GPT, then evaluate, checkpoint, plot and sample.

The loop, its learning rate and optimizer, and saving and resuming are here; the run's options,
processes, precision and signals are `fmoe.app.runtime`, what it reports besides the loss
`fmoe.app.evaluation`. Their names are importable from here too (the old `fmoe.train` held them all);
a test that patches `autocast` patches it in `fmoe.app.runtime`, where the steps look it up.

About 420 lines in one module: the Trainer's step, save and resume share its state (the model, the
optimizer, the sampler, the history) and are read together.
"""
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict

import torch
import torch.distributed as dist

from fmoe.app import checkpoints, runtime
from fmoe.app.data import BatchSampler, load_corpus
from fmoe.app.evaluation import (evaluate, harmonic_mean, imbalance, load_share, open_dashboards,  # noqa: F401
                                 plot_history, sample_text, smoothed)
from fmoe.app.files import WriteError, check_writable_folder, save_torch, write_json
from fmoe.app.gpt import GPT, GPTConfig, check_training_fits
from fmoe.app.runtime import (FAULT_PHASES, Interrupted, StopOnSignal, TrainConfig, all_ranks_agree,  # noqa: F401
                              autocast, end_with_parent, init_distributed, launched_by_torchrun, mean_over_ranks,
                              parse_fault, resolve_device)
from fmoe.distributed import checkpoint as sharded
from fmoe.distributed.ddp import DistributedGroupedDataParallel, clip_grad_norm_
from fmoe.distributed.interleave import interleave_micro_batches
from fmoe.layer import collect_aux_loss
from fmoe.load_balancing import register_bias_update_if_needed
from fmoe.observe.dashboards import Dashboards

WARMUP_FRACTION = 0.1
MIN_LR_RATIO = 0.1


@dataclass
class TrainResult:
    step: int
    first_loss: float
    last_loss: float        # mean over the last `last_window` steps
    last_window: int
    val_loss: float
    tokens_per_s: float
    load_imbalance: float
    seconds: float
    checkpoint: Path
    history: Path
    plot: Path
    sample: str


def lr_at(step: int, total: int, peak: float) -> float:
    """Linear warmup over the first WARMUP_FRACTION of the steps, then cosine down to MIN_LR_RATIO * peak."""
    warmup = max(1, int(total * WARMUP_FRACTION))
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: GPT, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on weight matrices and expert weight stacks only, not on norms or biases."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))


def new_history(model_cfg: GPTConfig, cfg: TrainConfig) -> dict:
    return {"model_config": asdict(model_cfg), "train_config": asdict(cfg), "step": [], "loss": [], "aux_loss": [],
            "lr": [], "grad_norm": [], "tokens_per_s": [], "load_share": [], "val_loss": []}


def resumed_model_config(saved: dict, asked: GPTConfig, flags: Dict[str, str]) -> GPTConfig:
    """The checkpoint's model config; an option the user gave (`flags`) must agree with it."""
    saved = GPTConfig(**saved)
    for name, option in flags.items():
        if getattr(asked, name) != getattr(saved, name):
            raise ValueError(f"--resume: {option} {getattr(asked, name)} differs from the checkpoint's "
                             f"{getattr(saved, name)!r}: drop {option} to continue the checkpoint's model, "
                             "or train a new one in another --out")
    return saved


class Trainer:
    """One run: the model, its optimizer and data stream, and the history, set up fresh or from a checkpoint."""

    def __init__(self, cfg: TrainConfig, model_cfg: GPTConfig, log: Callable[[str], None] = print):
        self.cfg = cfg
        if launched_by_torchrun():
            end_with_parent()
        self.groups = init_distributed(cfg) if launched_by_torchrun() else None
        self.rank = dist.get_rank() if self.groups else 0
        self.world = dist.get_world_size() if self.groups else 1
        self.log = log if self.rank == 0 else (lambda message: None)
        self.device = resolve_device(cfg.device)
        self.out = check_writable_folder(cfg.out, "--out")      # before any step, not at the first save
        self.fault = parse_fault(os.environ.get("FMOE_FAULT"))
        # One file in one process; sharded step folders (resharding on load) on several. Either resumes either.
        self.file_path, self.folder_root = self.out / "checkpoint.pt", self.out / "checkpoint"
        self.ckpt_path = self.folder_root if self.groups else self.file_path
        state = self.read_checkpoint() if cfg.resume else None
        if state is not None:
            model_cfg = resumed_model_config(state["model_config"], model_cfg, cfg.model_flags)
        self.model_cfg = model_cfg
        self.corpus = load_corpus(cfg.data, model_cfg.seq_len)
        self.log(f"corpus: {self.corpus.source}: {self.corpus.num_files} files, {self.corpus.num_bytes / 2**20:.2f} MiB"
            f"{' (capped)' if self.corpus.truncated else ''}")

        check_training_fits(model_cfg, self.device, cfg.ep_size, cfg.model_flags)     # a resumed config too
        torch.manual_seed(cfg.seed)
        if self.groups:
            self.model = GPT(model_cfg, self.groups.ep_size, self.groups.moe_group, fp8=cfg.fp8)
            # Experts on different ranks are different experts: each expert-parallel rank draws its own.
            torch.manual_seed(cfg.seed + 1 + dist.get_rank(self.groups.moe_group))
            for layer in self.model.moe_layers():
                layer.experts.reset_parameters()
            self.model.to(self.device)
            self.synced = DistributedGroupedDataParallel(self.model, groups=self.groups)
        else:
            self.model = GPT(model_cfg, fp8=cfg.fp8).to(self.device)
        if cfg.compile:
            self.model.compile()
        self.optimizer = make_optimizer(self.model, cfg)
        register_bias_update_if_needed(self.model, self.optimizer)     # a balancing bias moves once per step
        # Every rank reads its own batches.
        self.sampler = BatchSampler(self.corpus.train_N, cfg.batch_size, model_cfg.seq_len,
                                    cfg.seed + 1000 * self.rank)
        self.history = new_history(model_cfg, cfg)
        self.step = self.saved_step = 0
        if state is not None:
            self.restore(state)
            self.saved_step = self.step
            self.log(f"resumed from {self.resumed_from} at step {self.step} (model config from the checkpoint)")
        num_params = sum(p.numel() for p in self.model.parameters())
        self.log(f"model: {num_params / 1e6:.2f}M parameters on this rank, {model_cfg.n_layer} layers x "
                 f"{model_cfg.num_expert} experts (top-{model_cfg.top_k}, {model_cfg.gate} gate), device {self.device}"
                 + (f"; {self.world} processes, expert-parallel size {self.groups.ep_size}" if self.groups else ""))
        self.dashboards = Dashboards(cfg.log, self.out, {"model": asdict(model_cfg), "train": asdict(cfg)},
                                     write=self.rank == 0)
        open_dashboards(self.dashboards)

    def checkpoint_source(self) -> Path:
        """--resume-from, else the newest of checkpoint.pt and checkpoint/latest (whatever process count wrote it)."""
        if self.cfg.resume_from:
            return Path(self.cfg.resume_from)
        found = [p for p in (self.file_path, self.folder_root / checkpoints.LATEST) if p.exists()]
        if not found:
            raise ValueError(f"--resume: no checkpoint at {self.ckpt_path} (nor {self.file_path.name} or "
                             f"{self.folder_root.name}/ in {self.out}); train without --resume first, "
                             "or pass that run's --out")
        newest = max(found, key=lambda p: p.stat().st_mtime)
        return checkpoints.latest_folder(self.folder_root) if newest.name == checkpoints.LATEST else newest

    def read_checkpoint(self) -> dict:
        source = self.checkpoint_source()
        if source.is_dir() or not source.suffix:
            folder = checkpoints.load_folder(source.parent, source)
            state = checkpoints.read_torch(folder / checkpoints.TRAINER_FILE)
            rng_path = folder / f"rng-rank{self.rank}.pt"
            if rng_path.exists():
                state.update(checkpoints.read_torch(rng_path))
            else:       # resumed on more processes than saved it: this rank's batches start afresh
                self.log(f"note: {rng_path.name} is missing; rank {self.rank} draws fresh batches")
        else:
            state = checkpoints.load_file(source)
            if self.rank > 0:       # one process saved it: its random states are rank 0's
                self.log(f"note: rank {self.rank} draws fresh batches")
                state = {k: v for k, v in state.items() if not k.endswith("_rng")}
        if state["step"] >= self.cfg.steps:
            raise ValueError(f"--resume: the checkpoint is already at step {state['step']}; --steps (the total) "
                             f"must be larger, got {self.cfg.steps}")
        self.resumed_from = source
        return state

    def restore(self, state: dict):
        if "model" not in state:
            sharded.load_checkpoint(str(self.resumed_from), self.model, self.optimizer)
        elif self.groups and self.groups.ep_size > 1:
            self.load_full_state_into_shard(state)
        else:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        if "sampler_rng" in state:
            self.set_random_states(state)
        self.history, self.step = state["history"], state["step"]

    def load_full_state_into_shard(self, state: dict):
        """A one-process checkpoint on an expert-parallel rank: keep this rank's slice of every expert stack."""
        first = {}      # local expert stack -> its first global expert
        for layer in self.model.moe_layers():
            for p in layer.experts.parameters():
                first[p] = layer.moe_rank * layer.num_expert

        def local(value, p):
            if p in first and isinstance(value, torch.Tensor) and value.dim() > 0:
                return value[first[p]:first[p] + p.shape[0]].clone()
            return value

        params = dict(self.model.named_parameters())
        self.model.load_state_dict({k: local(v, params.get(k)) for k, v in state["model"].items()})
        ordered = [p for group in self.optimizer.param_groups for p in group["params"]]
        optim = state["optimizer"]
        self.optimizer.load_state_dict({**optim, "state": {i: {k: local(v, ordered[i]) for k, v in s.items()}
                                                           for i, s in optim["state"].items()}})

    def random_states(self) -> dict:
        return {"sampler_rng": self.sampler.generator.get_state(), "torch_rng": torch.get_rng_state(),
                "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}

    def set_random_states(self, states: dict):
        self.sampler.generator.set_state(states["sampler_rng"])
        torch.set_rng_state(states["torch_rng"])
        if states["cuda_rng"] and self.device.type == "cuda":
            torch.cuda.set_rng_state_all(states["cuda_rng"])

    def save(self):
        self.history["train_config"] = asdict(self.cfg)
        if self.groups:
            self.save_sharded()
        else:
            state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                     "model_config": asdict(self.model_cfg), "train_config": asdict(self.cfg), "step": self.step,
                     **self.random_states(), "history": self.history}
            checkpoints.save_file(self.file_path, state, self.cfg.keep)
            self.fault_point("save", self.step)
        self.saved_step = self.step
        return self.write_history()

    def save_sharded(self):
        """A new step folder: every rank writes its experts (by global id) and random states, rank 0 the
        trainer state, then (all written) the manifest of checksums and the `latest` pointer."""
        folder = [checkpoints.new_step_folder(self.folder_root, self.step) if self.rank == 0 else None]
        dist.broadcast_object_list(folder)
        folder = folder[0]
        failure = None
        try:
            sharded.save_checkpoint(str(folder), self.model, self.optimizer)
            save_torch(folder / f"rng-rank{self.rank}.pt", self.random_states())
            if self.rank == 0:
                save_torch(folder / checkpoints.TRAINER_FILE, {"model_config": asdict(self.model_cfg),
                                                   "train_config": asdict(self.cfg), "step": self.step,
                                                   "history": self.history})
        except OSError as err:
            failure = err
        self.fault_point("save", self.step)
        if not all_ranks_agree(failure is None):      # nobody publishes a folder that lacks a rank's part
            if self.rank == 0:
                shutil.rmtree(folder, ignore_errors=True)
            raise failure or WriteError(f"another rank could not write its part of {folder}; the previous "
                                        "checkpoint is unchanged")
        if self.rank == 0:
            checkpoints.write_manifest(folder, self.step, {"model_config": asdict(self.model_cfg),
                                                           "train_config": asdict(self.cfg), "world_size": self.world,
                                                           "ep_size": self.groups.ep_size})
            checkpoints.publish(self.folder_root, folder, self.cfg.keep)
        dist.barrier()

    def write_history(self):
        history_path, plot_path = self.out / "history.json", self.out / "training.png"
        if self.rank == 0:
            write_json(history_path, self.history)
            plot_history(self.history, plot_path)
        return history_path, plot_path

    def abort_step(self):
        """After an abort inside a step: before the update the step is undone and saved, so --resume is exact."""
        if self.updating or self.groups:        # a sharded save needs every rank, which are mid-step
            self.log(f"aborted inside step {self.step + 1}; the last checkpoint is from step {self.saved_step}")
            return
        self.set_random_states(self.step_start_states)
        self.optimizer.zero_grad(set_to_none=True)
        if self.step > self.saved_step:
            self.save()
        self.log(f"interrupted at step {self.step}: saved {self.ckpt_path}; continue with --resume")

    def fault_point(self, phase: str, step: int):
        """Test hook: FMOE_FAULT=phase:step:SIGNAL[:rank] sends SIGNAL to this process at that instant."""
        if self.fault and self.fault[:2] == (phase, step) and self.fault[3] in (None, self.rank):
            os.kill(os.getpid(), self.fault[2])

    def interleaved_forward_backward(self, x_BT, y_BT):
        """--overlap: the batch as two micro-batches of half of it, interleaved; each backward takes half
        of its loss, so the gradients are the whole batch's mean (its cross-entropy exactly, its balance
        losses each half's). The step's loss and aux loss: the halves' means."""
        self.optimizer.zero_grad(set_to_none=True)
        self.fault_point("forward", self.step + 1)
        half = len(x_BT) // 2

        def micro_batch(rows):
            with runtime.autocast(self.device):
                _, loss = self.model(x_BT[rows], y_BT[rows])
            aux = collect_aux_loss(self.model).detach()       # this micro-batch's (kept per micro-batch)
            (loss / 2).backward()
            return loss.detach(), aux

        (loss_a, aux_a), (loss_b, aux_b) = interleave_micro_batches(self.model, micro_batch,
                                                                      [slice(0, half), slice(half, None)])
        return (loss_a + loss_b) / 2, (aux_a + aux_b) / 2

    def train_step(self) -> dict:
        """One optimizer step; returns what the history keeps of it."""
        step_start = time.perf_counter()
        self.step_start_states, self.updating = self.random_states(), False
        lr = lr_at(self.step, self.cfg.steps, self.cfg.lr)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        x_BT, y_BT = (t.to(self.device) for t in self.sampler.next())
        if self.cfg.overlap:
            loss, aux = self.interleaved_forward_backward(x_BT, y_BT)
        else:
            self.fault_point("forward", self.step + 1)
            with runtime.autocast(self.device):
                _, loss = self.model(x_BT, y_BT)
            self.optimizer.zero_grad(set_to_none=True)
            self.fault_point("backward", self.step + 1)
            loss.backward()
            aux = collect_aux_loss(self.model)
        if self.groups:
            self.synced.allreduce_params()
            grad_norm = clip_grad_norm_(self.model, self.cfg.grad_clip, self.groups.moe_group)
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        aux = mean_over_ranks(aux.item())
        ce = mean_over_ranks(loss.item()) - self.model_cfg.aux_coef * aux
        if not math.isfinite(ce):
            raise FloatingPointError(f"loss became {ce} at step {self.step + 1}; try a lower --lr, or check "
                                     "the data and --aux-coef")
        share = load_share(self.model).tolist()
        # From here to the end of the step the state is half new: an abort here cannot be rolled back.
        self.updating = True
        self.optimizer.step()
        self.fault_point("optimizer", self.step + 1)
        self.step += 1
        self.fault_point("step", self.step)
        record = {"step": self.step, "loss": ce, "aux_loss": aux, "lr": lr, "grad_norm": grad_norm.item(),
                  "tokens_per_s": x_BT.numel() * self.world / (time.perf_counter() - step_start), "load_share": share}
        for key, value in record.items():
            self.history[key].append(value)
        self.dashboards.log_step(self.step, self.model,
                                 {k: v for k, v in record.items() if k not in ("step", "load_share")})
        self.updating = False
        return record

    def run(self, progress: bool = True) -> TrainResult:
        """Train up to cfg.steps, then evaluate, save, plot and sample. SIGINT / SIGTERM finish the current
        step on every rank, save a checkpoint to resume from and raise Interrupted."""
        from tqdm import tqdm

        start_time, start_records = time.perf_counter(), len(self.history["tokens_per_s"])
        self.model.train()
        bar = tqdm(total=self.cfg.steps, initial=self.step, desc="train", disable=not progress or self.rank > 0,
                   dynamic_ncols=True)
        with StopOnSignal() as stop:
            while self.step < self.cfg.steps:
                try:
                    record = self.train_step()
                except KeyboardInterrupt:       # raised inside a step (a second Ctrl-C): roll it back if it can be
                    bar.close()
                    self.abort_step()
                    raise
                bar.update()
                tokens_per_s = harmonic_mean(self.history["tokens_per_s"][start_records:])
                bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{tokens_per_s:,.0f}",
                                load=f"{imbalance(torch.tensor(record['load_share'])):.2f}", refresh=False)
                stopping = not all_ranks_agree(stop.signum is None)
                if stopping or (self.cfg.save_every and self.step % self.cfg.save_every == 0):
                    self.save()
                if stopping:
                    bar.close()
                    self.log(f"interrupted at step {self.step}: saved {self.ckpt_path}; continue with --resume")
                    raise Interrupted
            bar.close()

            val_sampler = BatchSampler(self.corpus.val_N, self.cfg.batch_size, self.model_cfg.seq_len,
                                       self.cfg.seed + 1)
            self.fault_point("validation", self.step)
            val_loss = evaluate(self.model, val_sampler, self.cfg.eval_batches, self.device)
            self.history["val_loss"].append([self.step, val_loss])
            self.dashboards.log({"val/loss": val_loss}, self.step)
            history_path, plot_path = self.save()
            if not all_ranks_agree(stop.signum is None):
                self.log(f"interrupted after the final checkpoint ({self.ckpt_path}, step {self.step})")
                raise Interrupted
        losses = self.history["loss"]
        return TrainResult(
            step=self.step,
            first_loss=losses[0],
            last_loss=sum(losses[-10:]) / len(losses[-10:]),
            last_window=len(losses[-10:]),
            val_loss=val_loss,
            tokens_per_s=harmonic_mean(self.history["tokens_per_s"][start_records:]),
            load_imbalance=imbalance(torch.tensor(self.history["load_share"][-1])),
            seconds=time.perf_counter() - start_time,
            checkpoint=self.ckpt_path,
            history=history_path,
            plot=plot_path,
            sample=sample_text(self.model, self.cfg.prompt, self.cfg.sample_bytes, self.cfg.seed, self.device),
        )


def train(cfg: TrainConfig, model_cfg: GPTConfig, log: Callable[[str], None] = print,
          progress: bool = True) -> TrainResult:
    """Train (with cfg.resume, continue up to cfg.steps in all) and write the run's outputs to cfg.out."""
    trainer = Trainer(cfg, model_cfg, log)
    try:
        return trainer.run(progress)
    finally:
        trainer.dashboards.close()
        if trainer.groups:
            dist.destroy_process_group()
