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
    gate.end_step()
    assert gate.expert_bias_E.tolist() == pytest.approx([-0.01, 0.01, 0.01, 0.01])
    for _ in range(500):
        gate.routing(x)
        gate.end_step()
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
    from fmoe import kernels
    from fmoe.routing import RoutingPlan
    idx = torch.tensor([[0, 1], [1, -1]])                  # token 1's second slot is dropped
    plan = RoutingPlan.build(idx, 2)
    assert plan.row_of_slot_TK[0, 0] == 0                  # row 0 is token 0's
    y = torch.tensor([[float("inf")], [1.0], [2.0], [0.0]])      # the last row: the dropped slot's
    out = kernels.unpermute(y, plan, torch.tensor([[0.5, 0.5], [1.0, 0.0]]), backend="torch")
    assert torch.isinf(out[0]).all()
    assert out[1].tolist() == [2.0]


# --- numerics: fp32 routing at least, float64 end to end -----------------------------------

GRADCHECK_GATES = {
    "naive": dict(gate="naive", top_k=2),
    "noisy_eval": dict(gate="noisy", top_k=2),
    "noisy_fixed_noise": dict(gate="noisy", top_k=2, train=True),
    "gshard": dict(gate="gshard", top_k=2),
    "switch": dict(gate="switch", top_k=1),
    "balanced": dict(gate="balanced", top_k=2),
    "faster": dict(gate="faster", top_k=2),
    "router_deepseek_v3": dict(gate=fmoe.gates.RouterGate, top_k=2,
                               gate_kwargs=dict(score="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5,
                                                n_group=2, topk_group=1, selection_bias="frozen")),
    "router_sparsemixer": dict(gate=fmoe.gates.RouterGate, top_k=2, gate_kwargs=dict(sparsemixer=True)),
}


@pytest.mark.parametrize("name", sorted(GRADCHECK_GATES))
def test_gradcheck_float64_whole_layer(name):
    """Input, router and expert gradients of a float64 layer match finite differences."""
    case = GRADCHECK_GATES[name]
    torch.manual_seed(0)
    layer = fmoe.FMoETransformerMLP(num_expert=4, d_model=4, d_hidden=6, top_k=case["top_k"], gate=case["gate"],
                                    gate_kwargs=case.get("gate_kwargs")).double()
    layer.train(case.get("train", False))
    names = [n for n, _ in layer.named_parameters()]
    params = [p.detach().clone().requires_grad_() for p in layer.parameters()]
    x = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)

    def run(x, *values):
        torch.manual_seed(1)        # the same noise on every call
        y = torch.func.functional_call(layer, dict(zip(names, values)), (x,))
        return y, layer.aux_loss
    assert torch.autograd.gradcheck(run, (x, *params), eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=True)
    assert layer.gate.last_logits_TE.dtype == torch.float64


@pytest.mark.parametrize("gate", ["naive", "noisy", "gshard", "switch", "balanced", "faster", "router"])
def test_bf16_layer_routes_in_fp32_from_fp32_weights(gate):
    torch.manual_seed(0)
    layer = fmoe.FMoETransformerMLP(num_expert=4, d_model=8, d_hidden=8, top_k=1 if gate == "switch" else 2,
                                    gate=gate).to(torch.bfloat16).eval()
    assert all(p.dtype == torch.float32 for p in layer.gate.parameters())
    assert all(p.dtype == torch.bfloat16 for p in layer.experts.parameters())
    x = torch.randn(10, 8).bfloat16()
    r = layer.gate.routing(x)
    assert r.weight_TK.dtype == torch.float32
    if gate == "noisy":
        expected = x.float() @ layer.gate.w_gate
    else:
        expected = torch.nn.functional.linear(x.float(), layer.gate.gate.proj.weight, layer.gate.gate.proj.bias)
    torch.testing.assert_close(layer.gate.last_logits_TE, expected)
    assert layer(x).dtype == torch.bfloat16


def test_noisy_gate_nan_token_in_training_stays_in_its_row():
    torch.manual_seed(0)
    layer = fmoe.FMoETransformerMLP(num_expert=4, d_model=8, d_hidden=8, top_k=2, gate="noisy").train()
    x = torch.randn(12, 8)
    x[3] = float("nan")
    y = layer(x)
    assert torch.isnan(y[3]).all()
    assert torch.isfinite(y[torch.arange(12) != 3]).all()


# --- options validated at construction --------------------------------------------------------

@pytest.mark.parametrize("build,match", [
    (lambda: fmoe.BalancedGate(8, 4, bias_update_speed=float("nan")), "bias_update_speed"),
    (lambda: fmoe.BalancedGate(8, 4, bias_update_speed=float("inf")), "bias_update_speed"),
    (lambda: fmoe.NaiveGate(8, 4, z_loss_coef=float("nan")), "z_loss_coef"),
    (lambda: fmoe.NaiveGate(8, 4, capacity=float("inf")), "capacity"),
    (lambda: fmoe.NaiveGate(8, 4, capacity=True), "capacity"),
    (lambda: fmoe.NaiveGate(True, 4), "d_model"),
    (lambda: fmoe.NaiveGate(8, True), "num_expert"),
    (lambda: fmoe.NaiveGate(8, 4, world_size=True), "world_size"),
    (lambda: fmoe.NaiveGate(8, 4, top_k=True), "top_k"),
    (lambda: fmoe.NaiveGate(8, 4, gate_bias=1), "gate_bias"),
    (lambda: fmoe.NoisyGate(8, 4, loss_coef=float("nan")), "loss_coef"),
    (lambda: fmoe.NoisyGate(8, 4, noise_epsilon=0.0), "noise_epsilon"),
    (lambda: fmoe.SwitchGate(8, 4, switch_eps=float("nan")), "switch_eps"),
    (lambda: fmoe.SwitchGate(8, 4, jitter="both"), "jitter"),
    (lambda: fmoe.GShardGate(8, 4, random_routing=1), "random_routing"),
    (lambda: fmoe.GShardGate(8, 4, drop_by="luck"), "drop_by"),
    (lambda: fmoe.GShardGate(8, 4, capacity_formula="ceil"), "capacity_formula"),
    (lambda: fmoe.FasterGate(8, 4, outgoing_fraction=1.5), "outgoing_fraction"),
    (lambda: fmoe.FasterGate(8, 4, gpus_per_node=0), "gpus_per_node"),
    (lambda: fmoe.FMoETransformerMLP(num_expert=True, d_model=8, d_hidden=8), "num_expert"),
    (lambda: fmoe.FMoETransformerMLP(num_expert=4, d_model=True, d_hidden=8), "d_model"),
])
def test_invalid_gate_option_raises_naming_it(build, match):
    with pytest.raises(ValueError, match=match):
        build()


@pytest.mark.parametrize("var,value", [("FMOE_TOPO_GPUS_PER_NODE", "eight"), ("FMOE_TOPO_GPUS_PER_NODE", "0"),
                                       ("FMOE_TOPO_OUTGOING_FRACTION", "lots"),
                                       ("FMOE_TOPO_OUTGOING_FRACTION", "nan")])
def test_invalid_topology_environment_variable_is_named(monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=var):
        fmoe.FasterGate(8, 4)


def test_topology_environment_variables_are_read(monkeypatch):
    monkeypatch.setenv("FMOE_TOPO_GPUS_PER_NODE", "2")
    monkeypatch.setenv("FMOE_TOPO_OUTGOING_FRACTION", "0.3")
    gate = fmoe.FasterGate(8, 4)
    assert (gate.gpus_per_node, gate.outgoing_fraction) == (2, 0.3)


# --- dropped vs randomly unrouted ---------------------------------------------------------------

def test_gshard_random_routing_counts_every_unrouted_slot():
    torch.manual_seed(0)
    layer = fmoe.FMoETransformerMLP(num_expert=4, d_model=8, d_hidden=8, top_k=2, gate="gshard",
                                    gate_kwargs=dict(capacity=None)).train()
    x = torch.randn(500, 8)
    torch.manual_seed(1)
    r = layer.gate.routing(x)
    skipped = int((r.expert_idx_TK < 0).sum())
    assert skipped > 0 and int(r.num_unrouted) == int(r.num_dropped) == skipped
    torch.manual_seed(1)
    layer(x)
    assert layer.num_dropped == skipped
    assert int(layer.last_counts_E.sum()) == 1000 - skipped


def test_gshard_fastmoe_order_capacity_then_random_routing():
    """FastMoE's GShard: capacity ceil(rate*T)*2//E kept first-come in token order, then random
    routing of the surviving second slots; the two counts are reported apart."""
    torch.manual_seed(0)
    gate = fmoe.GShardGate(8, 4, 1, 2, capacity=(0.3, 0.3)).train()
    x = torch.randn(50, 8)
    logits = gate.gate(x)
    top_TK = torch.topk(logits, 2).indices
    cap = math.ceil(0.3 * 50) * 2 // 4
    seen, expected = {}, top_TK.clone()
    for t in range(50):
        for k in range(2):
            e = int(top_TK[t, k])
            seen[e] = seen.get(e, 0) + 1
            if seen[e] > cap:
                expected[t, k] = -1
    torch.manual_seed(5)
    r = gate.routing(x)
    torch.manual_seed(5)
    probs = torch.softmax(logits, -1).gather(1, top_TK)
    skip = (2 * probs[:, 1] / probs.sum(-1) < torch.rand(50)) & (expected[:, 1] >= 0)
    expected[skip, 1] = -1
    assert torch.equal(r.expert_idx_TK, expected)
    assert int(r.num_unrouted) == int(skip.sum())
    assert int(r.num_dropped) == int((expected < 0).sum())


def test_gshard_fmoe_options_drop_by_score_and_exact_capacity():
    torch.manual_seed(0)
    gate = fmoe.GShardGate(8, 4, 1, 2, capacity=(0.3, 0.3), capacity_formula="exact", drop_by="score",
                           random_routing=False).train()
    x = torch.randn(50, 8)
    r = gate.routing(x)
    counts = torch.bincount(r.expert_idx_TK[r.expert_idx_TK >= 0], minlength=4)
    assert counts.max() <= expert_capacity(0.3, 50, 2, 4)
    assert int(r.num_unrouted) == 0


# --- FastMoE's semantics for FastMoE-named gates --------------------------------------------------

def test_switch_gate_noise_is_added_to_the_logits():
    torch.manual_seed(0)
    gate = fmoe.SwitchGate(8, 6, 1, 1, switch_eps=0.5, capacity=None).train()
    x = torch.randn(64, 8)
    torch.manual_seed(3)
    r = gate.routing(x)
    torch.manual_seed(3)
    logits = gate.gate(x)
    noisy = logits + torch.empty_like(logits).uniform_(0.5, 1.5)
    probs = torch.softmax(noisy, -1)
    assert torch.equal(r.expert_idx_TK[:, 0], probs.argmax(-1))
    torch.testing.assert_close(r.weight_TK[:, 0], probs.max(-1).values)


def test_noisy_gate_loss_coefficient_is_fastmoe_s():
    assert fmoe.NoisyGate(8, 4).loss_coef == 1.0


def fastermoe_oracle(logits, off_node, fraction):
    """FasterMoE's topology-aware choice, token by token (top-2)."""
    T = logits.shape[0]
    top = torch.topk(logits, 2).indices
    outgoing = [t for t in range(T) if off_node[top[t, 0]]]
    limit = int(T * fraction)
    if len(outgoing) < limit:
        return top
    kept = sorted(outgoing, key=lambda t: -float(logits[t, top[t, 0]]))[:limit]
    local = torch.topk(logits.masked_fill(off_node, -math.inf), 2).indices
    for t in kept:
        local[t, 1] = top[t, 0]
    return local


@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.3, 1.0])
def test_faster_gate_fastmoe_semantics(fraction):
    torch.manual_seed(0)
    # 4 ranks, 2 per node, 2 experts per rank; FastMoE's 4th positional argument: node 0.
    gate = fmoe.FasterGate(8, 2, 4, 0, gpus_per_node=2, outgoing_fraction=fraction)
    with torch.no_grad():
        gate.gate.proj.bias.copy_(torch.tensor([0, 0, 0, 0, 1.0, 1.0, 1.0, 1.0]))   # remote experts look best
    x = torch.randn(60, 8)
    logits = gate.gate(x).detach()
    expected = fastermoe_oracle(logits, torch.arange(8) >= 4, fraction)
    idx, val = gate(x)
    assert torch.equal(idx, expected)
    torch.testing.assert_close(val, torch.softmax(logits.gather(1, expected), -1))
    assert int((idx >= 4).sum()) <= max(int(60 * fraction), int((torch.topk(logits, 2).indices >= 4).sum()))


def test_faster_gate_single_node_is_naive():
    torch.manual_seed(0)
    faster = fmoe.FasterGate(8, 4, world_size=1, top_k=2, outgoing_fraction=0.0)
    naive = fmoe.NaiveGate(8, 4, 1, 2)
    naive.load_state_dict(faster.state_dict())
    x = torch.randn(20, 8)
    assert torch.equal(faster(x)[0], naive(x)[0])


def test_faster_gate_in_layer_takes_top_k_by_name():
    layer = fmoe.FMoETransformerMLP(num_expert=4, d_model=8, d_hidden=8, top_k=3, gate="faster")
    assert layer.gate.top_k == 3 and layer.gate.node_rank is None


# --- the gate protocol: FastMoE's tuple and FastMoE-style gates ------------------------------------

class FastMoEStyleGate(fmoe.gates.BaseGate):
    """A gate written FastMoE's way: BaseGate(num_expert, world_size), forward returns the tuple."""

    def __init__(self, d_model, num_expert, world_size, top_k=2):
        super().__init__(num_expert, world_size)
        self.gate = torch.nn.Linear(d_model, self.tot_expert)
        self.top_k = top_k

    def forward(self, inp):
        val, idx = torch.topk(self.gate(inp), self.top_k, dim=-1)
        self.set_loss(val.square().mean())
        return idx.view(-1), torch.softmax(val, -1).unsqueeze(1)     # FastMoE's flat / [T, 1, K] shapes


def test_fastmoe_style_gate_works_inside_fmoe():
    torch.manual_seed(0)
    layer = fmoe.FMoETransformerMLP(num_expert=4, d_model=8, d_hidden=8, top_k=2, gate=FastMoEStyleGate)
    naive = fmoe.FMoETransformerMLP(num_expert=4, d_model=8, d_hidden=8, top_k=2, gate="naive")
    naive.load_state_dict({k.replace("gate.gate.", "gate.gate.proj."): v for k, v in layer.state_dict().items()})
    x = torch.randn(10, 8)
    y = layer(x)
    torch.testing.assert_close(y, naive(x))
    val = torch.topk(layer.gate.gate(x), 2).values
    torch.testing.assert_close(layer.aux_loss, val.square().mean())
    assert layer.gate.has_loss and layer.num_dropped == 0
    y.sum().backward()
    assert layer.gate.gate.weight.grad is not None


def test_fastmoe_style_gate_drops_are_counted():
    class Dropping(FastMoEStyleGate):
        def forward(self, inp):
            idx, val = super().forward(inp)
            return idx.masked_fill(torch.arange(idx.numel()) % 3 == 0, -1), val
    layer = fmoe.FMoETransformerMLP(num_expert=4, d_model=8, d_hidden=8, top_k=2, gate=Dropping)
    layer(torch.randn(6, 8))
    assert layer.num_dropped == 4


def test_every_gate_called_directly_returns_the_fastmoe_tuple():
    x = torch.randn(5, 8)
    for name, gate_cls in fmoe.gates.GATES.items():
        k = 1 if name == "switch" else 2
        gate = fmoe.gates.make_gate(name, 8, 4, 1, k).eval()
        idx, val = gate(x)
        r = gate.routing(x)
        assert torch.equal(idx, r.expert_idx_TK) and torch.equal(val, r.weight_TK), name
        assert gate(x, return_all_scores=True)[2].shape == (5, 4)


# --- sync-free: no value read back to the host in any gate's forward ------------------------------

@pytest.mark.parametrize("training", [True, False])
def test_gates_forward_without_host_reads(training):
    torch.manual_seed(0)
    x = torch.randn(24, 8, requires_grad=True)
    gates = [fmoe.gates.make_gate(name, 8, 4, 1, 1 if name == "switch" else 2, capacity=(0.5, 0.5)).train(training)
             for name, gate_cls in fmoe.gates.GATES.items()
             if name != "noisy" and fmoe.gates.accepts_keyword(gate_cls, "capacity")]
    gates += [fmoe.gates.make_gate(name, 8, 4, 1, 2).train(training) for name in ("dc",)]   # SWIPE moves tokens by host-side counts, as FastMoE does
    gates += [fmoe.NoisyGate(8, 4, 1, 2).train(training), fmoe.GShardGate(8, 4, capacity=None).train(training),
              fmoe.FasterGate(8, 2, 4, 0, gpus_per_node=2, outgoing_fraction=0.1).train(training),
              fmoe.gates.RouterGate.from_preset("deepseek_v3", 8, 8, top_k=2, n_group=4, topk_group=2),
              fmoe.gates.RouterGate.from_preset("phimoe", 8, 4).train(training),
              fmoe.gates.RouterGate(8, 4, aux_loss="switch", selection_bias="updated", z_loss_coef=0.1).train(training)]
    mp = pytest.MonkeyPatch()
    try:
        def refuse(*_args, **_kwargs):
            raise AssertionError("a gate read a tensor value back to the host")
        for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
            mp.setattr(torch.Tensor, name, refuse)
        for gate in gates:
            r = gate.routing(x)
            (r.weight_TK.sum() + r.aux_loss).backward()
    finally:
        mp.undo()


# --- every rank reaches the balanced gate's all-reduce, even with no tokens -------------------------

def zero_token_rank_worker(rank, world):
    for gate, k in (("balanced", 2), ("router", 2), ("naive", 2), ("gshard", 2), ("switch", 1), ("noisy", 2)):
        torch.manual_seed(0)
        kwargs = dict(selection_bias="updated") if gate == "router" else {}
        layer = fmoe.FMoETransformerMLP(num_expert=2, d_model=8, d_hidden=8, world_size=world, top_k=k,
                                        gate=gate, gate_kwargs=kwargs).train()
        x = torch.randn(0 if rank == 0 else 16, 8, requires_grad=True)
        layer(x).sum().backward()
        fmoe.end_step(layer)
        bias = getattr(layer.gate, "e_score_correction_bias", None)
        if bias is not None:
            everyone = [torch.empty_like(bias) for _ in range(world)]
            dist.all_gather(everyone, bias)
            assert torch.equal(everyone[0], everyone[1]) and bias.abs().sum() > 0, (gate, everyone)


def test_zero_token_rank_reaches_balanced_gate_all_reduce():
    from tests.dist_utils import run_ranks
    run_ranks(zero_token_rank_worker, 2)
