"""Every page at scale (Streamlit AppTest), DeepSeek-V3-shaped (256 experts, 8 groups, 58 MoE layers) and
Kimi-K2-shaped (384 experts): no exception or error, never more than 20 experts in a categorical legend,
every label of the expert axes kept, and the expert axis the library gives (the 32 busiest experts).

The pages that only view a trace (Routing, Load, Structure, Compare, the playground's re-routing) are
checked on synthetic traces (`moeviz.testing.scale_traces`, 256 tokens through all 58 / 60 MoE layers: no
model, no forward), handed to the app in place of a capture. The pages that need a forward (Attention, About,
Why, Corpus; Checkpoints traces a series) open a real random model of each shape, saved as a local folder
(tests/support/scale_models.py: one per shape for the session)."""

from __future__ import annotations

import json

import pytest

from moeviz.analysis import expert_balance_frame, layer_trace
from moeviz.analysis.expert_order import expert_order
from moeviz.testing.scale_traces import SHAPES as SYNTHETIC_SHAPES
from moeviz.testing.scale_traces import shaped_trace
from tests.support.app import app_test_env, captured_as, run_page
from tests.support.scale_models import SHAPES, save_scale_series, with_tokenizer

VIEW_PAGES = ["routing", "load", "structure", "compare", "playground"]  # a trace is all they need
FORWARD_PAGES = ["attention", "about", "why", "corpus"]  # they run the model
EXPERT_FIELDS = {"expert", "co_expert", "next_expert", "expert_label", "top1", "bar"}
TOKENS = 256  # of a synthetic trace: over the Routing page's 64-token window at scale (binned overview)
TOP_N = 32  # the expert axis's default top-N


# ---- the views, on synthetic traces ---------------------------------------------------------------------
@pytest.fixture(scope="module", params=list(SYNTHETIC_SHAPES))
def synthetic(request):
    """(shape name, its synthetic trace, the prompt the app captures it for)."""
    return request.param, shaped_trace(request.param, num_tokens=TOKENS), f"synthetic {request.param} trace"


@pytest.fixture
def viewed(synthetic, monkeypatch):
    """The app's capture of the prompt `synthetic[2]` is the synthetic trace, for every model (the sample
    stays the model: it loads in a blink, and these pages read only the trace). A prompt of its own keeps
    the app's caches, keyed by (model, text), apart from every other test's."""
    app_test_env(monkeypatch)
    name, trace, prompt = synthetic
    captured_as(monkeypatch, prompt, trace)
    return name, trace, prompt


def _views(node):
    """Every dict of a Vega-Lite spec that has an `encoding`."""
    if isinstance(node, dict):
        if isinstance(node.get("encoding"), dict):
            yield node
        for value in node.values():
            yield from _views(value)
    elif isinstance(node, list):
        for value in node:
            yield from _views(value)


def spec_problems(spec: dict) -> list[str]:
    """Categorical colour legends of more than 20 experts, and categorical expert axes that may drop labels
    (Vega-Lite's default for ordinal axes is labelOverlap: true)."""
    problems = []
    title = json.dumps(spec.get("title", spec.get("vconcat", [{}])[0].get("title", "")))[:60]
    for view in _views(spec):
        for channel, enc in view["encoding"].items():
            if not isinstance(enc, dict) or enc.get("type") not in ("nominal", "ordinal"):
                continue
            field = enc.get("field", "")
            if channel == "color":
                domain = (enc.get("scale") or {}).get("domain")
                if field in EXPERT_FIELDS and (domain is None or len(domain) > 21):
                    entries = "unlimited" if domain is None else len(domain)
                    problems.append(f"{title}: categorical colour legend of {field}, {entries} entries")
            axis = enc.get("axis", {})
            overlap = True if axis is None else (axis or {}).get("labelOverlap", True)
            if channel in ("x", "y") and field in EXPERT_FIELDS and axis is not None and overlap is not False:
                problems.append(f"{title}: {channel} axis of {field} may drop labels")
    return problems


def assert_views_fit(at) -> list:
    """The page's charts (asserting none has a problem of `spec_problems`)."""
    charts = at.get("vega_lite_chart")
    problems = [p for chart in charts for p in spec_problems(json.loads(chart.proto.spec))]
    assert not problems, problems
    return charts


def sorted_experts(chart, channel: str) -> list[int]:
    """The one expert list every view of `chart` sorts its `channel` axis by (a list in the spec, or the
    order its data carries: `moeviz.charts.scale.order_in_data`)."""
    (encoded,) = {json.dumps(v["encoding"][channel]["sort"]) for v in _views(json.loads(chart.proto.spec))}
    sort = json.loads(encoded)
    if isinstance(sort, dict):  # {"field": <the rank column>, "op": "min"}: the experts by their rank
        import pyarrow as pa

        (dataset,) = chart.proto.datasets
        rows = pa.ipc.open_stream(dataset.data.data).read_all().to_pandas()
        return [int(e) for e in rows.groupby("expert")[sort["field"]].min().sort_values(kind="stable").index]
    return [int(e) for e in sort]


def busiest(trace, layer: int | None = None) -> list[int]:
    """The TOP_N busiest experts (of `layer`, else of all layers), by id: what the expert axis lists."""
    load = expert_balance_frame(trace if layer is None else layer_trace(trace, layer))
    return sorted(int(e) for e in expert_order(load, by="load")[:TOP_N])


@pytest.mark.parametrize("page", VIEW_PAGES)
def test_views_at_scale(viewed, page: str) -> None:
    name, trace, prompt = viewed
    at = run_page(f"pages/{page}.py", timeout_s=300, model="sample:mixtral-healthy", prompt=prompt)
    charts = assert_views_fit(at)
    first = trace.layers[0].layer  # the layer slider starts on the first MoE layer
    if page == "playground":  # one bias table (not an input per expert); the heatmap lists the top-N
        assert not [n for n in at.number_input if str(n.key).startswith("pg_bias_")]
        assert at.number_input(key="expert_top_n_widget").value == TOP_N
        heatmap = next(c for c in charts if "Re-routed scores and dispatch" in c.proto.spec)
        assert len(sorted_experts(heatmap, "y")) in (TOP_N, TOP_N + 1)  # the re-routed top-N, and the chosen
    if page == "structure":  # co-activation of the layer's busiest experts
        coactivation = next(c for c in charts if "Co-activation, layer" in c.proto.spec)
        assert sorted_experts(coactivation, "x") == busiest(trace, first)
    if page == "load":  # the layer × expert heatmap: every expert of every layer, on a canvas
        assert f"{len(trace.tokens)} tokens · {len(trace.layer_keys)} MoE layers" in at.caption[0].value
    if page != "routing":
        return
    experts = SYNTHETIC_SHAPES[name]["num_experts"]
    assert at.selectbox(key="expert_sort_widget").value == "id"
    assert at.number_input(key="expert_top_n_widget").value == TOP_N
    picker = at.selectbox(key="expert_widget")
    assert len(picker.options) == experts and " slots · " in picker.options[0]
    heatmap = next(c for c in charts if "Router scores" in c.proto.spec)
    assert sorted_experts(heatmap, "y") == busiest(trace, first)  # the top-32 by load (the chosen among them)
    # the token's drill-down (layers × experts) is drawn on request: off until a click or the toggle
    assert not any("Scores of" in c.proto.spec for c in charts)
    at.toggle(key="scale_token_detail_widget").set_value(True).run()
    assert not at.exception, [e.value for e in at.exception]
    assert any("Scores of" in c.proto.spec for c in at.get("vega_lite_chart"))
    captions = " ".join(c.value for c in at.caption)
    groups = SYNTHETIC_SHAPES[name]["n_group"]
    if groups > 1:
        assert "margin over the eligible experts of the chosen groups, on p + b" in captions
        assert f"by its group ({groups} groups of {experts // groups} experts)" in captions
    else:
        assert f"over all {experts} experts" in captions
        assert "continuous scale of expert ids" in captions


@pytest.mark.parametrize(
    "synthetic", ["deepseek_v3"], indirect=True
)  # one shape: the band does not depend on it
def test_routing_load_curve_carries_bootstrap_bands_at_scale(viewed) -> None:
    _, _, prompt = viewed
    at = run_page("pages/routing.py", timeout_s=300, model="sample:mixtral-healthy", prompt=prompt)
    curve = next(c for c in at.get("vega_lite_chart") if "Expert load" in c.proto.spec)
    views = list(_views(json.loads(curve.proto.spec)))
    (band,) = [v for v in views if (v["encoding"].get("y2") or {}).get("field") == "util_high"]
    assert band["encoding"]["x"]["field"] == "rank" and band["encoding"]["y"]["field"] == "util_low"
    assert "bootstrap band" in curve.proto.spec  # the subtitle names it
    helps = {m.label: m.proto.help for m in at.metric}
    for label in ("Load entropy", "Max share"):
        assert ". 90% bootstrap band: " in helps[label], helps[label]
    captions = " ".join(c.value for c in at.caption)
    assert "Grey band: 90% bootstrap band (400 draws, tokens resampled" in captions


@pytest.mark.parametrize("synthetic", ["deepseek_v3"], indirect=True)
def test_token_drilldown_draws_a_deep_rank_path_as_an_image(viewed, monkeypatch) -> None:
    """Past MOEVIZ_RASTER_ABOVE cells (a group-limited router's path reaches ranks in the hundreds at 58
    layers) the token's rank path is an image with hover bins under its dots, drawn like the rest."""
    _, _, prompt = viewed
    monkeypatch.setenv("MOEVIZ_RASTER_ABOVE", "1000")
    at = run_page("pages/routing.py", timeout_s=300, model="sample:mixtral-healthy", prompt=prompt)
    at.toggle(key="scale_token_detail_widget").set_value(True).run()
    assert not at.exception, [e.value for e in at.exception]
    path = next(c for c in at.get("vega_lite_chart") if "Path of" in c.proto.spec)
    marks = [
        v["mark"] if isinstance(v["mark"], str) else v["mark"]["type"]
        for v in _views(json.loads(path.proto.spec))
    ]
    assert marks[:2] == ["image", "rect"] and "circle" in marks  # the image, its hover bins, the dots
    shipped = [len(d.data.data) for d in path.proto.datasets]
    assert max(shipped) < 1_000_000 and len(path.proto.datasets) == len(marks)  # no dataset of every cell


# ---- the pages that run the model, on a real random model per shape --------------------------------------
@pytest.fixture(scope="module", params=list(SHAPES))
def scale_model(request, tiny_model_dir):
    return request.param, with_tokenizer(tiny_model_dir("deepseek_v3", **SHAPES[request.param]))


@pytest.fixture
def opened(scale_model, monkeypatch):
    name, folder = scale_model
    app_test_env(monkeypatch)
    monkeypatch.setenv("MOEVIZ_DEFAULT_MODEL", str(folder))  # opened as a local folder ...
    monkeypatch.setenv("MOEVIZ_MODEL_DIRS", str(folder.parent))  # ... from an allowed root
    return name


@pytest.mark.parametrize("page", FORWARD_PAGES)
def test_page_runs_the_model_at_scale(opened: str, page: str) -> None:
    at = run_page(f"pages/{page}.py", timeout_s=600)
    charts = assert_views_fit(at)
    experts = SHAPES[opened]["n_routed_experts"]
    if page == "corpus":  # load, balance, specialisation of the top-N experts (and the chosen one)
        assert len(charts) == 3
        spec = next(c for c in charts if "Domain specialisation" in c.proto.spec)
        assert len(sorted_experts(spec, "x")) in (TOP_N, TOP_N + 1)
    if page == "about":  # what the model is, from its config.json
        metrics = {m.label: m.value for m in at.metric}
        assert metrics["Routed experts"] == str(experts)
        assert metrics["Top-k"] == str(SHAPES[opened]["num_experts_per_tok"])
        blocks = SHAPES[opened]["num_hidden_layers"]
        assert metrics["MoE layers"] == str(blocks - SHAPES[opened]["first_k_dense_replace"])


@pytest.fixture(scope="module")
def scale_series(tmp_path_factory):
    """Three checkpoints of the Kimi-K2 shape (384 experts, 8 blocks)."""
    return save_scale_series("kimi-k2", tmp_path_factory.mktemp("series") / "kimi-k2-series")


def test_checkpoints_page_at_scale(scale_series, monkeypatch) -> None:
    app_test_env(monkeypatch)
    monkeypatch.setenv("MOEVIZ_MODEL_DIRS", str(scale_series.parent))
    at = run_page(
        "pages/checkpoints.py", timeout_s=600, series_choice="Local folder…", series_folder=str(scale_series)
    )
    charts = assert_views_fit(at)
    assert len(charts) == 4  # saturation, balance, drift, specialisation
    assert "kimi-k2-series · 3 checkpoints (step-00000 … step-01000)" in " ".join(c.value for c in at.caption)
