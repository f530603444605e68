"""One balance vocabulary on the app's pages (Streamlit AppTest), the app half of the cross-surface check:
tests/models/test_balance_surfaces.py checks the library, `moeviz capture`, the report JSON, the store,
the load chart, `whatif ep`, the Lab's history and the library paths of Learn and the playground; this module
checks what the pages show, each against the library's value on the same routing:

- Load & collapse: the balance table's load entropy and the balancing-loss table (every form of
  AUX_LOSS_FORMS and its balanced value), on a Switch-style model that drops slots at capacity;
- Routing: the layer's load entropy, on the same model;
- Playground: the captured routing's aux_loss_dispatched and its balanced value, on the same model;
- Learn: the load entropy of the load and collapse steps and the top-k aux loss of the aux step, on the
  lesson text through the samples (Learn's fixed routing);
- Deployment: the contiguous placement's ep_balancedness_over_layers = `report --devices`' (the library's
  `ep_balancedness_over_layers` of `trace_device_load`), on the sample.
"""

from __future__ import annotations

import numpy as np
import pytest

import moeviz
from moeviz.analysis import AUX_LOSS_FORMS, aux_loss_frame, balance_frame, loss_frame
from moeviz.analysis.balance import ep_balancedness_over_layers, trace_device_load
from moeviz.analysis.lesson import (
    collapse_contrast_layer,
    collapse_layers,
    largest_aux_layer,
    most_uneven_layer,
)
from moeviz.analysis.losses import loss_stats
from tests.support.app import app_importable, app_test_env, local_switch_model, run_page

CAPACITY = 5  # tokens per expert and sequence: the example prompt's ~28 tokens overflow 4 experts
SAMPLE = "sample:mixtral-healthy"


@pytest.fixture
def switch_folder(tiny_model_dir, monkeypatch):
    return local_switch_model(tiny_model_dir, monkeypatch, CAPACITY)


def captured(folder, text: str) -> moeviz.Trace:
    return moeviz.capture(moeviz.load_model(str(folder)), text)


def metric(at, label: str):
    (found,) = [m for m in at.metric if m.label == label]
    return found


# ---- the pages that open any model: a Switch-style model that drops slots -----------------------------
def test_load_page_balance_and_loss_tables_are_the_librarys(switch_folder) -> None:
    at = run_page("pages/load.py", timeout_s=120)
    trace = captured(switch_folder, at.session_state["prompt"])
    balance = balance_frame(trace)
    assert balance["dropped"].gt(0).any()  # the case under test
    tables = [d.value.reset_index(drop=True) for d in at.dataframe]
    (shown,) = [t for t in tables if "gini" in t.columns and "verdict" not in t.columns]
    np.testing.assert_allclose(shown["load_entropy"].astype(float), balance["load_entropy"], rtol=1e-12)

    (losses,) = [t for t in tables if "aux_loss_megatron" in t.columns]
    assert list(losses.columns) == list(aux_loss_frame(loss_frame(trace)).columns)
    seqs = trace.tokens["seq"].to_numpy()
    for row, routing in zip(losses.itertuples(), trace.layers, strict=True):
        assert (row.site, int(row.layer)) == (routing.site, routing.layer)
        want = loss_stats(routing, seqs[routing.token_rows])  # the library's losses of this layer
        for form, definition in AUX_LOSS_FORMS.items():
            assert getattr(row, form) == pytest.approx(getattr(want, form), rel=1e-12), form
            assert getattr(row, f"{form}_balanced") == definition.balanced_value(routing.k), form
        assert row.z_loss == pytest.approx(want.z_loss, rel=1e-12)


def test_routing_page_load_entropy_is_the_librarys(switch_folder) -> None:
    at = run_page("pages/routing.py", timeout_s=120)
    trace = captured(switch_folder, at.session_state["prompt"])
    site, layer = trace.layer_keys[0]  # the layer the slider starts on
    row = balance_frame(trace).set_index(["site", "layer"]).loc[(site, layer)]
    assert metric(at, "Load entropy").value == f"{row['load_entropy']:.2f}"


def test_playground_aux_loss_is_the_librarys_dispatched_form(switch_folder) -> None:
    at = run_page("pages/playground.py", timeout_s=120)
    trace = captured(switch_folder, at.session_state["prompt"])
    routing = trace.layers[0]  # the layer the playground starts on
    assert (routing.experts < 0).any()  # dropped slots: the dispatched form differs from the top-k form
    want = loss_frame(trace).set_index(["site", "layer"]).loc[(routing.site, routing.layer)]
    assert want["aux_loss_dispatched"] != pytest.approx(want["aux_loss_topk"])
    shown = metric(at, "aux_loss_dispatched, re-routed")
    assert shown.delta == f"captured {want['aux_loss_dispatched']:.4f}"
    balanced = AUX_LOSS_FORMS["aux_loss_dispatched"].balanced_value(routing.k)
    assert metric(at, "aux_loss_dispatched under even load").delta == f"captured {balanced:g}"


# ---- Learn: its fixed routing, the lesson text through the samples ------------------------------------
@pytest.fixture(scope="module")
def lesson():
    """`components.learn` (the lesson text and samples), imported as the page imports it."""
    with pytest.MonkeyPatch.context() as mp:
        app_importable(mp)
        from components import learn

        return learn


def test_learn_load_entropy_and_aux_loss_are_the_librarys(lesson, monkeypatch) -> None:
    app_test_env(monkeypatch)
    traces = {
        source: moeviz.capture(moeviz.load_model(source), lesson.LESSON_TEXT)
        for source in {lesson.HEALTHY, *lesson.COLLAPSE_SAMPLES.values()}
    }
    healthy = traces[lesson.HEALTHY]

    at = run_page("pages/learn.py", learn_step="load")
    site, layer = most_uneven_layer(healthy)  # the step opens where the load is least even
    entropy = balance_frame(healthy).set_index(["site", "layer"]).loc[(site, layer), "load_entropy"]
    assert metric(at, "Load entropy").value == f"{entropy:.3f}"

    at = run_page("pages/learn.py", learn_step="collapse")
    # the step opens where the trainings differ most (`collapse_contrast_layer`)
    site, layer = collapse_contrast_layer(
        collapse_layers({name: traces[source] for name, source in lesson.COLLAPSE_SAMPLES.items()})
    )
    for name, source in lesson.COLLAPSE_SAMPLES.items():
        entropy = (
            balance_frame(traces[source]).set_index(["site", "layer"]).loc[(site, layer), "load_entropy"]
        )
        assert metric(at, f"{name}: load entropy").value == f"{entropy:.2f}", name

    at = run_page("pages/learn.py", learn_step="aux")
    site, layer = largest_aux_layer(healthy)  # the step opens on the largest aux loss relative to k
    routing = healthy.layer(layer, site)
    want = loss_frame(healthy).set_index(["site", "layer"]).loc[(site, layer), "aux_loss_topk"]
    assert metric(at, "Aux loss L, top-k form").value == f"{want:.4f}"
    assert (
        metric(at, "Balanced value").value == f"{AUX_LOSS_FORMS['aux_loss_topk'].balanced_value(routing.k):g}"
    )


# ---- Deployment: expert-parallel balancedness ---------------------------------------------------------
def test_deployment_contiguous_balancedness_is_report_devices(monkeypatch) -> None:
    """The EP tab's "contiguous" figure is what `moeviz report --devices G` prints for the same routing."""
    app_test_env(monkeypatch)
    at = run_page("pages/deployment.py", timeout_s=120, model=SAMPLE)
    gpus = at.selectbox(key="ep_gpus").value
    trace = moeviz.capture(moeviz.load_model(SAMPLE), at.session_state["prompt"])
    want = ep_balancedness_over_layers(trace_device_load(trace, gpus))
    assert metric(at, "ep_balancedness_over_layers").delta == f"contiguous: {want:.3f}"
