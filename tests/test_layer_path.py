"""Following x through a forward of the layer on one rank (#38): every call stays in the engine,
goes down the import order, and the layer enters each of its parts once, in the diagram's order.

The trace is Python's profiler over one forward: an *entry* is a call whose function lives in
another fmoe module than its nearest fmoe caller (torch's frames in between, such as
`nn.Module.__call__`, do not count; a generator resumed is not a new entry).
"""
import inspect
import sys

import pytest
import torch

import fmoe
from tests.test_import_graph import import_graph

# The engine: the layer, its adapters and parts, the gates, the routing plan, the experts, the kernels.
ENGINE = ("fmoe.layer", "fmoe.tokens", "fmoe.dispatch", "fmoe.expert_calls", "fmoe.experts", "fmoe.routing",
          "fmoe.shared_experts", "fmoe.autocast", "fmoe.env", "fmoe.gates", "fmoe.kernels")


def entries_of(layer, x):
    """[(caller module, callee module, function, virtual)] of one forward of `layer` on x; `virtual`:
    the callee overrides a method of a class of the caller's module."""
    found = []

    def fmoe_caller(frame):
        frame = frame.f_back
        while frame is not None and not frame.f_globals.get("__name__", "").startswith("fmoe"):
            frame = frame.f_back
        return None if frame is None else frame.f_globals["__name__"]

    def profile(frame, event, arg):
        resumed = frame.f_code.co_flags & inspect.CO_GENERATOR and frame.f_lasti > 0
        if event != "call" or resumed:
            return
        module = frame.f_globals.get("__name__", "")
        caller = fmoe_caller(frame)
        if module.startswith("fmoe") and caller is not None and caller != module:
            # A method overriding one of the caller's classes (a gate's `route`) is the caller's own call.
            me = frame.f_locals.get("self")
            virtual = me is not None and caller in {c.__module__ for c in type(me).__mro__}
            found.append((caller, module, frame.f_code.co_name, virtual))
    sys.setprofile(profile)
    try:
        layer(x)
    finally:
        sys.setprofile(None)
    return found


def below(graph: dict) -> dict:
    """{module: every module it imports, directly or through others}."""
    reach = {}

    def walk(module):
        if module not in reach:
            reach[module] = set()
            for m in graph.get(module, ()):
                reach[module] |= {m} | walk(m)
        return reach[module]
    for module in graph:
        walk(module)
    return reach


@pytest.mark.parametrize("kwargs", [dict(), dict(recompute="none"), dict(activation="swiglu"),
                                    dict(shared_expert=8, shared_expert_gate=True), dict(gate="router")])
def test_following_x_stays_in_the_engine_and_goes_down(kwargs):
    torch.manual_seed(0)
    layer = fmoe.FMoETransformerMLP(num_expert=4, d_model=8, d_hidden=16, top_k=2, **kwargs)
    x = torch.randn(2, 3, 8)
    layer(x)            # the first call may build caches; the path is the second's
    entries = entries_of(layer, x)
    assert entries, "the profiler saw no call"
    outside = {m for _, m, _, _ in entries if not m.startswith(ENGINE)}
    assert not outside, f"x leaves the engine into {sorted(outside)}"
    reach = below(import_graph())
    # A call climbs back up when the callee imports its caller: the path must only go down.
    climbs = [(c, m, f) for c, m, f, virtual in entries if c in reach.get(m, ()) and not virtual]
    assert not climbs, f"calls back up the import order: {climbs}"
    # The layer runs its parts once each, in the diagram's order.
    from_layer = [(m, f) for c, m, f, _ in entries if c == "fmoe.layer"]
    parts = [m for m, _ in from_layer]
    expected = ["fmoe.tokens", "fmoe.gates", "fmoe.autocast", "fmoe.tokens", "fmoe.dispatch", "fmoe.shared_experts",
                "fmoe.dispatch", "fmoe.tokens", "fmoe.shared_experts", "fmoe.tokens"]
    assert [p.split(".")[0] + "." + p.split(".")[1] for p in parts] == expected, from_layer
    # The kernels' seam: the lean path's one op; the plain path's permute, MLP (is the fused CPU MLP
    # for these rows? then it) and unpermute.
    kernels_entries = [f for _, m, f, _ in entries if m == "fmoe.kernels"]
    lean = kwargs.get("recompute") != "none"
    routed = ["run"] if lean else ["permute", "fused_expert_mlp_applies", "run", "unpermute"]
    shared = ["run"] if "shared_expert" in kwargs else []      # the shared expert's lean MLP
    assert kernels_entries == routed + shared
