"""The Lab as a runs view, in-process (Streamlit AppTest): two tiny runs of one session overlaid on shared
axes with a table of their settings, smoothed as TensorBoard smooths, exported as CSV; the load snapshot at a
scrubbed step; a run's name short enough for the sidebar's model picker."""

from __future__ import annotations

import io
import math
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from moeviz.lab import LabConfig
from tests.support.app import APP, app_test_env

PAGE = "pages/lab.py"
TINY = LabConfig(experts=4, k=2, d_model=16, layers=1, batch=2, seq=16, steps=6, eval_every=3)
RUN_TIMEOUT_S = 60
# characters of a "lab: <name>" choice the sidebar's model picker shows whole, with room to spare: measured in
# Chromium at 1280 px, its text box is 206 px wide, "lab: run 12 · hub experts" 139 px, and a longer
# name, "lab: run 1 · E=8 k=2 aux=0.01 seed=0" (36 characters), 208 px: cut
PICKER_CHARS = 26


@pytest.fixture(autouse=True)
def app_env(monkeypatch):
    app_test_env(monkeypatch)


def checked(at: AppTest) -> AppTest:
    assert not at.exception, [e.value for e in at.exception]
    errors = [e.value for e in at.error]
    assert not errors, errors
    return at


def lab_page() -> AppTest:
    at = AppTest.from_file(str(APP), default_timeout=RUN_TIMEOUT_S)
    at.switch_page(PAGE)
    return checked(at.run())


def set_controls(at: AppTest, config: LabConfig) -> None:
    for field in ("experts", "k", "aux_coef", "z_coef", "bias_rate", "router_noise", "steps", "seed"):
        at.number_input(key=f"lab_{field}_widget").set_value(getattr(config, field))
    for field in ("d_model", "layers", "batch", "seq", "eval_every"):
        at.number_input(key=f"lab_{field}_widget").set_value(getattr(config, field))
    at.toggle(key="lab_capacity_on_widget").set_value(config.capacity_factor is not None)
    if config.capacity_factor is not None:
        checked(at.run())  # the factor's input is enabled by the toggle
        at.number_input(key="lab_capacity_factor_widget").set_value(config.capacity_factor)


def train(at: AppTest, config: LabConfig) -> pd.DataFrame:
    """Set the controls to `config`, run it to the end → its history, read from the runner."""
    set_controls(at, config)
    at.button(key="lab_start").click()
    checked(at.run())
    runner = at.session_state["lab_runner"]
    runner.join(RUN_TIMEOUT_S)
    assert runner.state == "done", runner.error
    checked(at.run())
    assert runner.config == config
    return runner.snapshot()[0]


def chart_frame(at: AppTest, title: str) -> pd.DataFrame:
    import pyarrow as pa

    charts = [c for c in at.get("vega_lite_chart") if f'"text": "{title}"' in c.proto.spec]
    assert len(charts) == 1, f"{len(charts)} charts titled {title!r}"
    (dataset,) = charts[0].proto.datasets
    return pa.ipc.open_stream(dataset.data.data).read_all().to_pandas()


def tensorboard_smooth(values, weight: float) -> list[float]:
    """TensorBoard's debiased EMA, as its dashboard's loop computes it (the reference)."""
    last, count, out = 0.0, 0, []
    for value in map(float, values):
        if not math.isfinite(value):
            out.append(value)
            continue
        last = last * weight + (1 - weight) * value
        count += 1
        out.append(last / (1 - weight**count))
    return out


def test_two_runs_overlay_on_shared_axes_with_their_settings_smoothing_and_csv(monkeypatch) -> None:
    from components import exports

    written = []  # the CSV files the page offers, as they are written
    real_csv = exports.csv_bytes
    monkeypatch.setattr(exports, "csv_bytes", lambda frame: written.append(real_csv(frame)) or written[-1])
    at = lab_page()
    second = replace(TINY, aux_coef=0.0, seed=1, steps=5)
    histories = {"run 1": train(at, TINY), "run 2": train(at, second)}
    try:
        at.segmented_control(key="lab_view_widget").set_value("All runs")
        checked(at.run())
        (table,) = [frame.value for frame in at.dataframe]  # the runs table
        assert list(table["run"]) == ["run 1", "run 2"]
        for (_, row), config in zip(table.iterrows(), (TINY, second), strict=True):
            assert (row["experts"], row["aux"], row["seed"], row["steps"]) == (
                config.experts,
                config.aux_coef,
                config.seed,
                config.steps,
            )
        assert list(table["steps done"]) == [TINY.steps, second.steps]

        shown = chart_frame(at, "Train loss")  # both runs on one chart, each with its own history
        assert set(shown["run"]) == {"run 1", "run 2"}
        for run, history in histories.items():
            rows = shown[shown["run"] == run]
            np.testing.assert_array_equal(rows["step"], history["step"])
            np.testing.assert_allclose(rows["value"], history["train_loss"])

        at.slider(key="lab_smoothing_widget").set_value(0.6)
        checked(at.run())
        shown = chart_frame(at, "Held-out loss")
        for run, history in histories.items():
            evaluations = history["heldout_loss"].dropna()
            rows = shown[shown["run"] == run]
            np.testing.assert_allclose(rows["smoothed"], tensorboard_smooth(evaluations, 0.6))

        assert [d.proto.label for d in at.get("download_button")].count("Curves (.csv)") == 1
        csv = pd.read_csv(io.BytesIO(written[-1]))
        for run, history in histories.items():
            rows = csv[(csv["metric"] == "train_loss") & (csv["run"] == run)]
            np.testing.assert_allclose(rows["value"], history["train_loss"])
            np.testing.assert_allclose(rows["smoothed"], tensorboard_smooth(history["train_loss"], 0.6))

        at.multiselect(key="lab_shown_runs").set_value(["run 2"])  # take run 1 off the charts
        checked(at.run())
        assert set(chart_frame(at, "Train loss")["run"]) == {"run 2"}
    finally:
        at.session_state["lab_runner"].stop()


def test_the_scrubber_shows_the_load_at_the_chosen_step() -> None:
    at = lab_page()
    train(at, TINY)
    runner = at.session_state["lab_runner"]
    try:
        _, load = runner.snapshot()
        assert chart_frame(at, f"Load at step {TINY.steps}, layer 0") is not None  # follows the latest
        at.slider(key="lab_scrub_widget").set_value(3)
        checked(at.run())
        shown = chart_frame(at, "Load at step 3, layer 0").sort_values("expert")
        expected = load[(load["step"] == 3) & (load["layer"] == 0)]
        np.testing.assert_allclose(shown["load"], expected["load"])
        checked(at.run())  # the choice stays
        assert at.slider(key="lab_scrub_widget").value == 3
    finally:
        runner.stop()


def test_a_run_is_named_short_enough_for_the_model_picker() -> None:
    """Every option set, so the settings label is at its longest: the picker's name is the run's short
    name (its settings are in the runs table), whole in the sidebar."""
    at = lab_page()
    config = replace(TINY, z_coef=0.001, bias_rate=0.001, capacity_factor=1.25, router_noise=0.5)
    train(at, config)
    try:
        at.button(key="lab_open").click()
        checked(at.run())
        (name,) = at.session_state["lab_models"]
        assert name == "run 1"
        assert at.session_state["model"] == f"lab: {name}"
        assert len(f"lab: {name}") <= PICKER_CHARS
        assert config.label() in " ".join(s.value for s in at.success)  # the settings, said where it opens
    finally:
        at.session_state["lab_runner"].stop()
