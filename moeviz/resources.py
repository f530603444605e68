"""Where the Streamlit app and the bundled sample models are, in a source checkout and in an installed wheel.

The repository keeps them at its top level (`app/`, `sample_models/`). The wheel ships both inside the
package, as `moeviz/_app` and `moeviz/_sample_models` (see setup.py); a checkout, and an editable install
of it, has no such folders and uses the top-level ones beside the package.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

BUNDLED = {"app": "_app", "sample_models": "_sample_models"}  # top-level folder -> name inside the wheel


def bundled_path(name: str) -> Path:
    """The folder `name` ("app" or "sample_models"): the installed copy if there is one, else the
    checkout's."""
    package = Path(str(files("moeviz")))
    installed = package / BUNDLED[name]
    return installed if installed.is_dir() else package.parent / name
