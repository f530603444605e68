"""The server's one import of torch and transformers, on a background thread, started once a first page
has run (`start`); whatever needs them waits for it (`wait`). No Streamlit here.

The app's first page is drawn without either (the example prompt's routing kept on disk,
`moeviz.trace.kept`): their import takes seconds, most of a cold server's first page. One thread imports
them, because transformers swaps itself for a lazy module in sys.modules during its first import: a second
thread importing from it meanwhile (Streamlit's fast reruns start a new script thread while the old one
still runs) is handed the half-built module ("cannot import name X"). `importlib` on one thread, and every
other user waiting for it, returns only the finished module."""

from __future__ import annotations

import contextlib
import importlib
import os
import threading

LIBRARIES = ("torch", "transformers")
# A background start waits this long first: the first page's browser is still drawing what the page's run
# sent (~1 s on 2 shared cores), and the import beside it, even at the lowest priority, drew it ~0.5 s later
# (it holds the GIL the server needs to send the browser Streamlit's scripts, and takes the second core).
BACKGROUND_DELAY_S = 2.0

_lock = threading.Lock()
_thread: threading.Thread | None = None
_finished = threading.Event()
_failure: list[BaseException] = []  # the import's error, raised to every waiter
_accelerators: list[str] = []
_wanted = threading.Event()  # someone waits for the import: no delay, no lowered priority


def _import_all(background: bool) -> None:
    if background and not _wanted.wait(BACKGROUND_DELAY_S):
        _lowest_priority()
        if _wanted.is_set():  # asked for between the wait and the lowering: `start` may have missed it
            _set_nice(threading.get_native_id(), 0)
    try:
        for library in LIBRARIES:
            importlib.import_module(library)
        import torch

        if torch.cuda.is_available():
            _accelerators.append("cuda")
        mps = getattr(torch.backends, "mps", None)
        if mps is not None and mps.is_available():
            _accelerators.append("mps")
    except BaseException as exc:  # handed to every waiter instead of dying with the thread
        _failure.append(exc)
    finally:
        _finished.set()


def _lowest_priority() -> None:
    """This thread at the lowest CPU priority (Linux: a thread's own nice value): the import must not slow
    what a user waits for meanwhile (a browser drawing the first page on the same cores)."""
    _set_nice(threading.get_native_id(), 19)


def _set_nice(thread_id: int, nice: int) -> None:
    with contextlib.suppress(AttributeError, OSError):  # not Linux, or not allowed: left as is
        os.setpriority(os.PRIO_PROCESS, thread_id, nice)


def start(*, background: bool = False) -> None:
    """Start the import (once per process; later calls return at once). `background`: nobody waits for it
    yet (a page's run has just ended: its browser is drawing it), so it begins `BACKGROUND_DELAY_S` later
    at the lowest CPU priority; a later call without it (someone waits) begins it at once, and gives it
    back the usual priority where the system allows (raising a priority needs privileges on Linux)."""
    global _thread
    with _lock:
        if not background and not _wanted.is_set():
            _wanted.set()
            if _thread is not None:
                _set_nice(_thread.native_id, 0)
        if _thread is None:
            _thread = threading.Thread(target=_import_all, args=(background,), name="moeviz-warmup")
            _thread.daemon = True
            _thread.start()


def done() -> bool:
    """Whether torch and transformers are imported (or their import failed: `wait` raises its error)."""
    return _finished.is_set()


def wait(*, start_now: bool = True) -> None:
    """Return once the import is finished (starting it now, unless `start_now` is False: the first page's
    attention row waits for the background start at the end of the page's run, app/streamlit_app.py, so
    as not to slow the views its browser is drawing); its error, if it failed."""
    if start_now:
        start()
    _finished.wait()
    if _failure:
        raise _failure[0]


def accelerators() -> list[str]:
    """The devices besides the CPU that torch reports here ("cuda", "mps"); none until the import is done."""
    return list(_accelerators) if done() else []
