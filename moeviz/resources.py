"""Where the Streamlit app, the bundled sample models and the documentation the app shows are, in a source
checkout and in an installed wheel.

The repository keeps them at its top level (`app/`, `sample_models/`, `docs/`). The wheel ships them inside
the package, as `moeviz/_app`, `moeviz/_sample_models` and `moeviz/_docs` (only the files the app reads:
see setup.py); a checkout, and an editable install of it, has no such folders and uses the top-level ones
beside the package.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

# top-level folder -> its name inside the wheel
BUNDLED = {"app": "_app", "sample_models": "_sample_models", "docs": "_docs"}


def bundled_path(name: str) -> Path:
    """The folder `name` ("app", "sample_models" or "docs"): the installed copy if there is one, else the
    checkout's."""
    package = Path(str(files("moeviz")))
    installed = package / BUNDLED[name]
    return installed if installed.is_dir() else package.parent / name
