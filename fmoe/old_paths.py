"""The module paths fmoe had before its packages by purpose (#38), and FastMoE's: each one names the
module or package now at its new path, as the very same module object.

`OLD_PATHS` maps an old dotted path to its new one. An entry covers the module and, for a package,
every module under it: `fmoe.megatron.layers` is `fmoe.integrations.megatron.layers`. `install()`
(which `fmoe/__init__.py` calls before it imports anything else) puts `AliasFinder` first on
`sys.meta_path`. Importing an old path imports the new module and enters that same object under the
old name in `sys.modules`, so `import fmoe.stats`, `from fmoe.layers import FMoE`,
`monkeypatch.setattr("fmoe.stats.x", ...)` and `unittest.mock.patch` all reach the one module, and
pickles naming old paths load. Classes keep their new `__module__`. `python -m <old path>` runs
the new module's code as `__main__` (the alias's loader hands runpy that code).

This module imports nothing of fmoe itself: it sits below every other module.
"""
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

OLD_PATHS = {
    # the training application
    "fmoe.train": "fmoe.app.train",
    "fmoe.gpt": "fmoe.app.gpt",
    "fmoe.data": "fmoe.app.data",
    "fmoe.cli": "fmoe.app.cli",
    "fmoe.convert": "fmoe.app.convert",
    "fmoe.checkpoints": "fmoe.app.checkpoints",
    "fmoe.files": "fmoe.app.files",
    # what a run or a layer reports
    "fmoe.stats": "fmoe.observe.stats",
    "fmoe.dashboards": "fmoe.observe.dashboards",
    "fmoe.memory": "fmoe.observe.memory",
    "fmoe.cpu_memory": "fmoe.observe.cpu_memory",
    "fmoe.launches": "fmoe.observe.launches",
    # the performance model
    "fmoe.perfmodel": "fmoe.perf.perfmodel",
    "fmoe.calibration": "fmoe.perf.calibration",
    "fmoe.simulate": "fmoe.perf.simulate",
    # tools
    "fmoe.kernels.aot": "fmoe.tools.aot",
    # other frameworks
    "fmoe.deepspeed": "fmoe.integrations.deepspeed",
    "fmoe.megatron": "fmoe.integrations.megatron",
    "fmoe.hf": "fmoe.integrations.hf",
    # FastMoE's names
    "fmoe.layers": "fmoe.fastmoe.layers",
    "fmoe.linear": "fmoe.fastmoe.linear",
    "fmoe.functions": "fmoe.fastmoe.functions",
    "fmoe.utils": "fmoe.fastmoe.utils",
    "fmoe.balance": "fmoe.fastmoe.balance",
    "fmoe.fastmoe_state": "fmoe.fastmoe.state",
    "fmoe.fastermoe": "fmoe.fastmoe.fastermoe",
}


def new_name(name: str) -> str:
    """`name` at its new path: an old path or a module under one is renamed, any other name is kept."""
    old = name
    while old and old not in OLD_PATHS:
        old = old.rpartition(".")[0]
    return OLD_PATHS[old] + name[len(old):] if old else name


class AliasLoader(importlib.abc.Loader):
    """Loads an old path as the module at its new path (imported first), never as a second copy."""

    def __init__(self, target: str, target_spec):
        self.target, self.target_spec = target, target_spec

    def create_module(self, spec):
        return importlib.import_module(self.target)

    def exec_module(self, module):
        alias = module.__spec__.name
        # The import system gave the module the alias's spec; it keeps its own (reload, pickle, runpy).
        module.__spec__ = self.target_spec
        keep_parent_attribute(alias)

    def get_code(self, fullname):
        """The new module's code, for `python -m <old path>` (runpy asks the loader for it)."""
        return self.target_spec.loader.get_code(self.target)

    def is_package(self, fullname):
        return self.target_spec.submodule_search_locations is not None


class KeepsItsNames(types.ModuleType):
    """A package that keeps a name it binds to something other than its submodule of that name (the function
    `convert` of `fmoe.integrations.hf`, from `convert.py`). After the first load of a name, the import system
    sets the module as its parent's attribute; loading an old path (`fmoe.hf.convert`) is such a first load,
    and would replace the function by the module."""

    def __setattr__(self, name, value):
        kept = self.__dict__.get(name)
        if (isinstance(value, types.ModuleType) and value.__name__ == f"{self.__name__}.{name}"
                and kept is not None and not isinstance(kept, types.ModuleType)):
            return
        super().__setattr__(name, value)


def keep_parent_attribute(alias: str):
    """Guard the parent package of an old path being loaded where it binds the leaf's name to a non-module."""
    parent_name, _, leaf = alias.rpartition(".")
    parent = sys.modules.get(parent_name)
    kept = getattr(parent, "__dict__", {}).get(leaf)
    if kept is not None and not isinstance(kept, types.ModuleType) and type(parent) is types.ModuleType:
        parent.__class__ = KeepsItsNames


class AliasFinder(importlib.abc.MetaPathFinder):
    """On `sys.meta_path` before the path finder, which would load a second copy of a module under an old
    package path (`fmoe.megatron.layers` through `fmoe.megatron`'s `__path__`)."""

    def find_spec(self, fullname, path=None, target=None):
        target_name = new_name(fullname)
        if target_name == fullname:
            return None
        target_spec = importlib.util.find_spec(target_name)
        if target_spec is None:
            return None         # no module at the new path either: ModuleNotFoundError names the old one
        spec = importlib.machinery.ModuleSpec(fullname, AliasLoader(target_name, target_spec),
                                              origin=target_spec.origin,
                                              is_package=target_spec.submodule_search_locations is not None)
        if spec.submodule_search_locations is not None:
            spec.submodule_search_locations = list(target_spec.submodule_search_locations)
        return spec


FINDER = AliasFinder()


def install():
    """Put the finder first on `sys.meta_path` (once)."""
    if not any(isinstance(f, AliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, FINDER)


def attribute(package_name: str, name: str):
    """`fmoe.<name>` for an old top-level path not imported yet (PEP 562 `__getattr__` of `fmoe`): the module,
    imported; AttributeError where there is none or it cannot import (a missing optional dependency)."""
    full = f"{package_name}.{name}"
    if new_name(full) == full:
        raise AttributeError(f"module {package_name!r} has no attribute {name!r}")
    try:
        return importlib.import_module(full)
    except ImportError as err:
        raise AttributeError(f"module {package_name!r} has no attribute {name!r} ({full}: {err})") from err
