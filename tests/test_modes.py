"""Every gate and preset gives the same routing in every mode: eager and compiled with Inductor (the
backend users get), training and evaluation where they should agree, with and without capacity and
grad, recomputed or not.

Inductor compiles C++ for each graph (seconds each on this CPU): `make test` runs one case per gate
class; `make test-modes` (FMOE_TEST_ALL_MODES=1) runs the whole cross product over every preset.
"""
import copy
import itertools
import os

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import fmoe
from fmoe.gates import PRESETS
from fmoe.gates.router import RouterGate
from tests.reference import grads_of


def grads_by_backward(module, x, out):
    """grads_of's probe loss, through .backward() (reentrant checkpointing refuses autograd.grad)."""
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(1234))
    module.zero_grad(set_to_none=True)
    (out * probe).sum().backward()
    grads = {"x": x.grad}
    grads.update({n: p.grad for n, p in module.named_parameters() if p.grad is not None})
    return grads

D, E, T = 16, 16, 24
ALL_MODES = os.environ.get("FMOE_TEST_ALL_MODES") == "1"

# (name, top_k, gate, gate_kwargs): FastMoE's gate classes and fmoe's own.
GATES = [
    ("naive", 2, "naive", {}),
    ("noisy", 2, "noisy", {}),
    ("gshard", 2, "gshard", {}),
    ("gshard_fixed", 2, "gshard", {"random_routing": False}),
    ("switch", 1, "switch", {}),
    ("balanced", 2, "balanced", {}),
    ("faster", 2, "faster", {}),
    ("dc", 2, "dc", {}),
    ("router_all_losses", 2, "router", {"aux_loss": ("switch", "sequence", "global"), "z_loss_coef": 0.1,
                                        "selection_bias": "updated"}),
]
PRESET_GATES = [(f"preset_{name}", 2, name, {}) for name in sorted(PRESETS)]


def make_gate(gate, top_k, kwargs, capacity):
    torch.manual_seed(0)
    kwargs = dict(kwargs)
    if capacity is not None and gate not in ("gshard", "switch"):       # those two have their own default
        kwargs["capacity"] = capacity
    if gate in PRESETS:
        return RouterGate.from_preset(gate, D, E, top_k=top_k, **kwargs)
    if gate == "dc":
        kwargs.pop("capacity", None)
    layer = fmoe.FMoETransformerMLP(num_expert=E, d_model=D, d_hidden=8, top_k=top_k, gate=gate, gate_kwargs=kwargs)
    return layer.gate


def routed(gate, x, grad: bool):
    with torch.set_grad_enabled(grad):
        r = gate.routing(x)
        return r.expert_idx_TK, r.weight_TK, r.aux_loss, r.num_dropped


def check_compiled_routing(gate, training: bool, grad: bool):
    eager, compiled_gate = copy.deepcopy(gate).train(training), copy.deepcopy(gate).train(training)
    compiled = torch.compile(lambda x: routed(compiled_gate, x, grad), backend="inductor", fullgraph=True)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(7))
    torch.manual_seed(3)
    want = routed(eager, x, grad)
    torch.manual_seed(3)
    got = compiled(x)
    assert torch.equal(got[0], want[0]), (got[0], want[0])
    for g, w in zip(got[1:], want[1:]):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    if hasattr(gate, "step_load_E"):
        assert torch.equal(compiled_gate.step_load_E, eager.step_load_E)


def sweep():
    cases = []
    for (name, top_k, gate, kwargs), training, capacity, grad in itertools.product(
            GATES + PRESET_GATES, (True, False), (None, 0.5), (True, False)):
        if gate == "dc" and capacity is not None:
            continue
        everyday = capacity is not None and grad and not name.startswith("preset_")
        if ALL_MODES or everyday and (training or name.startswith("gshard")):
            cases.append(pytest.param(gate, top_k, kwargs, training, capacity, grad,
                                      id=f"{name}-{'train' if training else 'eval'}-cap{capacity}-grad{grad}"))
    return cases


@pytest.fixture(autouse=True)
def same_random_numbers():
    torch._dynamo.reset()
    with torch._inductor.config.patch(fallback_random=True):
        yield


@pytest.mark.parametrize("gate,top_k,kwargs,training,capacity,grad", sweep())
def test_inductor_routes_as_eager(gate, top_k, kwargs, training, capacity, grad):
    check_compiled_routing(make_gate(gate, top_k, kwargs, capacity), training, grad)


def test_compiled_gshard_layer_with_inductor_equals_eager():
    """The held-out case: compiled GShard kept none of its routed weights (capacity, drop by order)."""
    torch.manual_seed(0)
    layer = fmoe.FMoETransformerMLP(num_expert=8, d_model=16, d_hidden=32, gate="gshard",
                                    gate_kwargs={"random_routing": False}).train()
    eager = copy.deepcopy(layer)
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    results = []
    for module, run in ((eager, eager), (layer, torch.compile(layer, fullgraph=True))):
        x_in = x.clone().requires_grad_(True)
        out = run(x_in)
        results.append((out, grads_of(module, x_in, out)))
    (out_e, grads_e), (out_c, grads_c) = results
    assert out_c.abs().sum() > 0
    torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-5)
    for name in grads_e:
        torch.testing.assert_close(grads_c[name], grads_e[name], rtol=1e-4, atol=1e-5)
    assert grads_c["experts.w1_eDF"].abs().sum() > 0


# --- eager modes that must agree --------------------------------------------------------------------

DETERMINISTIC = [g for g in GATES if g[0] in ("naive", "gshard_fixed", "router_all_losses")] + \
    [g for g in PRESET_GATES if g[2] not in ("phimoe",)]


@pytest.mark.parametrize("name,top_k,gate,kwargs", DETERMINISTIC, ids=[g[0] for g in DETERMINISTIC])
def test_train_and_eval_route_alike_without_capacity_or_noise(name, top_k, gate, kwargs):
    g = make_gate(gate, top_k, {k: v for k, v in kwargs.items() if k != "capacity"}, None)
    if gate == "gshard":
        g.capacity = None       # GShard's train and eval capacities differ by design
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(2))
    train, evaluation = routed(copy.deepcopy(g).train(), x, True), routed(copy.deepcopy(g).eval(), x, True)
    assert torch.equal(train[0], evaluation[0])
    torch.testing.assert_close(train[1], evaluation[1])


@pytest.mark.parametrize("name,top_k,gate,kwargs", GATES, ids=[g[0] for g in GATES])
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_recompute_equals_no_recompute(name, top_k, gate, kwargs, use_reentrant):
    """The whole layer under activation checkpointing: the same output and every gradient (random gates
    replay their numbers, the bias and the global loss's counts do not move in the recompute)."""
    torch.manual_seed(0)
    kwargs = dict(kwargs)
    if gate not in ("dc", "gshard", "switch"):     # GShard and Switch have capacity by default; DC has none
        kwargs.setdefault("capacity", 0.5)
    layer = fmoe.FMoETransformerMLP(num_expert=E, d_model=D, d_hidden=8, top_k=top_k, gate=gate,
                                    gate_kwargs=kwargs).train()
    if hasattr(layer.gate, "e_score_correction_bias"):
        fmoe.register_bias_update(torch.nn.Sequential(layer), torch.optim.SGD(layer.parameters(), lr=0.0))
        layer.gate.e_score_correction_bias.copy_(torch.linspace(-0.3, 0.3, E))
    ckpt = copy.deepcopy(layer)
    x = torch.randn(2, 12, D, generator=torch.Generator().manual_seed(5))
    results = []
    for module, run in ((layer, layer), (ckpt, lambda x: checkpoint(ckpt, x, use_reentrant=use_reentrant))):
        torch.manual_seed(11)
        x_in = x.clone().requires_grad_(True)
        out = run(x_in)
        # Reentrant checkpointing runs the forward under no_grad: a loss kept on the layer has no graph then.
        loss_term = 0.0 if use_reentrant else module.aux_loss
        results.append((out, grads_by_backward(module, x_in, out + loss_term)))
    (out_p, grads_p), (out_c, grads_c) = results
    torch.testing.assert_close(out_c, out_p, rtol=0, atol=0)
    for n in grads_p:
        torch.testing.assert_close(grads_c[n], grads_p[n], rtol=1e-6, atol=1e-7, msg=lambda m: f"{n}: {m}")
    if hasattr(layer.gate, "step_load_E"):
        assert torch.equal(ckpt.gate.step_load_E, layer.gate.step_load_E)
