"""The Lab page's fine-tune section in-process (Streamlit AppTest): a two-mode fine-tune draws exactly the
runner's histories, its side-by-side table is the library's summary of them, and a fine-tuned model opens in
the model picker from a folder `moeviz.load_model` reopens with the fine-tuned weights; a LoRA rank too
large for the router and an empty text are refused with one line each."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from streamlit.testing.v1 import AppTest

import moeviz
from moeviz.lab.finetune import MODE_LABELS, finetune_summary
from tests.support.app import app_test_env
from tests.support.lab_app import chart_frame, checked, lab_page

RUN_TIMEOUT_S = 120


@pytest.fixture
def app_env(monkeypatch):
    app_test_env(monkeypatch)


def _number(at: AppTest, field: str):
    return at.number_input(key=f"ft_{field}_widget")


def test_a_two_mode_fine_tune_draws_its_histories_and_opens_on_the_other_pages(app_env) -> None:
    at = lab_page(RUN_TIMEOUT_S)
    at.multiselect(key="ft_modes_widget").set_value(["router", "lora"])
    _number(at, "steps").set_value(2)
    _number(at, "lora_rank").set_value(4)
    at.button(key="ft_go").click()
    checked(at.run())
    runner = at.session_state["ft_runner"]
    try:
        runner.join(RUN_TIMEOUT_S)
        assert runner.state == "done", runner.error
        checked(at.run())
        results = runner.results()
        assert [r.config.mode for r in results] == ["router", "lora"]
        assert all(r.config.steps == 2 and r.config.lora_rank == 4 for r in results)
        shown = chart_frame(at, "New-domain loss")
        for result in results:
            drawn = shown[shown["run"] == MODE_LABELS[result.config.mode]]
            expected = result.history.dropna(subset=["new_loss"])
            assert drawn["step"].tolist() == expected["step"].tolist()
            assert drawn["value"].tolist() == pytest.approx(expected["new_loss"].tolist())
        (table,) = [d.value for d in at.dataframe if "kept balance" in d.value.columns]
        expected = finetune_summary(results).drop(columns="mode").round(4)
        pd.testing.assert_frame_equal(table.reset_index(drop=True), expected, check_dtype=False)

        at.button(key="ft_open_lora").click()
        checked(at.run())
        name = "ft 1 · LoRA"
        assert at.session_state["model"] == f"lab: {name}"
        folder = at.session_state["lab_models"][name]
        reopened = moeviz.load_model(folder, dtype="float32", device="cpu").model
        merged = runner.runs[1].plain_model()
        theirs = dict(reopened.named_parameters())
        assert all(torch.equal(p, theirs[n]) for n, p in merged.named_parameters())
        at.switch_page("pages/load.py")
        checked(at.run())
        assert at.selectbox(key="model_choice").value == f"lab: {name}"
    finally:
        runner.stop()


def test_a_rank_too_large_and_an_empty_text_are_one_line_each(app_env) -> None:
    at = lab_page(RUN_TIMEOUT_S)
    at.multiselect(key="ft_modes_widget").set_value(["lora"])
    _number(at, "lora_rank").set_value(9)  # the router is 8 × 128
    at.button(key="ft_go").click()
    checked(at.run())
    assert "ft_runner" not in at.session_state
    (warning,) = [w.value for w in at.warning if "LoRA rank" in w.value]
    assert warning == "fine-tune: LoRA rank 9 is larger than the router (8 × 128) allows: at most 8"

    at.selectbox(key="ft_domain_widget").set_value("your text")
    at.run()
    errors = [e.value for e in at.error]
    assert errors == ["fine-tune: the text to fine-tune on is empty"]
    assert at.button(key="ft_go").disabled
