"""The Deployment page in headless Chromium: every tab is there, and on the example prompt the Expert
parallelism tab's dispatch-bytes bars and the Offloading tab's hit rates and hit-rate curve show what
`moeviz.whatif` computes for the page's default settings."""

from __future__ import annotations

import re

from playwright.sync_api import Browser

import moeviz
from moeviz.charts.deployment import DISPATCH_KINDS
from moeviz.whatif.ep import EPConfig, simulate_ep
from moeviz.whatif.model_size import expert_bytes, expert_flops_per_token, model_size
from moeviz.whatif.offload import POLICIES, hit_rate_curve, simulate_offload
from moeviz.whatif.quant import FORMATS
from moeviz.whatif.routes import routes_from_trace
from tests.support.browser import (
    MODEL,
    RENDER_TIMEOUT_S,
    after_run,
    aria_fields,
    aria_labels,
    assert_no_error,
    charts_drawn,
    open_app,
    open_page,
)

TABS = ["Expert parallelism", "Offloading", "Capacity", "Quantisation", "Model size"]


def metrics(page) -> dict[str, str]:
    """label → value of every metric on the page."""
    texts = page.eval_on_selector_all('[data-testid="stMetric"]', "els => els.map(e => e.innerText)")
    return {lines[0]: lines[1] for lines in ([x for x in t.split("\n") if x.strip()] for t in texts)}


def test_the_page_in_a_browser_shows_the_librarys_what_ifs(app_url, browser: Browser, sample_model) -> None:
    page = open_app(browser, app_url(MODEL))
    try:
        example = page.locator(".st-key-routing_prompt textarea").input_value()
        routes = routes_from_trace(moeviz.capture(sample_model, example))
        experts, k = routes.layers[0].num_experts, routes.layers[0].k
        open_page(page, "Deployment", "Deployment what-ifs")
        for tab in TABS:
            page.get_by_role("tab", name=tab).wait_for(timeout=RENDER_TIMEOUT_S * 1000)

        # Expert parallelism, the defaults: 4 GPUs, 2 a node, EPLB placement (as tests/app's page test)
        config = EPConfig(
            gpus=4,
            gpus_per_node=2,
            placement="eplb",
            hidden_size=model_size(sample_model.model).hidden_size,
            expert_flops_per_token=expert_flops_per_token(sample_model),
        )
        result = simulate_ep(routes, config)
        page.locator('.st-key-ep_bytes [aria-roledescription="bar"]').first.wait_for(
            timeout=RENDER_TIMEOUT_S * 1000
        )
        charts_drawn(page)
        assert (
            metrics(page)["ep_balancedness_over_layers"]
            == f"{result.totals()['ep_balancedness_over_layers']:.3f}"
        )
        bars = {
            (int(f["layer"]), f["kind"]): int(f["bytes"].replace(",", ""))
            for f in map(aria_fields, aria_labels(page, '.st-key-ep_bytes [aria-roledescription="bar"]'))
        }
        layers = result.layers_frame()
        expected = {
            (int(row["layer"]), label): int(row[column])
            for _, row in layers.iterrows()
            for column, label in DISPATCH_KINDS.items()
        }
        assert bars == expected

        # Offloading: the cache of 2k experts by default, every policy
        after_run(page, page.get_by_role("tab", name="Offloading").click)
        page.locator('.st-key-offload_hit_rate [aria-roledescription="line mark"]').first.wait_for(
            timeout=RENDER_TIMEOUT_S * 1000
        )
        charts_drawn(page)
        cache, size = min(experts, 2 * k), expert_bytes(sample_model, FORMATS[0])  # the page's defaults
        shown = metrics(page)
        for policy in POLICIES:
            rate = simulate_offload(routes, cache, policy, expert_bytes=size).hit_rate
            assert shown[f"{policy} hit rate"] == f"{rate:.1%}", policy
        assert len(aria_labels(page, '.st-key-offload_hit_rate [aria-roledescription="line mark"]')) == len(
            POLICIES
        )  # one line a policy
        points = {}
        for fields in map(
            aria_fields, aria_labels(page, '.st-key-offload_hit_rate [aria-roledescription="point"]')
        ):
            points[(fields["policy"], int(fields["C"]))] = float(re.sub("%$", "", fields["hit rate"])) / 100
        curve = hit_rate_curve(routes, tuple(range(k, experts + 1)), policies=tuple(POLICIES))
        expected_curve = {(row.policy, int(row.cache)): row.hit_rate for row in curve.itertuples()}
        assert points.keys() == expected_curve.keys()
        for key, rate in expected_curve.items():
            assert abs(points[key] - rate) < 1e-6, (key, points[key], rate)
        assert_no_error(page)
    finally:
        page.close()
