"""The registry's status column tells the truth, and the docs' table of rows is the registry's."""
import os

from retiarii import nas

DOCS = os.path.join(os.path.dirname(__file__), "..", "docs", "spaces.md")


def test_every_status_is_faithful_or_names_what_differs():
    for row in nas.ROWS:
        assert row.status == "faithful" or row.status.startswith("variant: ")
        assert "stand-in" not in row.strategy or row.variant, row.name


def test_the_docs_table_is_the_registry():
    with open(DOCS) as f:
        text = f.read()
    for cells in nas.table():
        assert "| " + " | ".join(cells) + " |" in text, cells[1]
