"""`fmoe train`: train the byte-level MoE GPT, then evaluate, checkpoint, plot and sample."""
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fmoe.data import BatchSampler, load_corpus
from fmoe.distributed import checkpoint as sharded
from fmoe.distributed.ddp import DistributedGroupedDataParallel, clip_grad_norm_
from fmoe.distributed.groups import make_groups
from fmoe.gpt import GPT, GPTConfig
from fmoe.layer import collect_aux_loss

WARMUP_FRACTION = 0.1
MIN_LR_RATIO = 0.1


@dataclass
class TrainConfig:
    steps: int = 400
    batch_size: int = 32
    lr: float = 3e-3
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    device: str = "auto"
    data: Optional[str] = None
    out: str = "runs/fmoe-train"
    resume: bool = False
    eval_batches: int = 20
    sample_bytes: int = 100
    prompt: str = "def "
    ep_size: int = 1            # expert-parallel size when launched on several processes
    compile: bool = False       # torch.compile the model (nn.Module.compile: same state_dict keys)

    def __post_init__(self):
        for name in ("steps", "batch_size", "eval_batches", "ep_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive int, got {value!r}")
        if not self.lr > 0:
            raise ValueError(f"--lr must be > 0, got {self.lr!r}")


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


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "LOCAL_RANK" in os.environ


def init_distributed(cfg: TrainConfig):
    """One rank of `torchrun`: NCCL on GPUs, gloo on CPUs; the expert-parallel groups; a share of the cores."""
    cuda = torch.cuda.is_available() and cfg.device != "cpu"
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    dist.init_process_group("nccl" if cuda else "gloo")
    world = dist.get_world_size()
    if world % cfg.ep_size:
        raise ValueError(f"--ep-size ({cfg.ep_size}) must divide the number of processes ({world})")
    return make_groups(cfg.ep_size)


def mean_over_ranks(value: float) -> float:
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.double)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {name!r}") from err
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {name!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name!r}: CUDA is not available here; use --device cpu")
    return device


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


def load_share(model: GPT) -> torch.Tensor:
    """Each expert's share of the routed rows in the last forward (all ranks): [n_layer, num_expert], rows sum to 1."""
    loads_LE = model.expert_loads()
    if dist.is_initialized():
        dist.all_reduce(loads_LE)
    return loads_LE / loads_LE.sum(-1, keepdim=True).clamp_min(1)


def imbalance(share_LE: torch.Tensor) -> float:
    """max / mean load over the experts, averaged over layers: 1.0 is perfectly balanced."""
    return (share_LE.max(-1).values * share_LE.shape[-1]).mean().item()


def autocast(device: torch.device):
    # bf16 autocast where it pays (CUDA); CPU runs plain fp32.
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


@torch.no_grad()
def evaluate(model: GPT, sampler: BatchSampler, batches: int, device: torch.device) -> float:
    model.eval()
    total = 0.0
    for _ in range(batches):
        x_BT, y_BT = (t.to(device) for t in sampler.next())
        with autocast(device):
            logits_BTV, _ = model(x_BT)
        total += F.cross_entropy(logits_BTV.float().flatten(0, 1), y_BT.flatten()).item()
    model.train()
    return mean_over_ranks(total / batches)


def sample_text(model: GPT, prompt: str, num_bytes: int, seed: int, device: torch.device) -> str:
    model.eval()
    idx_1P = torch.tensor([list(prompt.encode() or b"\n")], dtype=torch.long, device=device)
    with autocast(device):
        out_1T = model.generate(idx_1P, num_bytes, generator=torch.Generator().manual_seed(seed))
    model.train()
    return bytes(out_1T[0].tolist()).decode("utf-8", errors="replace")


def new_history(model_cfg: GPTConfig, cfg: TrainConfig) -> dict:
    return {"model_config": asdict(model_cfg), "train_config": asdict(cfg), "step": [], "loss": [], "aux_loss": [],
            "lr": [], "grad_norm": [], "tokens_per_s": [], "load_share": [], "val_loss": []}


def load_checkpoint(path: Path, steps: int) -> dict:
    if not path.exists():
        raise ValueError(f"--resume: no checkpoint at {path}; train without --resume first, or pass that run's --out")
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state["step"] >= steps:
        raise ValueError(f"--resume: the checkpoint is already at step {state['step']}; --steps (the total) "
                         f"must be larger, got {steps}")
    return state


def smoothed(values, decay: float = 0.9):
    """Exponential moving average, debiased so the first points are not pulled toward 0."""
    out, avg = [], 0.0
    for i, v in enumerate(values):
        avg = decay * avg + (1 - decay) * v
        out.append(avg / (1 - decay ** (i + 1)))
    return out


def plot_history(history: dict, path: Path):
    """Loss per step on the left, each expert's load share per step (layer by layer) on the right."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax_loss, ax_load = fig.subplots(1, 2)
    ax_loss.plot(history["step"], history["loss"], lw=0.6, alpha=0.4, color="C0", label="train (cross-entropy)")
    ax_loss.plot(history["step"], smoothed(history["loss"]), color="C0", label="train, smoothed")
    if history["val_loss"]:
        val_steps, val_losses = zip(*history["val_loss"])
        ax_loss.plot(val_steps, val_losses, "o", color="C3", label="validation")
    ax_loss.set(xlabel="step", ylabel="loss (nats/byte)", title="loss")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend()

    share_SLE = torch.tensor(history["load_share"])
    S, L, E = share_SLE.shape
    extent = (history["step"][0] - 0.5, history["step"][-1] + 0.5, L * E - 0.5, -0.5)
    image = ax_load.imshow(share_SLE.permute(1, 2, 0).reshape(L * E, S).numpy(), aspect="auto",
                           interpolation="nearest", cmap="viridis", vmin=0, extent=extent)
    for layer in range(1, L):
        ax_load.axhline(layer * E - 0.5, color="white", lw=1)
    ax_load.set_yticks([layer * E + (E - 1) / 2 for layer in range(L)], [f"layer {layer}" for layer in range(L)])
    ax_load.set(xlabel="step", title=f"expert load share ({E} experts per layer, balanced = {1 / E:.3f})")
    fig.colorbar(image, ax=ax_load, label="share of routed rows")
    fig.savefig(path, dpi=100)


class Trainer:
    """One run: the model, its optimizer and data stream, and the history, set up fresh or from a checkpoint."""

    def __init__(self, cfg: TrainConfig, model_cfg: GPTConfig, log: Callable[[str], None] = print):
        self.cfg = cfg
        self.groups = init_distributed(cfg) if launched_by_torchrun() else None
        self.rank = dist.get_rank() if self.groups else 0
        self.world = dist.get_world_size() if self.groups else 1
        self.log = log if self.rank == 0 else (lambda message: None)
        self.device = resolve_device(cfg.device)
        self.out = Path(cfg.out)
        # One file in one process; a sharded checkpoint folder (resharding on load) on several.
        self.ckpt_path = self.out / ("checkpoint" if self.groups else "checkpoint.pt")
        state = self.read_checkpoint() if cfg.resume else None
        if state is not None:
            model_cfg = GPTConfig(**state["model_config"])
        self.model_cfg = model_cfg
        self.corpus = load_corpus(cfg.data, model_cfg.seq_len)
        self.log(f"corpus: {self.corpus.source}: {self.corpus.num_files} files, {self.corpus.num_bytes / 2**20:.2f} MiB"
            f"{' (capped)' if self.corpus.truncated else ''}")

        torch.manual_seed(cfg.seed)
        if self.groups:
            self.model = GPT(model_cfg, self.groups.ep_size, self.groups.moe_group)
            # Experts on different ranks are different experts: each expert-parallel rank draws its own.
            torch.manual_seed(cfg.seed + 1 + dist.get_rank(self.groups.moe_group))
            for layer in self.model.moe_layers():
                layer.experts.reset_parameters()
            self.model.to(self.device)
            self.synced = DistributedGroupedDataParallel(self.model, groups=self.groups)
        else:
            self.model = GPT(model_cfg).to(self.device)
        if cfg.compile:
            self.model.compile()
        self.optimizer = make_optimizer(self.model, cfg)
        # Every rank reads its own batches.
        self.sampler = BatchSampler(self.corpus.train_N, cfg.batch_size, model_cfg.seq_len,
                                    cfg.seed + 1000 * self.rank)
        self.history = new_history(model_cfg, cfg)
        self.step = 0
        if state is not None:
            self.restore(state)
            self.log(f"resumed from {self.ckpt_path} at step {self.step} (model config from the checkpoint)")
        num_params = sum(p.numel() for p in self.model.parameters())
        self.log(f"model: {num_params / 1e6:.2f}M parameters on this rank, {model_cfg.n_layer} layers x "
                 f"{model_cfg.num_expert} experts (top-{model_cfg.top_k}, {model_cfg.gate} gate), device {self.device}"
                 + (f"; {self.world} processes, expert-parallel size {self.groups.ep_size}" if self.groups else ""))

    def read_checkpoint(self) -> dict:
        if not self.groups:
            return load_checkpoint(self.ckpt_path, self.cfg.steps)
        state = load_checkpoint(self.ckpt_path / "trainer.pt", self.cfg.steps)
        rng_path = self.ckpt_path / f"rng-rank{self.rank}.pt"
        if rng_path.exists():
            state.update(torch.load(rng_path, weights_only=True))
        else:       # resumed on more processes than saved it: this rank's batches start afresh
            self.log(f"note: {rng_path.name} is missing; rank {self.rank} draws fresh batches")
        return state

    def restore(self, state: dict):
        if self.groups:
            sharded.load_checkpoint(str(self.ckpt_path), self.model, self.optimizer)
        else:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        if "sampler_rng" not in state:
            self.history, self.step = state["history"], state["step"]
            return
        self.sampler.generator.set_state(state["sampler_rng"])
        torch.set_rng_state(state["torch_rng"])
        if state["cuda_rng"] and self.device.type == "cuda":
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        self.history, self.step = state["history"], state["step"]

    def save(self):
        self.history["train_config"] = asdict(self.cfg)
        if self.groups:
            return self.save_sharded()
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "model_config": asdict(self.model_cfg),
            "train_config": asdict(self.cfg),
            "step": self.step,
            "sampler_rng": self.sampler.generator.get_state(),
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "history": self.history,
        }
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.ckpt_path.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, self.ckpt_path)     # a run killed while saving leaves the previous checkpoint whole
        return self.write_history()

    def save_sharded(self):
        """Every rank writes its experts (by global id) and its random states; rank 0 the rest."""
        sharded.save_checkpoint(str(self.ckpt_path), self.model, self.optimizer)
        rng = {"sampler_rng": self.sampler.generator.get_state(), "torch_rng": torch.get_rng_state(),
               "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}
        torch.save(rng, self.ckpt_path / f"rng-rank{self.rank}.pt")
        if self.rank == 0:
            torch.save({"model_config": asdict(self.model_cfg), "train_config": asdict(self.cfg), "step": self.step,
                        "history": self.history}, self.ckpt_path / "trainer.pt")
        dist.barrier()
        return self.write_history()

    def write_history(self):
        history_path, plot_path = self.out / "history.json", self.out / "training.png"
        if self.rank == 0:
            history_path.write_text(json.dumps(self.history))
            plot_history(self.history, plot_path)
        return history_path, plot_path

    def train_step(self) -> dict:
        """One optimizer step; returns what the history keeps of it."""
        step_start = time.perf_counter()
        lr = lr_at(self.step, self.cfg.steps, self.cfg.lr)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        x_BT, y_BT = (t.to(self.device) for t in self.sampler.next())
        with autocast(self.device):
            _, loss = self.model(x_BT, y_BT)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.groups:
            self.synced.allreduce_params()
            grad_norm = clip_grad_norm_(self.model, self.cfg.grad_clip, self.groups.moe_group)
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.step += 1

        aux = mean_over_ranks(collect_aux_loss(self.model).item())
        ce = mean_over_ranks(loss.item()) - self.model_cfg.aux_coef * aux
        if not math.isfinite(ce):
            raise FloatingPointError(f"loss became {ce} at step {self.step}; try a lower --lr")
        tokens_per_s = x_BT.numel() * self.world / (time.perf_counter() - step_start)
        record = {"step": self.step, "loss": ce, "aux_loss": aux, "lr": lr, "grad_norm": grad_norm.item(),
                  "tokens_per_s": tokens_per_s, "load_share": load_share(self.model).tolist()}
        for key, value in record.items():
            self.history[key].append(value)
        return record

    def run(self, progress: bool = True) -> TrainResult:
        """Train up to cfg.steps, then evaluate, save, plot and sample. Ctrl-C saves a checkpoint to resume from."""
        from tqdm import tqdm

        start_time, start_step = time.perf_counter(), self.step
        self.model.train()
        bar = tqdm(total=self.cfg.steps, initial=self.step, desc="train", disable=not progress or self.rank > 0,
                   dynamic_ncols=True)
        try:
            while self.step < self.cfg.steps:
                record = self.train_step()
                bar.update()
                tokens_per_s = harmonic_mean(self.history["tokens_per_s"][start_step:])
                bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{tokens_per_s:,.0f}",
                                load=f"{imbalance(torch.tensor(record['load_share'])):.2f}", refresh=False)
        except KeyboardInterrupt:
            bar.close()
            if self.step > start_step and not self.groups:      # a sharded save needs every rank
                self.save()
                self.log(f"interrupted at step {self.step}: saved {self.ckpt_path}; continue with --resume")
            raise
        bar.close()

        val_sampler = BatchSampler(self.corpus.val_N, self.cfg.batch_size, self.model_cfg.seq_len, self.cfg.seed + 1)
        val_loss = evaluate(self.model, val_sampler, self.cfg.eval_batches, self.device)
        self.history["val_loss"].append([self.step, val_loss])
        history_path, plot_path = self.save()
        losses = self.history["loss"]
        return TrainResult(
            step=self.step,
            first_loss=losses[0],
            last_loss=sum(losses[-10:]) / len(losses[-10:]),
            last_window=len(losses[-10:]),
            val_loss=val_loss,
            tokens_per_s=harmonic_mean(self.history["tokens_per_s"][start_step:]),
            load_imbalance=imbalance(torch.tensor(self.history["load_share"][-1])),
            seconds=time.perf_counter() - start_time,
            checkpoint=self.ckpt_path,
            history=history_path,
            plot=plot_path,
            sample=sample_text(self.model, self.cfg.prompt, self.cfg.sample_bytes, self.cfg.seed, self.device),
        )


def harmonic_mean(rates):
    """Tokens/s over several equal-sized steps: total tokens over total time."""
    return len(rates) / sum(1 / r for r in rates)


def train(cfg: TrainConfig, model_cfg: GPTConfig, log: Callable[[str], None] = print,
          progress: bool = True) -> TrainResult:
    """Train (with cfg.resume, continue up to cfg.steps in all) and write the run's outputs to cfg.out."""
    trainer = Trainer(cfg, model_cfg, log)
    try:
        return trainer.run(progress)
    finally:
        if trainer.groups:
            dist.destroy_process_group()
