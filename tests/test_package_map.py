"""The package map of `docs/DESIGN-NOTES.md` (#38), held: each package of `fmoe` imports only the
packages the map allows it. A new edge is a design decision: add it to the map and to the notes'
table, with its reason."""
from tests.test_import_graph import import_graph

ENGINE = "fmoe (engine)"        # the modules at the top of fmoe/: the layer and its parts
SUBPACKAGES = ("gates", "kernels", "distributed", "observe", "perf", "app", "integrations", "fastmoe", "tools",
               "bench")

# package: the other packages it may import (the notes' table, row by row)
MAP = {
    ENGINE: {"fmoe.gates", "fmoe.kernels", "fmoe.distributed", "fmoe.fastmoe", "fmoe.observe", "fmoe.app"},
    "fmoe.gates": {ENGINE, "fmoe.distributed"},
    "fmoe.kernels": {ENGINE},
    "fmoe.distributed": {ENGINE, "fmoe.kernels", "fmoe.perf"},
    "fmoe.observe": {"fmoe.gates", "fmoe.kernels"},
    "fmoe.perf": {ENGINE, "fmoe.gates", "fmoe.distributed", "fmoe.observe", "fmoe.app"},
    "fmoe.app": {ENGINE, "fmoe.gates", "fmoe.kernels", "fmoe.distributed", "fmoe.observe", "fmoe.integrations"},
    "fmoe.integrations": {ENGINE, "fmoe.gates", "fmoe.kernels", "fmoe.distributed", "fmoe.fastmoe", "fmoe.observe",
                          "fmoe.app"},
    "fmoe.fastmoe": {ENGINE, "fmoe.distributed", "fmoe.kernels"},
    "fmoe.tools": {"fmoe.kernels"},
    "fmoe.bench": {ENGINE, "fmoe.app", "fmoe.gates", "fmoe.kernels"},
}


def package_of(module: str) -> str:
    parts = module.split(".")
    return f"fmoe.{parts[1]}" if len(parts) > 1 and parts[1] in SUBPACKAGES else ENGINE


def test_every_package_imports_only_what_the_map_allows():
    extra = {}
    for module, imported in import_graph().items():
        here = package_of(module)
        for other in imported:
            there = package_of(other)
            if there != here and there not in MAP[here]:
                extra.setdefault(f"{here} -> {there}", []).append(f"{module} imports {other}")
    assert not extra, f"imports outside the package map: {extra}"


def test_the_map_names_every_package():
    assert set(MAP) == {ENGINE} | {f"fmoe.{p}" for p in SUBPACKAGES}


def test_a_module_over_400_lines_says_why_in_its_docstring():
    """#38: no module above about 400 lines without a reason stated in its docstring ("About N lines ...")."""
    import ast
    import re
    from pathlib import Path

    unexplained = []
    for path in sorted((Path(__file__).resolve().parents[1] / "fmoe").rglob("*.py")):
        source = path.read_text()
        if source.count("\n") > 400:
            docstring = ast.get_docstring(ast.parse(source)) or ""
            if not re.search(r"About \d+ lines", docstring):
                unexplained.append(f"{path.name}: {source.count(chr(10))} lines")
    assert not unexplained, f"modules over 400 lines with no reason in their docstring: {unexplained}"
