"""Every page (Streamlit AppTest) on the default sample and on DeepSeek-V3: no exception or error, and its key
chart holds what the library computes on the same prompt."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from tests.support.app import app_test_env
from tests.support.app import run_page as run_app_page

PAGES = [
    "pages/routing.py",
    "pages/load.py",
    "pages/structure.py",
    "pages/attention.py",
    "pages/compare.py",
    "pages/about.py",
]
MODELS = ["sample:mixtral-healthy", "sample:deepseek-v3-bias"]


@pytest.fixture(autouse=True)
def _app_env(monkeypatch):
    app_test_env(monkeypatch)


def run_page(page: str, model: str, **state) -> AppTest:
    return run_app_page(page, model=model, **state)


def chart_data(at: AppTest, title: str) -> list[dict]:
    """Rows of the one chart whose spec contains `title` (Streamlit ships the data as Arrow)."""
    import pyarrow as pa

    (chart,) = [c for c in at.get("vega_lite_chart") if title in c.proto.spec]
    (dataset,) = chart.proto.datasets
    return pa.ipc.open_stream(dataset.data.data).read_all().to_pylist()


def chart_count(at: AppTest) -> int:
    return len(at.get("vega_lite_chart"))


def chart_frame(at: AppTest, title: str) -> pd.DataFrame:
    """The rows of the one chart whose spec contains `title`, as a frame."""
    return pd.DataFrame(chart_data(at, title))


def assert_columns_equal(shown: pd.DataFrame, expected: pd.DataFrame, keys: list[str], values: list[str]):
    """`shown` and `expected` have the same rows by `keys`, with equal `values` (floats to 1e-9)."""
    shown = shown.sort_values(keys).reset_index(drop=True)
    expected = expected.sort_values(keys).reset_index(drop=True)
    assert shown[keys].astype(int).values.tolist() == expected[keys].astype(int).values.tolist()
    for column in values:
        np.testing.assert_allclose(shown[column].astype(float), expected[column].astype(float), atol=1e-9)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("page", PAGES)
def test_page_shows_the_librarys_numbers(page: str, model: str) -> None:
    """Each page's key chart on the example prompt holds what the library computes on it."""
    import moeviz
    from moeviz.analysis import expert_balance_frame, layer_coactivation_frame

    at = run_page(page, model)
    assert at.title[0].value
    loaded = moeviz.load_model(model)
    from components.prompt import EXAMPLE_PROMPT

    text = at.session_state.get("prompt", EXAMPLE_PROMPT)  # About has no prompt form: the example
    trace = moeviz.capture(loaded, text, attention=True)
    site, first = trace.layer_keys[0]  # the layer pickers start on the first MoE layer
    routing = trace.layer(first, site)
    if page == "pages/routing.py":  # the router scores of every token and expert, and the layer's load
        # the charts name no layer (their spec stays the same across layers): the line above them does
        assert f"Layer {first}: {routing.num_experts} experts" in " ".join(c.value for c in at.caption)
        heatmap = chart_frame(at, "Router scores")
        expected = trace.scores_frame(first, site)
        assert_columns_equal(heatmap, expected, ["pos", "expert"], ["score", "logit"])
        load = chart_frame(at, "Expert load")
        load = load[load["expert"] >= 0].sort_values("expert")
        counts = np.bincount(routing.experts[routing.experts >= 0], minlength=routing.num_experts)
        assert load["count"].astype(int).tolist() == counts.tolist()
    if page == "pages/load.py":  # every layer × expert
        heatmap = chart_frame(at, "Load per layer and expert")
        expected = expert_balance_frame(trace)
        assert_columns_equal(heatmap, expected, ["layer", "expert"], ["count", "share", "utilisation"])
    if page == "pages/structure.py":  # co-activation of the first MoE layer, the diagonal left out
        coact = chart_frame(at, f"Co-activation, layer {first}")
        expected = layer_coactivation_frame(trace, first, site)
        expected = expected[expected["expert"] != expected["co_expert"]]
        keys = ["expert", "co_expert"]
        assert_columns_equal(coact, expected, keys, ["pair_count", "expert_count", "coactivation"])
    if page == "pages/attention.py":  # the head grid's mean entropy (W = 32, the page's default)
        grid = chart_frame(at, "Entropy (nats)")
        expected = trace.attention.head_summary(32).rename(columns={"mean_entropy": "value"})
        assert_columns_equal(grid, expected, ["layer", "head"], ["value"])
    if page == "pages/compare.py":  # A is the model, B the default reference: each one's own load
        other = moeviz.capture(moeviz.load_model("sample:mixtral-unbalanced"), text)
        for name, routed in ((f"A: {model}", trace), ("B: sample:mixtral-unbalanced", other)):
            heatmap = chart_frame(at, name)
            assert_columns_equal(
                heatmap, expert_balance_frame(routed), ["layer", "expert"], ["count", "share"]
            )
    if page == "pages/about.py":  # what the library loaded; a balancing bias is drawn per layer and expert
        metrics = {m.label: m.value for m in at.metric}
        assert metrics["Parameters"] == f"{sum(p.numel() for p in loaded.model.parameters()):,}"
        assert metrics["MoE layers"] == str(len(trace.layer_keys))
        assert metrics["Routed experts"] == str(routing.num_experts) and metrics["Top-k"] == str(routing.k)
        if routing.bias is None:
            assert chart_count(at) == 0
        else:
            assert chart_count(at) == 1
            shown = chart_frame(at, "Balancing bias per expert").sort_values(["layer", "expert"])
            expected = np.concatenate([trace.layer(layer, s).bias for s, layer in sorted(trace.layer_keys)])
            np.testing.assert_allclose(shown["bias"].astype(float), expected, atol=1e-6)


def test_load_page_runs_over_the_corpus() -> None:
    at = run_page("pages/load.py", MODELS[0], use_corpus=True)
    caption = " ".join(c.value for c in at.caption)
    assert "10240 tokens" in caption


def test_compare_explains_a_different_tokenizer(tmp_path) -> None:
    # two checkpoints of the series share the tokenizer: the differences are shown
    at = run_page(
        "pages/compare.py",
        MODELS[0],
        compare_a="sample:mixtral-healthy-series/step-00100",
        compare_b="sample:mixtral-healthy-series/step-01000",
    )
    # load A, load B, agreement, load shift; one lineage, so what B changed from A (4 more)
    assert chart_count(at) == 8
    assert "What the fine-tune did" in [h.value for h in at.subheader]
    assert not at.warning


def test_selections_survive_a_page_switch() -> None:
    at = run_page("pages/routing.py", MODELS[0])
    at.select_slider(key="layer_widget").set_value("2").run()
    at.selectbox(key="timeline_expert").set_value(5).run()  # the expert timeline's picker
    at.switch_page("pages/structure.py").run()
    assert at.select_slider(key="layer_widget").value == "2"
    at.switch_page("pages/routing.py").run()
    assert at.select_slider(key="layer_widget").value == "2"
    assert at.selectbox(key="timeline_expert").value == 5
    assert not at.exception


@pytest.mark.parametrize("model", MODELS)
def test_attention_page_shows_heads_map_and_kv_whatif(model: str) -> None:
    import moeviz

    at = run_page("pages/attention.py", model)
    trace = moeviz.capture(moeviz.load_model(model), at.session_state["prompt"], attention=True)
    att = trace.attention
    keys = sorted(c.key or "" for c in at.get("vega_lite_chart"))
    assert len(keys) == 6, keys  # four head-grid metrics, the map, the KV what-if
    assert at.selectbox(key="attention_layer_widget").options == [str(x) for x in att.map_layers]
    # the map is the chosen head's exact block: its cells equal the library's
    n = len(trace.tokens)
    expected = att.block(att.map_layers[0], 0, 0)
    assert any(m.label == "KV bytes per token" for m in at.metric)
    bytes_metric = next(m for m in at.metric if m.label == "KV bytes per token")
    assert bytes_metric.value == f"{int(att.kv_cache_bytes_per_token()['bytes_per_token'].sum()):,}"
    values = chart_data(at, "Layer 0, head 0")
    shown = {(v["query_pos"], v["key_pos"]): v["weight"] for v in values}
    assert len(shown) == n * n
    for (i, j), w in shown.items():
        assert abs(w - expected[i, j]) < 1e-9

    # choosing another head redraws the map for it
    at.selectbox(key="attention_head_widget").set_value(2).run()
    assert not at.exception
    assert any("Layer 0, head 2" in c.proto.spec for c in at.get("vega_lite_chart"))


def test_token_drilldown_shows_its_attention_row() -> None:
    import moeviz

    at = run_page("pages/routing.py", MODELS[0])
    trace = moeviz.capture(moeviz.load_model(MODELS[0]), at.session_state["prompt"], attention=True)
    seq, pos = 0, int(at.selectbox(key="token_widget").value.split(":")[0])  # the token on show
    values = chart_data(at, "Attention of ")
    row = trace.attention.row(0, 0, seq, pos)
    assert [v["key_pos"] for v in values] == list(range(pos + 1))
    assert all(abs(v["weight"] - row[v["key_pos"]]) < 1e-9 for v in values)


def test_prompt_files_are_checked() -> None:
    from components import prompt

    limit = prompt.PROMPT_FILE_LIMIT
    assert prompt.prompt_from_file("ok.txt", "héllo".encode()) == "héllo"
    with pytest.raises(ValueError, match=f"big.txt has {limit + 1:,} bytes; .* at most {limit:,}"):
        prompt.prompt_from_file("big.txt", b"a" * (limit + 1))
    with pytest.raises(ValueError, match="not UTF-8 text \\(byte 3\\)"):
        prompt.prompt_from_file("l1.txt", "caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match="empty"):
        prompt.prompt_from_file("blank.txt", b" \n")
