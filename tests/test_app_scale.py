"""Every page at scale (Streamlit AppTest): random DeepSeek-V3-shaped (256 experts, 8 groups, 61 blocks) and
Kimi-K2-shaped (384 experts) models opened as local folders render without an exception or error, never
list more than 20 experts in a categorical legend, keep every label of their expert axes, and the Routing
page shows the expert-axis controls, the top-N filter and the group-aware margin. The Corpus page traces the
evaluation corpus with the model and lists the top-N experts in its domain specialisation; the Checkpoints
page runs on a series of three Kimi-K2-shaped checkpoints (the 61-block shape takes too long to trace
three times)."""

from __future__ import annotations

import json

import pytest

from tests.app_helpers import app_test_env, run_page
from tests.scale_models import SHAPES, save_scale_series, with_tokenizer

PAGES = ["routing", "load", "structure", "attention", "compare", "about", "why", "corpus", "playground"]
EXPERT_FIELDS = {"expert", "co_expert", "next_expert", "expert_label", "top1", "bar"}


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


@pytest.mark.parametrize("page", PAGES)
def test_page_renders_at_scale(opened: str, page: str) -> None:
    at = run_page(f"pages/{page}.py", timeout_s=600)
    charts = at.get("vega_lite_chart")
    problems = [p for chart in charts for p in spec_problems(json.loads(chart.proto.spec))]
    assert not problems, problems
    if page == "corpus":  # load, balance, specialisation of the top-N experts (and the chosen one)
        assert len(charts) == 3
        spec = json.loads(next(c for c in charts if "Domain specialisation" in c.proto.spec).proto.spec)
        (encoded,) = {json.dumps(v["encoding"]["x"]["sort"]) for v in _views(spec)}
        assert len(json.loads(encoded)) in (32, 33)
    if page == "playground":  # one bias table (not an input per expert); the heatmap lists the top-N
        assert not [n for n in at.number_input if str(n.key).startswith("pg_bias_")]
        assert at.number_input(key="expert_top_n_widget").value == 32
        heatmap = next(c for c in charts if "Re-routed scores and dispatch" in c.proto.spec)
        (encoded,) = {json.dumps(v["encoding"]["y"]["sort"]) for v in _views(json.loads(heatmap.proto.spec))}
        assert len(json.loads(encoded)) in (32, 33)
    if page != "routing":
        return
    experts = SHAPES[opened]["n_routed_experts"]
    assert at.selectbox(key="expert_sort_widget").value == "id"
    assert at.number_input(key="expert_top_n_widget").value == 32
    picker = at.selectbox(key="expert_widget")
    assert len(picker.options) == experts and " slots · " in picker.options[0]
    heatmap = next(c for c in charts if "Router scores" in c.proto.spec)
    (encoded,) = {json.dumps(v["encoding"]["y"]["sort"]) for v in _views(json.loads(heatmap.proto.spec))}
    assert len(json.loads(encoded)) in (32, 33)  # the top-32 by load, and the chosen expert
    # the token's drill-down (layers × experts) is drawn on request: off until a click or the toggle
    assert not any("Scores of" in c.proto.spec for c in charts)
    at.toggle(key="scale_token_detail_widget").set_value(True).run()
    assert not at.exception, [e.value for e in at.exception]
    assert any("Scores of" in c.proto.spec for c in at.get("vega_lite_chart"))
    captions = " ".join(c.value for c in at.caption)
    if SHAPES[opened]["n_group"] > 1:
        assert "margin over the eligible experts of the chosen groups, on p + b" in captions
        assert "by its group (8 groups of 32 experts)" in captions
    else:
        assert f"over all {experts} experts" in captions
        assert "continuous scale of expert ids" in captions


def test_routing_load_curve_carries_bootstrap_bands_at_scale(opened: str) -> None:
    if opened != "deepseek-v3":
        pytest.skip("one shape is enough: the band does not depend on it")
    at = run_page("pages/routing.py", timeout_s=600)
    curve = next(c for c in at.get("vega_lite_chart") if "Expert load, layer" in c.proto.spec)
    views = list(_views(json.loads(curve.proto.spec)))
    (band,) = [v for v in views if (v["encoding"].get("y2") or {}).get("field") == "util_high"]
    assert band["encoding"]["x"]["field"] == "rank" and band["encoding"]["y"]["field"] == "util_low"
    assert "bootstrap band" in curve.proto.spec  # the subtitle names it
    helps = {m.label: m.proto.help for m in at.metric}
    for label in ("Load entropy", "Max share"):
        assert ". 90% bootstrap band: " in helps[label], helps[label]
    captions = " ".join(c.value for c in at.caption)
    assert "Grey band: 90% bootstrap band (400 draws, tokens resampled" in captions


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
    charts = at.get("vega_lite_chart")
    assert len(charts) == 4  # saturation, balance, drift, specialisation
    problems = [p for chart in charts for p in spec_problems(json.loads(chart.proto.spec))]
    assert not problems, problems
    assert "kimi-k2-series · 3 checkpoints (step-00000 … step-01000)" in " ".join(c.value for c in at.caption)
