"""No import circles anywhere in `fmoe`: the modules form layers and every import goes down.

The graph is read from the source, so a circle fails here even where Python tolerates it at run
time. An edge is every `import` and `from ... import` in a module: at module level, inside
functions (a circle hidden by a lazy import is still a circle) and under `if TYPE_CHECKING:`
alike (an annotation is a dependency too; fmoe needs none). `from X import Y` imports the module
`X.Y` where that is a module, else `X`; relative imports count as their absolute names. The
parent packages Python initialises on the way (`import a.b` runs `a/__init__.py`) are not
edges: a package re-exporting its submodules is not a circle, a submodule asking its package
for a name is. Imports by a computed name (`importlib.import_module`) are not seen. An import of
an old path (`fmoe.stats`, `fmoe.megatron.layers`: `fmoe.old_paths`) is an edge to the module at
its new path, the one that import runs.
"""
import ast
from pathlib import Path

import fmoe
from fmoe.old_paths import new_name

FMOE = Path(fmoe.__file__).parent


def modules_under(root: Path) -> dict:
    """{dotted name: path} of every module of the package at `root`."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imports_of(name: str, path: Path, modules: dict, rename=lambda module: module) -> set:
    """The modules of `modules` that the module `name` (at `path`) imports, anywhere in it; `rename`
    maps an imported name to the module that import runs (an old path to its new one)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {rename(alias.name) for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0]
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                module = rename(f"{base}.{alias.name}")
                found.add(module if module in modules else rename(base))
    return (found & modules.keys()) - {name}


def import_graph(root: Path = FMOE, rename=new_name) -> dict:
    """{module: the package's modules it imports} for every module of the package at `root`."""
    modules = modules_under(root)
    return {name: imports_of(name, path, modules, rename) for name, path in modules.items()}


def circles(graph: dict) -> list:
    """One circle for each edge back into the path a depth-first walk is on; none: no circle."""
    found, done, path = [], set(), []

    def visit(module):
        if module in path:
            found.append(path[path.index(module):] + [module])
            return
        if module in done:
            return
        path.append(module)
        for dep in sorted(graph.get(module, ())):
            visit(dep)
        path.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)
    return found


def test_fmoe_has_no_import_circle():
    found = circles(import_graph())
    assert not found, "import circles:\n" + "\n".join(" -> ".join(circle) for circle in found)


def test_the_graph_sees_lazy_relative_and_submodule_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.a import f\n")
    (pkg / "a.py").write_text("def f():\n    from pkg.sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("X = 1\n")
    (pkg / "sub" / "b.py").write_text("from .. import c\nfrom . import X\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    graph = import_graph(pkg)
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.sub.b"}, "pkg.sub": set(), "pkg.sub.b": {"pkg.c", "pkg.sub"},
                     "pkg.c": {"pkg.a"}}
    assert circles(graph) == [["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]]


def test_the_graph_follows_old_paths_to_their_modules(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "new").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "new" / "__init__.py").write_text("")
    (pkg / "new" / "a.py").write_text("import pkg.b\n")
    (pkg / "b.py").write_text("from pkg import a\nfrom pkg.old.c import f\n")
    (pkg / "new" / "c.py").write_text("def f():\n    import pkg.a\n")
    renames = {"pkg.a": "pkg.new.a", "pkg.old": "pkg.new"}

    def rename(module):
        for old, new in renames.items():
            if module == old or module.startswith(old + "."):
                return new + module[len(old):]
        return module

    graph = import_graph(pkg, rename)
    assert graph["pkg.b"] == {"pkg.new.a", "pkg.new.c"} and graph["pkg.new.c"] == {"pkg.new.a"}
    assert circles(graph) == [["pkg.b", "pkg.new.a", "pkg.b"]]
    assert circles(import_graph(pkg, lambda module: module)) == []      # blind to the old paths


def test_new_name_follows_the_table():
    assert new_name("fmoe.stats") == "fmoe.observe.stats"
    assert new_name("fmoe.megatron.layers") == "fmoe.integrations.megatron.layers"
    assert new_name("fmoe.megatron") == "fmoe.integrations.megatron"
    assert new_name("fmoe.layer") == "fmoe.layer" and new_name("fmoe.statsx") == "fmoe.statsx"
