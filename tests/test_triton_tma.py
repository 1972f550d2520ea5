"""The Hopper grouped GEMM (tensor descriptors, persistent tiles; FMOE_TRITON_TMA=1) against the torch path.

Without a GPU the kernel runs in Triton's interpreter, which runs tensor descriptors as masked
pointer loads and stores clipped at the descriptor's shape, as the copy engine clips: outputs and
every gradient are checked there. What the interpreter cannot show, that the kernel compiles to
the copy engine and wgmma on sm_90, is checked by the AOT test (tests/test_kernels_aot.py).
"""
import contextvars
import threading
import types

import pytest
import torch

from fmoe import kernels
from fmoe.kernels import torch_ops, triton_grouped_mm_tma, triton_ops
from tests.test_triton_kernels import (DEVICE, TOL, assert_gather_grouped_mm_agrees, assert_layer_backends_agree,
                                      assert_same, expert_inputs, run_both)


@pytest.fixture
def tma_calls(monkeypatch):
    """Turn the TMA path on and count the launches that take it."""
    monkeypatch.setenv("FMOE_TRITON_TMA", "1")
    calls = []
    real = triton_grouped_mm_tma.grouped_mm_rows_tma

    def counted(x, w, *args):
        calls.append(w.stride(2) != 1)     # whether the weight was read transposed
        return real(x, w, *args)

    monkeypatch.setattr(triton_grouped_mm_tma, "grouped_mm_rows_tma", counted)
    return calls


TMA_DTYPES = [torch.float32, torch.bfloat16]
COUNTS = {"empty_and_single_and_partial": [0, 1, 17, 0, 30], "one_expert_holds_all": [0, 0, 40, 0],
          "single_expert": [37], "no_rows": [0, 0, 0]}


@pytest.mark.parametrize("dtype", TMA_DTYPES, ids=str)
@pytest.mark.parametrize("case", COUNTS)
def test_grouped_mm_through_descriptors(case, dtype, tma_calls):
    """Forward (weight as stored) and the input gradient (weight transposed) both take the TMA kernel."""
    inputs = expert_inputs(COUNTS[case], 32, 24, dtype, bias=case != "one_expert_holds_all")
    results = run_both(lambda ops, x, w, c, *b: ops.grouped_mm(x, w, c, *b), inputs)
    assert_same(results, dtype, ["x", "w", "bias"])
    if case != "no_rows":
        assert tma_calls == [False, True]


@pytest.mark.parametrize("dtype", TMA_DTYPES, ids=str)
@pytest.mark.parametrize("case", ["plain", "dropped_slots", "no_tokens"])
def test_gather_grouped_mm_through_descriptors(case, dtype, tma_calls):
    """Rows of x read through the plan's token index (plain loads), weight and output through descriptors."""
    assert_gather_grouped_mm_agrees(case, dtype, width=32)
    if case != "no_tokens":
        assert len(tma_calls) == 2


def test_rows_past_the_segments_stay_zero_and_neighbours_intact(tma_calls):
    """A 1-row expert's 16-row tile must not write its neighbour's rows (the store is clipped), and rows
    of dropped slots past the last segment stay zero."""
    x, w, counts = expert_inputs([1, 20, 2], 32, 16, torch.float32)
    x = torch.cat([x, torch.randn(5, 32, device=DEVICE)])      # 5 rows beyond the segments
    y = triton_ops.grouped_mm_rows(x, w, counts)
    ref = torch_ops.grouped_mm_rows(x, w, counts, sync_free=True)
    torch.testing.assert_close(y, ref, **TOL[torch.float32])
    assert torch.count_nonzero(y[23:]) == 0 and tma_calls == [False]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("recompute", ["activation", "experts", "none"])
def test_lean_layer_with_tma_equals_torch(dtype, recompute, tma_calls):
    """FMoETransformerMLP, SwiGLU, capacity drops: its GEMMs that read rows (the gathered first GEMM,
    the second, the input gradients) take the TMA kernel; the weight gradients the plain one."""
    assert_layer_backends_agree(dtype, recompute=recompute)
    assert False in tma_calls and True in tma_calls


def test_operands_the_copy_engine_cannot_take_fall_back(tma_calls):
    """bf16 rows 20 wide are 40 bytes, not a multiple of 16: the plain kernel runs, with the same answer."""
    x, w, counts = expert_inputs([5, 0, 19], 20, 20, torch.bfloat16)
    assert not triton_grouped_mm_tma.tma_applies(x, w, None, None)
    results = run_both(lambda ops, x_, w_, c: ops.grouped_mm(x_, w_, c), [x, w, counts])
    assert_same(results, torch.bfloat16, ["x", "w"])
    assert tma_calls == []


def test_off_by_default(monkeypatch):
    monkeypatch.delenv("FMOE_TRITON_TMA", raising=False)
    calls = []
    monkeypatch.setattr(triton_grouped_mm_tma, "grouped_mm_rows_tma", lambda *a: calls.append(a))
    x, w, counts = expert_inputs([5, 11], 32, 16, torch.float32)
    kernels.grouped_mm(x, w, counts, backend="triton")
    assert calls == [] and not triton_grouped_mm_tma.tma_enabled()
    monkeypatch.setenv("FMOE_TRITON_TMA", "sometimes")
    with pytest.raises(ValueError, match="FMOE_TRITON_TMA"):
        triton_grouped_mm_tma.tma_enabled()


def test_fmoe_info_says_whether_it_is_on(monkeypatch):
    from fmoe import kernels

    monkeypatch.delenv("FMOE_TRITON_TMA", raising=False)
    assert kernels.backend_report()["triton_tma"].startswith("off")
    monkeypatch.setenv("FMOE_TRITON_TMA", "1")
    assert kernels.backend_report()["triton_tma"].startswith("on")


def test_gpus_before_hopper_keep_the_plain_kernel(monkeypatch):
    """On CUDA tensors the path needs sm_90 or later (TMA, wgmma) and a tensor-core dot."""
    takes = triton_grouped_mm_tma.gpu_takes_tma
    assert not takes((8, 0), torch.bfloat16) and not takes((8, 9), torch.float16)
    assert takes((9, 0), torch.bfloat16) and takes((10, 0), torch.float16)
    # torch 2.13's cuBLAS settings object answers allow_tf32 through __getattr__, which monkeypatch
    # cannot patch: the whole object is replaced instead.
    monkeypatch.setattr(torch.backends.cuda, "matmul", types.SimpleNamespace(allow_tf32=True))
    assert takes((9, 0), torch.float32)
    monkeypatch.setattr(torch.backends.cuda, "matmul", types.SimpleNamespace(allow_tf32=False))
    assert not takes((9, 0), torch.float32)       # exact fp32 runs on the CUDA cores: nothing to feed


def test_allocator_installed_per_context_and_a_users_own_kept():
    """triton.set_allocator is a ContextVar: autograd's backward threads start without it, so the
    launcher installs one wherever none is set, and never replaces a user's."""
    from triton.runtime._allocation import NullAllocator, _allocator

    def fresh():
        _allocator.set(NullAllocator())
        triton_grouped_mm_tma.ensure_allocator()
        return _allocator.get()

    assert contextvars.Context().run(fresh) is triton_grouped_mm_tma._torch_scratch

    def users_own(size, alignment, stream):
        raise AssertionError("not called here")

    def kept():
        _allocator.set(users_own)
        triton_grouped_mm_tma.ensure_allocator()
        return _allocator.get()

    assert contextvars.Context().run(kept) is users_own
    seen = []
    thread = threading.Thread(target=lambda: (triton_grouped_mm_tma.ensure_allocator(), seen.append(_allocator.get())))
    thread.start()
    thread.join()
    assert seen == [triton_grouped_mm_tma._torch_scratch]
