"""What the layer keeps for backward, per recompute mode, and that every mode gives the same answer.

Saved bytes are counted by unique storage through saved_tensors_hooks (fmoe.observe.memory), parameters
left out: a deterministic count, held to each mode's formula exactly.
"""
import pytest
import torch
import torch.nn.functional as F

import fmoe
from fmoe import kernels
from fmoe.experts import GLU, ClampedSwiGLU
from fmoe.observe.memory import SavedTensors, peak_bytes, saved_bytes
from fmoe.routing import RoutingPlan
from tests import dist_workers
from tests.dist_utils import run_ranks
from tests.reference import grads_of, per_token_moe

T, D, H, E, K = 16, 8, 16, 4, 2
ACTIVATIONS = {
    "gelu": "gelu", "relu": "relu", "swiglu": "swiglu",
    "geglu": GLU(F.gelu), "clamped_swiglu": ClampedSwiGLU(limit=0.5),
}
GATED = {"swiglu", "geglu", "clamped_swiglu"}
BACKENDS = ["torch", "triton"]
MODES = ["activation", "experts", "none"]


def make_layer(act="gelu", backend="torch", recompute="activation", **kw):
    torch.manual_seed(0)
    return fmoe.FMoETransformerMLP(num_expert=E, d_model=D, d_hidden=H, top_k=K, activation=ACTIVATIONS[act],
                                   backend=backend, recompute=recompute, **kw)


def inputs(rows=T, dtype=torch.float32):
    return torch.randn(rows, D, generator=torch.Generator().manual_seed(5), dtype=dtype).requires_grad_(True)


def expected_bytes(act, backend, mode):
    """The mode's formula, in fp32 bytes for the whole batch (NaiveGate: the softmax of the top-k
    logits and their int64 indices; the plan: row of each slot, token and slot of each row)."""
    width1 = 2 * H if act in GATED else H
    N = T * K
    scores = 4 * N                      # the gate's top-k weights
    ints = 8 * 3 * N + 8 * N + 8 * E    # the plan's three maps, the top-k indices, the counts
    lean = 4 * T * D + scores + ints     # x, scores, ints: the combine reads the weights in slot order
    if mode == "activation":
        return lean + 4 * N * width1
    if mode == "experts":
        return lean
    # "none": the path that keeps every intermediate: permuted x and the experts' output as well;
    # on the CPU's fused MLP the pre-activation alone, elsewhere the activation's saves too.
    kept = 4 * T * D + scores + ints + 2 * 4 * N * D + 4 * N * width1
    if backend == "triton":
        kept += 4 * N * H * (2 if act in GATED else 1)
    return kept


def floor_bytes(act):
    """x, the pre-activation, the router's scores and the routing integers: SonicMoE's set."""
    width1 = 2 * H if act in GATED else H
    return 4 * T * D + 4 * T * K * width1 + 4 * T * K + 8 * 4 * T * K + 8 * E


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("act", list(ACTIVATIONS))
@pytest.mark.parametrize("mode", MODES)
def test_saved_bytes_follow_the_formula(mode, act, backend):
    if backend == "triton" and act not in ("gelu", "swiglu"):
        pytest.skip("the interpreter is slow; the torch path covers the other activations' counts")
    layer = make_layer(act, backend, mode)
    saved = saved_bytes(layer, inputs())
    assert saved.nbytes == expected_bytes(act, backend, mode), sorted(saved.storages.values(), key=str)
    if mode == "activation":
        assert saved.nbytes <= 1.05 * floor_bytes(act)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("act", list(ACTIVATIONS))
@pytest.mark.parametrize("mode", MODES)
def test_every_mode_equals_the_per_token_loop(mode, act, backend):
    layer = make_layer(act, backend, mode, gate_kwargs={"capacity": 0.5}).train()   # dropped slots too
    x = inputs()
    out = layer(x)
    assert layer.num_dropped > 0
    ref, _ = per_token_moe(layer, x)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    got, want = grads_of(layer, x, out), grads_of(layer, x, ref)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("act", ["gelu", "swiglu", "clamped_swiglu"])
def test_modes_agree_in_bf16_on_triton(act):
    """The fused default and "experts" against "none" in bf16 on the Triton path (interpreter here):
    outputs and every gradient within bf16 rounding."""
    x = inputs(dtype=torch.bfloat16)
    results = {}
    for mode in MODES:
        layer = make_layer(act, "triton", mode).to(torch.bfloat16)
        out = layer(x)
        results[mode] = (out, grads_of(layer, x, out))
    ref, ref_grads = results["none"]
    for mode in ("activation", "experts"):
        out, grads = results[mode]
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
        for name in ref_grads:
            torch.testing.assert_close(grads[name].float(), ref_grads[name].float(), atol=3e-2, rtol=3e-2,
                                       msg=lambda m: f"{mode} {name}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_modes_agree_with_shared_experts_and_keep_only_their_pre_activation(backend):
    results, counts = [], {}
    for mode in MODES:
        layer = make_layer("swiglu", backend, mode, shared_expert=H)
        x = inputs()
        out = layer(x)
        results.append((out, grads_of(layer, x, out)))
        counts[mode] = saved_bytes(layer, x).nbytes - expected_bytes("swiglu", backend, mode)
    for out, grads in results[1:]:
        torch.testing.assert_close(out, results[0][0], atol=1e-5, rtol=1e-5)
        for name in grads:
            torch.testing.assert_close(grads[name], results[0][1][name], atol=1e-5, rtol=1e-5)
    # The shared MLP's pre-activation and its one-expert count (x is the layer's, counted already).
    assert counts["activation"] == 4 * T * 2 * H + 8
    assert counts["experts"] == 8


@pytest.mark.parametrize("act", ["gelu", "relu", "swiglu", "geglu", "clamped_swiglu"])
@pytest.mark.parametrize("keep_hidden", [True, False])
@pytest.mark.parametrize("sync_free", [False, True], ids=["by_expert", "grouped"])
def test_lean_mlp_gradcheck_float64(act, keep_hidden, sync_free, monkeypatch):
    """Both torch bodies: one expert's segment at a time (host counts) and all rows at once."""
    monkeypatch.setenv("FMOE_SYNC_FREE", "1" if sync_free else "0")
    torch.manual_seed(1)
    spec = fmoe.experts.fused_activation_spec(ACTIVATIONS[act])
    width1 = 2 * H if act in GATED else H
    rows_TK = torch.randint(-1, E, (6, K))      # -1: dropped slots
    plan = RoutingPlan.build(rows_TK, E)
    x = torch.randn(6, D, dtype=torch.float64, requires_grad=True)
    params = [torch.randn(E, D, width1, dtype=torch.float64) / 3, torch.randn(E, H, D, dtype=torch.float64) / 3,
              torch.randn(E, width1, dtype=torch.float64), torch.randn(E, D, dtype=torch.float64)]
    weight_N = torch.rand(plan.num_rows, dtype=torch.float64)
    leaves = [x, weight_N] + [p.requires_grad_(True) for p in params]
    for t in leaves:
        t.requires_grad_(True)

    def layer(x, weight_N, w1, w2, b1, b2):
        y_ND = kernels.weighted_mlp(x, plan.counts_E, spec, w1, w2, b1, b2, rows_N=plan.token_N,
                                    row_of_slot_TK=plan.row_of_slot_TK, weight_N=weight_N,
                                    keep_hidden=keep_hidden, backend="torch")
        return kernels.sum_rows(y_ND, plan, "torch")
    assert torch.autograd.gradcheck(layer, leaves)


@pytest.mark.parametrize("act", ["gelu", "swiglu", "clamped_swiglu"])
@pytest.mark.parametrize("keep_hidden", [True, False])
@pytest.mark.parametrize("sync_free", [False, True], ids=["by_expert", "grouped"])
def test_routed_mlp_gradcheck_float64(act, keep_hidden, sync_free, monkeypatch):
    """The lean MLP with the combine (the default path on one rank), both torch bodies."""
    monkeypatch.setenv("FMOE_SYNC_FREE", "1" if sync_free else "0")
    torch.manual_seed(2)
    spec = fmoe.experts.fused_activation_spec(ACTIVATIONS[act])
    d, h = 4, 4         # small: gradcheck perturbs every weight element
    width1 = 2 * h if act in GATED else h
    plan = RoutingPlan.build(torch.randint(-1, E, (6, K)), E)
    leaves = [torch.randn(6, d, dtype=torch.float64), torch.rand(6, K, dtype=torch.float64),
              torch.randn(E, d, width1, dtype=torch.float64) / 2, torch.randn(E, h, d, dtype=torch.float64) / 2,
              torch.randn(E, width1, dtype=torch.float64), torch.randn(E, d, dtype=torch.float64)]

    def layer(x, weight_TK, w1, w2, b1, b2):
        return kernels.routed_mlp(x, plan, weight_TK, spec, w1, w2, b1, b2, keep_hidden=keep_hidden,
                                  backend="torch")
    assert torch.autograd.gradcheck(layer, [t.requires_grad_(True) for t in leaves])


def test_bad_recompute_is_refused():
    with pytest.raises(ValueError, match="recompute must be one of"):
        make_layer(recompute="all")


def test_user_expert_modules_keep_what_their_modules_keep():
    torch.manual_seed(0)
    layer = fmoe.FMoE(num_expert=E, d_model=D, top_k=K, expert=lambda d: torch.nn.Linear(d, d), recompute="experts")
    assert saved_bytes(layer, inputs()).nbytes > 4 * T * K * D      # the permuted rows, as Linear keeps them


def test_counter_counts_a_storage_once_and_leaves_parameters_out():
    w = torch.nn.Parameter(torch.randn(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    with SavedTensors(exclude=[w]) as saved:
        (x[:2] @ w).sum() + (x @ w).sum()
    assert saved.nbytes == x.untyped_storage().nbytes()


def test_peak_covers_the_saved_set():
    layer = make_layer("gelu", "torch")
    x = inputs(256)
    assert peak_bytes(lambda: layer(x).sum().backward(), x.device) >= saved_bytes(layer, x).nbytes


def test_expert_parallel_modes_equal_one_process():
    run_ranks(dist_workers.check_recompute_modes_match_single_process, 2)


def test_expert_parallel_keeps_received_rows_once():
    run_ranks(dist_workers.check_expert_parallel_keeps_received_rows_once, 2)
