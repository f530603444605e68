"""Every page renders without exceptions (Streamlit AppTest) on the default sample and on DeepSeek-V3."""

from __future__ import annotations

import pytest
from streamlit.testing.v1 import AppTest

from tests.app_helpers import app_test_env
from tests.app_helpers import run_page as run_app_page

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


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("page", PAGES)
def test_page_renders(page: str, model: str) -> None:
    at = run_page(page, model)
    assert at.title[0].value
    assert chart_count(at) >= 1 or page == "pages/about.py"
    if model.endswith("deepseek-v3-bias") and page == "pages/about.py":
        assert chart_count(at) == 1  # the balancing-bias chart
        assert any(m.label == "Top-k" and m.value == "4" for m in at.metric)


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
    assert chart_count(at) == 4  # load A, load B, agreement, load shift
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
