"""Pages at 256 experts and 58 MoE layers, Streamlit AppTest: the Load page counts its
verdicts and folds the per-layer sentences, Structure counts expert paths over a window of layers, the
Attention page colours one head's map on a log scale by default.

Load and Structure read a DeepSeek-V3-shaped synthetic trace handed to the app in place of a capture (as in
test_app_scale.py); Attention runs a real random model of that shape (tests/support/scale_models.py)."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from moeviz.analysis import collapse_report
from moeviz.testing.scale_traces import synthetic_trace
from tests.support.app import app_test_env, captured_as, run_page
from tests.support.scale_models import SHAPES, with_tokenizer

PROMPT = "synthetic trace of 16 texts"  # the app's capture of this prompt is the synthetic trace
TEXTS, TEXT_TOKENS = 16, 64


@pytest.fixture(scope="module")
def trace():
    """256 experts, 58 MoE layers, 1024 tokens cut into 16 texts of 64: enough effective tokens to judge
    the load, a skew that some layers' load shows significantly (warnings) and others not (notes)."""
    made = synthetic_trace(num_tokens=TEXTS * TEXT_TOKENS, skew=0.3, seed=2)
    made.tokens["seq"] = np.arange(len(made.tokens)) // TEXT_TOKENS
    made.tokens["pos"] = np.arange(len(made.tokens)) % TEXT_TOKENS
    return made


@pytest.fixture
def viewed(trace, monkeypatch):
    app_test_env(monkeypatch)
    captured_as(monkeypatch, PROMPT, trace)
    return trace


def chart_rows(at, title_part: str) -> tuple[dict, list[dict]]:
    """The one chart whose title contains `title_part`: its spec and its data rows (Streamlit ships a
    chart's data apart from its spec, as Arrow)."""
    import pyarrow as pa

    (chart,) = [
        c
        for c in at.get("vega_lite_chart")
        if title_part in json.dumps(json.loads(c.proto.spec).get("title"), ensure_ascii=False)
    ]
    (dataset,) = chart.proto.datasets
    rows = pa.ipc.open_stream(dataset.data.data).read_all().to_pylist()
    return json.loads(chart.proto.spec), rows


def test_load_page_summarises_the_verdicts_and_folds_the_sentences(viewed):
    report = collapse_report(viewed)
    flagged = [lv for lv in report.layers if lv.reasons]
    quiet = [lv for lv in report.layers if lv.notes and not lv.reasons]
    insignificant = sum(any(n.startswith("not significant") for n in lv.notes) for lv in report.layers)
    assert (
        len(report.layers) == 58 and insignificant >= 10 and flagged
    )  # the page this is for: notes on many layers
    at = run_page("pages/load.py", timeout_s=600, model="sample:mixtral-healthy", prompt=PROMPT)
    (summary,) = [m.value for m in at.markdown if m.value.startswith("58 MoE layers: ")]
    verdicts = Counter(str(lv.verdict) for lv in report.layers)
    for name, n in verdicts.items():
        assert f"{n} {name}" in summary
    assert f"{insignificant} layers not significant" in summary
    folded = {e.label: e for e in at.expander}
    (notes_label,) = [label for label in folded if label.startswith("Notes on ")]
    assert f"{len(quiet)} layers" in notes_label
    notes = folded[notes_label]
    assert notes.proto.expanded is False  # closed: the summary line stands for them
    shown = "\n".join(m.value for m in notes.markdown)
    assert all(f"  - *note:* {n}" in shown for lv in quiet for n in lv.notes)  # every note, in full
    if flagged:
        (reasons_label,) = [label for label in folded if label.startswith("Reasons: ")]
        assert reasons_label.startswith(f"Reasons: {len(flagged)} of 58 layers")
        listed = "\n".join(m.value for m in folded[reasons_label].markdown)
        assert all(f"  - {r}" in listed for lv in flagged for r in lv.reasons)
    # nothing of the per-layer sentences outside the folds
    outside = [m.value for m in at.markdown if m.value.startswith("- **Layer ")]
    inside = [m.value for e in at.expander for m in e.markdown]
    assert all(text in inside for text in outside)


def test_structure_counts_paths_over_a_window_of_consecutive_layers(viewed):
    at = run_page("pages/structure.py", timeout_s=600, model="sample:mixtral-healthy", prompt=PROMPT)
    assert at.slider(key="path_layers").value == 2  # the default window at hundreds of experts
    first = viewed.layers[0].layer  # the page opens on the first MoE layer
    paths, rows = chart_rows(at, "Most frequent expert paths")
    assert paths["title"] == f"Most frequent expert paths, layers {first}–{first + 1}"
    top1 = {r.layer: r.experts[:, 0].tolist() for r in viewed.layers}
    counted = Counter(f"{a}→{b}" for a, b in zip(top1[first], top1[first + 1], strict=True))
    assert [r["count"] for r in rows] == [n for _, n in counted.most_common(len(rows))]  # the most frequent
    assert all(counted[r["label"]] == r["count"] for r in rows)  # (ties in either order)
    assert rows[0]["count"] > 1  # two-layer paths repeat (58-layer ones each occurred once)

    at.slider(key="path_layers").set_value(3).run()
    _, rows = chart_rows(at, "Most frequent expert paths")
    assert all(r["label"].count("→") == 2 for r in rows)


@pytest.fixture(scope="module")
def scale_model(tiny_model_dir):
    return with_tokenizer(tiny_model_dir("deepseek_v3", **SHAPES["deepseek-v3"]))


def test_attention_map_opens_on_a_log_scale(scale_model, monkeypatch):
    app_test_env(monkeypatch)
    monkeypatch.setenv("MOEVIZ_DEFAULT_MODEL", str(scale_model))  # opened as a local folder ...
    monkeypatch.setenv("MOEVIZ_MODEL_DIRS", str(scale_model.parent))  # ... from an allowed root
    at = run_page("pages/attention.py", timeout_s=600)
    assert at.radio(key="attention_map_scale").value == "log"
    head_map, rows = chart_rows(at, "queries ×")
    colour = head_map["encoding"]["color"]
    assert colour["scale"]["type"] == "log" and colour["field"] == "shade"
    assert all(r["shade"] == pytest.approx(min(max(r["weight"], 1e-4), 1.0)) for r in rows)

    at.radio(key="attention_map_scale").set_value("row").run()
    _, rows = chart_rows(at, "queries ×")
    top = {}
    for r in rows:
        top[r["query_pos"]] = max(top.get(r["query_pos"], 0.0), r["weight"])
    assert all(r["shade"] == pytest.approx(r["weight"] / top[r["query_pos"]]) for r in rows)
