"""The app's trace cache (`app/components/trace_cache.py`, free of Streamlit) under concurrent use:
each (model, text) is computed once, its trace is the library's, the LRU bound holds, and a failing
computation reaches only the threads that asked for it."""

from __future__ import annotations

import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import moeviz
from tests.support.app import app_importable

MODEL = "sample:mixtral-healthy"
TEXTS = [f"Sentence number {i}: the router sends each token to two of eight experts." for i in range(4)]
BROKEN = "sample:no-such-model"
THREADS = 8


@pytest.fixture
def cache_module(monkeypatch):
    app_importable(monkeypatch)
    from components import trace_cache

    return trace_cache


@pytest.fixture(scope="module")
def loaded():
    return moeviz.load_model(MODEL)


class Counting:
    """`load` and `capture` for a TraceCache that count their calls; `load` fails for BROKEN."""

    def __init__(self, loaded, capture) -> None:
        self.loaded = loaded
        self.inner = capture
        self.calls: Counter = Counter()
        self.lock = threading.Lock()

    def load(self, source: str):
        if source == BROKEN:
            with self.lock:
                self.calls[(source, "load")] += 1
            raise moeviz.MoevizError(f"no sample named {source}")
        return self.loaded

    def capture(self, loaded, text, progress):
        with self.lock:
            self.calls[text] += 1
        return self.inner(loaded, text, progress)


def same_trace(a: moeviz.Trace, b: moeviz.Trace) -> None:
    assert a.tokens.equals(b.tokens)
    assert a.layer_keys == b.layer_keys
    for ra, rb in zip(a.layers, b.layers, strict=True):
        np.testing.assert_array_equal(ra.experts, rb.experts)
        np.testing.assert_allclose(ra.weights, rb.weights, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(ra.logits, rb.logits, rtol=1e-5, atol=1e-6)


def test_the_cache_module_does_not_import_streamlit(cache_module) -> None:
    import ast
    from pathlib import Path

    tree = ast.parse(Path(cache_module.__file__).read_text())
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    imported |= {
        node.module.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module
    }
    assert imported <= {"__future__", "threading", "collections", "concurrent", "typing", "moeviz"}, imported
    assert "streamlit" not in imported


def test_concurrent_requests_compute_each_key_once(cache_module, loaded) -> None:
    counting = Counting(loaded, cache_module.capture_for_app)
    cache = cache_module.TraceCache(counting.load, size=len(TEXTS), capture=counting.capture)
    requests = [(MODEL, TEXTS[i % len(TEXTS)]) for i in range(THREADS * 3)]
    start = threading.Barrier(THREADS)

    def ask(key):
        if threading.current_thread().name not in started:
            started.add(threading.current_thread().name)
            start.wait()  # every thread starts at once: the first requests of each key overlap
        return key, cache.get(*key)

    started: set[str] = set()
    with ThreadPoolExecutor(THREADS) as pool:
        results = list(pool.map(ask, requests))

    assert {text: counting.calls[text] for text in TEXTS} == dict.fromkeys(TEXTS, 1)
    by_key: dict = {}
    for key, trace in results:
        assert by_key.setdefault(key, trace) is trace  # every thread got the one shared capture
    for text in TEXTS:
        direct = moeviz.capture(loaded, text, attention=True)
        same_trace(by_key[(MODEL, text)], direct)
        assert by_key[(MODEL, text)].attention is not None  # decoder-only: attention is captured
    assert len(cache) == len(TEXTS)


def test_the_lru_bound_holds(cache_module, loaded) -> None:
    counting = Counting(loaded, cache_module.capture_for_app)
    cache = cache_module.TraceCache(counting.load, size=2, capture=counting.capture)
    first = cache.get(MODEL, TEXTS[0])
    cache.get(MODEL, TEXTS[1])
    assert cache.get(MODEL, TEXTS[0]) is first  # a hit: TEXTS[0] is now the most recent
    cache.get(MODEL, TEXTS[2])  # evicts TEXTS[1], the least recently used
    assert len(cache) == 2
    assert cache.cached_keys() == [(MODEL, TEXTS[0]), (MODEL, TEXTS[2])]
    assert cache.get(MODEL, TEXTS[0]) is first
    cache.get(MODEL, TEXTS[1])  # computed again
    assert counting.calls[TEXTS[1]] == 2 and counting.calls[TEXTS[0]] == 1

    # the bound also holds under concurrent use over more keys than it keeps
    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(lambda i: cache.get(MODEL, TEXTS[i % len(TEXTS)]), range(THREADS * 2)))
    assert len(cache) == 2
    with pytest.raises(ValueError):
        cache_module.TraceCache(counting.load, size=0)


def test_an_error_does_not_poison_other_keys(cache_module, loaded) -> None:
    counting = Counting(loaded, cache_module.capture_for_app)
    cache = cache_module.TraceCache(counting.load, size=8, capture=counting.capture)
    requests = [(BROKEN if i % 2 else MODEL, TEXTS[i % 2]) for i in range(THREADS * 2)]

    def ask(key):
        try:
            return key, cache.get(*key)
        except moeviz.MoevizError as exc:
            return key, exc

    with ThreadPoolExecutor(THREADS) as pool:
        results = list(pool.map(ask, requests))

    for key, result in results:
        if key[0] == BROKEN:
            assert isinstance(result, moeviz.MoevizError) and "no-such-model" in str(result)
        else:
            assert isinstance(result, moeviz.Trace)
    assert counting.calls[TEXTS[0]] == 1  # the good key: once, whatever failed beside it
    assert (BROKEN, TEXTS[1]) not in cache.cached_keys()  # an error is not kept ...
    assert cache.cached_keys() == [(MODEL, TEXTS[0])]
    before = counting.calls[(BROKEN, "load")]
    with pytest.raises(moeviz.MoevizError):
        cache.get(BROKEN, TEXTS[1])
    assert counting.calls[(BROKEN, "load")] == before + 1  # ... the next request tries again
    same_trace(cache.get(MODEL, TEXTS[0]), moeviz.capture(loaded, TEXTS[0]))


def test_waiting_threads_share_one_error_and_recover_from_an_interruption(cache_module, loaded) -> None:
    release = threading.Event()
    calls = Counter()
    interrupt = {"next": True}

    class Interrupted(BaseException):
        """Like Streamlit's StopException: not an Exception."""

    def capture(loaded, text, progress):
        calls[text] += 1
        release.wait(timeout=30)
        if text == "fails":
            raise moeviz.MoevizError("this text fails")
        if interrupt["next"]:
            interrupt["next"] = False
            raise Interrupted
        return cache_module.capture_for_app(loaded, text, progress)

    cache = cache_module.TraceCache(lambda source: loaded, size=4, capture=capture)

    def ask(text):
        try:
            return cache.get(MODEL, text)
        except moeviz.MoevizError as exc:
            return exc
        except Interrupted as exc:
            return exc

    with ThreadPoolExecutor(THREADS) as pool:
        failing = [pool.submit(ask, "fails") for _ in range(THREADS // 2)]
        while not calls["fails"]:
            threading.Event().wait(0.01)
        threading.Event().wait(0.2)  # the other requests are now waiting for the first one
        release.set()
        errors = [f.result() for f in failing]
    assert calls["fails"] == 1  # computed once, its one error handed to every waiting thread
    assert all(isinstance(e, moeviz.MoevizError) for e in errors)
    assert len({id(e) for e in errors}) == 1

    # an interrupted computation (a page stopped mid-capture) is not an error for the others: one of the
    # waiting threads computes it instead
    release.clear()
    with ThreadPoolExecutor(THREADS) as pool:
        futures = [pool.submit(ask, TEXTS[0]) for _ in range(THREADS // 2)]
        while not calls[TEXTS[0]]:
            threading.Event().wait(0.01)
        threading.Event().wait(0.2)
        release.set()
        results = [f.result() for f in futures]
    interrupted = [r for r in results if isinstance(r, Interrupted)]
    traces = [r for r in results if isinstance(r, moeviz.Trace)]
    assert len(interrupted) == 1 and len(traces) == THREADS // 2 - 1
    assert calls[TEXTS[0]] == 2
    assert all(t is traces[0] for t in traces)
