"""FastMoE path `fmoe.megatron.balance`: per-layer load-balance profiles from the gate hook.

On Megatron-Core there are no global arguments: pass `balance_strategy` where FastMoE read
`args.balance_strategy` (Megatron-LM's global arguments are used when they exist).
"""
import torch
import torch.distributed as dist

from fmoe.fastmoe.balance import reset_balance_profile, update_balance_profile
from fmoe.integrations.megatron.utils import megatron_args
from fmoe.layer import FMoE

balance_dict = {}
num_layers = 0


def _strategy(balance_strategy):
    if balance_strategy is not None:
        return balance_strategy
    args = megatron_args()
    return getattr(args, "balance_strategy", None) if args is not None else None


def reset_gate_hook(_num_layers=None, balance_strategy=None):
    """Clear the balance profile kept by the gate hooks, for `_num_layers` layers and a strategy."""
    global num_layers
    if _num_layers is not None:
        num_layers = _num_layers
    reset_balance_profile(balance_dict, num_layers, _strategy(balance_strategy))


def get_balance_profile():
    """The balance metrics the gate hooks recorded, by metric, one entry per layer."""
    return balance_dict


def generate_megatron_gate_hook(layer_idx, num_expert_global, balance_strategy=None):
    """A `gate_hook` for FMoE that records layer `layer_idx`'s balance metrics."""
    strategy = _strategy(balance_strategy)

    def megatron_gate_hook(gate_top_k_idx, gate_score_top_k, gate_context):
        update_balance_profile(balance_dict, gate_top_k_idx, gate_score_top_k, gate_context, layer_idx,
                               num_expert_global, strategy)

    return megatron_gate_hook


def add_balance_log(model, writer, iteration):
    """Log every MoE layer's balance loss (averaged over ranks) to a TensorBoard `writer` on the
    last rank. Finds the layers by type, so it works on Megatron-Core models as on FastMoE's."""
    gates = [m.gate for m in model.modules() if isinstance(m, FMoE) and m.gate.has_loss]
    if not gates:
        return
    losses = torch.stack([g.get_loss(clear=True).detach().float().reshape(()) for g in gates])
    if dist.is_initialized():
        dist.all_reduce(losses)
        losses /= dist.get_world_size()
    last = not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1
    if writer is not None and last:
        for layer_id, value in enumerate(losses):
            writer.add_scalar(f"balance-loss/layer-{layer_id}", value.item(), iteration)
        writer.add_scalar("balance-loss/all", losses.mean().item(), iteration)
