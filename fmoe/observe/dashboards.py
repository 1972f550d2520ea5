"""Where `fmoe train` sends each step's losses and routing statistics: TensorBoard, W&B, both or neither.

`--log tensorboard,wandb` (or one of them, or `none`); by default TensorBoard when it is installed.
TensorBoard's event files go to `<out>/tensorboard`, the W&B run to `<out>/wandb` (it works with no
network under WANDB_MODE=offline; `wandb sync` uploads it later).
"""
import importlib.util
import warnings
from pathlib import Path
from typing import Dict, Optional, Tuple

from torch import nn

from fmoe.observe.stats import routing_stats, scalars

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
    """Scalars by step to the backends `--log` names (`spec`, see `parse_log`), under the run's folder
    `out`, opened by `open` before the first step (a run refused before that leaves nothing). Every
    rank of a run makes one (they compute the statistics together); only the one with `write=True`
    opens and writes."""

    def __init__(self, spec: Optional[str], out: Path, run_config: dict, write: bool = True):
        self.spec, self.backends = spec, parse_log(spec)
        self.out, self.run_config, self.write = out, run_config, write
        self.tensorboard = self.wandb = None

    def open(self):
        """Opens each backend. One that cannot (a tensorboard whose protobuf does not match, wandb
        with no API key) stops an asked-for `--log` in one line, every backend closed again; the
        default `--log` goes without it, with one warning."""
        if not self.write:
            return
        for backend in self.backends:
            try:
                getattr(self, f"open_{backend}")()
            except Exception as err:      # whatever the backend's import or login raises
                reason = f"{backend} cannot open ({type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]})"
                if self.spec is not None:
                    self.close()
                    raise ValueError(f"--log {self.spec}: {reason}") from err
                warnings.warn(f"{reason}: no dashboard for this run (--log none goes without, quietly)",
                              stacklevel=2)

    def open_tensorboard(self):
        from torch.utils.tensorboard import SummaryWriter

        self.tensorboard = SummaryWriter(log_dir=str(self.out / "tensorboard"))

    def open_wandb(self):
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
