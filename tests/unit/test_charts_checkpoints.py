"""Spec tests of the checkpoint-timeline and corpus-store charts: marks, encodings and rows vs the input."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from moeviz.charts.checkpoints import (
    balance_timeline_chart,
    domain_specialisation_heatmap,
    drift_timeline_chart,
    saturation_timeline_chart,
    specialisation_timeline_chart,
)

CHECKPOINTS = ["step-00000", "step-00010", "step-00100", "step-01000"]
LAYERS = [0, 1, 2]
DOMAINS = ["english", "python"]
rng = np.random.default_rng(0)


def _grid(**extra) -> pd.DataFrame:
    rows = [
        {"checkpoint": c, "order": i, "site": "mlp", "layer": layer}
        for i, c in enumerate(CHECKPOINTS)
        for layer in LAYERS
    ]
    frame = pd.DataFrame(rows)
    for name, fn in extra.items():
        frame[name] = fn(len(frame))
    return frame


@pytest.fixture
def saturation() -> pd.DataFrame:
    return _grid(tokens=lambda n: [512] * n, saturation_topk=rng.random, saturation_top1=rng.random)


@pytest.fixture
def collapse() -> pd.DataFrame:
    return _grid(
        verdict=lambda n: ["healthy"] * n,
        reasons=lambda n: [""] * n,
        max_share=rng.random,
        dead_fraction=rng.random,
        load_entropy=rng.random,
        z_loss=rng.random,
    )


@pytest.fixture
def crossings() -> pd.DataFrame:
    rows = []
    for layer in LAYERS:
        rows += [
            {
                "site": "mlp",
                "layer": layer,
                "indicator": "load_entropy",
                "level": "warning",
                "threshold": 0.8,
            },
            {
                "site": "mlp",
                "layer": layer,
                "indicator": "load_entropy",
                "level": "collapsed",
                "threshold": 0.5,
            },
            {"site": "mlp", "layer": layer, "indicator": "verdict", "level": "warning", "threshold": np.nan},
        ]
    frame = pd.DataFrame(rows)
    frame["first_checkpoint"] = None
    frame["value"] = None
    return frame


def _data(spec: dict, layer: int = 0) -> list[dict]:
    """Rows of a (layer of a) chart's inline dataset."""
    part = spec["layer"][layer] if "layer" in spec else spec
    name = part["data"]["name"] if "data" in part else spec["data"]["name"]
    return spec["datasets"][name]


def test_saturation_chart_draws_one_point_per_checkpoint_and_layer(saturation) -> None:
    spec = saturation_timeline_chart(saturation, "top1").to_dict()
    assert spec["mark"]["type"] == "line" and spec["mark"]["point"] is True
    enc = spec["encoding"]
    assert enc["x"]["field"] == "checkpoint" and enc["x"]["sort"] == CHECKPOINTS
    assert enc["y"]["field"] == "saturation_top1" and enc["y"]["scale"]["domain"] == [0, 1]
    assert enc["color"]["field"] == "row"
    rows = _data(spec)
    assert len(rows) == len(saturation)
    got = {(r["checkpoint"], r["layer"]): r["saturation_top1"] for r in rows}
    for r in saturation.itertuples():
        assert got[(r.checkpoint, r.layer)] == pytest.approx(r.saturation_top1)
    with pytest.raises(ValueError):
        saturation_timeline_chart(saturation, "top3")


def test_checkpoint_axis_follows_training_order_not_names(saturation) -> None:
    shuffled = saturation.assign(checkpoint=saturation["order"].map(dict(enumerate(["z", "b", "a", "c"]))))
    spec = saturation_timeline_chart(shuffled.sample(frac=1, random_state=1)).to_dict()
    assert spec["encoding"]["x"]["sort"] == ["z", "b", "a", "c"]


def test_balance_chart_has_lines_and_one_rule_per_threshold(collapse, crossings) -> None:
    spec = balance_timeline_chart(collapse, "load_entropy", crossings).to_dict()
    lines, rules = spec["layer"]
    assert lines["mark"]["type"] == "line" and lines["encoding"]["y"]["field"] == "load_entropy"
    assert rules["mark"]["type"] == "rule" and rules["encoding"]["y"]["field"] == "threshold"
    assert len(_data(spec, 0)) == len(collapse)
    assert sorted((r["level"], r["threshold"]) for r in _data(spec, 1)) == [
        ("collapsed", 0.5),
        ("warning", 0.8),
    ]
    # no thresholds known for this indicator (or none given): no rule rows
    assert _data(balance_timeline_chart(collapse, "max_share", crossings).to_dict(), 1) == []
    assert _data(balance_timeline_chart(collapse, "z_loss").to_dict(), 1) == []
    with pytest.raises(ValueError):
        balance_timeline_chart(collapse, "verdict")


def test_drift_chart_averages_over_experts() -> None:
    rows = [
        {"checkpoint": c, "order": i, "site": "mlp", "layer": layer, "expert": e, "drift": (e + i) / 10}
        for i, c in enumerate(CHECKPOINTS[1:], 1)
        for layer in LAYERS
        for e in range(4)
    ]
    drift = pd.DataFrame(rows)
    drift.loc[0, "drift"] = np.nan  # an expert with no token in either checkpoint is skipped
    spec = drift_timeline_chart(drift).to_dict()
    assert spec["mark"]["type"] == "line" and spec["encoding"]["y"]["field"] == "drift"
    data = _data(spec)
    assert len(data) == (len(CHECKPOINTS) - 1) * len(LAYERS)
    got = {(r["checkpoint"], r["layer"]): (r["drift"], r["max_drift"]) for r in data}
    expected = drift.groupby(["checkpoint", "layer"])["drift"].agg(["mean", "max"])
    for (c, layer), row in expected.iterrows():
        assert got[(c, layer)] == pytest.approx((row["mean"], row["max"]))


def test_specialisation_timeline_facets_by_domain() -> None:
    frame = pd.concat([_grid().assign(domain=d) for d in DOMAINS], ignore_index=True)
    frame["tokens"], frame["top_expert"] = 512, 3
    frame["ds"] = rng.random(len(frame))
    frame["baseline"], frame["lift"] = 0.25, frame["ds"] / 0.25
    spec = specialisation_timeline_chart(frame).to_dict()
    assert spec["facet"]["field"] == "domain"
    assert spec["spec"]["mark"]["type"] == "line" and spec["spec"]["encoding"]["y"]["field"] == "lift"
    assert len(spec["datasets"][spec["data"]["name"]]) == len(frame)


def test_domain_specialisation_heatmap_has_one_cell_per_row() -> None:
    rows = [
        {"site": "mlp", "layer": layer, "domain": d, "expert": e, "tokens": 100, "dispatched": 10 * e}
        for layer in LAYERS
        for d in DOMAINS
        for e in range(8)
    ]
    spec_frame = pd.DataFrame(rows)
    spec_frame["ds"] = spec_frame["dispatched"] / spec_frame["tokens"]
    spec_frame["baseline"] = 0.25
    spec_frame["lift"] = spec_frame["ds"] / 0.25
    spec = domain_specialisation_heatmap(spec_frame).to_dict()
    assert spec["facet"]["field"] == "row"
    inner = spec["spec"]
    assert inner["mark"]["type"] == "rect"
    assert inner["encoding"]["x"]["field"] == "expert" and inner["encoding"]["y"]["field"] == "domain"
    assert inner["encoding"]["color"]["scale"]["domainMid"] == 0
    data = spec["datasets"][spec["data"]["name"]]
    assert len(data) == len(spec_frame)
    # colour = log₂ lift, clipped at 8× either way (lift 0 → −3)
    for r in data:
        assert r["log2_lift"] == pytest.approx(np.log2(np.clip(r["lift"], 1 / 8, 8)))
    assert {r["log2_lift"] for r in data if r["lift"] == 0} == {-3.0}


def test_timeline_of_many_layers_colours_them_on_a_sequential_scale() -> None:
    """58 MoE layers (DeepSeek-V3): one line each, coloured by layer number, no categorical legend."""
    frame = pd.DataFrame(
        [
            {"checkpoint": c, "order": i, "site": "mlp", "layer": layer}
            for i, c in enumerate(CHECKPOINTS)
            for layer in range(3, 61)
        ]
    )
    frame["saturation_topk"] = frame["saturation_top1"] = rng.random(len(frame))
    encoding = saturation_timeline_chart(frame).to_dict()["encoding"]
    assert encoding["color"]["field"] == "layer" and encoding["color"]["type"] == "quantitative"
    assert encoding["detail"]["field"] == "row"
