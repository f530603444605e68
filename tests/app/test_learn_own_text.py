"""The Learn page on the user's own text (Streamlit AppTest): with "Use my own text" on, the routing steps'
numbers are those of an independent capture of that text (moeviz.capture here, numpy by hand), their
"what to notice" lines say so when the text is too short to compare loads, and an empty text gives a
message instead of numbers."""

from __future__ import annotations

import math

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest

import moeviz
from tests.support.app import run_page
from tests.support.learn import (  # noqa: F401  (fixtures: pytest finds them in the module)
    BIASED,
    HEALTHY,
    PAGE,
    _app_env,
    chart_rows,
    ui,
)

OWN = (
    "Bread rises because yeast turns sugar into gas.\n"
    "for i in range(10):\n    print(i * i)\n"
    "12 + 30 = 42 and 7 * 6 = 42."
)
SHORT = "Hello there"


def metric(at: AppTest, label: str) -> str:
    (found,) = [m for m in at.metric if m.label == label]
    return found.value


def notice(at: AppTest) -> str:
    (line,) = [i.value for i in at.info if "What to notice" in i.value]
    return line


def entropy(counts: np.ndarray) -> float:
    """Normalised load entropy H(c / Σc) / log E, by hand."""
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum() / np.log(len(counts)))


def own_text(at: AppTest, text: str) -> AppTest:
    """Turn "Use my own text" on and enter `text` in its box (as a user does: then the page reruns)."""
    at.toggle(key="learn_use_own_text_widget").set_value(True).run()
    at.text_area(key="learn_own_text_widget").input(text).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


@pytest.fixture(scope="module")
def captured():
    """OWN and SHORT routed through the samples here, apart from the app."""
    return {
        (source, text): moeviz.capture(moeviz.load_model(source), text)
        for source in (HEALTHY, BIASED)
        for text in (OWN, SHORT)
    }


def test_load_step_shows_the_numbers_of_the_users_text(captured) -> None:
    trace = captured[(HEALTHY, OWN)]
    at = run_page(PAGE, learn_step="load")
    before = notice(at)
    own_text(at, OWN)
    # the step opens on the layer whose load is least even, found here on the independent capture
    counts = {
        r.layer: np.bincount(r.experts[r.experts >= 0].ravel(), minlength=r.num_experts) for r in trace.layers
    }
    layer = min(counts, key=lambda key: (entropy(counts[key]), key))
    routing = trace.layer(layer)
    load = chart_rows(at, f"Expert load, MoE layer {layer}").sort_values("expert")
    np.testing.assert_array_equal(load["count"], counts[layer])
    assert metric(at, "Busiest expert") == f"{counts[layer].max() / routing.experts.size:.1%}"
    assert metric(at, "Load entropy") == f"{entropy(counts[layer]):.3f}"
    tokens = len(trace.tokens)
    assert tokens >= math.ceil(5 * routing.num_experts / routing.k)  # long enough to name the busiest
    busiest = int(np.argmax(counts[layer]))
    share = counts[layer][busiest] / counts[layer].sum()
    line = notice(at)
    assert line != before and f"expert {busiest} gets {share:.1%}" in line
    assert any(f"{tokens} tokens × k = {routing.k} slots" in c.value for c in at.caption)
    # off again: the lesson's own text is back
    at.toggle(key="learn_use_own_text_widget").set_value(False).run()
    assert notice(at) == before


def test_bias_step_counts_the_tokens_of_the_users_text(captured) -> None:
    trace = captured[(BIASED, OWN)]
    at = own_text(run_page(PAGE, learn_step="bias"), OWN)
    tokens = len(trace.tokens)
    changed = metric(at, "Tokens that change experts")
    assert changed.endswith(f"of {tokens}"), changed
    rows = chart_rows(at, "Load with and without the bias")
    with_bias = rows[rows["routing"] == "with the bias (the model)"].sort_values("expert")["count"].to_numpy()
    layers = {r.layer: r for r in trace.layers}
    matches = [
        layer
        for layer, r in layers.items()
        if np.array_equal(with_bias, np.bincount(r.experts[r.experts >= 0], minlength=r.num_experts))
    ]
    assert matches, "the model's load drawn is none of the independent capture's layers"


def test_a_short_text_says_it_is_too_short_instead_of_comparing_loads(captured) -> None:
    trace = captured[(HEALTHY, SHORT)]
    tokens, routing = len(trace.tokens), trace.layers[0]
    need = math.ceil(5 * routing.num_experts / routing.k)
    assert tokens < need
    at = own_text(run_page(PAGE, learn_step="load"), SHORT)
    line = notice(at)
    assert f"your text gives this layer {tokens} tokens ({routing.k * tokens} slots" in line
    assert f"at least {need} tokens" in line
    assert "gets" not in line  # no busiest / quietest expert claimed
    for step in ("collapse", "aux"):
        at.session_state["learn_step"] = step
        at.run()
        assert not at.exception, [e.value for e in at.exception]
        line = notice(at)
        assert "too few to tell" in line, (step, line)
        assert "The weaker the balancing" not in line and "differ by" not in line
        assert "adds the most" not in line


def test_an_empty_text_gives_a_message_and_no_numbers() -> None:
    at = own_text(run_page(PAGE, learn_step="load"), "   ")
    assert any("Your text is empty" in i.value for i in at.info)
    assert not [i for i in at.info if "What to notice" in i.value]
    assert not at.get("vega_lite_chart") and not at.metric
    # steps that read no text are unaffected
    at.session_state["learn_step"] = "deployment"
    at.run()
    assert [i for i in at.info if "What to notice" in i.value]
