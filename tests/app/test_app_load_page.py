"""The Load & collapse page (Streamlit AppTest) shows every collapse reason in full and the balancing losses
per layer next to their balanced values, equal to the library's on the same trace."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from tests.support.app import app_test_env, corpus_trace, run_page

COLLAPSED = "sample:mixtral-collapsed"


@pytest.fixture(autouse=True)
def _app_env(monkeypatch):
    app_test_env(monkeypatch)


def losses_table(at) -> pd.DataFrame:
    (shown,) = [d.value for d in at.dataframe if "aux_loss_topk_balanced" in d.value.columns]
    return shown.reset_index(drop=True)


def assert_losses_are_the_librarys(at, trace, experts: int, top_k: int) -> None:
    from moeviz.analysis import loss_frame

    expected = loss_frame(trace)
    shown = losses_table(at)
    assert shown["layer"].astype(int).tolist() == expected["layer"].tolist()
    for column in ("aux_loss_top1", "aux_loss_topk", "aux_loss_dispatched", "seq_aux_loss", "z_loss"):
        np.testing.assert_allclose(shown[column], expected[column], rtol=1e-12, err_msg=column)
    np.testing.assert_allclose(shown["aux_loss_megatron"], expected["aux_loss_topk"] / top_k, rtol=1e-12)
    # Balanced value by hand: f_e = k/E for every expert, so E · Σ_e (k/E) P_e = k Σ_e P_e = k (f not divided
    # by k); Switch's top-1 and the forms that divide f by k give 1. E does not enter.
    assert set(shown["experts"]) == {experts} and set(shown["top_k"]) == {top_k}
    for column, balanced in {
        "aux_loss_top1": 1,
        "aux_loss_topk": top_k,
        "aux_loss_megatron": 1,
        "aux_loss_dispatched": top_k,
        "seq_aux_loss": 1,
    }.items():
        assert (shown[f"{column}_balanced"] == balanced).all(), column
    caption = " ".join(c.value for c in at.caption)
    for source in ("Switch Transformers", "GShard", "Megatron-Core", "DeepSeek-V3 sequence-wise", "ST-MoE"):
        assert source in caption, source


def test_collapse_reasons_are_shown_in_full_and_losses_are_the_librarys() -> None:
    from moeviz.analysis import CollapseThresholds, collapse_report

    at = run_page("pages/load.py", timeout_s=600, model=COLLAPSED, use_corpus=True)
    trace = corpus_trace(COLLAPSED)
    report = collapse_report(trace, CollapseThresholds())
    reasons = [r for lv in report.layers for r in lv.reasons]
    assert len(reasons) >= 4  # every layer of the collapsed sample has at least one reason on the corpus
    shown = "\n".join(m.value for m in at.markdown)
    missing = [r for r in reasons + [n for lv in report.layers for n in lv.notes] if f"- {r}" not in shown]
    assert not missing, missing  # each reason a bullet of its own, in full
    (table,) = [d.value for d in at.dataframe if "verdict" in d.value.columns]
    assert table["reasons"].tolist() == [len(lv.reasons) for lv in report.layers]  # counted, not cut
    assert_losses_are_the_librarys(at, trace, experts=8, top_k=2)


def test_balancing_losses_on_a_prompt_of_a_bias_router() -> None:
    import moeviz

    model = "sample:deepseek-v3-bias"
    at = run_page("pages/load.py", model=model)
    trace = moeviz.capture(moeviz.load_model(model), at.session_state["prompt"])
    # config.json: n_routed_experts 16, num_experts_per_tok 4 (and a balancing bias: dispatched ≠ top-k)
    assert_losses_are_the_librarys(at, trace, experts=16, top_k=4)
