"""What a training run reports besides its loss: the validation loss, a text sample, each expert's
load share and the imbalance, tokens/s over steps, training.png, and the dashboards opened on every
rank alike. The forwards run under `fmoe.app.runtime.autocast`, as the training steps do."""
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fmoe.app import runtime
from fmoe.app.data import BatchSampler
from fmoe.app.files import save_figure
from fmoe.app.gpt import GPT
from fmoe.app.runtime import all_ranks_agree, mean_over_ranks
from fmoe.observe.dashboards import Dashboards


def load_share(model: GPT) -> torch.Tensor:
    """Each expert's share of the routed rows in the last forward (all ranks): [n_layer, num_expert], rows sum to 1."""
    loads_LE = model.expert_loads()
    if dist.is_initialized():
        dist.all_reduce(loads_LE)
    return loads_LE / loads_LE.sum(-1, keepdim=True).clamp_min(1)


def imbalance(share_LE: torch.Tensor) -> float:
    """max / mean load over the experts, averaged over layers: 1.0 is perfectly balanced."""
    return (share_LE.max(-1).values * share_LE.shape[-1]).mean().item()


@torch.no_grad()
def evaluate(model: GPT, sampler: BatchSampler, batches: int, device: torch.device) -> float:
    model.eval()
    total = 0.0
    for _ in range(batches):
        x_BT, y_BT = (t.to(device) for t in sampler.next())
        with runtime.autocast(device):
            logits_BTV, _ = model(x_BT)
        total += F.cross_entropy(logits_BTV.float().flatten(0, 1), y_BT.flatten()).item()
    model.train()
    return mean_over_ranks(total / batches)


def sample_text(model: GPT, prompt: str, num_bytes: int, seed: int, device: torch.device) -> str:
    model.eval()
    idx_1P = torch.tensor([list(prompt.encode() or b"\n")], dtype=torch.long, device=device)
    with runtime.autocast(device):
        out_1T = model.generate(idx_1P, num_bytes, generator=torch.Generator().manual_seed(seed))
    model.train()
    return bytes(out_1T[0].tolist()).decode("utf-8", errors="replace")


def harmonic_mean(rates):
    """Tokens/s over several equal-sized steps: total tokens over total time (0 for no steps)."""
    return len(rates) / sum(1 / r for r in rates) if rates else 0.0


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
    save_figure(path, fig, dpi=100)


def open_dashboards(dashboards: Dashboards):
    """Before the first step, on every rank: an asked-for --log backend that cannot open on the
    writing rank stops them all, not only that one."""
    error = None
    try:
        dashboards.open()
    except ValueError as err:
        error = err
    if not all_ranks_agree(error is None):
        raise error or ValueError("--log: the dashboards could not open on the rank that writes them (its "
                                  "message says why)")
