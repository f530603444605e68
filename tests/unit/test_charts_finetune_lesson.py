"""The fine-tuning lesson's curves (moeviz.charts.finetune_lesson): each panel carries exactly the evaluated
rows of its metric, one colour per mode in the order given (the page's colour key uses the same map), the
even-share rule on max share, and an unknown metric is refused."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from moeviz.charts.finetune_lesson import LESSON_METRICS, finetune_lesson_chart, mode_colours
from moeviz.charts.lab import RUN_COLOURS


def curves() -> pd.DataFrame:
    """Two modes, three steps; the train-only step 1 has no evaluation (NaN)."""
    return pd.DataFrame(
        {
            "run": ["full"] * 3 + ["LoRA"] * 3,
            "step": [0, 1, 2] * 2,
            "new_loss": [3.5, np.nan, 3.4, 3.5, np.nan, 3.45],
            "max_share": [0.2, np.nan, 0.25, 0.2, np.nan, 0.21],
            "router_mismatch": [0.0, np.nan, 0.2, 0.0, np.nan, 0.06],
            "old_loss": [3.1, np.nan, 3.3, 3.1, np.nan, 3.11],
        }
    )


@pytest.mark.parametrize("metric", LESSON_METRICS)
def test_each_panel_holds_the_evaluated_rows_of_its_metric(metric):
    spec = finetune_lesson_chart(curves(), metric, runs=["LoRA", "full"], height=70).to_dict()
    (rows,) = spec["datasets"].values()
    expected = curves().dropna(subset=[metric])
    assert [(r["run"], r["step"], r["value"]) for r in rows] == list(
        zip(expected["run"], expected["step"], expected[metric], strict=True)
    )
    colour = spec["layer"][0]["encoding"]["color"]
    assert colour["scale"] == {"domain": ["LoRA", "full"], "range": RUN_COLOURS[:2]}
    assert colour["legend"] is None and spec["height"] == 70
    rules = [layer for layer in spec["layer"] if layer["mark"]["type"] == "rule"]
    assert not rules


def test_the_even_share_rule_and_the_colour_map():
    spec = finetune_lesson_chart(curves(), "max_share", runs=["full", "LoRA"], reference=0.125).to_dict()
    (rule,) = [layer for layer in spec["layer"] if layer["mark"]["type"] == "rule"]
    assert rule["encoding"]["y"] == {"datum": 0.125}
    assert mode_colours(["a", "b", "c"]) == dict(zip("abc", RUN_COLOURS[:3], strict=True))


def test_an_unknown_metric_is_refused():
    with pytest.raises(ValueError, match="unknown lesson metric 'lr'"):
        finetune_lesson_chart(curves(), "lr", runs=["full"])
