"""The deployment charts draw the result frames' own values (`moeviz.charts.deployment`)."""

from __future__ import annotations

import altair as alt
import numpy as np
import pandas as pd
import pytest

from moeviz.charts import deployment as charts
from tests.support.charts import data_of

LAYERS = [0, 1, 2]


def spec_of(chart) -> dict:
    return chart.to_dict()  # validates against the Vega-Lite schema


def ep_layers(seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    frame = pd.DataFrame({"layer": LAYERS})
    frame["max_gpu_load"] = rng.integers(20, 40, len(LAYERS))
    frame["mean_gpu_load"] = frame["max_gpu_load"] * rng.uniform(0.5, 1.0, len(LAYERS))
    frame["ep_balancedness"] = frame["mean_gpu_load"] / frame["max_gpu_load"]
    for column in ("local", "intra", "inter"):
        frame[f"dispatch_bytes_{column}"] = rng.integers(0, 10_000, len(LAYERS)) * 256
    frame["dispatch_bytes_nodedup"] = frame.filter(like="dispatch_bytes_").sum(axis=1) + 512
    frame["a2a_time_s"] = rng.uniform(1e-6, 1e-5, len(LAYERS))
    frame["compute_time_s"] = rng.uniform(1e-6, 1e-5, len(LAYERS))
    frame["comm_share"] = frame["a2a_time_s"] / (frame["a2a_time_s"] + frame["compute_time_s"])
    return frame


def test_gpu_load_heatmap_draws_each_gpu_load() -> None:
    load = pd.DataFrame({"layer": np.repeat(LAYERS, 4), "gpu": np.tile(range(4), 3), "load": range(12)})
    data = data_of(spec_of(charts.gpu_load_heatmap(load)))
    assert data[["layer", "gpu", "load"]].to_numpy().tolist() == load.to_numpy().tolist()
    assert np.allclose(data.groupby("layer")["relative"].mean(), 1.0)  # ÷ the layer's mean


def test_balancedness_chart_groups_placements() -> None:
    both = pd.concat([ep_layers(0).assign(placement="contiguous"), ep_layers(1).assign(placement="eplb")])
    spec = spec_of(charts.balancedness_chart(both))
    data = data_of(spec)
    assert data["ep_balancedness"].tolist() == pytest.approx(both["ep_balancedness"].tolist())
    assert spec["encoding"]["xOffset"]["field"] == "placement"


def test_dispatch_bytes_stack_to_the_layer_total() -> None:
    layers = ep_layers()
    data = data_of(spec_of(charts.dispatch_bytes_chart(layers)))
    stacked = data.groupby("layer")["bytes"].sum()
    total = layers.set_index("layer")[list(charts.DISPATCH_KINDS)].sum(axis=1)
    assert stacked.tolist() == total.tolist()
    assert data.groupby("layer")["nodedup"].max().tolist() == layers["dispatch_bytes_nodedup"].tolist()


def test_comm_share_chart_draws_both_times() -> None:
    layers = ep_layers()
    data = data_of(spec_of(charts.comm_share_chart(layers)))
    a2a = data[data["part"] == "All-to-All"].sort_values("layer")
    assert a2a["microseconds"].to_numpy() == pytest.approx(layers["a2a_time_s"].to_numpy() * 1e6)
    assert a2a["comm_share"].tolist() == pytest.approx(layers["comm_share"].tolist())


def test_hit_rate_curve_dashes_belady() -> None:
    curve = pd.DataFrame(
        {
            "policy": np.repeat(["lru", "lfu", "belady"], 3),
            "cache": [2, 3, 4] * 3,
            "hit_rate": np.linspace(0, 1, 9),
        }
    )
    spec = spec_of(charts.hit_rate_curve_chart(curve))
    assert data_of(spec)[["policy", "cache", "hit_rate"]].to_numpy().tolist() == curve.to_numpy().tolist()
    dash = spec["encoding"]["strokeDash"]["scale"]
    assert dash["range"][dash["domain"].index("belady")] != [1, 0]


def test_cumulative_bytes_and_prefetch_recall() -> None:
    steps = pd.DataFrame({"step": range(5), "cumulative_bytes": [0, 10, 10, 30, 40], "policy": "lru"})
    assert data_of(spec_of(charts.cumulative_bytes_chart(steps)))["cumulative_bytes"].tolist() == [
        0,
        10,
        10,
        30,
        40,
    ]
    recall = pd.DataFrame({"layer": [1, 2], "from_layer": [0, 1], "recall": [0.5, 0.75], "tokens": [9, 9]})
    assert data_of(spec_of(charts.prefetch_recall_chart(recall)))["recall"].tolist() == [0.5, 0.75]


def test_capacity_charts() -> None:
    layers = pd.DataFrame(
        {
            "layer": [0, 0, 1, 1],
            "cf": [1.0, 2.0, 1.0, 2.0],
            "policy": "probs",
            "capacity": [3, 5, 3, 5],
            "dropped_fraction": [0.2, 0.0, 0.1, 0.05],
        }
    )
    assert data_of(spec_of(charts.capacity_drop_chart(layers)))["dropped_fraction"].tolist() == [
        0.2,
        0.0,
        0.1,
        0.05,
    ]
    position = pd.DataFrame(
        {
            "cf": [1.0, 1.0],
            "bucket": [0, 1],
            "bucket_start": [0, 5],
            "bucket_end": [5, 10],
            "drop_rate": [0.0, 0.3],
        }
    )
    assert data_of(spec_of(charts.position_drop_chart(position)))["drop_rate"].tolist() == [0.0, 0.3]
    experts = pd.DataFrame(
        {
            "layer": [0, 0, 0, 0],
            "cf": [1.0, 1.0, 2.0, 2.0],
            "expert": [0, 1, 0, 1],
            "assigned": [6, 2, 6, 2],
            "dropped": [3, 0, 1, 0],
            "dropped_fraction": [0.5, 0.0, 1 / 6, 0.0],
        }
    )
    shown = data_of(spec_of(charts.overflow_heatmap(experts, 2.0)))
    assert shown["dropped"].tolist() == [1, 0] and set(shown["cf"]) == {2.0}


def test_overflow_heatmap_at_256_experts_is_the_overview_and_detail() -> None:
    """256 experts × 58 layers (DeepSeek-V3's shape): not a label per expert on one axis (they overlap), but
    the pages' heatmap at scale, every cell's dropped share once, on the white → orange scale."""
    layers, e = 58, 256
    rng = np.random.default_rng(0)
    experts = pd.DataFrame(
        {
            "layer": np.repeat(np.arange(layers), e),
            "cf": 1.0,
            "expert": np.tile(np.arange(e), layers),
            "assigned": rng.integers(0, 40, layers * e),
        }
    )
    experts["dropped"] = experts["assigned"] // 3
    experts["dropped_fraction"] = experts["dropped"] / experts["assigned"].clip(lower=1)
    with alt.data_transformers.enable(max_rows=None):  # as the app draws it (exports.show_chart)
        spec = spec_of(charts.overflow_heatmap(experts, 1.0))
    overview, _ = spec["vconcat"]
    x = overview["layer"][0]["encoding"]["x"]
    assert x["type"] == "quantitative" and not x["axis"]["labelOverlap"]  # ticks Vega fits, not 256 labels
    assert overview["width"] / e <= 3
    data = data_of(spec)
    assert len(data) == layers * e
    assert np.allclose(data["value"], experts["dropped_fraction"])
    assert (data["count"] == experts["assigned"]).all()
    colour = overview["layer"][0]["encoding"]["color"]
    assert colour["scale"]["range"] == ["#ffffff", "#a63603"] and colour["title"] == "dropped"


def test_quantisation_charts() -> None:
    layers = pd.DataFrame(
        {
            "layer": [0, 1, 0, 1],
            "dtype": ["int8", "int8", "int4", "int4"],
            "target": "router",
            "flip_rate": [0.0, 0.1, 0.2, 0.3],
            "top1_agreement": [1.0, 0.9, 0.8, 0.7],
            "tokens": 10,
        }
    )
    data = data_of(spec_of(charts.flip_rate_chart(layers)))
    assert data["flip_rate"].tolist() == [0.0, 0.1, 0.2, 0.3]
    assert list(dict.fromkeys(data["format"])) == ["int8 (router)", "int4 (router)"]
    margins = pd.DataFrame(
        {
            "layer": [0] * 4,
            "quartile": [1, 2, 3, 4],
            "margin_low": [0.0, 0.1, 0.2, 0.3],
            "margin_high": [0.1, 0.2, 0.3, 0.4],
            "flip_rate": [0.4, 0.1, 0.0, 0.0],
            "tokens": 3,
        }
    )
    assert data_of(spec_of(charts.margin_flips_chart(margins)))["flip_rate"].tolist() == [0.4, 0.1, 0.0, 0.0]


def test_params_chart() -> None:
    sizes = pd.DataFrame({"name": ["a", "b"], "total_params": [100, 10_000], "active_params": [50, 1_000]})
    data = data_of(spec_of(charts.params_chart(sizes)))
    assert data.pivot(index="name", columns="kind", values="params").loc["b"].tolist() == [1_000, 10_000]


def test_capacity_drop_chart_never_lists_58_layers_in_a_legend() -> None:
    """Up to 20 layers a legend entry per layer; 58 (DeepSeek-V3): a gradient, still one line per layer."""
    for count, kind in ((4, "nominal"), (58, "quantitative")):
        layers = pd.DataFrame(
            {
                "layer": np.repeat(np.arange(count), 2),
                "cf": np.tile([1.0, 2.0], count),
                "policy": "probs",
                "capacity": np.tile([2, 4], count),
                "dropped_fraction": np.tile([0.5, 0.1], count),
            }
        )
        encoding = spec_of(charts.capacity_drop_chart(layers))["encoding"]
        assert encoding["color"]["type"] == kind and encoding["detail"]["field"] == "layer"
