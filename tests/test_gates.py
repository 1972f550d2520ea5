"""Gates: capacity drops, auxiliary losses against their formulas, bias updates, bad input."""
import math

import pytest
import torch
import torch.distributed as dist

import fmoe
from fmoe.gates.capacity import drop_over_capacity, expert_capacity
from fmoe.gates.gshard import balance_loss
from fmoe.gates.noisy import cv_squared
from fmoe.gates.base import z_loss


def test_capacity_drops_lowest_scores_deterministically():
    idx = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]])
    score = torch.tensor([[0.6, 0.4], [0.9, 0.1], [0.6, 0.4], [0.5, 0.5]])
    weight = score.clone()
    new_idx, new_w, dropped = drop_over_capacity(idx, weight, score, tot_expert=3, capacity=2)
    # expert 0 has slots with scores 0.6 (t0), 0.9 (t1), 0.6 (t2), 0.5 (t3): keeps t1 and t0 (tie with t2 -> earlier)
    # expert 1 has 0.4 (t0), 0.4 (t2), 0.5 (t3): keeps t3 and t0
    assert new_idx.tolist() == [[0, 1], [0, 2], [-1, -1], [1, -1]]
    assert int(dropped) == 3
    assert new_w[2].tolist() == [0.0, 0.0] and new_w[3, 1] == 0


def test_expert_capacity_formula():
    assert expert_capacity(1.0, 100, 2, 8) == 25
    assert expert_capacity(1.25, 10, 1, 4) == math.ceil(1.25 * 10 / 4)


def test_layer_reports_drops_and_nothing_drops_without_capacity():
    torch.manual_seed(0)
    layer = fmoe.FMoETransformerMLP(num_expert=4, d_model=8, d_hidden=8, top_k=2, gate="naive")
    with torch.no_grad():
        layer.gate.gate.proj.weight.zero_()
        layer.gate.gate.proj.bias.copy_(torch.tensor([3.0, 2.0, 0.0, 0.0]))
    layer(torch.randn(40, 8))
    assert layer.num_dropped == 0 and layer.last_counts_E.tolist() == [40, 40, 0, 0]
    capped = fmoe.FMoETransformerMLP(num_expert=4, d_model=8, d_hidden=8, top_k=2, gate="naive",
                                     gate_kwargs={"capacity": (0.5, 1.0)})
    capped.gate.load_state_dict(layer.gate.state_dict())
    capped.train()(torch.randn(40, 8))
    cap = expert_capacity(0.5, 40, 2, 4)    # 10 per expert
    assert capped.last_counts_E.tolist() == [cap, cap, 0, 0]
    assert capped.num_dropped == 80 - 2 * cap
    capped.eval()(torch.randn(40, 8))
    assert capped.num_dropped == 80 - 2 * expert_capacity(1.0, 40, 2, 4)


def test_balance_loss_formula():
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.6, 0.3, 0.1], [0.2, 0.2, 0.6]])
    top1 = probs.argmax(-1)
    f = torch.tensor([2, 1, 1]) / 4
    p = probs.mean(0)
    torch.testing.assert_close(balance_loss(probs, top1), 3 * (f * p).sum())
    uniform = torch.full((6, 3), 1 / 3)
    torch.testing.assert_close(balance_loss(uniform, torch.tensor([0, 1, 2, 0, 1, 2])), torch.tensor(1.0))


def test_gshard_and_switch_aux_losses_equal_formula():
    torch.manual_seed(0)
    x = torch.randn(32, 8)
    for gate in (fmoe.GShardGate(8, 4, 1, 2), fmoe.SwitchGate(8, 4, 1, 1)):
        gate.eval()
        probs = torch.softmax(gate.gate(x), -1)
        expected = balance_loss(probs, probs.argmax(-1))
        torch.testing.assert_close(gate.routing(x).aux_loss, expected)


def test_cv_squared_and_noisy_loss_in_eval():
    v = torch.tensor([1.0, 2.0, 3.0])
    torch.testing.assert_close(cv_squared(v), v.var() / v.mean() ** 2, rtol=1e-6, atol=1e-8)
    torch.manual_seed(0)
    gate = fmoe.NoisyGate(8, 4, 1, 2, loss_coef=0.5).eval()
    x = torch.randn(20, 8)
    r = gate.routing(x)
    gates = torch.zeros(20, 4).scatter(1, r.expert_idx_TK, r.weight_TK)
    expected = 0.5 * (cv_squared(gates.sum(0)) + cv_squared((gates > 0).sum(0).float()))
    torch.testing.assert_close(r.aux_loss, expected)


def test_z_loss_added_on_every_gate():
    x = torch.randn(12, 8)
    for name, k in (("naive", 2), ("noisy", 2), ("gshard", 2), ("switch", 1), ("balanced", 2)):
        torch.manual_seed(0)
        plain = fmoe.gates.GATES[name](8, 4, 1, k).eval()
        torch.manual_seed(0)
        with_z = fmoe.gates.GATES[name](8, 4, 1, k, z_loss_coef=0.1).eval()
        logits = x @ with_z.w_gate if name == "noisy" else with_z.gate(x)
        expected = plain.routing(x).aux_loss + 0.1 * torch.logsumexp(logits, -1).square().mean()
        torch.testing.assert_close(with_z.routing(x).aux_loss, expected)
    torch.testing.assert_close(z_loss(torch.zeros(3, 4)), torch.tensor(math.log(4) ** 2))


def test_balanced_gate_bias_moves_toward_balance():
    torch.manual_seed(0)
    gate = fmoe.BalancedGate(8, 4, 1, 1, gate_bias=True, bias_update_speed=0.01).train()
    with torch.no_grad():
        gate.gate.proj.bias.copy_(torch.tensor([3.0, 0.0, 0.0, 0.0]))
    x = torch.randn(256, 8)
    first_load = torch.bincount(gate.routing(x).expert_idx_TK.reshape(-1), minlength=4)
    assert first_load[0] > 200
    assert gate.expert_bias_E.tolist() == pytest.approx([-0.01, 0.01, 0.01, 0.01])
    for _ in range(500):
        gate.routing(x)
    load = torch.bincount(gate.routing(x).expert_idx_TK.reshape(-1), minlength=4)
    assert load.max() < 2 * 64, load    # within 2x of perfect balance (64 each)
    assert gate.expert_bias_E[0] < gate.expert_bias_E[1:].min()


def test_gshard_random_routing_skips_only_second_slot():
    torch.manual_seed(0)
    gate = fmoe.GShardGate(8, 4, 1, 2, capacity=None).train()
    r = gate.routing(torch.randn(200, 8))
    assert (r.expert_idx_TK[:, 0] >= 0).all()
    skipped = r.expert_idx_TK[:, 1] < 0
    assert 0 < skipped.sum() < 200
    assert (r.weight_TK[skipped, 1] == 0).all()


@pytest.mark.parametrize("kwargs,match", [
    (dict(top_k=0), "top_k"),
    (dict(top_k=5), "top_k"),
    (dict(gate="nope"), "gate"),
    (dict(activation="tanhh"), "activation"),
    (dict(gate_kwargs={"capacity": 0}), "capacity"),
    (dict(gate_kwargs={"capacity": (1.0, -1.0)}), "capacity"),
    (dict(world_size=2), "world_size"),
    (dict(gate="gshard", top_k=1), "top_k"),
])
def test_bad_arguments_raise_naming_the_argument(kwargs, match):
    assert not dist.is_initialized()
    args = dict(num_expert=4, d_model=8, d_hidden=8, top_k=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        fmoe.FMoETransformerMLP(**args)


def test_bad_input_raises():
    layer = fmoe.FMoETransformerMLP(num_expert=4, d_model=8, d_hidden=8)
    with pytest.raises(ValueError, match="d_model=8"):
        layer(torch.randn(3, 7))
    with pytest.raises(TypeError, match="floating"):
        layer(torch.ones(3, 8, dtype=torch.long))
    with pytest.raises(TypeError, match="gate"):
        fmoe.FMoETransformerMLP(num_expert=4, d_model=8, d_hidden=8, gate=42)


def test_dropped_slot_never_reads_another_tokens_row():
    """A non-finite expert output for one token must not leak into a token whose slot was dropped."""
    from fmoe.kernels import torch_ops
    from fmoe.routing import RoutingPlan
    idx = torch.tensor([[0, 1], [1, -1]])                  # token 1's second slot is dropped
    plan = RoutingPlan.build(idx, 2)
    assert plan.row_of_slot_TK[0, 0] == 0                  # row 0 is token 0's
    y = torch.tensor([[float("inf")], [1.0], [2.0]])
    out = torch_ops.unpermute(y, plan, torch.tensor([[0.5, 0.5], [1.0, 0.0]]))
    assert torch.isinf(out[0]).all()
    assert out[1].tolist() == [2.0]
