"""The server's background import of torch and transformers (`components.warmup`): a background start
waits before it begins and then runs at the lowest CPU priority; someone waiting for it begins it at once
at the usual priority. The libraries are stand-ins that record the thread that imports them."""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.support.app import APP_DIR

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="a thread's own nice value is Linux's")
STAND_IN = """
import os, threading, time
IMPORTED_AT = time.monotonic()
THREAD = threading.get_native_id()
NICE = os.getpriority(os.PRIO_PROCESS, THREAD)
"""


@pytest.fixture
def warmup(monkeypatch, tmp_path: Path):
    """A new copy of `components.warmup` (the app's own, with its state, is left alone) whose libraries
    are one stand-in module (`stand_in`), made in tmp_path."""
    (tmp_path / "stand_in.py").write_text(STAND_IN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "stand_in", raising=False)
    spec = importlib.util.spec_from_file_location("warmup_under_test", APP_DIR / "components" / "warmup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "LIBRARIES", ("stand_in",))
    yield module
    module._finished.wait(30)


def test_a_background_start_waits_then_imports_at_the_lowest_priority(warmup, monkeypatch):
    monkeypatch.setattr(warmup, "BACKGROUND_DELAY_S", 0.5)
    started = time.monotonic()
    warmup.start(background=True)
    assert not warmup.done()
    warmup.wait(start_now=False)
    stand_in = sys.modules["stand_in"]
    assert stand_in.IMPORTED_AT - started >= 0.5  # after the delay
    assert threading.get_native_id() != stand_in.THREAD and stand_in.NICE == 19


def test_someone_waiting_begins_it_at_once_at_the_usual_priority(warmup, monkeypatch):
    monkeypatch.setattr(warmup, "BACKGROUND_DELAY_S", 60.0)
    started = time.monotonic()
    warmup.start(background=True)
    time.sleep(0.2)
    assert not warmup.done()  # still waiting out its delay
    warmup.wait()  # a page needs the model: no minute's wait
    stand_in = sys.modules["stand_in"]
    assert stand_in.IMPORTED_AT - started < 30
    assert stand_in.NICE == 0
