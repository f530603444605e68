"""The Lab's runs view as numbers and charts: TensorBoard's smoothing (`moeviz.lab.curves.ema_smooth`),
several runs' curves in one tidy frame (`runs_curves`), the overlay chart, the load snapshot at a scrubbed
step, and the loss legend kept off the curves (`moeviz.charts.lab`)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from moeviz.charts import lab as charts
from moeviz.lab import curves
from tests.support.charts import data_of

STEPS, LAYERS, EXPERTS = 12, 2, 4
# Legend positions that Vega-Lite draws inside the plot area, over the marks.
INSIDE = {"top-left", "top-right", "bottom-left", "bottom-right", "none"}


def tensorboard_smooth(values, weight: float) -> list[float]:
    """TensorBoard's scalar smoothing, written out as its dashboard's loop does it (the reference): a running
    `last` from 0, debiased by 1 − w^n over the n finite points so far; non-finite points and constant
    curves pass through."""
    values = [float(v) for v in values]
    constant = all(v == values[0] for v in values)
    last, count, out = 0.0, 0, []
    for value in values:
        if constant or not math.isfinite(value):
            out.append(value)
            continue
        last = last * weight + (1 - weight) * value
        count += 1
        out.append(last / (1 - weight**count))
    return out


def history(seed: int, steps: int = STEPS) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    step = np.arange(1, steps + 1)
    return pd.DataFrame(
        {
            "step": step,
            "train_loss": 8.0 - 0.3 * step + rng.normal(0, 0.2, steps),
            "heldout_loss": np.where(step % 4 == 0, 8.2 - 0.3 * step, np.nan),
            "aux_loss_megatron": 1.0 + 0.01 * step,
            "z_loss": rng.uniform(0, 1, steps),
            "load_entropy": np.linspace(1.0, 0.2, steps),
            "dead_experts_window_sum": np.minimum(step // 3, EXPERTS - 1),
            "collapsed": step >= 9,
        }
    )


def load() -> pd.DataFrame:
    grid = np.indices((STEPS, LAYERS, EXPERTS)).reshape(3, -1)
    rng = np.random.default_rng(3)
    shares = rng.dirichlet(np.ones(EXPERTS), size=STEPS * LAYERS).reshape(-1)
    return pd.DataFrame({"step": grid[0] + 1, "layer": grid[1], "expert": grid[2], "load": shares})


@pytest.mark.parametrize("weight", [0.0, 0.3, 0.6, 0.95])
def test_smoothing_is_tensorboards(weight: float) -> None:
    values = [5.0, 4.0, float("nan"), 4.5, 3.0, float("inf"), 2.5, 2.0]
    np.testing.assert_allclose(
        curves.ema_smooth(values, weight), tensorboard_smooth(values, weight), equal_nan=True
    )


def test_smoothing_leaves_a_constant_curve_and_refuses_a_weight_of_one() -> None:
    np.testing.assert_array_equal(curves.ema_smooth([2.0] * 5, 0.9), [2.0] * 5)
    with pytest.raises(ValueError, match="smoothing"):
        curves.ema_smooth([1.0, 2.0], 1.0)


def test_runs_curves_holds_each_runs_points_smoothed_on_their_own() -> None:
    runs = {"run 1": history(0), "run 2": history(1, steps=8)}
    frame = curves.runs_curves(runs, ["train_loss", "heldout_loss"], smoothing=0.6)
    assert list(frame.columns) == curves.CURVE_COLUMNS
    for run, source in runs.items():
        for metric in ("train_loss", "heldout_loss"):
            rows = frame[(frame["run"] == run) & (frame["metric"] == metric)]
            points = source.dropna(subset=[metric])  # the held-out loss only at its evaluations
            np.testing.assert_array_equal(rows["step"], points["step"])
            np.testing.assert_allclose(rows["value"], points[metric])
            # smoothed over this run's own points: never pulled by another run, nor by NaN steps
            np.testing.assert_allclose(rows["smoothed"], tensorboard_smooth(points[metric], 0.6))
    assert curves.runs_curves({}).empty and list(curves.runs_curves({}).columns) == curves.CURVE_COLUMNS


def test_with_smoothed_adds_a_column_only_when_smoothing() -> None:
    frame = history(0)
    assert curves.with_smoothed(frame, ["train_loss"], 0.0) is frame
    smoothed = curves.with_smoothed(frame, ["train_loss", "z_loss"], 0.5)
    np.testing.assert_allclose(smoothed["z_loss_smoothed"], tensorboard_smooth(frame["z_loss"], 0.5))
    pd.testing.assert_frame_equal(smoothed[frame.columns], frame)


def test_loss_legend_sits_off_the_curves() -> None:
    spec = charts.lab_loss_chart(history(0), steps=STEPS).to_dict()
    legends = [
        layer["encoding"]["color"]["legend"]
        for layer in spec["layer"]
        if "legend" in layer.get("encoding", {}).get("color", {})
    ]
    assert legends and all(legend.get("orient", "right") not in INSIDE for legend in legends)


def test_loss_chart_draws_the_smoothed_train_loss_over_the_raw_one() -> None:
    smoothed = curves.with_smoothed(history(0), ["train_loss"], 0.6)
    spec = charts.lab_loss_chart(smoothed, steps=STEPS).to_dict()
    pd.testing.assert_frame_equal(data_of(spec), smoothed, check_dtype=False)
    fields = [layer["encoding"]["y"]["field"] for layer in spec["layer"] if "y" in layer.get("encoding", {})]
    assert "train_loss_smoothed" in fields and "train_loss" in fields
    assert spec["layer"][0]["mark"]["opacity"] == charts.RAW_OPACITY


def test_runs_chart_overlays_the_runs_on_shared_axes() -> None:
    frame = curves.runs_curves({"run 1": history(0), "run 2": history(1)}, smoothing=0.5)
    spec = charts.lab_runs_chart(
        frame, "z_loss", runs=["run 2", "run 1"], steps=STEPS, smoothed=True
    ).to_dict()
    shown = data_of(spec)
    expected = frame[frame["metric"] == "z_loss"].reset_index(drop=True)
    pd.testing.assert_frame_equal(shown, expected, check_dtype=False)
    lines = [layer for layer in spec["layer"] if layer["mark"]["type"] == "line"]
    assert [line["encoding"]["y"]["field"] for line in lines] == ["value", "smoothed"]
    assert all(line["encoding"]["color"]["scale"]["domain"] == ["run 2", "run 1"] for line in lines)
    assert len(set(lines[0]["encoding"]["color"]["scale"]["range"])) == 2  # a colour of its own per run
    assert lines[0]["encoding"]["x"]["scale"]["domain"] == [0, STEPS]  # one step axis for every run
    raw = charts.lab_runs_chart(frame, "z_loss").to_dict()
    assert [layer["encoding"]["y"]["field"] for layer in raw["layer"]] == ["value"]


def test_load_snapshot_shows_the_scrubbed_step() -> None:
    frame = load()
    spec = charts.lab_load_snapshot_chart(frame, 1, 5, EXPERTS).to_dict()
    shown = data_of(spec)
    expected = frame[(frame["step"] == 5) & (frame["layer"] == 1)]
    np.testing.assert_allclose(shown.sort_values("expert")["load"], expected["load"])
    assert [
        layer["encoding"]["y"]["datum"] for layer in spec["layer"] if layer["mark"]["type"] == "rule"
    ] == [pytest.approx(1 / EXPERTS)]
    assert spec["title"]["text"] == "Load at step 5, layer 1"
    area = charts.lab_load_chart(frame, 1, EXPERTS, marked_step=5).to_dict()
    marks = [layer["encoding"]["x"]["datum"] for layer in area["layer"] if layer["mark"]["type"] == "rule"]
    assert marks == [5]
