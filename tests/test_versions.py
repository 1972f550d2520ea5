"""What fmoe does on the older releases it declares (torch 2.4, triton 3.0, numpy 1.26, transformers
5.0): the checks that decide by version or by probing, run here against stand-ins for those releases;
`make test-compat` runs this file and the feature tests on the real ones."""
import re
from pathlib import Path

import pytest
import torch

import fmoe
from fmoe import autocast
from fmoe.gates import NaiveGate
from fmoe.kernels import ops, torch_ops

ROOT = Path(__file__).resolve().parent.parent


def test_autocast_state_is_read_without_asking_torch_which_devices_it_covers(monkeypatch):
    """Dynamo traces torch._C._is_autocast_available only from torch 2.12 on: the forward never calls it."""
    def untraceable(device_type):
        raise AssertionError("is_autocast_available called in the forward")
    monkeypatch.setattr(torch.amp, "is_autocast_available", untraceable)
    layer = fmoe.FMoETransformerMLP(num_expert=4, d_model=8, d_hidden=16, top_k=2)
    x = torch.randn(5, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(x).dtype == torch.bfloat16
    assert layer(x).dtype == torch.float32


def test_a_gate_knows_from_its_class_whether_forward_routes():
    class FastMoEStyle(NaiveGate):
        def forward(self, x):
            return super().forward(x)

    assert not NaiveGate(8, 4, 1, 2)._routes_by_forward
    assert FastMoEStyle(8, 4, 1, 2)._routes_by_forward


def test_sync_free_grouped_mm_takes_the_loop_where_torch_has_no_cpu_kernel(monkeypatch):
    """torch 2.8 has torch._grouped_mm but no CPU kernel for it."""
    def no_cpu_kernel(*args, **kwargs):
        raise NotImplementedError("Could not run 'aten::_grouped_mm' with arguments from the 'CPU' backend")
    monkeypatch.setattr(torch, "_grouped_mm", no_cpu_kernel, raising=False)
    monkeypatch.setattr(torch_ops, "_grouped_mm_runs", {})
    g = torch.Generator().manual_seed(0)
    x, w, counts = torch.randn(5, 8, generator=g), torch.randn(2, 8, 4, generator=g), torch.tensor([2, 3])
    y = ops.grouped_mm(x, w, counts, None, "torch_sync_free")
    torch.testing.assert_close(y, torch.cat([x[:2] @ w[0], x[2:] @ w[1]]))
    assert not torch_ops.grouped_mm_runs_on("cpu")


def test_old_triton_interpreters_refuse_the_numpy_they_miscompute_with():
    pytest.importorskip("triton")
    from fmoe.kernels.triton_interpreter import interpreter_problem

    assert "numpy<2" in interpreter_problem("3.0.0", "2.3.5")
    assert "numpy<2.4" in interpreter_problem("3.6.0", "2.4.6")
    assert interpreter_problem("3.0.0", "1.26.4") is None
    assert interpreter_problem("3.4.0", "2.3.0") is None
    assert interpreter_problem("3.9.0", "2.4.6") is None


def test_every_test_requirement_is_pinned_in_the_constraints():
    setup = (ROOT / "setup.py").read_text()
    test_extra = re.search(r'"test": \[(.*?)\]', setup, re.S).group(1)
    wanted = {re.split(r"[<>=;\s]", req.strip().strip('"'))[0].lower() for req in test_extra.split(",")}
    pinned = {line.split("==")[0].lower().replace("_", "-") for line in (ROOT / "constraints.txt").read_text().splitlines()
              if "==" in line and not line.startswith("#")}
    assert wanted - {""} <= pinned, wanted - pinned
    assert "setup_constraints.py constraints.txt" in (ROOT / "Makefile").read_text()    # settled, then -c
