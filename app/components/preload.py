"""The libraries every page imports (pandas, Altair, pyarrow and the parts of moeviz a page reads
routing with: no torch), imported by app/serve.py as the server starts, before it answers. No
Streamlit here."""

from __future__ import annotations

import importlib

MODULES = (
    "pandas",
    "pyarrow.parquet",
    "altair",
    "moeviz.trace",
    "moeviz.analysis",
    "moeviz.charts",
)


def import_all() -> None:
    """Import `MODULES`; one that fails is left to the page that imports it, which shows the error."""
    for name in MODULES:
        try:
            importlib.import_module(name)
        except Exception:
            continue
