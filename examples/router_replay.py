"""Router replay (R3): the experts a bf16 rollout chose, replayed in an fp32 training step.

A rollout runs the policy in bf16 for inference; the trainer runs it in fp32. Rounding alone moves
some tokens to other experts, so the trainer would compute the policy ratio for a different model.
Recording the rollout's routing and replaying it makes the trainer use exactly those experts:

    python examples/router_replay.py
"""
import copy

import torch
from torch import nn

import fmoe
from fmoe.gates import RouterGate

D, H, EXPERTS, TOP_K, LAYERS, TOKENS = 32, 64, 16, 4, 3, 2048


def policy() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[fmoe.FMoETransformerMLP(num_expert=EXPERTS, d_model=D, d_hidden=H, top_k=TOP_K,
                                                   gate=RouterGate.from_preset("qwen3_moe", D, EXPERTS, top_k=TOP_K))
                           for _ in range(LAYERS)])


def watch_choices(model: nn.Module) -> list:
    """The experts each MoE layer uses in the next forwards (through FMoE's gate_hook)."""
    seen = []
    for layer in model:
        layer.gate_hook = lambda idx, weight, _, seen=seen: seen.append(idx.detach().sort(-1).values)
    return seen


def fraction_differing(choices, trace) -> float:
    """The fraction of (token, layer) pairs whose set of experts differs from the rollout's."""
    recorded = [trace[name][0].sort(-1).values for name in trace.names]
    differ = [(got != want).any(-1).float().mean() for got, want in zip(choices, recorded)]
    return float(torch.stack(differ).mean())


def main():
    trainer = policy()
    rollout = copy.deepcopy(trainer).to(torch.bfloat16).eval()      # the inference copy
    x = torch.randn(TOKENS, D, generator=torch.Generator().manual_seed(1))
    with fmoe.record_routing(rollout) as trace, torch.no_grad():
        rollout(x.to(torch.bfloat16))
    optimizer = torch.optim.SGD(trainer.parameters(), lr=1e-2)

    free = watch_choices(trainer)
    with torch.no_grad():
        trainer(x)
    print(f"tokens routed differently without replay: {fraction_differing(free, trace):.4f}")

    replayed = watch_choices(trainer)
    with fmoe.replay_routing(trainer, trace):
        loss = trainer(x).pow(2).mean() + fmoe.collect_aux_loss(trainer)
        loss.backward()
    optimizer.step()
    print(f"tokens routed differently with replay: {fraction_differing(replayed, trace):.4f}")


if __name__ == "__main__":
    main()
