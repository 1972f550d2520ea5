"""The constraints `make setup` installs with: constraints.txt, with torch and triton settled first.

`make setup` is one `pip install` of fmoe's extras, so torch is installed at most once:
- no torch on the machine: torch is pinned to the release fmoe is tested with (`--torch`, the same one
  `.ci/run` installs), resolved together with everything else, triton at constraints.txt's pin;
- a torch already installed (a CUDA build, say): it is pinned as it is, so pip never replaces it, and
  triton follows that torch's own requirement when it has one (its CUDA builds pin the triton they were
  built with), else constraints.txt's pin.

Run by path before fmoe is installed (`python fmoe/tools/setup_constraints.py constraints.txt
--torch 2.13.0`); it imports nothing of fmoe, nor torch (it reads installed metadata only).
`--check-report FILE` reads the report of `pip install --dry-run --report FILE` made with those
constraints on a machine without torch (`make check-setup`) and fails unless it installs torch once, at
`--torch`.
"""
import argparse
import json
import re
import sys
from importlib import metadata
from typing import List, Optional, Sequence

_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def requirement_name(line: str) -> Optional[str]:
    """The normalised project name a requirement or constraint line is about, or None for a comment."""
    stripped = line.split("#", 1)[0].strip()
    match = _NAME.match(stripped)
    return re.sub(r"[-_.]+", "-", match.group(1)).lower() if match else None


def triton_required_by(torch_requires: Sequence[str]) -> Optional[str]:
    """torch's own triton requirement (`triton==3.6.0`), markers dropped, or None (a CPU build)."""
    for requirement in torch_requires:
        if requirement_name(requirement) == "triton" and "extra ==" not in requirement:
            return requirement.split(";", 1)[0].strip().replace(" ", "")
    return None


def settled(constraints: Sequence[str], installed_torch: Optional[str], torch_requires: Sequence[str],
            tested_torch: str) -> List[str]:
    """constraints.txt's lines with torch and triton settled (see the module's docstring)."""
    if installed_torch is None:
        torch_pin, triton_pin = f"torch=={tested_torch}", None
    else:
        torch_pin, triton_pin = f"torch=={installed_torch}", triton_required_by(torch_requires)
    lines = [line for line in constraints if requirement_name(line) != "torch"]
    if triton_pin is not None:
        lines = [line for line in lines if requirement_name(line) != "triton"] + [triton_pin]
    return lines + [torch_pin]


def installed_torch() -> tuple:
    try:
        return metadata.version("torch"), metadata.requires("torch") or []
    except metadata.PackageNotFoundError:
        return None, []


def report_problems(report: dict, tested_torch: str) -> List[str]:
    """What is wrong with a `pip install --dry-run --report` of the setup on a machine without torch."""
    versions = [item["metadata"]["version"] for item in report.get("install", [])
                if requirement_name(item["metadata"]["name"]) == "torch"]
    if len(versions) != 1:
        return [f"the setup installs torch {len(versions)} times ({versions}), not once"]
    if versions[0].split("+", 1)[0] != tested_torch:
        return [f"the setup installs torch {versions[0]}, not the tested {tested_torch}"]
    return []


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("constraints", nargs="?", help="constraints.txt")
    parser.add_argument("--torch", required=True, help="the torch release to install where none is")
    parser.add_argument("--check-report", metavar="FILE", help="check a pip --dry-run report instead")
    args = parser.parse_args(argv)
    if args.check_report:
        with open(args.check_report) as f:
            problems = report_problems(json.load(f), args.torch)
        for problem in problems:
            print(f"setup_constraints: {problem}", file=sys.stderr)
        return 1 if problems else 0
    if args.constraints is None:
        parser.error("constraints: the constraints file is required")
    with open(args.constraints) as f:
        constraints = f.read().splitlines()
    version, requires = installed_torch()
    print("\n".join(settled(constraints, version, requires, args.torch)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
