"""The "Why this expert?" page reached from the Routing page: it opens on the clicked heatmap cell's token,
layer and expert (or the token's top-1), and its what-if shows the effect at every later position."""

from __future__ import annotations

import numpy as np
from streamlit.testing.v1 import AppTest

import moeviz
from moeviz.charts import token_label
from moeviz.interventions import DisableExpert, counterfactual
from tests.support.app import APP, sample_page_fixtures

MODEL = "sample:mixtral-healthy"
TEXT = "The quick brown fox jumps over the lazy dog, and then it runs back home."
POS = 4

_app_env, loaded = sample_page_fixtures(MODEL)


def _ok(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]


def _slots(loaded, layer: int, pos: int) -> list[int]:
    """The token's dispatched experts at `layer`, largest combination weight first, from the library."""
    trace = moeviz.capture(loaded, TEXT)
    routing = trace.layer(layer)
    row = list(routing.token_rows).index(int(trace.tokens.index[trace.tokens["pos"] == pos][0]))
    experts, weights = routing.experts[row], routing.weights[row]
    order = np.argsort(-weights, kind="stable")
    return [int(experts[i]) for i in order if experts[i] >= 0]


def _why_after_click(loaded, layer: int, expert: int) -> AppTest:
    """Run the Routing page at `layer`, click the heatmap cell (token POS, `expert`), and follow the link."""
    at = AppTest.from_file(str(APP), default_timeout=120)
    at.session_state["model"] = MODEL
    at.session_state["prompt"] = TEXT
    at.session_state["layer"] = str(layer)  # the Routing page's layer slider
    at.switch_page("pages/routing.py").run()
    _ok(at)
    # a click on the heatmap, as the browser reports it (the selection's fields: seq, pos, expert)
    at.session_state["heatmap_chart"] = {"selection": {"token": [{"seq": 0, "pos": POS, "expert": expert}]}}
    at.run()
    _ok(at)
    trace = moeviz.capture(loaded, TEXT)
    assert at.session_state["token"] == token_label(POS, trace.tokens["token"].iloc[POS])
    at.switch_page("pages/why.py").run()
    _ok(at)
    return at


def test_why_opens_on_the_clicked_token_layer_and_its_dispatched_expert(loaded):
    layer = loaded.sites[1].layer
    slots = _slots(loaded, layer, POS)
    clicked = slots[1]  # dispatched, but not the top-1: the click decides
    at = _why_after_click(loaded, layer, clicked)
    trace = moeviz.capture(loaded, TEXT)
    assert at.selectbox(key="token_widget").value == token_label(POS, trace.tokens["token"].iloc[POS])
    assert at.select_slider(key="layer_widget").value == str(layer)
    assert at.selectbox(key="expert_widget").value == clicked
    assert any(f"expert {clicked}, the heatmap cell you clicked" in c.value for c in at.caption)

    # the what-if: the effect at every position from the intervened token on, and its mean
    at.radio(key="why_kind").set_value("Disable expert for this token").run()
    at.button(key="why_whatif").click().run()
    _ok(at)
    cf = counterfactual(
        loaded,
        token_ids=[int(i) for i in trace.tokens["token_id"]],
        interventions=[DisableExpert(expert=clicked, layer=layer, positions=POS, site="mlp")],
    )
    (mean,) = [m for m in at.metric if m.label.startswith("mean Δ log p(next token)")]
    assert f"positions ≥ {POS}" in mean.label
    assert mean.value == f"{cf.mean_delta_after:+.4f}"
    assert f"{cf.max_abs_delta_after:.4f}" in str(mean.proto.delta)
    charts = [c.proto.spec for c in at.get("vega_lite_chart") if "Effect on every next-token" in c.proto.spec]
    assert len(charts) == 1
    assert any("log p(" in m.label for m in at.metric)  # the next-token metric stays


def test_why_opens_on_the_top1_where_the_clicked_expert_was_not_dispatched(loaded):
    layer = loaded.sites[0].layer
    slots = _slots(loaded, layer, POS)
    clicked = next(e for e in range(loaded.sites[0].num_experts) if e not in slots)
    at = _why_after_click(loaded, layer, clicked)
    assert at.select_slider(key="layer_widget").value == str(layer)
    assert at.selectbox(key="expert_widget").value == slots[0]  # the top-1, computed from the trace
    (note,) = [c.value for c in at.caption if c.value.startswith("Opened on expert")]
    assert (
        f"expert {slots[0]}, this token's top-1" in note and f"expert {clicked}, the cell you clicked" in note
    )
