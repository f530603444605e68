"""The libraries every page imports (pandas, Altair, pyarrow and the parts of moeviz a page reads
routing with: no torch), imported on a thread as the server starts (`start`, from app/serve.py), while
a browser loads Streamlit's scripts; a page's script waits for it (`wait`) rather than import the same
modules beside it. No Streamlit here."""

from __future__ import annotations

import importlib
import threading

MODULES = (
    "pandas",
    "pyarrow.parquet",
    "altair",
    "moeviz.trace",
    "moeviz.analysis",
    "moeviz.charts",
)

_lock = threading.Lock()
_thread: threading.Thread | None = None
_finished = threading.Event()


def _import_all() -> None:
    try:
        for name in MODULES:
            importlib.import_module(name)
    except Exception:  # the page imports them itself and shows the error there
        pass
    finally:
        _finished.set()


def start() -> None:
    """Start the import (once per process)."""
    global _thread
    with _lock:
        if _thread is None:
            _thread = threading.Thread(target=_import_all, name="moeviz-preload", daemon=True)
            _thread.start()


def wait() -> None:
    """Until the import started by `start` is finished; at once when none was started (the app run as
    `streamlit run app/streamlit_app.py`, or in a test)."""
    with _lock:
        started = _thread is not None
    if started:
        _finished.wait()
