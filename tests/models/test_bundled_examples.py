"""The example routing shipped with the bundled samples (`moeviz.models.bundled_examples`, written by
scripts/samples/bundle_examples.py): every sample the app can open on has one, its key matches this install
(so the app reads it), and it is what the app's capture of the example gives now. A failure here means a
sample, the prompt, the capture or a pinned library changed: run the script."""

from __future__ import annotations

import dataclasses

import pytest

import moeviz
from moeviz.models import bundled_examples as bundled
from moeviz.models.sources import SAMPLE_PREFIX, list_samples, resolve_source
from moeviz.samples import EXAMPLE_PROMPT
from tests.support.app import app_importable
from tests.support.traces import assert_traces_equal

REGENERATE = "run `python scripts/samples/bundle_examples.py`"
SAMPLES = [name for name in list_samples() if "/" not in name]  # the app opens top-level samples


@pytest.fixture(autouse=True)
def keeping_on(monkeypatch, tmp_path):
    monkeypatch.setenv("MOEVIZ_CACHE_DIR", str(tmp_path))  # bundled examples are read only with keeping on


def test_every_sample_the_app_opens_on_ships_its_example():
    assert SAMPLES, "no bundled samples found"
    assert sorted(bundled._manifest()) == SAMPLES, REGENERATE
    for name in SAMPLES:
        folder = resolve_source(SAMPLE_PREFIX + name)
        entry = bundled._manifest()[name]
        now = bundled.content_facts(folder, EXAMPLE_PROMPT, SAMPLE_PREFIX + name)
        assert entry["facts"] == now, f"{name}: made from other files, text or versions; {REGENERATE}"
        assert entry["key"] == bundled.content_key(folder, EXAMPLE_PROMPT, SAMPLE_PREFIX + name)


@pytest.mark.parametrize("name", SAMPLES)
def test_the_bundled_routing_is_the_apps_capture_of_the_example(name, monkeypatch):
    app_importable(monkeypatch)
    from components.trace_cache import capture_for_app

    source = SAMPLE_PREFIX + name
    shipped = bundled.bundled_trace(resolve_source(source), EXAMPLE_PROMPT, options=source)
    assert shipped is not None, REGENERATE
    now = capture_for_app(moeviz.load_model(source), EXAMPLE_PROMPT)
    assert now.attention is not None  # the app's capture: with attention, as the page captures it
    # another thread count or vector width sums in another order (measured: 3.5e-7 apart in a logit between 1
    # and 2 threads here): close in relative and absolute terms, not bitwise
    assert_traces_equal(shipped, dataclasses.replace(now, attention=None), close=(1e-5, 1e-6))
