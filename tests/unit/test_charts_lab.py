"""The Lab's curves draw the run's frames unchanged, mark the collapse step and stay light on long runs
(`moeviz.charts.lab`)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from moeviz.charts import lab as charts
from tests.support.charts import data_of

STEPS, LAYERS, EXPERTS = 12, 2, 4


def history() -> pd.DataFrame:
    step = np.arange(1, STEPS + 1)
    return pd.DataFrame(
        {
            "step": step,
            "train_loss": 8.0 - 0.3 * step,
            "heldout_loss": np.where(step % 4 == 0, 8.2 - 0.3 * step, np.nan),
            "aux_loss_megatron": 1.0 + 0.01 * step,
            "z_loss": 0.5 * step,
            "load_entropy": np.linspace(1.0, 0.2, STEPS),
            "dead_experts_window_sum": np.minimum(step // 3, EXPERTS - 1),
            "collapsed": step >= 9,
        }
    )


def load(steps: int = STEPS) -> pd.DataFrame:
    grid = np.indices((steps, LAYERS, EXPERTS)).reshape(3, -1)
    return pd.DataFrame({"step": grid[0] + 1, "layer": grid[1], "expert": grid[2], "load": 1.0 / EXPERTS})


def rules(spec: dict) -> list[int]:
    """Steps of the collapse rules drawn."""
    return [
        layer["encoding"]["x"]["datum"]
        for layer in spec["layer"]
        if layer["mark"]["type"] == "rule" and "datum" in layer["encoding"].get("x", {})
    ]


def test_loss_chart_draws_the_history_and_the_collapse_rule() -> None:
    frame = history()
    spec = charts.lab_loss_chart(frame, steps=STEPS, collapse_step=9).to_dict()
    pd.testing.assert_frame_equal(data_of(spec), frame, check_dtype=False)
    assert rules(spec) == [9]
    assert spec["layer"][0]["encoding"]["x"]["scale"]["domain"] == [0, STEPS]
    assert rules(charts.lab_loss_chart(frame).to_dict()) == []


def test_load_chart_draws_one_layer_and_thins_long_runs() -> None:
    frame = load()
    data = data_of(charts.lab_load_chart(frame, 1, EXPERTS, collapse_step=3).to_dict())
    assert len(data) == STEPS * EXPERTS and np.allclose(data.groupby("step")["load"].sum(), 1.0)
    long = load(1000)
    thinned = charts.thin_steps(long[long["layer"] == 0])
    assert thinned["step"].nunique() == charts.MAX_LOAD_STEPS
    assert {1, 1000} <= set(thinned["step"])


@pytest.mark.parametrize("metric", list(charts.LAB_METRICS))
def test_metric_charts(metric: str) -> None:
    frame = history()
    spec = charts.lab_metric_chart(frame, metric, steps=STEPS, collapse_step=9, reference=1.0).to_dict()
    pd.testing.assert_frame_equal(data_of(spec), frame, check_dtype=False)
    assert rules(spec) == [9]
    with pytest.raises(ValueError, match="unknown lab metric"):
        charts.lab_metric_chart(frame, "nope")


def test_an_aux_loss_curve_says_the_balanced_value_of_its_form(monkeypatch) -> None:
    """The balanced value under the Megatron-form curve comes from the one table of forms, not the chart."""
    import dataclasses

    from moeviz.analysis import losses

    def subtitle() -> str:
        return charts.lab_metric_chart(history(), "aux_loss_megatron").to_dict()["title"]["subtitle"]

    balanced = losses.AUX_LOSS_FORMS["aux_loss_megatron"].balanced
    assert subtitle() == f"{balanced} = even load" == "1 = even load"
    form = dataclasses.replace(losses.AUX_LOSS_FORMS["aux_loss_megatron"], balanced="k")
    monkeypatch.setitem(losses.AUX_LOSS_FORMS, "aux_loss_megatron", form)
    assert subtitle() == "k = even load"
