"""The notebooks in docs/notebooks run, top to bottom, in a Jupyter kernel of this environment's Python
(nbclient, offline, on the bundled sample models): no cell fails or prints a traceback, every cell tagged
"chart" displays its Altair chart, and a Trace displays as its HTML summary."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")
pytest.importorskip("ipykernel")

NOTEBOOKS = Path(__file__).resolve().parents[2] / "docs" / "notebooks"
KERNEL = "moeviz-notebooks"
CELL_TIMEOUT_S = 300

pytestmark = pytest.mark.slow


@pytest.fixture
def kernel(tmp_path, monkeypatch) -> str:
    """A kernel spec that starts this Python (the venv's), found before any the user registered: the
    notebooks must run against the checkout under test, not whichever `python3` kernel a machine has."""
    spec = tmp_path / "jupyter" / "kernels" / KERNEL
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": KERNEL, "language": "python"})
    )
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TQDM_DISABLE", "1")  # the weight-loading bars would fill the outputs
    return KERNEL


def shows_a_chart(cell) -> bool:
    """An output of the cell is a rendered Altair chart (HTML with vegaEmbed, or the Vega-Lite mimetype)."""
    for output in cell.get("outputs", []):
        data = output.get("data", {})
        if any(kind.startswith("application/vnd.vegalite") for kind in data):
            return True
        if "vegaEmbed" in data.get("text/html", ""):
            return True
    return False


@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.stem)
def test_the_notebook_runs(path: Path, kernel: str, tmp_path: Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        notebook,
        kernel_name=kernel,
        timeout=CELL_TIMEOUT_S,
        allow_errors=False,  # the first failing cell raises CellExecutionError, with its traceback
        resources={"metadata": {"path": str(tmp_path)}},  # cells run in a scratch folder, never docs/
    )
    client.execute()
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    for index, cell in enumerate(code):
        for output in cell.outputs:
            text = output.get("text", "") if output.output_type == "stream" else ""
            assert "Traceback" not in text, f"code cell {index} printed a traceback:\n{text}"
        if "chart" in cell.metadata.get("tags", []):
            assert shows_a_chart(cell), f"code cell {index} shows no chart:\n{cell.source}"
    charts = [cell for cell in code if "chart" in cell.metadata.get("tags", [])]
    assert charts, "a notebook of moeviz shows at least one chart"
    traces = [
        cell
        for cell in code
        for output in cell.outputs
        if "<strong>moeviz.Trace</strong>" in output.get("data", {}).get("text/html", "")
    ]
    assert traces, "the notebook displays a Trace, which shows as its HTML summary"
