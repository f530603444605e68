"""The Deployment page (Streamlit AppTest, and one browser test): every tab renders on the default sample, and
what it shows is what `moeviz.whatif` gives directly."""

from __future__ import annotations

import pandas as pd
import pytest
from playwright.sync_api import Browser

import moeviz
from moeviz.whatif.ep import EPConfig, simulate_ep
from moeviz.whatif.model_size import expert_flops_per_token, model_size
from moeviz.whatif.quant import quantisation_flips
from moeviz.whatif.routes import routes_from_trace
from tests.app_helpers import app_test_env, run_page
from tests.app_server import AppDidNotStart, running_app

MODEL = "sample:mixtral-healthy"
PAGE = "pages/deployment.py"
TABS = ["Expert parallelism", "Offloading", "Capacity", "Quantisation", "Model size"]
TEXT = "The cat sat on the mat because it was warm and the sun was shining on the garden."


@pytest.fixture(autouse=True)
def _app_env(monkeypatch):
    app_test_env(monkeypatch)


@pytest.fixture(scope="module")
def loaded():
    return moeviz.load_model(MODEL)


def metric(at, label: str) -> str:
    (found,) = [m for m in at.metric if m.label == label]
    return found.value


def test_every_tab_renders_by_default() -> None:
    at = run_page(PAGE, model=MODEL)
    assert at.title[0].value == "Deployment what-ifs"
    for tab in TABS:
        at.session_state["deployment_tab"] = tab
        at.run()
        assert not at.exception, (tab, [e.value for e in at.exception])
        assert not at.error, (tab, [e.value for e in at.error])
        assert at.get("vega_lite_chart") or tab == "Quantisation", tab  # quantisation waits for its button
        assert any("Definition" in c.value for c in at.caption), tab


def test_the_hit_rate_curve_samples_the_cache_sizes_at_scale() -> None:
    """Every cache size up to CURVE_POINTS of them (the samples: k = 2 of 8); at 256 experts, top-8, 25 sizes
    from k to E instead of 249 replays of every layer."""
    from components.deployment import CURVE_POINTS, curve_caches

    assert curve_caches(2, 8) == tuple(range(2, 9))
    sizes = curve_caches(8, 256)
    assert len(sizes) == CURVE_POINTS and sizes[0] == 8 and sizes[-1] == 256
    assert list(sizes) == sorted(set(sizes))


def test_gpus_change_the_balancedness_to_the_library_value(loaded) -> None:
    at = run_page(PAGE, model=MODEL, prompt=TEXT)
    routes = routes_from_trace(moeviz.capture(loaded, TEXT))
    common = dict(
        gpus_per_node=2,
        placement="eplb",
        hidden_size=model_size(loaded.model).hidden_size,
        expert_flops_per_token=expert_flops_per_token(loaded),
    )
    assert (
        metric(at, "ep_balancedness_over_layers")
        == f"{simulate_ep(routes, EPConfig(gpus=4, **common)).ep_balancedness_over_layers:.3f}"
    )
    at.selectbox(key="ep_gpus").set_value(8).run()
    at.selectbox(key="ep_gpus_per_node").set_value(2).run()
    assert not at.exception and not at.error
    assert (
        metric(at, "ep_balancedness_over_layers")
        == f"{simulate_ep(routes, EPConfig(gpus=8, **common)).ep_balancedness_over_layers:.3f}"
    )


def test_the_quantisation_button_shows_the_library_flip_rates(loaded) -> None:
    at = run_page(PAGE, model=MODEL, prompt=TEXT, deployment_tab="Quantisation")
    at.selectbox(key="quant_dtype").set_value("int4").run()
    at.selectbox(key="quant_target").set_value("router").run()
    at.button(key="quant_run").click().run()
    assert not at.exception and not at.error
    expected = quantisation_flips(loaded, text=TEXT, dtype="int4", target="router").layers_frame()
    (shown,) = [d.value for d in at.dataframe if "flip_rate" in d.value.columns]
    pd.testing.assert_frame_equal(shown.reset_index(drop=True), expected.reset_index(drop=True))
    assert any(c.proto.spec and "flip rate" in c.proto.spec for c in at.get("vega_lite_chart"))


@pytest.mark.browser
def test_the_page_in_a_browser(browser: Browser) -> None:
    try:
        with running_app(MODEL, 90) as url:
            page = browser.new_page(viewport={"width": 1200, "height": 1000})
            try:
                page.goto(url, wait_until="domcontentloaded")
                page.get_by_role("link", name="Deployment").click()
                page.get_by_role("heading", level=1).filter(has_text="Deployment").wait_for(timeout=90_000)
                for tab in TABS:
                    page.get_by_role("tab", name=tab).wait_for(timeout=60_000)
                page.locator('.st-key-ep_bytes [aria-roledescription="bar"]').first.wait_for(timeout=60_000)
                page.get_by_role("tab", name="Offloading").click()
                lines = page.locator('.st-key-offload_hit_rate [aria-roledescription="line mark"]')
                lines.first.wait_for(timeout=60_000)
                assert lines.count() >= 1
                errors = page.locator('[data-testid="stException"], [data-testid="stAlertContentError"]')
                assert errors.count() == 0
            finally:
                page.close()
    except AppDidNotStart as exc:
        pytest.fail(str(exc))
