"""The Deployment page (Streamlit AppTest) with out-of-bound values in its session state: a NaN link rate is
refused with the library's one-line message (no traceback, no NaN table), and a huge capacity factor keeps
every slot with C = T·k instead of overflowing into "every slot dropped"."""

from __future__ import annotations

import math

from streamlit.testing.v1 import AppTest

import moeviz
from moeviz.whatif.routes import routes_from_trace
from tests.support.app import APP, sample_page_fixtures

MODEL = "sample:mixtral-healthy"
PAGE = "pages/deployment.py"
TEXT = "The cat sat on the mat because it was warm and the sun was shining on the garden."

_app_env, loaded = sample_page_fixtures(MODEL)


def page(**state) -> AppTest:
    at = AppTest.from_file(str(APP), default_timeout=120)
    for key, value in {"model": MODEL, "prompt": TEXT, **state}.items():
        at.session_state[key] = value
    at.switch_page(PAGE).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def test_a_nan_link_rate_shows_the_message_not_nan_rows(loaded) -> None:
    at = page(ep_nvlink=math.nan)
    assert [e.value for e in at.error] == [
        "NVLink bandwidth (--nvlink-gbps, GB/s) must be a finite number > 0, got nan"
    ]
    assert not [m for m in at.metric if m.label == "ep_balancedness_over_layers"]  # nothing simulated


def test_a_huge_capacity_factor_keeps_every_slot(loaded) -> None:
    at = page(deployment_tab="Capacity", capacity_cfs=[1.0, 1e19])
    assert not at.error, [e.value for e in at.error]
    routes = routes_from_trace(moeviz.capture(loaded, TEXT))
    (layers,) = [d.value for d in at.dataframe if {"cf", "capacity", "dropped"} <= set(d.value.columns)]
    huge = layers[layers.cf == 1e19]
    assert len(huge) == len(routes.layers) and (huge.dropped == 0).all()
    assert huge.capacity.tolist() == [layer.tokens * layer.k for layer in routes.layers]  # one sequence
    assert (layers[layers.cf == 1.0].dropped > 0).any()  # the prompt does overflow at CF 1
