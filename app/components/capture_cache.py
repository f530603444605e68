"""The latest captures per (model, text), shared by every session of the server. No Streamlit here: only
moeviz and the standard library, so the cache is tested on its own (tests/test_capture_cache.py)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future

import moeviz

Progress = Callable[[int, int], None]
Key = tuple[str, str]


def capture_for_app(loaded: moeviz.LoadedModel, text: str, progress: Progress | None = None) -> moeviz.Trace:
    """What the app captures of `text`: routing, and attention for decoder-only models."""
    return moeviz.capture(loaded, text, attention=not loaded.is_encoder_decoder, progress=progress)


class CaptureCache:
    """The latest `size` captures per (model source, text); each is computed once, also when several
    threads (sessions) ask for it at the same time: the first computes, the others wait for its result.

    An error is not kept: every thread waiting for that computation gets it, the next request computes
    again, and other keys are unaffected. When the computing thread is interrupted instead (a
    `BaseException` that is not an `Exception`, such as Streamlit stopping or rerunning that session's
    script from inside the progress callback), a waiting thread computes it instead.

    `load(source)` gives the model (itself cached by the caller); `capture(loaded, text, progress)`
    computes; only the computing request's progress callback is called.

    A capture is a resource, not data: its attention part holds a lock and lazily computed summaries, so it
    cannot be pickled; it is read-only and thread-safe, so sessions may share it. Few entries: it keeps
    every layer's queries and keys (linear in tokens, but not small)."""

    def __init__(
        self,
        load: Callable[[str], moeviz.LoadedModel],
        size: int = 8,
        capture: Callable[[moeviz.LoadedModel, str, Progress | None], moeviz.Trace] = capture_for_app,
    ) -> None:
        if size < 1:
            raise ValueError(f"a capture cache holds at least one capture, not {size}")
        self._load = load
        self._capture = capture
        self._size = size
        self._done: OrderedDict[Key, moeviz.Trace] = OrderedDict()
        self._running: dict[Key, Future[moeviz.Trace | None]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._done)

    def cached_keys(self) -> list[Key]:
        """The cached keys, least recently used first."""
        with self._lock:
            return list(self._done)

    def get(self, source: str, text: str, progress: Progress | None = None) -> moeviz.Trace:
        """The capture of `text` by the model at `source`, computed at most once while cached."""
        key = (source, text)
        while True:
            with self._lock:
                if key in self._done:
                    self._done.move_to_end(key)
                    return self._done[key]
                running = self._running.get(key)
                if running is None:
                    running = self._running[key] = Future()
                    break  # this thread computes it
            trace = running.result()  # another thread computes it: wait for its trace (or its error)
            if trace is not None:
                return trace
            # None: that thread was interrupted (not an error of the capture): ask again
        try:
            trace = self._capture(self._load(source), text, progress)
        except BaseException as exc:
            with self._lock:
                del self._running[key]
            if isinstance(exc, Exception):
                running.set_exception(exc)  # the waiting threads get the same error
            else:  # a control-flow interruption of the computing thread (a page rerun or stop, an exit)
                running.set_result(None)
            raise
        with self._lock:
            del self._running[key]
            self._done[key] = trace
            while len(self._done) > self._size:
                self._done.popitem(last=False)
        running.set_result(trace)
        return trace
