"""The Triton kernels against the torch path: outputs and every gradient.

On a machine without a GPU, tests/conftest.py has set TRITON_INTERPRET=1 before anything
imports triton, so the kernels run in Triton's interpreter on CPU tensors (tiny shapes: it is
slow). On a GPU the same tests run compiled (benchmarks/gpu_check.sh runs them there).
"""
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fmoe
from fmoe import kernels
from fmoe.routing import RoutingPlan

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = Path(__file__).resolve().parent.parent
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Loose enough for a different summation order in 16-bit outputs of size ~1.
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=1e-2, rtol=1e-2),
       torch.bfloat16: dict(atol=5e-2, rtol=3e-2)}


def leaves(*tensors):
    return [t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors]


class Backend:
    """The seam's ops with `backend=` fixed: what `run_both` hands its function."""

    def __init__(self, name):
        self.name = name

    def __getattr__(self, op):
        return functools.partial(getattr(kernels, op), backend=self.name)


def run_both(fn_of_ops, inputs, seed=0):
    """fn_of_ops(ops, *inputs) on each backend: (outputs, grads of the float inputs) per backend."""
    results = []
    for ops in (Backend("triton"), Backend("torch")):
        args = leaves(*inputs)
        out = fn_of_ops(ops, *args)
        probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out)
        floats = [a for a in args if a.requires_grad]
        grads = torch.autograd.grad(out, floats, probe, allow_unused=True)
        results.append((out, [g if g is not None else torch.zeros_like(a) for g, a in zip(grads, floats)]))
    return results


def assert_same(results, dtype, names):
    (out, grads), (ref, ref_grads) = results
    torch.testing.assert_close(out, ref, **TOL[dtype])
    for name, g, r in zip(names, grads, ref_grads):
        torch.testing.assert_close(g, r, **TOL[dtype], msg=lambda m: f"grad of {name}: {m}")


def expert_inputs(counts, I, O, dtype, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    N, E = sum(counts), len(counts)
    x = torch.randn(N, I, generator=g)
    w = torch.randn(E, I, O, generator=g) / I ** 0.5
    out = [x.to(DEVICE, dtype), w.to(DEVICE, dtype), torch.tensor(counts, device=DEVICE)]
    if bias:
        out.append(torch.randn(E, O, generator=g).to(DEVICE, dtype))
    return out


COUNTS = {
    "empty_and_single_and_partial": [0, 1, 17, 0, 30],
    "one_expert_holds_all": [0, 0, 40, 0],
    "nine_experts": [3, 0, 16, 5, 0, 0, 9, 1, 2],
    "single_expert": [37],
    "no_rows": [0, 0, 0],
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", COUNTS)
def test_grouped_mm(case, dtype):
    bias = case != "one_expert_holds_all"
    inputs = expert_inputs(COUNTS[case], 24, 20, dtype, bias=bias)
    results = run_both(lambda ops, x, w, c, *b: ops.grouped_mm(x, w, c, *b), inputs)
    assert_same(results, dtype, ["x", "w", "bias"])


def test_grouped_mm_strided_operands():
    """A transposed weight view (FMoELinear's) and rows with a stride wider than their width."""
    x, w, counts = expert_inputs([5, 0, 19], 16, 24, torch.float32)
    x_wide = torch.cat([x, torch.randn_like(x)], dim=1)[:, :16]
    w_t = w.transpose(1, 2).contiguous().transpose(1, 2)
    assert not x_wide.is_contiguous() and not w_t.is_contiguous()
    results = run_both(lambda ops, x_, w_, c: ops.grouped_mm(x_, w_, c), [x_wide, w_t, counts])
    assert_same(results, torch.float32, ["x", "w"])


def make_plan(T, K, E, drop_every=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx_TK = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K].contiguous()    # K distinct experts a token
    if drop_every:
        idx_TK.view(-1)[::drop_every] = -1
    weight_TK = torch.rand(T, K, generator=g).masked_fill(idx_TK < 0, 0.0)
    return RoutingPlan.build(idx_TK.to(DEVICE), E), weight_TK.to(DEVICE)


PLANS = {"plain": (13, 2, 4, 0), "dropped_slots": (13, 3, 5, 4), "all_dropped": (6, 2, 3, 1), "no_tokens": (0, 2, 3, 0)}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", PLANS)
def test_permute(case, dtype):
    plan, _ = make_plan(*PLANS[case])
    x = torch.randn(plan.num_tokens, 20).to(DEVICE, dtype)
    results = run_both(lambda ops, x_: ops.permute(x_, plan), [x])
    assert torch.equal(results[0][0], results[1][0])
    assert_same(results, dtype, ["x"])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", PLANS)
def test_unpermute(case, dtype):
    plan, weight_TK = make_plan(*PLANS[case])
    y = torch.randn(plan.num_rows, 20).to(DEVICE, dtype)
    results = run_both(lambda ops, y_, w_: ops.unpermute(y_, plan, w_), [y, weight_TK.to(dtype)])
    assert_same(results, dtype, ["y", "weight_TK"])
    if case == "dropped_slots":
        dropped = plan.row_of_slot_TK < 0
        assert dropped.any() and (results[0][1][1][dropped] == 0).all()


def test_unpermute_fp32_weights_on_16bit_rows():
    """Gate weights stay fp32 while the rows are bf16; the weight gradient comes back fp32."""
    plan, weight_TK = make_plan(*PLANS["dropped_slots"])
    y = torch.randn(plan.num_rows, 20).to(DEVICE, torch.bfloat16)
    results = run_both(lambda ops, y_, w_: ops.unpermute(y_, plan, w_), [y, weight_TK])
    assert results[0][1][1].dtype == torch.float32
    assert_same(results, torch.bfloat16, ["y", "weight_TK"])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ["plain", "dropped_slots", "no_tokens"])
def test_gather_grouped_mm(case, dtype):
    assert_gather_grouped_mm_agrees(case, dtype, width=24)


def assert_gather_grouped_mm_agrees(case, dtype, width):
    """gather_grouped_mm on plan PLANS[case], x `width` wide, Triton against torch."""
    plan, _ = make_plan(*PLANS[case])
    g = torch.Generator().manual_seed(0)
    E = plan.counts_E.numel()
    x = torch.randn(plan.num_tokens, width, generator=g).to(DEVICE, dtype)
    w = (torch.randn(E, width, 16, generator=g) / width ** 0.5).to(DEVICE, dtype)
    b = torch.randn(E, 16, generator=g).to(DEVICE, dtype)

    def fn(ops, x_, w_, b_):
        return ops.gather_grouped_mm(x_, plan.token_N, w_, plan.counts_E, plan.row_of_slot_TK, b_)

    results = run_both(fn, [x, w, b])
    assert_same(results, dtype, ["x", "w", "bias"])


def test_gather_grouped_mm_equals_permute_then_grouped_mm():
    plan, _ = make_plan(*PLANS["dropped_slots"])
    x = torch.randn(plan.num_tokens, 16, device=DEVICE)
    w = torch.randn(plan.counts_E.numel(), 16, 16, device=DEVICE)
    fused = kernels.gather_grouped_mm(x, plan.token_N, w, plan.counts_E, plan.row_of_slot_TK, backend="triton")
    unfused = kernels.grouped_mm(kernels.permute(x, plan, backend="triton"), w, plan.counts_E, backend="triton")
    torch.testing.assert_close(fused, unfused, **TOL[torch.float32])


def test_sums_are_deterministic():
    plan, weight_TK = make_plan(*PLANS["dropped_slots"])
    y = torch.randn(plan.num_rows, 20, device=DEVICE, requires_grad=True)
    first = kernels.unpermute(y, plan, weight_TK, backend="triton")
    (grad_first,) = torch.autograd.grad(first.sum(), y)
    second = kernels.unpermute(y, plan, weight_TK, backend="triton")
    (grad_second,) = torch.autograd.grad(second.sum(), y)
    assert torch.equal(first, second) and torch.equal(grad_first, grad_second)


@pytest.mark.skipif(DEVICE != "cuda", reason="host synchronisation only exists on a GPU")
def test_no_host_sync():
    x, w, counts, b = (t.requires_grad_(t.is_floating_point()) for t in
                       expert_inputs([0, 1, 17, 0, 30], 64, 32, torch.bfloat16, bias=True))
    kernels.grouped_mm(x, w, counts, b, backend="triton").sum().backward()    # autotuning synchronises; do it first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        kernels.grouped_mm(x, w, counts, b, backend="triton").sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_bad_input_names_the_argument():
    x, w, counts = expert_inputs([2, 3], 8, 8, torch.float32)
    with pytest.raises(TypeError, match="w_eIO"):
        kernels.grouped_mm(x, w.half(), counts, backend="triton")
    with pytest.raises(ValueError, match="counts_e"):
        kernels.grouped_mm(x, w, counts[:1], backend="triton")
    with pytest.raises(ValueError, match="x_NI"):
        kernels.grouped_mm(x[None], w, counts, backend="triton")
    with pytest.raises(ValueError, match="bias_eO"):
        kernels.grouped_mm(x, w, counts, torch.zeros(2, 3, device=DEVICE), backend="triton")
    plan, weight_TK = make_plan(*PLANS["plain"])
    with pytest.raises(ValueError, match="weight_TK"):
        kernels.unpermute(torch.zeros(plan.num_rows, 4, device=DEVICE), plan, weight_TK[:, :1], backend="triton")


@pytest.mark.skipif(DEVICE == "cuda", reason="checks the message for CPU tensors without the interpreter")
def test_cpu_tensors_without_interpreter_fail_clearly(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, w, counts = expert_inputs([2, 3], 8, 8, torch.float32)
    with pytest.raises(ValueError, match="CUDA tensors"):
        kernels.grouped_mm(x, w, counts, backend="triton")


def test_backend_report(monkeypatch):
    monkeypatch.delenv("FMOE_BACKEND", raising=False)
    report = kernels.backend_report()
    assert report["importable"] == {"torch": True, "triton": True}
    assert report["cpu_tensors"] == "torch (not CUDA)"
    assert report["TRITON_INTERPRET"] == (os.environ.get("TRITON_INTERPRET") == "1")
    monkeypatch.setenv("FMOE_BACKEND", "triton")
    assert kernels.backend_report()["cpu_tensors"] == "triton (FMOE_BACKEND)"
    monkeypatch.setenv("FMOE_BACKEND", "cutlass")
    assert kernels.backend_report()["cpu_tensors"].startswith("error: ")


@pytest.mark.parametrize("capability, backend", [((7, 0), "torch"), ((7, 5), "torch"), ((8, 0), "triton"),
                                                 ((8, 9), "triton"), ((9, 0), "triton")])
def test_cuda_tensors_get_triton_from_sm80_on(monkeypatch, capability, backend):
    """Before Ampere Triton's tl.dot has no tensor cores, so the experts run on cuBLAS (the torch path)."""
    monkeypatch.delenv("FMOE_BACKEND", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    gpu = torch.device("cuda", 0)
    assert kernels.backend_for_device(gpu) == backend
    assert kernels.backend_report()["cuda:0_tensors"].startswith(f"{backend} (sm_{capability[0]}{capability[1]}")
    assert kernels.backend_for_device(gpu, "triton") == "triton"     # an explicit choice wins
    monkeypatch.setenv("FMOE_BACKEND", "triton")
    assert kernels.backend_for_device(gpu) == "triton"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_layer_triton_equals_torch(dtype):
    """FMoETransformerMLP end to end, with capacity drops, on the same weights and input."""
    assert_layer_backends_agree(dtype)


def assert_layer_backends_agree(dtype, **kw):
    """A SwiGLU FMoETransformerMLP with capacity drops, Triton against torch: output and every gradient."""
    torch.manual_seed(0)
    kwargs = dict(num_expert=4, d_model=16, d_hidden=16, top_k=2, gate="gshard", activation="swiglu",
                  gate_kwargs=dict(capacity=(0.6, 0.6)), **kw)
    layers = [fmoe.FMoETransformerMLP(backend=backend, **kwargs).to(DEVICE, dtype) for backend in ("triton", "torch")]
    layers[1].load_state_dict(layers[0].state_dict())
    x = torch.randn(2, 12, 16).to(DEVICE, dtype)
    grads = []
    for layer in layers:
        layer.eval()
        xa = x.clone().requires_grad_(True)
        out = layer(xa)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out))
        grads.append({"out": out, "x": xa.grad, **{n: p.grad for n, p in layer.named_parameters()}})
    assert layers[0].num_dropped > 0
    for name, ref in grads[1].items():
        torch.testing.assert_close(grads[0][name], ref, **TOL[dtype], msg=lambda m: f"{name}: {m}")


def test_benchmark_quick_writes_json(tmp_path):
    out = tmp_path / "kernels.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_kernels.py"), "--quick", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    payload = json.loads(out.read_text())
    assert payload["quick"] is True and payload["grouped_mm"] and payload["layer"]
    for row in payload["grouped_mm"]:
        assert row["max_rel_err"] < 2e-2 and row["results"]["triton"]["ms"] > 0


# The fused lean MLP with its combine (fmoe.kernels.routed_mlp): every activation layout, with and
# without biases and the kept pre-activation, dropped slots and an expert without rows.
ROUTED_SPECS = ["gelu", "relu", "swiglu", "glu:gelu_tanh:interleaved", "glu:relu:split",
                "clamped_swiglu:1.702:0.5:interleaved", "clamped_swiglu:1.702:0.5:split"]


def routed_inputs(spec, dtype, bias, T=10, D=16, H=16, E=4, K=2):
    g = torch.Generator().manual_seed(3)
    width1 = H if spec in ("gelu", "relu") else 2 * H
    x = torch.randn(T, D, generator=g)
    w1 = torch.randn(E, D, width1, generator=g) / D ** 0.5
    w2 = torch.randn(E, H, D, generator=g) / H ** 0.5
    weight = torch.rand(T, K, generator=g)
    b1, b2 = (torch.randn(E, width1, generator=g), torch.randn(E, D, generator=g)) if bias else (None, None)
    to = lambda t: None if t is None else t.to(DEVICE, dtype)    # noqa: E731
    return [to(x), to(weight), to(w1), to(w2), to(b1), to(b2)]


@pytest.mark.parametrize("keep_hidden", [True, False], ids=["keep_hidden", "recompute_hidden"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("spec", ROUTED_SPECS)
def test_routed_mlp(spec, bias, keep_hidden):
    idx_TK = torch.randint(0, 3, (10, 2), generator=torch.Generator().manual_seed(1))   # expert 3 gets no rows
    idx_TK[::4, 1] = -1                                                                   # dropped slots
    plan = make_plan_of(idx_TK)
    inputs = [t for t in routed_inputs(spec, torch.float32, bias) if t is not None]

    def run(ops, x, weight, w1, w2, *b):
        return ops.routed_mlp(x, plan, weight, spec, w1, w2, *b, keep_hidden=keep_hidden)
    assert_same(run_both(run, inputs), torch.float32, ["x", "weight", "w1", "w2", "b1", "b2"])


def make_plan_of(idx_TK):
    return RoutingPlan.build(idx_TK.to(DEVICE), 4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_routed_mlp_16bit(dtype):
    """16-bit operands, fp32 accumulators and routing weights: the torch body within 16-bit tolerances."""
    plan = make_plan_of(torch.randint(0, 4, (10, 2), generator=torch.Generator().manual_seed(2)))
    x, weight, w1, w2, b1, b2 = routed_inputs("swiglu", dtype, True)

    def run(ops, x, weight, w1, w2, b1, b2):
        return ops.routed_mlp(x, plan, weight, "swiglu", w1, w2, b1, b2)
    assert_same(run_both(run, [x, weight.float(), w1, w2, b1, b2]), dtype, ["x", "weight", "w1", "w2", "b1", "b2"])


def test_routed_mlp_refuses_a_plan_across_ranks():
    plan = make_plan_of(torch.zeros(4, 2, dtype=torch.long))
    plan.dedup = object()
    x, weight, w1, w2, _, _ = routed_inputs("gelu", torch.float32, False, T=4)
    with pytest.raises(ValueError, match="routed_mlp takes a plan on one rank"):
        kernels.routed_mlp(x, plan, weight, "gelu", w1, w2)
