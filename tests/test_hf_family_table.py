"""docs/hf-families.md is current for the installed transformers (#53, item 6): it was made for this release and
names every family `discover()` finds, each with fmoe's full conversion where fmoe's table has the family.
Cheap: discovery imports the modeling modules (about a second) and builds no model; the sweep's own tests
(tests/test_hf_seam.py) hold what the table says of each family. Regenerate it with

    python -m tests.hf_family_table docs/hf-families.md
"""
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from fmoe.integrations.hf.discovery import discover  # noqa: E402
from fmoe.integrations.hf.families import BY_NAME  # noqa: E402
from tests.hf_family_table import NO_TABLE, parse, table_version  # noqa: E402

TABLE = Path(__file__).resolve().parent.parent / "docs" / "hf-families.md"
REGENERATE = "regenerate it: python -m tests.hf_family_table docs/hf-families.md"


@pytest.fixture(scope="module")
def table():
    return TABLE.read_text()


def test_family_table_is_for_the_installed_transformers(table):
    assert table_version(table) == transformers.__version__, \
        f"{TABLE} was made with transformers {table_version(table)}, {transformers.__version__} is installed; {REGENERATE}"


def test_family_table_names_every_discovered_family(table):
    found, rows = {family.name for family in discover()}, parse(table)
    assert set(rows) == found, (f"{TABLE}: families missing {sorted(found - set(rows))}, gone "
                                f"{sorted(set(rows) - found)}; {REGENERATE}")


def test_family_table_full_convert_column_follows_fmoe_table(table):
    for name, row in parse(table).items():
        if "full convert" in row and not row["model built"].startswith("no:"):
            assert (row["full convert"] == NO_TABLE) == (name not in BY_NAME), f"{name}: {row['full convert']}"
