"""The documentation: every public name in the API reference with a docstring, a short README, and
every relative link of the README and docs/ pointing at a file (and heading) that exists.

`make test` also builds the site with `mkdocs build --strict`; these checks say which name or link
is wrong without it, and hold what a build does not: that nothing public is left out.
"""
import importlib
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
README_MAX_LINES = 300

# The modules whose `__all__` is the public API; each name must be documented under some path that
# imports the same object (a gate of `fmoe.__all__` is documented as `fmoe.gates.<name>`).
PUBLIC_MODULES = ["fmoe", "fmoe.gates", "fmoe.hf", "fmoe.megatron", "fmoe.deepspeed"]


def documented_paths():
    """Every `::: dotted.path` of the API reference pages, with the page it is on."""
    found = []
    for page in sorted((DOCS / "api").glob("*.md")):
        for line in page.read_text().splitlines():
            m = re.match(r"^:::\s+([\w.]+)\s*$", line)
            if m:
                found.append((m.group(1), page.relative_to(ROOT).as_posix()))
    return found


def import_path(path):
    """The object a dotted path names at run time: the longest importable module, then attributes."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(path)


def import_or_skip(module):
    try:
        return importlib.import_module(module)
    except ImportError as err:  # fmoe.megatron without megatron-core, fmoe.deepspeed without deepspeed
        pytest.skip(f"{module}: {err}")


def test_the_api_reference_has_pages():
    assert len(documented_paths()) > 50


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_every_public_name_is_in_the_api_reference(module):
    mod = import_or_skip(module)
    objects = []
    for path, _ in documented_paths():
        try:
            objects.append(import_path(path))
        except (ImportError, AttributeError):
            pass  # reported by test_every_documented_path_imports
    missing = [name for name in mod.__all__ if not any(getattr(mod, name) is obj for obj in objects)]
    assert not missing, f"{module}.__all__ names missing from docs/api/*.md (add a `::: path` line): {missing}"


def test_every_documented_path_imports():
    bad = []
    for path, page in documented_paths():
        if path.startswith(("fmoe.integrations.megatron", "fmoe.integrations.deepspeed")):
            try:
                importlib.import_module(".".join(path.split(".")[:3]))
            except ImportError:
                continue
        try:
            import_path(path)
        except (ImportError, AttributeError) as err:
            bad.append(f"{page}: {path}: {err}")
    assert not bad, "\n".join(bad)


def test_every_documented_name_has_a_docstring():
    """As the reference renders it: griffe reads the source (a constant's docstring is the string
    under its assignment) and follows the public path's alias to the definition."""
    griffe = pytest.importorskip("griffe")
    loader = griffe.GriffeLoader(search_paths=[str(ROOT), *sys.path], allow_inspection=True)  # as mkdocs.yml: paths
    package = loader.load("fmoe")
    loader.resolve_aliases(implicit=False, external=False)
    undocumented = []
    for path, page in documented_paths():
        obj = package[path.removeprefix("fmoe.")]
        docstring = obj.docstring  # an alias reads its target's
        if docstring is None or not docstring.value.strip():
            undocumented.append(f"{page}: {path}")
    assert not undocumented, "no docstring:\n" + "\n".join(undocumented)


def test_the_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines, more than {README_MAX_LINES}: move the detail to a page under docs/")


def test_the_readme_keeps_the_commands():
    """The two commands, and the slow acceptance runs behind their own targets (CI and reviewers read them here)."""
    text = README.read_text()
    for command in ("make demo", "make test", "make test-compat", "make test-modes", "make test-megatron-parallel",
                    "make test-megatron19", "make aot", "make docs"):
        assert re.search(rf"(?<![-\w]){re.escape(command)}(?![-\w])", text), f"README.md no longer names {command}"


def markdown_files():
    return [README] + sorted(DOCS.rglob("*.md"))


def prose(text):
    """The text outside fenced code blocks and inline code, where a link is a link."""
    text = re.sub(r"^(```|~~~).*?^\1", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def slugs(page):
    """The anchors of a page's headings, as MkDocs and GitHub make them (inline code keeps its text)."""
    found = set()
    for line in re.sub(r"^(```|~~~).*?^\1", "", page.read_text(), flags=re.S | re.M).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*$", line)
        if not m:
            continue
        title = re.sub(r"\[([^]]*)\]\([^)]*\)", r"\1", m.group(1)).lower()
        title = re.sub(r"[^\w\s-]", "", title)
        found.add(re.sub(r"[-\s]+", "-", title).strip("-"))  # MkDocs
        found.add(re.sub(r"\s", "-", title))  # GitHub
    return found


@pytest.mark.parametrize("page", markdown_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page):
    broken = []
    for target in re.findall(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", prose(page.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in slugs(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_every_docs_requirement_is_pinned_in_the_constraints():
    """`make setup` installs `.[test,docs]` with constraints.txt: the site is built with the versions pinned there."""
    setup = (ROOT / "setup.py").read_text()
    docs_extra = re.search(r'"docs": \[(.*?)\]', setup, re.S).group(1)
    wanted = {re.split(r"[\[<>=;\s]", req.strip().strip('"'))[0].lower() for req in docs_extra.split(",")} - {""}
    pinned = {line.split("==")[0].lower().replace("_", "-") for line in (ROOT / "constraints.txt").read_text().splitlines()
              if "==" in line and not line.startswith("#")}
    assert wanted and wanted <= pinned, wanted - pinned
    assert {"mkdocstrings-python", "griffelib"} <= pinned
    makefile = (ROOT / "Makefile").read_text()
    assert "setup_constraints.py constraints.txt" in makefile and "'.[test,docs]' -c $(VENV)/constraints.txt" in makefile
