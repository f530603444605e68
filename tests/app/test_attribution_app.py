"""The "Why this expert?" page: explain, what-if and importance in the app on both sample families show the
library's results."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from tests.support.app import APP, app_test_env


@pytest.fixture(autouse=True)
def _app_env(monkeypatch):
    app_test_env(monkeypatch)


def _ok(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]


def charts(at: AppTest) -> list[tuple[str, pd.DataFrame]]:
    """(spec, rows) of every chart on the page (Streamlit ships the rows as Arrow)."""
    import pyarrow as pa

    return [
        (c.proto.spec, pa.ipc.open_stream(c.proto.datasets[0].data.data).read_all().to_pandas())
        for c in at.get("vega_lite_chart")
        if c.proto.datasets
    ]


@pytest.mark.parametrize("model", ["sample:mixtral-healthy", "sample:deepseek-v3-bias"])
def test_why_page_explains_and_runs_what_if(model):
    """Explain, the what-if and the importance sweep on the page's defaults (the last token, the first MoE
    layer, its busiest expert) show what `moeviz.attribution` and `moeviz.interventions` give directly."""
    import moeviz
    from moeviz.attribution import router_attribution
    from moeviz.interventions import NextBest, counterfactual, expert_importance

    at = AppTest.from_file(str(APP), default_timeout=90)
    at.session_state["model"] = model
    at.switch_page("pages/why.py").run()
    _ok(at)
    loaded = moeviz.load_model(model)
    trace = moeviz.capture(loaded, at.session_state["prompt"])
    ids = [int(i) for i in trace.tokens["token_id"]]
    pos = int(at.selectbox(key="token_widget").value.split(":")[0])
    layer = int(at.select_slider(key="layer_widget").value)
    site = trace.layer_keys[[key[1] for key in trace.layer_keys].index(layer)][0]
    expert = int(at.selectbox(key="expert_widget").value)
    assert pos == len(ids) - 1  # the default: the last token

    at.button(key="why_explain").click().run()  # Explain
    _ok(at)
    res = router_attribution(
        loaded, token_ids=ids, position=pos, layer=layer, site=site, expert=expert, target="score",
        baseline="pad", n_steps=32,
    )  # fmt: skip
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["router score"] == f"{res.value:.4f}"
    assert metrics["IG convergence delta"] == f"{res.delta:+.3g}"
    (shown,) = [rows for spec, rows in charts(at) if res.what in spec and "feature ablation" not in spec]
    np.testing.assert_allclose(shown["ig"], res.frame()["ig"], rtol=1e-5, atol=1e-8)  # a cell a token

    at.radio(key="why_kind").set_value("Replace the top choice by the next-best").run()
    at.button(key="why_whatif").click().run()  # Run what-if
    _ok(at)
    cf = counterfactual(
        loaded, token_ids=ids, interventions=[NextBest(layer=layer, positions=pos, site=site)]
    )
    metrics = {m.label: m.value for m in at.metric}
    assert metrics[f"log p({cf.next_token!r}) after the prompt"] == f"{cf.next_logprob_after:.4f}"

    at.button(key="why_importance_run").click().run()  # importance
    _ok(at)
    expected = expert_importance(loaded, token_ids=ids)
    (shown,) = [rows for _, rows in charts(at) if set(expected.columns) <= set(rows.columns)]
    assert len(shown) == len(expected)
    numeric = [c for c in expected.columns if c in shown.columns and expected[c].dtype.kind == "f"]
    assert numeric, list(expected.columns)
    for column in numeric:
        np.testing.assert_allclose(shown[column], expected[column], rtol=1e-5, atol=1e-8, err_msg=column)


def test_why_page_declines_prompts_over_its_limit():
    import moeviz

    loaded = moeviz.load_model("sample:mixtral-healthy")
    ids = list(range(3, 203)) * 11  # 2,200 tokens
    text = loaded.tokenizer.decode(ids)
    n = len(moeviz.capture(loaded, text).tokens)
    at = AppTest.from_file(str(APP), default_timeout=90)
    at.session_state["model"] = "sample:mixtral-healthy"
    at.session_state["prompt"] = text
    at.switch_page("pages/why.py").run()
    _ok(at)
    assert n > 2048
    assert any(f"has {n:,}" in i.value for i in at.info)
    assert [b.key for b in at.button if b.key.startswith("why_")] == []  # nothing to run
