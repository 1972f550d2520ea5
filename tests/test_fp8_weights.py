"""FP8 weights quantised once a step and kept until they change (#49, `fmoe.kernels.fp8_weights`): exact
counts of the quantisations a step runs, every way a weight can change dropping its copy, and training
with the cache equal, bit for bit, to quantising at every use. Every test name contains "fp8"."""
import copy
import gc

import pytest
import torch

import fmoe
from fmoe.kernels import fp8, fp8_weights

D, H, E, T = 64, 32, 4, 48


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch):
    monkeypatch.delenv("FMOE_FP8_WEIGHT_CACHE", raising=False)
    fp8_weights.forget_quantised_weights()
    fp8_weights.reset_counts()
    yield
    fp8_weights.forget_quantised_weights()


def make_layer(recipe, **kwargs):
    torch.manual_seed(0)
    return fmoe.FMoETransformerMLP(num_expert=E, d_model=D, d_hidden=H, top_k=2, fp8=recipe, **kwargs)


def batch(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, D, generator=g), torch.randn(T, D, generator=g)


def micro_step(layer, seed):
    x, probe = batch(seed)
    (layer(x.requires_grad_(True)) * probe).sum().backward()


# Weights the experts hold (w1, w2) times the orientations a recipe quantises (blockwise: one, both GEMMs).
ORIENTATIONS = {"blockwise": 1, "rowwise": 2, "mxfp8": 2}


@pytest.mark.parametrize("recompute", ["activation", "experts"])
@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_fp8_weights_quantised_once_a_step_across_micro_batches(recipe, recompute):
    """Three micro-batches (forward, recompute, backward each) quantise each weight once per orientation;
    every other use finds the copy: 3 uses a micro-batch per weight (forward, input gradient, and the
    recomputed forward under recompute="experts")."""
    layer = make_layer(recipe, recompute=recompute)
    for seed in range(3):
        micro_step(layer, seed)
    counts = fp8_weights.counts()
    assert counts["quantised"] == 2 * ORIENTATIONS[recipe]
    uses = 3 * 2 * (3 if recompute == "experts" else 2)
    assert counts["quantised"] + counts["reused"] == uses


@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_fp8_weights_cached_training_equals_quantising_at_every_use(recipe, monkeypatch):
    """Four optimiser steps of two micro-batches each: parameters bit-identical with the cache and with
    FMOE_FP8_WEIGHT_CACHE=0; the optimiser's step drops the copies, so each step quantises again."""
    def train(cache: bool):
        monkeypatch.setenv("FMOE_FP8_WEIGHT_CACHE", "1" if cache else "0")
        fp8_weights.reset_counts()
        layer = make_layer(recipe)
        opt = torch.optim.AdamW(layer.parameters(), lr=1e-2)
        for step in range(4):
            for micro in range(2):
                micro_step(layer, 10 * step + micro)
            opt.step()
            opt.zero_grad()
        return {k: v.detach().clone() for k, v in layer.state_dict().items()}, fp8_weights.counts()

    cached, counts = train(True)
    uncached, uncached_counts = train(False)
    for name in cached:
        assert torch.equal(cached[name], uncached[name]), name
    assert counts["quantised"] == 4 * 2 * ORIENTATIONS[recipe]
    assert uncached_counts == {"quantised": 4 * 2 * 2 * 2, "reused": 0}


def expert_output(layer, x):
    with torch.no_grad():
        return layer(x)


@pytest.mark.parametrize("change", ["in_place", "load_state_dict", "data_assigned", "data_copy_then_forget"])
def test_fp8_weights_a_changed_weight_is_quantised_again(change):
    """Each way of changing a weight outside an optimiser step gives the output of a layer that never
    cached anything (a fresh copy with the changed weights)."""
    layer = make_layer("blockwise")
    x, _ = batch(0)
    expert_output(layer, x)
    w = layer.experts.w1_eDF
    new = w.detach() * 0.5 + 0.01
    if change == "in_place":
        with torch.no_grad():
            w.mul_(0.5).add_(0.01)
    elif change == "load_state_dict":
        state = layer.state_dict()
        state["experts.w1_eDF"] = new
        layer.load_state_dict(state)
    elif change == "data_assigned":
        w.data = new.clone()
    else:       # .data writes keep the version counter: the documented call drops the copies
        w.data.copy_(new)
        fp8_weights.forget_quantised_weights()
    torch.testing.assert_close(layer.experts.w1_eDF.detach(), new, rtol=0, atol=0)
    fresh = copy.deepcopy(layer)
    fp8_weights.forget_quantised_weights()
    assert torch.equal(expert_output(layer, x), expert_output(fresh, x))


def test_fp8_weights_copy_freed_with_its_weight():
    """The cache holds its weights weakly: a layer's copies go when the layer does."""
    layer = make_layer("rowwise")
    expert_output(layer, batch(0)[0])
    assert len(fp8_weights._entries) == 2
    del layer
    gc.collect()
    assert len(fp8_weights._entries) == 0


def test_fp8_weights_the_optimiser_step_frees_the_copies():
    layer = make_layer("mxfp8")
    micro_step(layer, 0)
    assert fp8_weights._entries
    torch.optim.SGD(layer.parameters(), lr=0.1).step()
    assert not fp8_weights._entries


@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_fp8_weights_cached_copy_equals_quantising_now(recipe):
    """Both orientations of a cached copy hold exactly what quantising the weight (or its transpose) gives."""
    w = torch.randn(3, 160, 72)
    for transposed in (False, True):
        for _ in range(2):      # the second call reads the cache
            q = fp8_weights.quantised_weight(w, recipe, transposed)
            want = fp8.quantise_weight(w.transpose(-1, -2) if transposed else w, recipe)
            assert torch.equal(fp8.dequantise(q), fp8.dequantise(want))
    assert fp8_weights.counts()["quantised"] == ORIENTATIONS[recipe]
