"""Router replay at the experts seam (#53, item 2): a seam-converted model records which experts each
token went to (`fmoe.record_routing`) and replays a trace (`fmoe.replay_routing`) through its family's
own router, whose top-k returns the recorded experts and whose code weighs them."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

import fmoe  # noqa: E402
import fmoe.integrations.hf  # noqa: E402
from fmoe.integrations.hf.seam import seam_layers  # noqa: E402
from fmoe.integrations.hf.seam_replay import filled_choice  # noqa: E402
from tests.hf_families import (assert_close_fp32, assert_same_run, build_error, forward_backward, tiny,  # noqa: E402
                               tokens)


def softmax_normalised(router, h, idx):
    probs = torch.softmax(torch.nn.functional.linear(h, router.weight), dim=-1, dtype=torch.float)
    w = probs.gather(1, idx)
    return w / w.sum(dim=-1, keepdim=True) if router.norm_topk_prob else w


def sigmoid_scaled(router, h, idx):
    w = torch.nn.functional.linear(h.float(), router.weight.float()).sigmoid().gather(1, idx)
    if router.norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * router.routed_scaling_factor


def softmax_of_chosen_logits(router, h, idx):
    return torch.softmax(torch.nn.functional.linear(h, router.weight, router.bias).gather(1, idx), dim=1)


def sigmoid_normalised(router, h, idx):
    w = torch.nn.functional.linear(h, router.weight).float().sigmoid().gather(1, idx)
    return w / w.sum(dim=-1, keepdim=True)


# Each family's router weighs its chosen experts by these formulas (read from transformers' routers):
# the weights a replay must hand the experts for any experts the trace names.
WEIGHED = {"qwen3_moe": softmax_normalised, "deepseek_v3": sigmoid_scaled, "glm4_moe": sigmoid_scaled,
           "gpt_oss": softmax_of_chosen_logits, "minimax_m2": sigmoid_normalised}
FAMILIES = sorted(WEIGHED)


def seam_model(name, **options):
    if build_error(name):
        pytest.xfail(build_error(name))
    return fmoe.integrations.hf.convert(tiny(name), seam=True, **options)


def router_of(layer_name, model):
    block = model.get_submodule(layer_name.rpartition(".")[0])
    return block.gate if hasattr(block, "gate") else block.router


def random_trace(model, like, seed=5):
    """A trace of `like`'s shape naming K distinct random experts per token."""
    g = torch.Generator().manual_seed(seed)
    E = seam_layers(model)[0][1].gate.tot_expert
    return fmoe.RoutingTrace({name: [torch.stack([torch.randperm(E, generator=g)[:e.shape[1]] for _ in range(len(e))])
                                     for e in entries] for name, entries in like.layers.items()})


@pytest.mark.parametrize("name", FAMILIES)
def test_seam_replay_of_the_recorded_trace_reproduces_the_run(name):
    model = seam_model(name)
    model.train()
    ids = tokens()
    with fmoe.record_routing(model) as trace:
        want = forward_backward(model, ids)
    assert sorted(trace.names) == sorted(n for n, _ in seam_layers(model))
    with fmoe.replay_routing(model, trace):
        got = forward_backward(model, ids)
    assert_same_run(got, want, f"{name} replaying its own trace")


@pytest.mark.parametrize("name", FAMILIES)
def test_seam_replay_of_another_trace_routes_to_it_weighed_by_the_family_router(name):
    """Every slot goes to the trace's expert, weighed by the family's router from its scores at that
    expert; the statistics count the replayed choice and the router's weight still gets a gradient."""
    model = seam_model(name)
    ids = tokens()
    with fmoe.record_routing(model) as recorded:
        forward_backward(model, ids)
    trace = random_trace(model, recorded)
    assert any(not torch.equal(a, b) for n in trace.names for a, b in zip(trace[n], recorded[n]))
    handed, router_inputs = {}, {}

    def keep(into, key, value):             # a pre-hook that returns something replaces the call's arguments
        into[key] = value

    for layer_name, layer in seam_layers(model):
        layer.register_forward_pre_hook(lambda m, a, n=layer_name: keep(handed, n, a[1:]))
        router_of(layer_name, model).register_forward_pre_hook(
            lambda m, a, n=layer_name: keep(router_inputs, n, a[0].detach().reshape(-1, a[0].shape[-1])))
    with fmoe.replay_routing(model, trace):
        forward_backward(model, ids)
    for layer_name, layer in seam_layers(model):
        (want_idx,) = trace[layer_name]
        idx, weights = handed[layer_name]
        assert torch.equal(idx.long(), want_idx), layer_name
        want_w = WEIGHED[name](router_of(layer_name, model), router_inputs[layer_name], want_idx)
        assert_close_fp32(weights.detach(), want_w.detach().to(weights.dtype), f"{name} {layer_name}: replayed weights")
        assert torch.equal(layer.last_counts_E, torch.bincount(want_idx.flatten(), minlength=layer.num_expert))
        assert router_of(layer_name, model).weight.grad.abs().sum() > 0


def test_seam_replay_fills_a_dropped_slot_from_the_router_and_reproduces_a_run_with_capacity():
    """A capacity-dropped slot is -1 in the trace; replaying fills it, for the router's normalisation,
    with the best expert the token's other slots do not name, and sends it nowhere."""
    model = seam_model("qwen3_moe", capacity=0.5)
    ids = tokens()
    with fmoe.record_routing(model) as trace:
        want = forward_backward(model, ids)
    assert any(bool((entry < 0).any()) for n in trace.names for entry in trace[n])
    with fmoe.replay_routing(model, trace):
        got = forward_backward(model, ids)
    assert_same_run(got, want, "qwen3_moe with capacity 0.5 replaying its own trace")
    for layer_name, layer in seam_layers(model):
        assert layer.last_num_unrouted == int((trace[layer_name][0] < 0).sum())


def test_seam_filled_choice_takes_the_best_unnamed_experts_in_slot_order():
    scores = torch.tensor([[0.1, 0.9, 0.5, 0.7], [0.4, 0.3, 0.2, 0.1]])
    recorded = torch.tensor([[2, -1, -1], [-1, 3, 0]])
    assert filled_choice(scores, recorded).tolist() == [[2, 1, 3], [1, 3, 0]]
    whole = torch.tensor([[3, 1, 0], [0, 1, 2]])
    assert filled_choice(scores, whole) is whole


def test_seam_replay_refuses_a_router_it_cannot_steer_and_holds_its_own_choice():
    """PhiMoE's sparsemixer chooses without a top-k: replaying its own recorded choice holds, another
    trace is refused in one line naming the layer."""
    model = seam_model("phimoe")
    ids = tokens()
    with fmoe.record_routing(model) as recorded:
        want = forward_backward(model, ids)
    with fmoe.replay_routing(model, recorded):
        assert_same_run(forward_backward(model, ids), want, "phimoe replaying its own trace")
    with pytest.raises(ValueError, match=r"cannot replay layer 'model\.layers\.\d\.mlp\.experts': "
                                         r"PhimoeSparseMoeBlock's router chooses its experts without a top-k"):
        with fmoe.replay_routing(model, random_trace(model, recorded)):
            forward_backward(model, ids)


def test_seam_replay_refuses_a_layer_called_outside_its_block():
    model = seam_model("qwen3_moe")
    name, layer = seam_layers(model)[0]
    trace = fmoe.RoutingTrace({n: [torch.tensor([[0, 1], [2, 3]])] for n, _ in seam_layers(model)})
    with fmoe.replay_routing(model, trace):
        with pytest.raises(RuntimeError, match="called outside its family's block"):
            layer(torch.randn(2, layer.d_model), torch.tensor([[0, 1], [2, 3]]), torch.ones(2, 2))
