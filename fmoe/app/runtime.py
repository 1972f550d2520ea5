"""What a training run stands on: its options (`TrainConfig`), its processes (torchrun ranks, process
groups, device), its precision (`autocast`), and what stops it (signals, the parent's death, the
FMOE_FAULT test hook). `fmoe.app.train` runs the loop on these."""
import math
import os
import signal
from dataclasses import dataclass, field
from typing import Dict, Optional

import torch
import torch.distributed as dist

from fmoe.distributed.groups import make_groups
from fmoe.distributed.timeout import collective_timeout
from fmoe.kernels.fp8 import RECIPES as FP8_RECIPES
from fmoe.observe.dashboards import parse_log


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
    save_every: int = 0         # also save every this many steps (0: only at the end and on a signal)
    keep: int = 2               # checkpoints kept: the newest and keep - 1 before it
    resume_from: Optional[str] = None   # a checkpoint.pt or step folder to resume from instead of the newest
    log: Optional[str] = None   # dashboards: tensorboard, wandb, both or none (None: tensorboard when installed)
    # Each step's batch as two micro-batches interleaved (fmoe.interleave_micro_batches): one's exchanges
    # travel while the other computes
    overlap: bool = False
    # The experts' GEMMs in this FP8 recipe (fmoe.kernels.fp8.RECIPES; None: off). No FP8 state is saved: a
    # run resumes with or without it.
    fp8: Optional[str] = None
    # The model options the user gave (GPTConfig field -> its flag): a resumed run refuses one that
    # differs from the checkpoint's; the others take the checkpoint's values.
    model_flags: Dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        for name in ("steps", "batch_size", "eval_batches", "ep_size", "keep", "save_every", "sample_bytes"):
            value = getattr(self, name)
            low = 0 if name in ("save_every", "sample_bytes") else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"--{name.replace('_', '-')} must be an int >= {low}, got {value!r}")
        for name, low, strict in (("lr", 0.0, True), ("weight_decay", 0.0, False), ("grad_clip", 0.0, True)):
            value = getattr(self, name)
            if (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)
                    or value < low or (strict and value == low)):
                raise ValueError(f"--{name.replace('_', '-')} must be a finite number {'>' if strict else '>='} "
                                 f"{low:g}, got {value!r}")
        if self.overlap and self.batch_size % 2:
            raise ValueError(f"--overlap runs each batch as two micro-batches of half of it: --batch-size must be "
                             f"even, got {self.batch_size}")
        if self.fp8 is not None and self.fp8 not in FP8_RECIPES:
            raise ValueError(f"--fp8 must be one of {', '.join(FP8_RECIPES)}, got {self.fp8!r}")
        if self.resume_from is not None:
            self.resume = True
        parse_log(self.log)


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "LOCAL_RANK" in os.environ


def init_distributed(cfg: TrainConfig):
    """One rank of `torchrun`: NCCL on GPUs, gloo on CPUs; the expert-parallel groups; a share of the cores."""
    cuda = torch.cuda.is_available() and cfg.device != "cpu"
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    # Every collective of the run is bounded (FMOE_COLLECTIVE_TIMEOUT): a stopped rank fails the others.
    dist.init_process_group("nccl" if cuda else "gloo", timeout=collective_timeout())
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


def all_ranks_agree(flag: bool) -> bool:
    """True on every rank only if `flag` is true on every rank (one tiny all-reduce)."""
    if not dist.is_initialized():
        return flag
    t = torch.tensor([0 if flag else 1])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item() == 0


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


def autocast(device: torch.device):
    # bf16 autocast where it pays (CUDA; the MoE layers' expert GEMMs included); CPU runs plain fp32.
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM, after the current step finished and a checkpoint was saved."""


class StopOnSignal:
    """While active, SIGINT and SIGTERM only note the request; the training loop stops at the end of the step.
    A second signal aborts at once (the checkpoints already on disk stay whole)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signum = None

    def handle(self, signum, frame):
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum

    def __enter__(self):
        self.previous = {s: signal.signal(s, self.handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def end_with_parent(sig=signal.SIGTERM):
    """Linux: get `sig` when the parent process dies, so killing a launcher ends its ranks."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig))    # PR_SET_PDEATHSIG
    except (OSError, AttributeError):       # not Linux: nothing to arm
        return
    if os.getppid() == 1:                   # the parent died before the arm
        os.kill(os.getpid(), sig)


FAULT_PHASES = ("forward", "backward", "optimizer", "step", "validation", "save")


def parse_fault(spec: Optional[str]):
    """FMOE_FAULT=phase:step:SIGNAL[:rank], e.g. backward:3:SIGTERM (a test hook; unset in real runs)."""
    if not spec:
        return None
    parts = spec.split(":")
    try:
        phase, step, name = parts[:3]
        sig = signal.Signals[name] if name.startswith("SIG") else signal.Signals["SIG" + name]
        rank = int(parts[3]) if len(parts) > 3 else None
        if phase not in FAULT_PHASES or len(parts) > 4:
            raise ValueError
        return phase, int(step), sig, rank
    except (ValueError, KeyError):
        raise ValueError(f"FMOE_FAULT must be phase:step:SIGNAL[:rank] with phase one of {', '.join(FAULT_PHASES)}"
                         f", got {spec!r}") from None
