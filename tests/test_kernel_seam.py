"""The kernel seam is one hop: fmoe.kernels -> fmoe::ops -> a body, and the imports only go down.

Read from the source (every import, the lazy ones inside functions too), so a circle between the
op registrations and their bodies fails here even where Python would tolerate it at run time.
"""
import ast
from pathlib import Path

import pytest
import torch

from fmoe import kernels
from fmoe.kernels import bodies
from fmoe.routing import RoutingPlan

KERNELS = Path(kernels.__file__).parent


def kernel_imports():
    """{module: the fmoe.kernels modules it imports} for every module of the package."""
    graph = {}
    for path in KERNELS.glob("*.py"):
        name = "fmoe.kernels" if path.stem == "__init__" else f"fmoe.kernels.{path.stem}"
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module == "fmoe.kernels":
                    found |= {f"fmoe.kernels.{a.name}" for a in node.names}
                elif node.module.startswith("fmoe.kernels."):
                    found.add(node.module)
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("fmoe.kernels.")}
        graph[name] = found - {name}
    return graph


def test_kernel_imports_have_no_circle():
    graph = kernel_imports()
    done, path = set(), []

    def visit(module):
        if module in path:
            raise AssertionError("import circle: " + " -> ".join(path[path.index(module):] + [module]))
        if module in done:
            return
        path.append(module)
        for dep in sorted(graph.get(module, ())):
            visit(dep)
        path.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)
    # The bodies know nothing of the seam above them.
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
