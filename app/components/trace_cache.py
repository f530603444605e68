"""The server's shared results: `SharedResults`, the latest results per key, each computed once however many
sessions ask for it at the same time, and `TraceCache`, the captured traces per (model, text) built on it
(the loaded models are one too: `caches.models`). No Streamlit here: only moeviz and the standard library,
so the caches are tested on their own (tests/models/test_trace_cache.py,
tests/unit/test_trace_cache_cancel.py)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Generic, TypeVar

import moeviz

Progress = Callable[[int, int], None]
Key = TypeVar("Key", bound=Hashable)
Value = TypeVar("Value")


def capture_for_app(loaded: moeviz.LoadedModel, text: str, progress: Progress | None = None) -> moeviz.Trace:
    """What the app captures of `text`: routing, and attention for decoder-only models."""
    attention = not (loaded.is_encoder_decoder or loaded.is_token_classifier)
    return moeviz.capture(loaded, text, attention=attention, progress=progress)


class SharedResults(Generic[Key, Value]):
    """The latest `size` results per key; each is computed once, also when several threads (sessions) ask
    for it at the same time: the first computes, the others wait for its result.

    An error is not kept: every thread waiting for that computation gets it, the next request computes
    again, and other keys are unaffected. When the computing thread is interrupted instead (a
    `BaseException` that is not an `Exception`, such as Streamlit stopping or rerunning that session's
    script from inside a progress callback), a waiting thread computes it instead."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"a cache holds at least one result, not {size}")
        self._size = size
        self._done: OrderedDict[Key, Value] = OrderedDict()
        self._running: dict[Key, Future[tuple[Value] | None]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._done)

    def cached_keys(self) -> list[Key]:
        """The cached keys, least recently used first."""
        with self._lock:
            return list(self._done)

    def get(self, key: Key, compute: Callable[[], Value]) -> Value:
        """The result of `key`, computed by `compute()` at most once while cached."""
        while True:
            with self._lock:
                if key in self._done:
                    self._done.move_to_end(key)
                    return self._done[key]
                running = self._running.get(key)
                if running is None:
                    running = self._running[key] = Future()
                    break  # this thread computes it
            result = running.result()  # another thread computes it: wait for its result (or its error)
            if result is not None:
                return result[0]
            # None: that thread was interrupted (not an error of the computation): ask again
        try:
            value = compute()
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
            self._done[key] = value
            while len(self._done) > self._size:
                self._done.popitem(last=False)
        running.set_result((value,))
        return value


class TraceCache:
    """The latest `size` captured traces per (model source, text), each captured once (`SharedResults`:
    concurrent requests wait for one capture; an error is not kept; a capture interrupted by its page's
    rerun or stop is captured again by a waiting request).

    `load(source)` gives the model (itself cached by the caller); `capture(loaded, text, progress)`
    captures; only the capturing request's progress callback is called.

    A trace here is a resource, not data: its attention part holds a lock and lazily computed summaries,
    so it cannot be pickled; it is read-only and thread-safe, so sessions may share it. Few entries: it
    keeps every layer's queries and keys (linear in tokens, but not small)."""

    def __init__(
        self,
        load: Callable[[str], moeviz.LoadedModel],
        size: int = 8,
        capture: Callable[[moeviz.LoadedModel, str, Progress | None], moeviz.Trace] = capture_for_app,
    ) -> None:
        self._load = load
        self._capture = capture
        self._traces: SharedResults[tuple[str, str], moeviz.Trace] = SharedResults(size)

    def __len__(self) -> int:
        return len(self._traces)

    def cached_keys(self) -> list[tuple[str, str]]:
        """The cached (source, text) keys, least recently used first."""
        return self._traces.cached_keys()

    def get(self, source: str, text: str, progress: Progress | None = None) -> moeviz.Trace:
        """The trace of `text` captured by the model at `source`, captured at most once while cached."""
        return self._traces.get((source, text), lambda: self._capture(self._load(source), text, progress))
