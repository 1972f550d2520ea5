"""torch.compile and sync-freedom: compiled layers equal eager ones, and no host reads.

Compiled with backend="aot_eager": Dynamo and AOTAutograd trace the whole layer and its backward
through the `fmoe::` custom ops' fake implementations (what fullgraph checks); Inductor's code
generation adds minutes of C++ compiling per case on a CPU and is left to the benchmark.
"""
import contextlib
import copy

import pytest
import torch
from torch import nn

import fmoe
from fmoe import kernels
from fmoe.kernels import ops, torch_ops
from fmoe.routing import RoutingPlan
from tests import dist_workers
from tests.dist_utils import run_ranks
from tests.reference import grads_of, per_token_moe

D, H, E = 8, 16, 4


def make_layer(gate="naive", top_k=2, dtype=torch.float32, backend=None, expert=None, **gate_kwargs):
    torch.manual_seed(0)
    kw = dict(expert=expert) if expert is not None else dict(d_hidden=H)
    layer = fmoe.FMoETransformerMLP(num_expert=E, d_model=D, top_k=top_k, gate=gate, backend=backend,
                                    gate_kwargs=gate_kwargs, **kw)
    return layer.to(dtype)


def check_compiled_equals_eager(layer, T=6, fullgraph=True, dtype=torch.float32):
    """Outputs and every gradient of the compiled layer equal those of an eager copy."""
    eager = copy.deepcopy(layer)
    compiled = torch.compile(layer, fullgraph=fullgraph, backend="aot_eager")
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(7)).to(dtype)
    results = []
    for module, run in ((eager, eager), (layer, compiled)):
        torch.manual_seed(3)            # the same noise for the noisy gates
        x_in = x.clone().requires_grad_(True)
        out = run(x_in)
        results.append((out, grads_of(module, x_in, out)))
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    (out_e, grads_e), (out_c, grads_c) = results
    torch.testing.assert_close(out_c, out_e, **tol)
    assert grads_c.keys() == grads_e.keys()
    for name in grads_e:
        torch.testing.assert_close(grads_c[name], grads_e[name], **tol, msg=lambda m: f"grad of {name}: {m}")
    return out_e


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield


@pytest.mark.parametrize("gate,top_k,gate_kwargs", [
    ("naive", 2, {}),
    ("naive", 2, {"capacity": 0.5}),
    ("noisy", 2, {}),
    ("gshard", 2, {}),                      # capacity (1.2, 2.4) and random routing
    ("switch", 1, {}),                      # capacity (1.2, 2.4) and logit noise
    ("balanced", 2, {"capacity": 0.5}),
])
def test_compiled_equals_eager_every_gate(gate, top_k, gate_kwargs):
    layer = make_layer(gate, top_k, **gate_kwargs).train()
    check_compiled_equals_eager(layer, T=8)


def test_faster_gate_compiles_whole():
    # FasterGate computes both outcomes of its outgoing-slot cap and keeps one on the device.
    check_compiled_equals_eager(make_layer("faster", 2, capacity=0.5).train(), T=8)


@pytest.mark.parametrize("top_k,dtype,T", [
    (1, torch.float32, 5), (2, torch.bfloat16, 5), (3, torch.float32, 1), (4, torch.bfloat16, 1),
    (2, torch.float32, 0), (4, torch.float32, 3),
])
def test_compiled_equals_eager_top_k_dtypes_and_tiny_inputs(top_k, dtype, T):
    check_compiled_equals_eager(make_layer("naive", top_k, dtype), T=T, dtype=dtype)


@pytest.mark.parametrize("gate,top_k,gate_kwargs", [("naive", 3, {}), ("gshard", 2, {"capacity": 0.5})])
def test_compiled_equals_eager_triton_interpreter(gate, top_k, gate_kwargs):
    pytest.importorskip("triton")
    layer = make_layer(gate, top_k, backend="triton", **gate_kwargs).train()
    check_compiled_equals_eager(layer, T=5)


class UserExpert(nn.Module):
    def __init__(self, d_model):
        super().__init__()
        self.fc = nn.Linear(d_model, 12)
        self.out = nn.Linear(12, d_model)

    def forward(self, x):
        return self.out(torch.tanh(self.fc(x)))


def test_user_expert_class_compiles_with_a_graph_break():
    # The per-expert split sizes are read on the host: a graph break, hence fullgraph=False.
    layer = make_layer("naive", 2, expert=UserExpert, capacity=0.5)
    out = check_compiled_equals_eager(layer, T=7, fullgraph=False)
    x = torch.randn(7, D, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(out, per_token_moe(layer, x)[0], atol=1e-5, rtol=1e-5)


@contextlib.contextmanager
def no_host_reads():
    """Every way a tensor's value reaches Python raises while this is open."""
    def refuse(name):
        def raiser(*args, **kwargs):
            raise AssertionError(f"Tensor.{name} read a tensor value back to the host")
        return raiser
    names = ("item", "tolist", "__bool__", "__int__", "__index__", "__float__")
    saved = {name: getattr(torch.Tensor, name) for name in names}
    try:
        for name in names:
            setattr(torch.Tensor, name, refuse(name))
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


def test_no_host_reads_guard_works():
    with no_host_reads(), pytest.raises(AssertionError, match="host"):
        torch.ones(2).sum().item()


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("gate,top_k,gate_kwargs", [
    ("naive", 2, {}), ("naive", 3, {"capacity": 0.5}), ("gshard", 2, {}), ("switch", 1, {}),
    ("balanced", 2, {"capacity": 0.5}),
])
def test_single_rank_forward_backward_reads_nothing_on_the_host(backend, gate, top_k, gate_kwargs, monkeypatch):
    if backend == "triton":
        pytest.importorskip("triton")
    else:
        if not torch_ops.grouped_mm_runs_on("cpu"):
            pytest.skip("the torch backend keeps counts on the device only with torch._grouped_mm's CPU kernel")
        monkeypatch.setenv("FMOE_SYNC_FREE", "1")     # the torch backend's sync-free path, in eager mode
    layer = make_layer(gate, top_k, backend=backend, **gate_kwargs).train()
    reference = copy.deepcopy(layer)
    x = torch.randn(6, D, generator=torch.Generator().manual_seed(1), requires_grad=True)
    torch.manual_seed(3)
    with no_host_reads():
        out = layer(x)
        out.pow(2).sum().backward()
    monkeypatch.delenv("FMOE_SYNC_FREE", raising=False)
    torch.manual_seed(3)
    x_ref = x.detach().clone().requires_grad_(True)
    out_ref = reference(x_ref)      # the eager CPU path (host counts) for torch; the same kernels for triton
    out_ref.pow(2).sum().backward()
    torch.testing.assert_close(out, out_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-5, rtol=1e-5)
    for (name, p), q in zip(layer.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-5, msg=lambda m: f"grad of {name}: {m}")


def test_plan_has_every_slot_as_a_row_dropped_ones_last():
    idx_TK = torch.tensor([[2, -1], [0, 2], [-1, 1]])
    plan = RoutingPlan.build(idx_TK, 3)
    assert plan.num_rows == 6
    assert plan.counts_E.tolist() == [1, 1, 2]
    assert plan.slot_N.tolist() == [2, 5, 0, 3, 1, 4]
    assert plan.row_of_slot_TK.tolist() == [[2, -1], [0, 3], [-1, 1]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sync_free_grouped_mm_equals_the_loop_and_zeroes_rows_past_the_segments(dtype):
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 2])
    x = torch.randn(7, 8, generator=g).to(dtype)                       # 2 rows past the segments
    w = torch.randn(3, 8, 4, generator=g).to(dtype)
    b = torch.randn(3, 4, generator=g).to(dtype)
    results = []
    for sync_free in (False, True):
        xs, ws, bs = (t.clone().requires_grad_(True) for t in (x, w, b))
        y = ops.grouped_mm(xs, ws, counts, bs, "torch_sync_free" if sync_free else "torch")
        y.backward(torch.ones_like(y))
        results.append((y, xs.grad, ws.grad, bs.grad))
    for loop, free in zip(*results):
        torch.testing.assert_close(free, loop, atol=1e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2)
    assert not results[1][0][5:].any()


def test_custom_ops_pass_opcheck():
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([2, 0, 3])
    x = torch.randn(6, 8, generator=g, requires_grad=True)
    w = torch.randn(3, 8, 4, generator=g, requires_grad=True)
    b = torch.randn(3, 4, generator=g, requires_grad=True)
    w2 = torch.randn(3, 4, 8, generator=g, requires_grad=True)
    b2 = torch.randn(3, 8, generator=g, requires_grad=True)
    plan = RoutingPlan.build(torch.tensor([[0, 2], [2, -1], [0, 2]]), 3)
    x_TD = torch.randn(3, 8, generator=g, requires_grad=True)
    weight_TK = torch.rand(3, 2, generator=g, requires_grad=True)
    for impl in ("torch", "torch_sync_free"):
        torch.library.opcheck(ops.grouped_mm, (x, w, counts, b, impl))
        torch.library.opcheck(ops.permute, (x_TD, plan.token_N, plan.row_of_slot_TK, impl))
        torch.library.opcheck(ops.unpermute, (x, weight_TK, plan.token_N, plan.slot_N, plan.row_of_slot_TK, impl))
        torch.library.opcheck(ops.gather_grouped_mm,
                              (x_TD, plan.token_N, w, counts, plan.row_of_slot_TK, b, impl))
        for keep_hidden in (True, False):
            torch.library.opcheck(ops.routed_mlp, (x_TD, plan.token_N, plan.slot_N, plan.row_of_slot_TK, plan.counts_E,
                                                   weight_TK, "gelu", w, w2, b, b2, keep_hidden, impl))
    torch.library.opcheck(ops.expert_mlp_with_hidden, (x, counts, "gelu", w, w2, b, b2))


def test_kernels_choose_the_sync_free_path_when_compiling(monkeypatch):
    x = torch.zeros(2, 8)
    monkeypatch.delenv("FMOE_SYNC_FREE", raising=False)
    assert not kernels.sync_free(x)
    assert kernels.fused_expert_mlp_applies(x, "gelu")
    assert torch.compile(lambda t: t + kernels.sync_free(t), fullgraph=True, backend="eager")(x).eq(1).all()
    monkeypatch.setenv("FMOE_SYNC_FREE", "1")
    assert kernels.sync_free(x) and not kernels.fused_expert_mlp_applies(x, "gelu")


def test_expert_parallel_compiled_equals_eager_on_two_ranks():
    run_ranks(dist_workers.check_compiled_layer_matches_eager, 2)


@pytest.mark.parametrize("gate, gate_kwargs", [("naive", None), ("router", {"aux_loss": "sequence"})])
def test_compiled_layer_compiles_once_more_for_new_token_counts(gate, gate_kwargs):
    """#53 case 8: a compiled layer does not recompile for every token count (prefill then decode, a
    short last batch): the first count compiles, the second compiles dynamic, later ones reuse it."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    layer = fmoe.FMoETransformerMLP(num_expert=4, d_model=16, d_hidden=16, top_k=2, gate=gate, gate_kwargs=gate_kwargs)
    compiled = torch.compile(layer, backend="aot_eager")
    for length in (5, 7, 9):
        compiled(torch.randn(2, length, 16)).sum().backward()
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
    torch._dynamo.reset()
