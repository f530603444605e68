"""The long actions of the Why and Deployment pages say what they will cost before they run, and a what-if
that cannot change anything is refused before any forward."""

from __future__ import annotations

import re

import moeviz
from tests.support.app import run_page, sample_page_fixtures

MODEL = "sample:mixtral-healthy"
TEXT = "Hello there"  # a few tokens × top-2 of 8 experts: experts no token is sent to

_app_env, loaded = sample_page_fixtures(MODEL)


def _captions(at) -> list[str]:
    return [c.value for c in at.caption]


def test_why_shows_costs_and_refuses_a_whatif_that_cannot_change_anything(loaded):
    at = run_page("pages/why.py", timeout_s=120, model=MODEL, prompt=TEXT)
    trace = moeviz.capture(loaded, TEXT)
    tokens = len(trace.tokens)
    (cost,) = [c for c in _captions(at) if c.startswith("Cost: 2 forwards")]
    assert cost.startswith(f"Cost: 2 forwards ({2 * tokens:,} tokens) ≈ ")
    # priced by one timed forward per model and server (on the first input a page asked about)
    assert re.search(r"\(one forward of [\d,]+ tokens took [\d.]+ s on this model\)\.$", cost)
    # the importance sweep: every expert the prompt dispatches, counted from the trace apart from the app
    used = [set(r.experts[(r.experts >= 0) & (r.weights != 0)].tolist()) for r in trace.layers]
    dispatched, chunks = sum(map(len, used)), sum(-(-len(u) // 8) for u in used)
    (sweep,) = [c for c in _captions(at) if "(layer, expert) pairs" in c]
    assert f"{len(trace.layers)} of {len(trace.layers)} MoE layers" in sweep
    assert f": {dispatched:,} (layer, expert) pairs. Cost: {1 + chunks} forwards" in sweep

    layer = int(at.select_slider(key="layer_widget").value)
    routing = trace.layer(layer)
    unused = next(e for e in range(routing.num_experts) if e not in routing.experts)
    at.radio(key="why_kind").set_value("Disable expert in this layer").run()
    at.selectbox(key="expert_widget").set_value(unused).run()
    assert not at.exception
    assert at.button(key="why_whatif").disabled
    assert (
        f"Nothing to run: expert {unused} is not dispatched by any token at layer {layer}: disabling it "
        "cannot change anything." in _captions(at)
    )
    used = int(routing.experts[0, 0])
    at.selectbox(key="expert_widget").set_value(used).run()
    assert not at.button(key="why_whatif").disabled
    at.button(key="why_whatif").click().run()
    assert not at.exception and not at.error
    assert any("log p(" in m.label for m in at.metric)


def test_deployment_quantisation_and_prefetch_show_their_cost(loaded):
    tokens = len(moeviz.capture(loaded, TEXT).tokens)
    at = run_page(
        "pages/deployment.py", timeout_s=120, model=MODEL, prompt=TEXT, deployment_tab="Quantisation"
    )
    (cost,) = [c for c in _captions(at) if c.startswith("Cost: ")]
    # routing of the original and the copy (one sequence: each forward also scores it), and the quantising
    assert cost.startswith(f"Cost: 2 forwards ({2 * tokens:,} tokens) + quantising ")
    at.button(key="quant_run").click().run()
    assert not at.exception and not at.error
    at.session_state["deployment_tab"] = "Offloading"
    at.run()
    (cost,) = [c for c in _captions(at) if c.startswith("Cost: ")]
    assert cost.startswith(f"Cost: 1 forward ({tokens:,} tokens) ≈ ")
    at.button(key="prefetch_run").click().run()
    assert not at.exception and not at.error
