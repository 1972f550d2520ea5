"""`make setup` installs torch at most once: fmoe/tools/setup_constraints.py settles torch and triton in
constraints.txt (#51). `make check-setup` (run by CI) holds a dry run on a machine without torch."""
import re
from importlib import metadata
from pathlib import Path

import pytest

from fmoe.tools.setup_constraints import report_problems, settled, triton_required_by

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = (ROOT / "constraints.txt").read_text().splitlines()
CUDA_TORCH_REQUIRES = ["filelock", 'nvidia-cudnn-cu13==9.13.0.50; platform_system == "Linux"',
                       'triton==3.6.0; platform_system == "Linux"', 'optree>=0.13.0; extra == "optree"']


def pins(lines):
    return {m.group(1).lower(): m.group(2) for m in map(re.compile(r"^([A-Za-z0-9_.-]+)==(\S+)$").match, lines) if m}


def test_setup_without_torch_pins_the_tested_release_and_keeps_the_triton_pin():
    lines = settled(CONSTRAINTS, None, [], "2.13.0")
    assert pins(lines)["torch"] == "2.13.0"
    assert pins(lines)["triton"] == pins(CONSTRAINTS)["triton"]


def test_setup_keeps_an_installed_cuda_torch_and_its_triton():
    lines = settled(CONSTRAINTS, "2.11.0+cu130", CUDA_TORCH_REQUIRES, "2.13.0")
    assert pins(lines)["torch"] == "2.11.0+cu130", "an installed torch is never replaced"
    assert pins(lines)["triton"] == "3.6.0", "triton follows the installed torch, not constraints.txt"
    assert sum(1 for line in lines if line.startswith("triton")) == 1


def test_setup_keeps_an_installed_cpu_torch_with_the_constrained_triton():
    lines = settled(CONSTRAINTS, "2.13.0+cpu", ["filelock", 'optree>=0.13.0; extra == "optree"'], "2.13.0")
    assert pins(lines)["torch"] == "2.13.0+cpu" and pins(lines)["triton"] == pins(CONSTRAINTS)["triton"]


def test_triton_of_an_extra_is_not_torchs_own():
    assert triton_required_by(['triton>=3; extra == "compile"']) is None
    assert triton_required_by(CUDA_TORCH_REQUIRES) == "triton==3.6.0"


def test_constraints_leave_torch_to_the_setup_and_ci_installs_the_tested_release():
    assert "torch" not in pins(CONSTRAINTS), "constraints.txt must not pin torch: an installed one is kept"
    tested = re.search(r"^TORCH\s*\?=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    ci = re.search(r"pip install --quiet torch==(\S+)", (ROOT / ".ci" / "run").read_text()).group(1)
    assert ci == tested, f".ci/run installs torch {ci}, make setup's TORCH is {tested}"


def test_the_setup_agrees_with_this_environment():
    """The constraints the setup would write here are what is installed: torch and triton as they are."""
    try:
        torch_version, requires = metadata.version("torch"), metadata.requires("torch") or []
        triton_version = metadata.version("triton")
    except metadata.PackageNotFoundError as missing:
        pytest.skip(f"{missing} is not installed")
    lines = pins(settled(CONSTRAINTS, torch_version, requires, "2.13.0"))
    assert lines["torch"] == torch_version
    assert lines["triton"] == triton_version


@pytest.mark.parametrize("installs,problem", [
    ([("torch", "2.13.0"), ("triton", "3.9.0")], None),
    ([("torch", "2.14.1"), ("triton", "3.10.0")], "not the tested 2.13.0"),
    ([("triton", "3.9.0")], "0 times"),
])
def test_check_setup_reads_pips_report(installs, problem):
    report = {"install": [{"metadata": {"name": name, "version": version}} for name, version in installs]}
    problems = report_problems(report, "2.13.0")
    assert (problems == []) if problem is None else (problem in problems[0]), problems
