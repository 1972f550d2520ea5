"""Worker bodies for the multi-process router replay tests."""
import torch

import fmoe
from tests.dist_utils import assert_expert_parallel_grads
from tests.dist_workers import D, build_pair


def check_replay_matches_single_process(rank, world, exchanges, megatron):
    for exchange in exchanges:
        check_exchange(rank, world, exchange)
    if megatron:
        check_megatron_stage_names()


def check_exchange(rank, world, exchange):
    """A trace recorded by one process on the whole batch, split by rank: each rank replays its own
    tokens (global expert ids) and the outputs and gradients equal the single process's replay."""
    tokens = 5
    for gate, top_k, kwargs in (("naive", 2, {}), ("gshard", 2, {}),
                                ("router", 2, {"gate_kwargs": {"aux_loss": "switch", "aux_loss_coef": 0.1}})):
        full, ep = build_pair(gate, top_k, 2, world, rank, exchange=exchange, **kwargs)
        g = torch.Generator().manual_seed(42)
        x_all = torch.randn(tokens * world, D, generator=g)
        probe = torch.randn(tokens * world, D, generator=g)
        with fmoe.record_routing(full) as trace, torch.no_grad():
            full(x_all)
        for layer in (full, ep):        # the trainer's router has moved since the rollout
            with torch.no_grad():
                for p in layer.gate.parameters():
                    p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(9)))
            layer.train()
        lo, hi = rank * tokens, (rank + 1) * tokens
        x_full = x_all.clone().requires_grad_(True)
        with fmoe.replay_routing(full, trace):
            out_all = full(x_full)
        (out_all * probe).sum().backward()
        x = x_all[lo:hi].clone().requires_grad_(True)
        with fmoe.replay_routing(ep, trace.split(tokens)[rank]):
            out = ep(x)
        (out * probe[lo:hi]).sum().backward()
        ctx = f"{exchange} exchange: {gate} rank {rank} of {world}"
        mine = trace[""][0][lo:hi]
        assert torch.equal(ep.last_counts_E, torch.bincount(mine[mine >= 0], minlength=2 * world)), ctx
        torch.testing.assert_close(out, out_all[lo:hi], atol=1e-5, rtol=1e-5, msg=lambda m: f"{ctx} out: {m}")
        torch.testing.assert_close(x.grad, x_full.grad[lo:hi], atol=1e-5, rtol=1e-5, msg=lambda m: f"{ctx} dx: {m}")
        assert_expert_parallel_grads(ep, full, rank, 2, ctx, atol=1e-5, rtol=1e-5)


def check_megatron_stage_names():
    """A Megatron layer names itself in a trace by its global layer number: the layers of a later pipeline
    stage (local index 0, global layer 3) find their entries in a whole model's trace."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from fmoe.integrations.megatron import training
    from fmoe.integrations.megatron.mlp import MegatronMLP

    training.initialize(1, 1, seed=0)          # the 2 ranks are data-parallel replicas
    config = TransformerConfig(num_layers=4, hidden_size=D, num_attention_heads=2, ffn_hidden_size=16,
                               num_moe_experts=4, moe_router_topk=2, add_bias_linear=False,
                               use_cpu_initialization=True)
    stage = torch.nn.ModuleDict({"decoder": torch.nn.ModuleDict({"layers": torch.nn.ModuleList()})})
    whole = torch.nn.ModuleDict({"decoder": torch.nn.ModuleDict({"layers": torch.nn.ModuleList()})})
    for number in range(1, 5):
        mlp = MegatronMLP(config, gate="naive")
        mlp.set_layer_number(number)
        whole["decoder"]["layers"].append(torch.nn.ModuleDict({"mlp": mlp}))
    stage["decoder"]["layers"].append(whole["decoder"]["layers"][3])      # a stage holding the last layer
    x = torch.randn(3, 2, D, generator=torch.Generator().manual_seed(0))
    with fmoe.record_routing(whole) as trace, torch.no_grad():
        for layer in whole["decoder"]["layers"]:
            layer["mlp"](x)
    assert trace.names == [f"decoder.layers.{i}.mlp.moe" for i in range(4)]
    with fmoe.replay_routing(stage, trace):
        stage["decoder"]["layers"][0]["mlp"](x)
    assert torch.equal(stage["decoder"]["layers"][0]["mlp"].moe.last_counts_E,
                       torch.bincount(trace["decoder.layers.3.mlp.moe"][0].reshape(-1), minlength=4))
