"""Dense heatmaps as rasters (`moeviz.charts.raster`): the PNG's pixels are the colour scale applied to the
matrix (decoded and compared with colours computed here from the scheme's stops, independently), the image
sits on the cells of its axes, the hover bins hold the binned means, and views switch to a raster above
the threshold only."""

from __future__ import annotations

import base64
import io

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from moeviz.analysis.scale_frames import token_scores_frame
from moeviz.charts import layer_expert_heatmap, token_rank_path_chart
from moeviz.charts.attention import attention_map_raster
from moeviz.charts.raster import (
    OVERLAY_CELLS,
    RASTER_ABOVE,
    SCHEMES,
    ColourRamp,
    overlay_bins,
    overlay_frame,
    png_data_url,
    raster_heatmap,
    upscale_factors,
    use_raster,
)
from moeviz.testing.scale_traces import synthetic_trace


def decode(url: str) -> np.ndarray:
    """[H, W, 3] pixels of a PNG data URL."""
    assert url.startswith("data:image/png;base64,")
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB"))


def expected_colour(value: float, colours: list[str], lo: float, hi: float, log: bool = False) -> tuple:
    """The colour of one value, computed apart: which two stops it falls between, and the straight line in
    RGB between them, rounded half up (NaN: light grey)."""
    if np.isnan(value):
        return (217, 217, 217)
    t = (np.log10(value) - np.log10(lo)) / (np.log10(hi) - np.log10(lo)) if log else (value - lo) / (hi - lo)
    t = min(max(t, 0.0), 1.0) * (len(colours) - 1)
    i = min(int(t), len(colours) - 2)
    frac = t - i
    a = [int(colours[i][k : k + 2], 16) for k in (1, 3, 5)]
    b = [int(colours[i + 1][k : k + 2], 16) for k in (1, 3, 5)]
    return tuple(int(np.floor(x + (y - x) * frac + 0.5)) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(
    ("scheme", "domain", "log"),
    [("viridis", (0.0, 2.0), False), ("bluered", (-3.0, 3.0), False), ("greys", (1e-4, 1.0), True)],
)
def test_pixels_are_the_colour_scale_of_the_matrix(scheme, domain, log) -> None:
    rng = np.random.default_rng(0)
    lo, hi = domain
    matrix = (
        10 ** rng.uniform(-5, 0.2, (7, 13)) if log else rng.uniform(lo - 0.5, hi + 0.5, (7, 13))
    )  # values past both ends: clamped
    matrix[2, 3] = np.nan
    ramp = ColourRamp.of(scheme, domain, log=log)
    fy, fx = upscale_factors(*matrix.shape)
    pixels = decode(png_data_url(matrix, ramp))
    assert pixels.shape == (7 * fy, 13 * fx, 3)
    assert fy > 1 and fx > 1  # small matrices are upscaled by whole factors
    colours = list(SCHEMES[scheme])
    for r in range(7):
        for c in range(13):
            want = expected_colour(matrix[r, c], colours, lo, hi, log)
            block = pixels[r * fy : (r + 1) * fy, c * fx : (c + 1) * fx].reshape(-1, 3)
            assert (block == want).all(), (r, c, block[0], want)  # row 0 at the top, column 0 at the left


def test_legend_scale_has_the_raster_stops() -> None:
    ramp = ColourRamp.of("viridis", (0.0, 9.0))
    scale = ramp.scale().to_dict()
    assert scale["range"] == list(SCHEMES["viridis"])
    assert scale["domain"] == pytest.approx(np.linspace(0, 9, len(SCHEMES["viridis"])).tolist())
    assert scale["interpolate"] == "rgb" and scale["clamp"] is True


def test_overlay_means_equal_binned_means() -> None:
    rng = np.random.default_rng(1)
    matrix = rng.normal(size=(58, 256))
    matrix[5, 17] = np.nan
    frame = overlay_frame(matrix, max_cells=500)
    by_row, by_col = overlay_bins(58, 256, 500)
    assert len(frame) <= 500 and len(frame) == -(-58 // by_row) * -(-256 // by_col)
    for _, bin_ in frame.iterrows():
        r0, r1 = int(bin_["y0"] + 0.5), int(bin_["y1"] - 0.5)
        c0, c1 = int(bin_["x0"] + 0.5), int(bin_["x1"] - 0.5)
        cells = [matrix[r, c] for r in range(r0, r1 + 1) for c in range(c0, c1 + 1)]
        cells = [v for v in cells if not np.isnan(v)]
        assert bin_["mean"] == pytest.approx(sum(cells) / len(cells))
        assert bin_["min"] == min(cells) and bin_["max"] == max(cells)
    # the bins tile the matrix: every cell in exactly one
    assert ((frame["x1"] - frame["x0"]) * (frame["y1"] - frame["y0"])).sum() == 58 * 256


def test_small_bins_list_every_cell() -> None:
    matrix = np.arange(12.0).reshape(3, 4)
    frame = overlay_frame(matrix, col_labels=[7, 5, 3, 1], max_cells=6)  # bins of 1 row × 2 columns
    assert frame.loc[0, "values"] == "7: 0 · 5: 1"
    assert frame.loc[frame.index[-1], "values"] == "3: 10 · 1: 11"


def test_image_spans_the_cells_of_its_axes() -> None:
    matrix = np.random.default_rng(2).random((40, 300))
    spec = raster_heatmap(
        matrix, ColourRamp.of("viridis", (0, 1)), row_title="layer", col_title="expert", value_title="v"
    ).to_dict()
    image, overlay = spec["layer"]
    row = spec["datasets"][image["data"]["name"]][0]
    assert (row["x0"], row["x1"], row["y0"], row["y1"]) == (-0.5, 299.5, -0.5, 39.5)
    assert image["encoding"]["x"]["scale"]["domain"] == [-0.5, 299.5]
    assert image["encoding"]["y"]["scale"]["domain"] == [-0.5, 39.5]
    assert image["encoding"]["y"]["scale"]["reverse"] is True  # row 0 at the top, as in the PNG
    assert overlay["encoding"]["x"]["scale"] == image["encoding"]["x"]["scale"]
    assert decode(row["url"]).shape[:2] == (
        40 * upscale_factors(40, 300)[0],
        300 * upscale_factors(40, 300)[1],
    )


def _balance(layers: int, experts: int) -> pd.DataFrame:
    rng = np.random.default_rng(3)
    return pd.DataFrame(
        {
            "layer": np.repeat(np.arange(layers), experts),
            "expert": np.tile(np.arange(experts), layers),
            "utilisation": rng.gamma(2.0, 0.5, layers * experts),
        }
    )


def _marks(spec) -> list[str]:
    found = []
    if isinstance(spec, dict):
        mark = spec.get("mark")
        if mark is not None:
            found.append(mark if isinstance(mark, str) else mark["type"])
        for value in spec.values():
            found += _marks(value)
    elif isinstance(spec, list):
        for value in spec:
            found += _marks(value)
    return found


def test_threshold_switch() -> None:
    assert use_raster(58, 256) and not use_raster(20, 200)
    small = layer_expert_heatmap(_balance(10, 30), "utilisation").to_dict()  # 300 cells: rects
    assert "image" not in _marks(small)
    large = layer_expert_heatmap(_balance(58, 256), "utilisation", highlight=4).to_dict()
    assert RASTER_ABOVE < 58 * 256 and "image" in _marks(large)
    assert max(len(rows) for rows in large["datasets"].values()) < 58 * 256 // 3  # never a row per cell


def test_layer_expert_raster_pixels_follow_the_axis_order() -> None:
    frame = _balance(58, 256)
    order = np.random.default_rng(4).permutation(256)
    spec = layer_expert_heatmap(frame, "utilisation", order=order).to_dict()
    overview = spec["vconcat"][0]
    data = overview["layer"][0].get("data", overview.get("data"))  # a lone layer's data moves up
    pixels = decode(spec["datasets"][data["name"]][0]["url"])
    fy, fx = upscale_factors(58, 256)
    util = frame.pivot(index="layer", columns="expert", values="utilisation").to_numpy()
    colours = list(SCHEMES["bluered"])
    for r, pos in [(0, 0), (57, 255), (10, 100), (33, 7)]:
        log2 = np.log2(np.clip(util[r, order[pos]], 1 / 8, 8))
        assert tuple(pixels[r * fy, pos * fx]) == expected_colour(log2, colours, -3.0, 3.0)


def test_attention_map_raster_shape_and_domain() -> None:
    n = 300
    block = np.tril(np.random.default_rng(5).random((n, n)))
    block /= block.sum(1, keepdims=True)
    tokens = pd.DataFrame({"pos": np.arange(n), "token": [f"t{i}" for i in range(n)]})
    spec = attention_map_raster(block, np.arange(n), np.arange(n), tokens, scale="linear").to_dict()
    image, overlay = spec["layer"]
    assert image["encoding"]["x"]["scale"]["domain"] == [-0.5, n - 0.5]
    pixels = decode(spec["datasets"][image["data"]["name"]][0]["url"])
    fy, fx = upscale_factors(n, n)
    assert pixels.shape == (n * fy, n * fx, 3)
    assert tuple(pixels[0, -1]) == (255, 255, 255)  # a future key (weight 0): white, top right
    bins = pd.DataFrame(spec["datasets"][overlay["data"]["name"]])
    assert bins["mean"].to_numpy() @ ((bins["x1"] - bins["x0"]) * (bins["y1"] - bins["y0"])).to_numpy() == (
        pytest.approx(n)  # weights, not shades: every row sums to 1
    )


def test_rank_path_background_raster_names_each_cells_expert() -> None:
    trace = synthetic_trace(num_tokens=12, seed=2)  # DeepSeek-V3 shaped: 58 MoE layers × 256 experts
    pos = 7
    chart = token_rank_path_chart(token_scores_frame(trace, 0, pos), rank_by="score", raster=True)
    spec = chart.to_dict()
    image, overlay, _line, dots = spec["layer"]
    # independently: each layer's experts ranked by the token's score, down to the deepest dispatched one
    ranked = [np.argsort(-r.scores[pos], kind="stable") for r in trace.layers]
    deepest = max(
        int(np.flatnonzero(np.isin(order, r.experts[pos])).max())
        for order, r in zip(ranked, trace.layers, strict=True)
    )
    top = max(deepest + 1, 16)
    scores = np.array([r.scores[pos][order[:top]] for order, r in zip(ranked, trace.layers, strict=True)]).T
    pixels = decode(spec["datasets"][image["data"]["name"]][0]["url"])
    fy, fx = upscale_factors(*scores.shape)
    assert pixels.shape[:2] == (scores.shape[0] * fy, scores.shape[1] * fx)
    greys, lo, hi = list(SCHEMES["greys"]), scores.min(), scores.max()
    for rank, column in [(0, 0), (top - 1, 57), (5, 30), (11, 2)]:
        want = expected_colour(scores[rank, column], greys, lo, hi)
        assert np.abs(pixels[rank * fy, column * fx].astype(int) - want).max() <= 1  # float32 scores
    # each hover bin lists its cells as "rank eX: score", X the expert at that rank of that layer
    bins = pd.DataFrame(spec["datasets"][overlay["data"]["name"]])
    layer_at = {str(r.layer): i for i, r in enumerate(trace.layers)}
    checked = 0
    for _, bin_ in bins.iterrows():
        column = layer_at[bin_["cols_text"]]  # one layer a bin: its ranks listed
        for cell in bin_["values"].split(" · "):
            where, value = cell.split(": ")
            rank, expert = where.split(" e")
            assert int(expert) == ranked[column][int(rank)]
            assert value == format(float(scores[int(rank), column]), ".4g")
            checked += 1
    assert checked == scores.size
    # the dots are the dispatched experts; no dataset ships a row per cell
    assert len(spec["datasets"][dots["data"]["name"]]) == 8 * len(trace.layers)
    assert max(len(rows) for rows in spec["datasets"].values()) <= min(OVERLAY_CELLS, scores.size // 2)
