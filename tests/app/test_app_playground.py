"""The Routing playground page (AppTest, run from its page file): it opens on the captured routing, its load
chart and metrics are `moeviz.analysis.reroute`'s for the settings chosen, and its re-run shows the change
of `counterfactual(ForceRouting(...))` called directly."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest

import moeviz
from moeviz.analysis.reroute import RerouteSettings, reroute_layer
from moeviz.interventions import ForceRouting, counterfactual
from tests.support.app import APP_DIR, app_test_env

PAGE = APP_DIR / "pages" / "playground.py"
TEXT = "The quick brown fox jumps over the lazy dog, and then it runs back home."


@pytest.fixture(autouse=True)
def _app_env(monkeypatch):
    app_test_env(monkeypatch)


def _run(model: str, layer: int) -> AppTest:
    at = AppTest.from_file(str(PAGE), default_timeout=120)
    at.session_state["model"] = model
    at.session_state["prompt"] = TEXT
    at.session_state["layer"] = str(layer)
    at.run()
    _ok(at)
    return at


def _ok(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]
    assert not at.warning, [w.value for w in at.warning]


def _load(at: AppTest) -> list[int]:
    """Per-expert counts of the re-routed load chart (Streamlit ships its data as Arrow)."""
    import pyarrow as pa

    (chart,) = [c for c in at.get("vega_lite_chart") if "Expert load, re-routed" in c.proto.spec]
    (dataset,) = chart.proto.datasets
    rows = pa.ipc.open_stream(dataset.data.data).read_all().to_pandas()
    return rows[rows["kind"] == "expert"].sort_values("expert")["count"].astype(int).tolist()


def _metric(at: AppTest, label: str):
    (metric,) = [m for m in at.metric if m.label == label]
    return metric


def test_playground_follows_k_and_reruns_the_model() -> None:
    model = "sample:mixtral-healthy"
    loaded = moeviz.load_model(model)
    trace = moeviz.capture(loaded, TEXT)
    layer = loaded.sites[1].layer
    routing = trace.layer(layer)
    n = len(routing.token_rows)
    at = _run(model, layer)
    assert at.title[0].value == "Routing playground"
    captured = reroute_layer(trace, layer, RerouteSettings.captured(routing))
    assert _load(at) == captured.load.tolist()
    assert _metric(at, "Tokens that changed experts").value == f"0 of {n}"

    at.slider(key="pg_k").set_value(1).run()
    _ok(at)
    top1 = reroute_layer(trace, layer, RerouteSettings(k=1))
    assert _load(at) == top1.load.tolist() != captured.load.tolist()
    assert _metric(at, "Tokens that changed experts").value == f"{top1.changed_tokens} of {n}"
    assert _metric(at, "aux_loss_dispatched, re-routed").value == f"{top1.aux_loss_dispatched:.4f}"

    at.button(key="pg_rerun").click().run()
    _ok(at)
    ids = [int(i) for i in trace.tokens["token_id"]]
    cf = counterfactual(
        loaded, token_ids=ids, interventions=[ForceRouting(layer, *top1.forced(), site="mlp")]
    )
    assert _metric(at, "mean Δ log p(next token)").value == f"{cf.mean_delta_after:+.4f}"
    assert any("Effect on every next-token" in c.proto.spec for c in at.get("vega_lite_chart"))

    at.button(key="pg_reset").click().run()  # back to the captured routing
    _ok(at)
    assert at.slider(key="pg_k").value == routing.k and _load(at) == captured.load.tolist()


def test_playground_on_deepseek_bias_and_capacity() -> None:
    model = "sample:deepseek-v3-bias"
    loaded = moeviz.load_model(model)
    trace = moeviz.capture(loaded, TEXT)
    layer = loaded.sites[0].layer
    routing = trace.layer(layer)
    n = len(routing.token_rows)
    at = _run(model, layer)
    assert at.toggle(key="pg_groups").value  # the group limit is applied, and can be turned off
    assert _metric(at, "Tokens that changed experts").value == f"0 of {n}"

    settings = RerouteSettings.captured(routing)
    bias = np.array(settings.bias, dtype=np.float32)
    bias[3] = np.float32(float(bias[3]) + 1.0)
    at.number_input(key="pg_bias_3").set_value(float(bias[3]))
    at.toggle(key="pg_capacity_on").set_value(True).run()
    _ok(at)
    expected = reroute_layer(trace, layer, dataclasses.replace(settings, bias=bias, capacity_factor=1.25))
    assert expected.load[3] > 0 and expected.changed_tokens > 0
    assert _load(at) == expected.load.tolist()
    assert _metric(at, "Tokens that changed experts").value == f"{expected.changed_tokens} of {n}"
    assert _metric(at, "Dropped slots").value == f"{expected.dropped_slots} of {n * routing.k}"
