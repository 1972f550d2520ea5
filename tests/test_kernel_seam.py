"""The kernel seam is one hop: fmoe.kernels -> fmoe::ops -> a body, and the imports only go down
(the import graph, read from the source, is tests/test_import_graph.py's)."""
import pytest
import torch

from fmoe import kernels
from fmoe.kernels import bodies
from fmoe.routing import RoutingPlan
from tests.test_import_graph import import_graph


def test_kernel_bodies_know_nothing_of_the_seam_above_them():
    graph = import_graph()
    for body in ("fmoe.kernels.torch_ops", "fmoe.kernels.triton_ops", "fmoe.kernels.triton_grouped_mm",
                 "fmoe.kernels.triton_permute"):
        assert not graph[body] & {"fmoe.kernels", "fmoe.kernels.ops", "fmoe.kernels.bodies", "fmoe.kernels.lean"}


def test_each_seam_call_runs_one_body(monkeypatch):
    """permute -> fmoe::permute -> bodies.run_impl once, with the impl the tensor gets."""
    calls = []
    run = bodies.run_impl

    def counted(impl, name, *args):
        calls.append((impl, name))
        return run(impl, name, *args)
    monkeypatch.setattr(bodies, "run_impl", counted)
    monkeypatch.setattr("fmoe.kernels.ops.run_impl", counted)
    plan = RoutingPlan.build(torch.tensor([[0, 1], [1, 0]]), 2)
    kernels.permute(torch.randn(2, 3), plan, backend="torch")
    assert calls == [("torch", "permute_rows")]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bad_input_fails_at_the_seam_on_both_backends(backend):
    plan = RoutingPlan.build(torch.tensor([[0, 1], [1, 0]]), 2)
    with pytest.raises(ValueError, match="plan routes 2 tokens, the input has 3"):
        kernels.permute(torch.randn(3, 4), plan, backend=backend)
    with pytest.raises(TypeError, match="w_eIO must have x_NI's dtype"):
        kernels.grouped_mm(torch.randn(4, 3), torch.randn(2, 3, 5, dtype=torch.float16), torch.tensor([2, 2]),
                           backend=backend)
    with pytest.raises(ValueError, match="weight_TK must have shape"):
        kernels.unpermute(torch.randn(4, 3), plan, torch.rand(2, 1), backend=backend)
