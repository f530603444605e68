"""The model picker's "Advanced" options reach `moeviz.load_model` and key the caches; bad values are
messages; the About page shows what the library loaded (Streamlit AppTest)."""

from __future__ import annotations

import pytest
from streamlit.testing.v1 import AppTest

from tests.support.app import APP, app_test_env, run_page

MODEL = "sample:mixtral-healthy"


@pytest.fixture(autouse=True)
def _app_env(monkeypatch):
    app_test_env(monkeypatch)


def metric(at: AppTest, label: str) -> str:
    (value,) = [m.value for m in at.metric if m.label == label]
    return value


def test_model_keys_carry_the_options() -> None:
    from components.load_options import LoadOptions, parse_max_memory, split_key

    assert LoadOptions().key(MODEL) == MODEL  # the default options' key is the source: old keys hold
    options = LoadOptions(dtype="bfloat16", device_map="auto", max_memory="cpu=2GiB")
    key = options.key(MODEL)
    assert key != MODEL and key != LoadOptions(dtype="float32").key(MODEL)
    assert split_key(key) == (MODEL, options)
    assert options.load_kwargs() == {
        "dtype": "bfloat16",
        "device": "auto",
        "device_map": "auto",
        "max_memory": {"cpu": "2GiB"},
    }
    assert parse_max_memory("0=70GiB, cpu=8 GiB") == {0: "70GiB", "cpu": "8GiB"}


def test_about_shows_what_the_library_loaded() -> None:
    import moeviz
    from moeviz.models.memory import format_bytes

    at = run_page("pages/about.py", model=MODEL, load_dtype="bfloat16")
    loaded = moeviz.load_model(MODEL, dtype="bfloat16")
    assert metric(at, "dtype") == loaded.info.dtype == "bfloat16"
    assert metric(at, "Device") == loaded.info.device
    assert metric(at, "Parameter bytes") == format_bytes(loaded.info.parameter_bytes)
    assert "bfloat16" in " ".join(c.value for c in at.caption)


def test_a_bad_max_memory_is_a_message() -> None:
    at = AppTest.from_file(str(APP), default_timeout=60)
    at.session_state["model"] = MODEL
    at.session_state["load_device_map"] = "auto"
    at.session_state["load_max_memory"] = "cpu=lots"
    at.switch_page("pages/about.py").run()
    assert not at.exception, [e.value for e in at.exception]
    (error,) = [e.value for e in at.error]
    assert "max memory takes DEVICE=SIZE pairs" in error and "cpu=lots" in error


def test_an_offload_folder_outside_the_model_dirs_is_a_message(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("MOEVIZ_MODEL_DIRS", str(tmp_path / "models"))
    at = AppTest.from_file(str(APP), default_timeout=60)
    at.session_state["model"] = MODEL
    at.session_state["load_device_map"] = "auto"
    at.session_state["load_offload_folder"] = str(tmp_path / "elsewhere")
    at.switch_page("pages/about.py").run()
    assert not at.exception, [e.value for e in at.exception]
    (error,) = [e.value for e in at.error]
    assert "outside the model folders" in error


def verdict_table(at: AppTest):
    (table,) = [d.value for d in at.dataframe if "verdict" in d.value.columns and "status" in d.value.columns]
    return table


def test_load_page_verdicts_on_the_example_prompt() -> None:
    at = run_page("pages/load.py", model=MODEL)
    table = verdict_table(at)
    assert {"effective_tokens", "p_dead", "p_max_share", "p_entropy", "alpha"} <= set(table.columns)
    assert not table["verdict"].eq("warning").any() and not table["verdict"].eq("collapsed").any()
    assert "Model verdict: **healthy**" in " ".join(m.value for m in at.markdown)
    assert "α = 0.01" in " ".join(c.value for c in at.caption)


def test_load_page_says_a_tiny_text_is_not_enough() -> None:
    from moeviz.analysis.collapse import NOT_ENOUGH_TOKENS

    at = run_page("pages/load.py", model=MODEL, prompt="Hi there.")
    assert verdict_table(at)["status"].eq(NOT_ENOUGH_TOKENS).all()
    assert NOT_ENOUGH_TOKENS in " ".join(m.value for m in at.markdown)


def test_the_first_load_shows_its_progress_and_a_cache_hit_none(monkeypatch) -> None:
    import streamlit as st

    shown: list[str] = []
    real = st.progress

    def progress(value, text=None, **kwargs):
        shown.append(text or "")
        return real(value, text=text, **kwargs)

    monkeypatch.setattr(st, "progress", progress)

    def script() -> None:
        import streamlit as st
        from components import caches

        st.write(caches.get_model(st.session_state["model_key"]).info.dtype)

    at = AppTest.from_function(script, default_timeout=60)
    at.session_state["model_key"] = MODEL + ' ⚙ {"dtype": "float16"}'  # a key no other test loads
    at.run()
    assert not at.exception and at.markdown[0].value == "float16"
    assert shown and all(text.startswith("Loading weights: ") and "MiB" in text for text in shown)
    shown.clear()
    at.run()
    assert not at.exception and at.markdown[0].value == "float16" and not shown


def test_routing_load_chart_has_bootstrap_bands() -> None:
    at = run_page("pages/routing.py", model=MODEL)
    (chart,) = [c for c in at.get("vega_lite_chart") if '"Expert load"' in c.proto.spec]
    assert "count_low" in chart.proto.spec or "count_low" in str(chart.proto.datasets)
    helps = " ".join(m.proto.help for m in at.metric if m.label in ("Load entropy", "Max share"))
    assert helps.count("90% bootstrap band") == 2


def test_a_model_too_large_is_refused_with_its_message(monkeypatch) -> None:
    import moeviz.models.memory as memory

    monkeypatch.setattr(memory, "available_memory", lambda device, max_age=0.0: 1024)  # 1 KiB free
    at = AppTest.from_file(str(APP), default_timeout=60)
    at.session_state["model"] = MODEL
    at.session_state["load_dtype"] = "float32"  # a key of its own: nothing cached
    at.switch_page("pages/about.py").run()
    assert not at.exception, [e.value for e in at.exception]
    (error,) = [e.value for e in at.error]
    assert "Nothing was loaded" in error and "only 1.0 KiB is free" in error
