"""Where `fmoe train` sends each step's losses and routing statistics: TensorBoard, W&B, both or neither.

`--log tensorboard,wandb` (or one of them, or `none`); by default TensorBoard when it is installed.
TensorBoard's event files go to `<out>/tensorboard`, the W&B run to `<out>/wandb` (it works with no
network under WANDB_MODE=offline; `wandb sync` uploads it later).
"""
import importlib.util
from pathlib import Path
from typing import Dict, Optional, Tuple

from torch import nn

from fmoe.stats import routing_stats, scalars

BACKENDS = ("tensorboard", "wandb")


def installed(backend: str) -> bool:
    return importlib.util.find_spec(backend) is not None


def parse_log(spec: Optional[str]) -> Tuple[str, ...]:
    """The backends `--log` names; None: TensorBoard when installed, else none."""
    if spec is None:
        return ("tensorboard",) if installed("tensorboard") else ()
    names = [name.strip() for name in spec.split(",")]
    if names == ["none"]:
        return ()
    if not all(name in BACKENDS for name in names):
        raise ValueError(f"--log must be tensorboard, wandb, both comma-separated, or none, got {spec!r}")
    missing = [name for name in names if not installed(name)]
    if missing:
        raise ValueError(f"--log {spec}: {' and '.join(missing)} is not installed (pip install {' '.join(missing)})")
    return tuple(dict.fromkeys(names))


class Dashboards:
    """Scalars by step to the chosen backends, under the run's folder `out`, opened at the first
    scalar (a run refused before its first step leaves nothing). Every rank of a run makes one (they
    compute the statistics together); only the one with `write=True` writes."""

    def __init__(self, backends: Tuple[str, ...], out: Path, run_config: dict, write: bool = True):
        self.backends = backends
        self.out, self.run_config, self.write = out, run_config, write
        self.tensorboard = self.wandb = None

    def open(self):
        if "tensorboard" in self.backends:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(log_dir=str(self.out / "tensorboard"))
        if "wandb" in self.backends:
            import wandb

            self.out.mkdir(parents=True, exist_ok=True)
            self.wandb = wandb.init(project="fmoe", name=self.out.name, dir=str(self.out), config=self.run_config)

    def log_step(self, step: int, model: nn.Module, values: Dict[str, float]):
        """`values` as `train/<name>` and every MoE layer's routing statistics over the tokens of all
        ranks as `routing/<layer>/<statistic>` (one all-reduce: every rank calls this)."""
        if self.backends:
            self.log({**{f"train/{name}": value for name, value in values.items()},
                      **scalars(routing_stats(model, over="world"))}, step)

    def log(self, scalars: Dict[str, float], step: int):
        if not self.write:
            return
        if self.tensorboard is None and self.wandb is None:
            self.open()
        if self.tensorboard is not None:
            for tag, value in scalars.items():
                self.tensorboard.add_scalar(tag, value, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def close(self):
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
        self.tensorboard = self.wandb = None
