"""Every old module path (`fmoe.old_paths`) and every FastMoE import path is the module at its new
path, the same object; the top of `fmoe/` holds the engine only, so the layout cannot drift back."""
import importlib
import importlib.util
import multiprocessing
import os
import pickle
import re
import subprocess
import sys
import types
import unittest.mock
from pathlib import Path

import pytest
import torch

import fmoe
from fmoe.old_paths import OLD_PATHS, new_name

FMOE = Path(fmoe.__file__).parent
ROOT = FMOE.parent

# The top of fmoe/: the engine (the layer and its parts, its experts, routing and what they stand on),
# FastMoE's FMoETransformerMLP / moefy (core API), the package itself and its alias layer. The layer's
# parts are those of the layer's split on main (#38), some of which this checkout may not have yet.
ENGINE = {"layer", "dispatch", "expert_calls", "layer_checks", "shared_experts", "tokens", "experts", "routing",
          "autocast", "last_forward", "env", "replay", "load_balancing", "transformer"}
TOP_MODULES = ENGINE | {"__init__", "__main__", "old_paths"}
ENGINE_PACKAGES = {"gates", "kernels", "distributed"}
BY_PURPOSE = {"app", "observe", "perf", "tools", "integrations", "fastmoe", "bench"}

# The framework each integration imports when it is imported.
NEEDS = {"fmoe.integrations.megatron": "megatron.core", "fmoe.integrations.deepspeed": "deepspeed",
         "fmoe.integrations.hf": "transformers"}

# FastMoE's import paths (fmoe.gates.* and fmoe.megatron.* in full below).
FASTMOE_PATHS = ["fmoe", "fmoe.layers", "fmoe.linear", "fmoe.functions", "fmoe.transformer", "fmoe.gates",
                 "fmoe.distributed", "fmoe.utils", "fmoe.balance", "fmoe.fastermoe", "fmoe.fastermoe.config",
                 "fmoe.fastermoe.schedule", "fmoe.megatron"]


def modules_of(package: str) -> list:
    """The dotted names of `package` and every module under it, read from the files."""
    folder = FMOE.parent.joinpath(*package.split("."))
    names = []
    for path in sorted(folder.rglob("*.py")):
        parts = path.relative_to(FMOE.parent).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def importable(module: str):
    """Skip a module whose framework is not installed."""
    for package, framework in NEEDS.items():
        if (module == package or module.startswith(package + ".")) and importlib.util.find_spec(framework) is None:
            pytest.skip(f"{module} needs {framework}")


def old_and_new():
    """(old path, new path) for every entry of the table and every module under a moved package."""
    pairs = []
    for old, new in OLD_PATHS.items():
        if (FMOE.parent / Path(*new.split("."))).is_dir():
            pairs += [(old + name[len(new):], name) for name in modules_of(new)]
        else:
            pairs.append((old, new))
    return pairs


@pytest.mark.parametrize("old,new", old_and_new())
def test_an_old_path_is_the_module_at_its_new_path(old, new):
    importable(new)
    module = importlib.import_module(old)
    assert module is importlib.import_module(new) and sys.modules[old] is sys.modules[new]
    assert module.__name__ == new and module.__spec__.name == new      # the module keeps its own identity
    assert new_name(old) == new
    parent, _, leaf = old.rpartition(".")
    attribute = getattr(sys.modules[parent], leaf)
    if leaf in BOUND_TO_A_FUNCTION.get(new.rpartition(".")[0], ()):
        assert callable(attribute) and not isinstance(attribute, types.ModuleType)
    else:
        assert attribute is module       # `import fmoe.stats; fmoe.stats.x`


# Packages that bind a name to the function of their submodule of that name, as they did before #38.
BOUND_TO_A_FUNCTION = {"fmoe.integrations.hf": ("convert", "export"), "fmoe.integrations.megatron": ("fmoefy",)}


@pytest.mark.parametrize("package,names", BOUND_TO_A_FUNCTION.items())
def test_importing_an_old_path_keeps_the_function_its_package_names_after_it(package, names):
    module = importlib.import_module(package)
    old_package = next(old for old, new in OLD_PATHS.items() if new == package)
    for name in names:
        function = getattr(module, name)
        assert callable(function) and not isinstance(function, types.ModuleType)
        sys.modules.pop(f"{old_package}.{name}", None)          # a first load under the old path
        submodule = importlib.import_module(f"{old_package}.{name}")
        assert submodule is sys.modules[f"{package}.{name}"]
        assert getattr(module, name) is function
        module.new_attribute = submodule                        # any other assignment still works
        assert module.new_attribute is submodule
        del module.new_attribute


@pytest.mark.parametrize("path", FASTMOE_PATHS + modules_of("fmoe.gates")
                         + ["fmoe.megatron" + m[len("fmoe.integrations.megatron"):]
                            for m in modules_of("fmoe.integrations.megatron")])
def test_fastmoe_import_paths(path):
    importable(new_name(path))
    assert importlib.import_module(path) is importlib.import_module(new_name(path))


def test_fastmoe_names_at_fastmoe_paths():
    from fmoe.distributed import DistributedGroupedDataParallel
    from fmoe.layers import FMoE
    from fmoe.linear import FMoELinear
    from fmoe.transformer import FMoETransformerMLP

    assert FMoE is fmoe.FMoE and FMoELinear is fmoe.FMoELinear and FMoETransformerMLP is fmoe.FMoETransformerMLP
    assert DistributedGroupedDataParallel is fmoe.DistributedGroupedDataParallel


def test_an_old_path_as_an_attribute_of_fmoe():
    """`import fmoe; fmoe.simulate`, as when fmoe/__init__.py imported it: the module, imported on first use."""
    assert fmoe.simulate is importlib.import_module("fmoe.perf.simulate")
    from fmoe import cpu_memory
    assert cpu_memory is importlib.import_module("fmoe.observe.cpu_memory")
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        fmoe.nothing_here
    assert not hasattr(fmoe, "kernels_aot")


def test_no_module_at_an_old_path_or_beside_the_engine():
    """The top of fmoe/ holds the engine and the packages by purpose, nothing else; no file or folder
    sits at an old path (the alias would hide it)."""
    files = {p.stem for p in FMOE.glob("*.py")}
    assert files <= TOP_MODULES, (f"modules at the top of fmoe/ beside the engine: {sorted(files - TOP_MODULES)} "
                                  "(put them in the package of their purpose)")
    assert {"__init__", "__main__", "old_paths", "layer"} <= files
    packages = {p.parent.name for p in FMOE.glob("*/__init__.py")}
    assert packages == BY_PURPOSE | ENGINE_PACKAGES, f"packages at the top of fmoe/: {sorted(packages)}"
    for old in OLD_PATHS:
        where = ROOT.joinpath(*old.split("."))
        # (a checkout from before the move may keep the old folders' ignored __pycache__: no module there)
        assert not where.with_suffix(".py").exists() and not any(where.rglob("*.py")), f"{where} is at an old path"


def test_patching_an_old_path_patches_the_module(monkeypatch):
    from fmoe.observe import stats
    from fmoe.perf import perfmodel

    monkeypatch.setattr("fmoe.stats.in_recompute", "patched")
    assert stats.in_recompute == "patched"
    with unittest.mock.patch("fmoe.perfmodel.env_float", "mocked"):
        assert perfmodel.env_float == "mocked"
    assert perfmodel.env_float != "mocked"


def test_pickles_name_the_new_paths_and_old_ones_load(tmp_path):
    from fmoe.app.gpt import GPTConfig
    from fmoe.app.runtime import TrainConfig

    cfg = GPTConfig(n_layer=1)
    assert GPTConfig.__module__ == "fmoe.app.gpt" and TrainConfig.__module__ == "fmoe.app.runtime"
    torch.save({"cfg": cfg}, tmp_path / "cfg.pt")
    assert torch.load(tmp_path / "cfg.pt", weights_only=False)["cfg"] == cfg
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    # A pickle written before the move names fmoe.gpt.GPTConfig (protocol 0: the path in plain text).
    old = pickle.dumps(cfg, protocol=0).replace(b"fmoe.app.gpt", b"fmoe.gpt")
    assert b"cfmoe.gpt\nGPTConfig" in old and pickle.loads(old) == cfg


def spawned_child(old: str) -> tuple:
    module = importlib.import_module(old)
    return module.__name__, sys.modules[old] is sys.modules[module.__name__]


def test_a_spawned_process_resolves_old_paths():
    """A spawn worker (as the gloo tests start) imports this module, fmoe with it, and then old paths."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        assert pool.apply(spawned_child, ("fmoe.simulate",)) == ("fmoe.perf.simulate", True)


def run_module(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_python_m_fmoe_and_old_command_paths():
    """`python -m fmoe`, and `python -m` at an old path runs the new module as __main__ (the aliases'
    loader hands runpy its code): `python -m fmoe.kernels.aot` is the documented AOT report."""
    run = run_module("fmoe", "--help")
    assert run.returncode == 0 and "usage: fmoe" in run.stdout, run.stderr
    run = run_module("fmoe.kernels.aot", "--help")
    assert run.returncode == 0 and "usage: python -m fmoe.tools.aot" in run.stdout, run.stderr
    run = run_module("fmoe.cli", "simulate", "--help")
    assert run.returncode == 0 and "usage: fmoe simulate" in run.stdout, run.stderr


def test_the_console_script_names_the_cli():
    script = re.search(r'"fmoe=([\w.]+):(\w+)"', (ROOT / "setup.py").read_text())
    assert script and script[1] == "fmoe.app.cli"
    assert callable(getattr(importlib.import_module(script[1]), script[2]))
