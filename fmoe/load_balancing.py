"""State that follows the load changes once per optimizer step.

    fmoe.register_bias_update(model, optimizer)    # before training; the hook does the rest

Each gate with an updated selection bias counts its experts' load on the device in every
training forward (no collective there, and not again in a recompute). Just before
`optimizer.step()`, the hook sums every such gate's load over the gate's replicas in one
all-reduce (bounded by FMOE_COLLECTIVE_TIMEOUT, naming the layers), moves each bias once, and
restarts the counts of the step, the global-batch loss's too. Ranks may run different numbers
of micro-batches: only the step issues a collective.
"""
from typing import Dict, List

import torch
from torch import nn

from fmoe.gates.load_state import check_balance_group
from fmoe.gates.router import RouterGate, end_step_of


def step_gates(model: nn.Module) -> List[RouterGate]:
    """The gates of `model` whose state follows the step's load, each named for messages."""
    gates = []
    for name, module in model.named_modules():
        if isinstance(module, RouterGate) and (module.selection_bias == "updated" and module.bias_update == "step"
                                               or "global" in module.aux_losses):
            module.layer_name = name or type(module).__name__
            gates.append(module)
    return gates


def end_step(model: nn.Module):
    """What the hook runs: every step gate's bias moved by its step's load; counts restarted.
    Call it yourself once per optimizer step if you cannot register the hook."""
    by_group: Dict[object, List[RouterGate]] = {}
    for gate in step_gates(model):
        by_group.setdefault(gate.balance_group, []).append(gate)
    for group, gates in by_group.items():
        names = ", ".join(g.label for g in gates[:3]) + (f" and {len(gates) - 3} more" if len(gates) > 3 else "")
        end_step_of(gates, group, f"{len(gates)} gate(s) ({names})")


def base_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer under DeepSpeed's, Megatron's or accelerate's wrappers: its `step` runs
    once per optimizer step whichever wrapper calls it."""
    seen = optimizer
    for _ in range(8):
        # accelerate's AcceleratedOptimizer is an Optimizer subclass without hooks of its own: go inside.
        # Megatron's ChainedOptimizer (dense and expert parameters) refuses `.optimizer` when it holds
        # several; its first one steps once per step like the others.
        chained = getattr(seen, "chained_optimizers", None)
        inner = chained[0] if chained else getattr(seen, "optimizer", None)
        if inner is None and isinstance(seen, torch.optim.Optimizer):
            return seen
        seen = inner
    raise ValueError(f"optimizer must be a torch.optim.Optimizer or a wrapper holding one in .optimizer, "
                     f"got {type(optimizer).__name__}")


def register_bias_update(model: nn.Module, optimizer, group=None):
    """Runs `end_step(model)` before each `optimizer.step()`; returns the hook's handle (`.remove()`).

    `group` ("world", "local" or a ProcessGroup) sets the replicas of every gate if given; by
    default each gate keeps its `balance_group` ("world"). Registering again replaces the hook."""
    gates = step_gates(model)
    if not gates:
        raise ValueError(f"register_bias_update: {type(model).__name__} has no gate with selection_bias='updated' "
                         "(bias_update='step') or aux_loss='global'")
    torch_optimizer = base_optimizer(optimizer)
    if group is not None:
        check_balance_group(group)
    for gate in gates:
        if group is not None:
            gate.balance_group = group
        gate.step_hooked = True
    previous = getattr(model, "fmoe_bias_update_hook", None)
    if previous is not None:
        previous.remove()
    handle = torch_optimizer.register_step_pre_hook(lambda *_: end_step(model))
    model.fmoe_bias_update_hook = handle
    return handle


def register_bias_update_if_needed(model: nn.Module, optimizer, group=None):
    """`register_bias_update` when `model` has a gate that needs it (the integrations call this)."""
    if step_gates(model):
        return register_bias_update(model, optimizer, group)
    return None
