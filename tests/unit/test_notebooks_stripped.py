"""The notebooks in docs/notebooks are committed without outputs: no output, no execution count, no
widget state (tests/system/test_notebooks.py runs them; the site renders them). A committed output would
go stale the first time a chart changes, and would put megabytes of chart data into git."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[2] / "docs" / "notebooks"
EXPECTED = ("tour", "diagnose_collapse", "deployment_whatifs", "compare_engines")


def unstripped(notebook: dict) -> list[str]:
    """What a notebook (its JSON) carries that a stripped one does not, one line per finding."""
    found = []
    for index, cell in enumerate(notebook.get("cells", [])):
        if cell.get("cell_type") != "code":
            continue
        if cell.get("outputs"):
            found.append(f"cell {index}: {len(cell['outputs'])} outputs")
        if cell.get("execution_count") is not None:
            found.append(f"cell {index}: execution count {cell['execution_count']}")
        if "execution" in cell.get("metadata", {}):
            found.append(f"cell {index}: execution timings in its metadata")
    if "widgets" in notebook.get("metadata", {}):
        found.append("widget state in the notebook's metadata")
    return found


def test_the_notebooks_are_there() -> None:
    assert {path.stem for path in NOTEBOOKS.glob("*.ipynb")} >= set(EXPECTED)


@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.name)
def test_a_committed_notebook_has_no_outputs(path: Path) -> None:
    notebook = json.loads(path.read_text(encoding="utf-8"))
    assert notebook["nbformat"] == 4
    assert unstripped(notebook) == [], f"{path.name}: clear its outputs before committing"


def test_an_executed_notebook_is_caught() -> None:
    executed = {
        "metadata": {"widgets": {}},
        "cells": [
            {"cell_type": "markdown", "metadata": {}, "source": "text"},
            {
                "cell_type": "code",
                "execution_count": 3,
                "metadata": {"execution": {"iopub.execute_input": "2025-01-01T00:00:00"}},
                "outputs": [{"output_type": "stream", "name": "stdout", "text": "1\n"}],
                "source": "print(1)",
            },
            {"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [], "source": "x = 1"},
        ],
    }
    assert unstripped(executed) == [
        "cell 1: 1 outputs",
        "cell 1: execution count 3",
        "cell 1: execution timings in its metadata",
        "widget state in the notebook's metadata",
    ]
