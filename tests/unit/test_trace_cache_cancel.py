"""A capture whose page run was superseded (the model switched mid-capture: Streamlit stops the old run by
raising StopException from its next `st` call, here the progress bar's update) stops early, is not
cached, and does not strand or fail another session waiting for the same capture."""

from __future__ import annotations

import threading
from collections import Counter

import pytest
from streamlit.runtime.scriptrunner_utils.exceptions import StopException

from tests.support.app import app_importable

LAYERS = 8
KEY = ("model-a", "the prompt")
WAIT_S = 20


@pytest.fixture
def cache_module(monkeypatch):
    app_importable(monkeypatch)
    from components import trace_cache

    return trace_cache


class Capture:
    """A capture of LAYERS MoE layers calling `progress` after each; counts layers run per call."""

    def __init__(self) -> None:
        self.layers: list[int] = []
        self.started = threading.Event()
        self.go_on = threading.Event()
        self.go_on.set()

    def __call__(self, loaded, text, progress):
        self.layers.append(0)
        for layer in range(1, LAYERS + 1):
            self.layers[-1] = layer
            self.started.set()
            self.go_on.wait(WAIT_S)
            if progress is not None:
                progress(layer, LAYERS)
        return ("trace", loaded, text, len(self.layers))


def stopped_after(calls: int, counter: Counter):
    """A progress callback like the app's once its run is superseded: the update after `calls` raises."""

    def progress(done: int, total: int) -> None:
        counter["progress"] += 1
        if counter["progress"] > calls:
            raise StopException()

    return progress


def test_a_superseded_capture_stops_early_and_is_not_cached(cache_module) -> None:
    capture = Capture()
    cache = cache_module.TraceCache(lambda source: source, size=4, capture=capture)
    counter: Counter = Counter()
    with pytest.raises(StopException):
        cache.get(*KEY, stopped_after(2, counter))
    assert capture.layers == [3]  # stopped at the 3rd layer's update, not run to the end
    assert counter["progress"] == 3
    assert len(cache) == 0 and cache.cached_keys() == []
    trace = cache.get(*KEY)  # a later request computes it afresh
    assert trace == ("trace", "model-a", "the prompt", 2)
    assert capture.layers == [3, LAYERS]
    assert cache.get(*KEY) is trace and len(capture.layers) == 2  # and that one is kept


def test_a_waiting_session_gets_a_fresh_capture_not_an_error(cache_module) -> None:
    capture = Capture()
    capture.go_on.clear()
    cache = cache_module.TraceCache(lambda source: source, size=4, capture=capture)
    results: dict[str, object] = {}

    def superseded() -> None:
        try:
            results["first"] = cache.get(*KEY, stopped_after(2, Counter()))
        except StopException as exc:
            results["first"] = exc

    def waiting() -> None:
        try:
            results["second"] = cache.get(*KEY, lambda done, total: None)
        except BaseException as exc:  # any error here is the failure under test
            results["second"] = exc

    first = threading.Thread(target=superseded, daemon=True)
    first.start()
    assert capture.started.wait(WAIT_S)
    second = threading.Thread(target=waiting, daemon=True)
    second.start()
    second.join(0.3)
    assert second.is_alive()  # it waits for the first one's capture instead of starting its own
    assert len(capture.layers) == 1
    capture.go_on.set()
    first.join(WAIT_S)
    second.join(WAIT_S)
    assert not first.is_alive() and not second.is_alive(), "a thread was left hanging"
    assert isinstance(results["first"], StopException)
    assert results["second"] == ("trace", "model-a", "the prompt", 2)  # its own, complete run
    assert capture.layers == [3, LAYERS]
    assert cache.cached_keys() == [KEY]
