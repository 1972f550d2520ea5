"""On a CUDA GPU: a single-GPU forward+backward never synchronises with the host, and the layer
captures and replays in a CUDA graph. Skipped without CUDA; benchmarks/gpu_check.sh runs it."""
import copy

import pytest
import torch

import fmoe

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

D, H, E = 64, 128, 8


def make_layer(gate, top_k, backend, dtype, **gate_kwargs):
    torch.manual_seed(0)
    layer = fmoe.FMoETransformerMLP(num_expert=E, d_model=D, d_hidden=H, top_k=top_k, gate=gate,
                                    backend=backend, gate_kwargs=gate_kwargs)
    return layer.to("cuda", dtype)


def forward_backward(layer, x):
    out = layer(x)
    out.float().pow(2).sum().backward()
    return out


CASES = [("naive", 2, "triton", torch.float32, {}), ("gshard", 2, "triton", torch.bfloat16, {}),
         ("switch", 1, "triton", torch.float32, {}), ("naive", 3, "triton", torch.float32, {"capacity": 0.5}),
         ("balanced", 2, "triton", torch.bfloat16, {}), ("naive", 2, "torch", torch.bfloat16, {})]


@pytest.mark.parametrize("gate,top_k,backend,dtype,gate_kwargs", CASES)
def test_forward_backward_never_syncs(gate, top_k, backend, dtype, gate_kwargs):
    layer = make_layer(gate, top_k, backend, dtype, **gate_kwargs).train()
    x = torch.randn(256, D, device="cuda", dtype=dtype, requires_grad=True)
    forward_backward(layer, x)              # compiles the kernels (and would autotune) first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        forward_backward(layer, x)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


@pytest.mark.parametrize("gate,top_k,backend,dtype,gate_kwargs", [CASES[0], CASES[3], CASES[5]])
def test_cuda_graph_capture_and_replay_equals_eager(gate, top_k, backend, dtype, gate_kwargs):
    layer = make_layer(gate, top_k, backend, dtype, **gate_kwargs).eval()
    reference = copy.deepcopy(layer)
    static_x = torch.randn(128, D, device="cuda", dtype=dtype, requires_grad=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            forward_backward(layer, static_x)
    torch.cuda.current_stream().wait_stream(side)
    layer.zero_grad(set_to_none=True)
    static_x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = forward_backward(layer, static_x)
    for seed in (1, 2):
        x = torch.randn(128, D, device="cuda", dtype=dtype, generator=torch.Generator("cuda").manual_seed(seed))
        with torch.no_grad():
            static_x.copy_(x)
        graph.replay()
        reference.zero_grad(set_to_none=True)
        x_ref = x.clone().requires_grad_(True)
        out_ref = forward_backward(reference, x_ref)
        tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(static_out, out_ref, **tol)
        torch.testing.assert_close(static_x.grad, x_ref.grad, **tol)
        for p, q in zip(layer.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **tol)


def test_compiled_fullgraph_equals_eager_on_the_gpu():
    layer = make_layer("naive", 2, "triton", torch.float32).eval()
    reference = copy.deepcopy(layer)
    compiled = torch.compile(layer, fullgraph=True)
    x = torch.randn(256, D, device="cuda")
    outs = []
    for module, run in ((reference, reference), (layer, compiled)):
        x_in = x.clone().requires_grad_(True)
        outs.append((forward_backward(run, x_in), x_in.grad, [p.grad for p in module.parameters()]))
    (out_e, dx_e, g_e), (out_c, dx_c, g_c) = outs
    torch.testing.assert_close(out_c, out_e, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(dx_c, dx_e, atol=1e-4, rtol=1e-4)
    for a, b in zip(g_c, g_e):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="the Hopper kernel (FMOE_TRITON_TMA=1) needs sm_90")
def test_hopper_kernel_never_syncs_and_replays_in_a_graph(monkeypatch):
    """The descriptors' scratch comes from torch's allocator at every launch: inside a captured
    graph too (its private pool), and with no host sync."""
    monkeypatch.setenv("FMOE_TRITON_TMA", "1")
    test_forward_backward_never_syncs(*CASES[1])
    test_cuda_graph_capture_and_replay_equals_eager(*CASES[1])
