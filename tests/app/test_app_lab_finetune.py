"""The Lab page's fine-tune section in-process (Streamlit AppTest): a two-mode fine-tune draws exactly the
runner's histories, its side-by-side table is the library's summary of them, and a fine-tuned model opens in
the model picker from a folder `moeviz.load_model` reopens with the fine-tuned weights; a LoRA rank too
large for the router and an empty text are refused with one line each; a fine-tune pauses and resumes from
the page, ends when paused past the pause limit (its note shown, its training state released), and the Lab's
janitor stops the fine-tune of a session gone."""

from __future__ import annotations

import time

import pandas as pd
import pytest
import torch
from streamlit.testing.v1 import AppTest

import moeviz
from moeviz.lab.finetune import MODE_LABELS, finetune_summary
from moeviz.lab.runner import active_runs
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


def _long_fine_tune(at: AppTest):
    """A router-only fine-tune of 5,000 steps started from the page (it runs until stopped)."""
    at.multiselect(key="ft_modes_widget").set_value(["router"])
    _number(at, "steps").set_value(5000)
    at.button(key="ft_go").click()
    checked(at.run())
    return at.session_state["ft_runner"]


def _wait_for(condition, timeout: float = RUN_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _buttons(at: AppTest) -> dict[str, bool]:
    """Which of the fine-tune's buttons are enabled."""
    return {key: not at.button(key=f"ft_{key}").disabled for key in ("go", "pause", "resume", "stop")}


def test_a_fine_tune_pauses_resumes_and_ends_when_paused_past_the_limit(app_env) -> None:
    at = lab_page(RUN_TIMEOUT_S)
    runner = _long_fine_tune(at)
    try:
        assert _buttons(at) == {"go": False, "pause": True, "resume": False, "stop": True}
        _wait_for(lambda: runner.steps_done >= 1)
        at.button(key="ft_pause").click()
        checked(at.run())
        assert runner.state == "paused" and active_runs() == 1  # a paused fine-tune keeps its slot
        _wait_for(runner._parked.is_set)
        frozen = runner.steps_done
        assert _buttons(at) == {"go": False, "pause": False, "resume": True, "stop": True}
        time.sleep(0.3)
        assert runner.steps_done == frozen  # parked: no step runs
        at.button(key="ft_resume").click()
        checked(at.run())
        _wait_for(lambda: runner.steps_done > frozen)
        assert runner.state == "running"

        runner.pause_limit = 0.2  # a pause past the limit ends the fine-tune
        at.button(key="ft_pause").click()
        checked(at.run())
        runner.join(RUN_TIMEOUT_S)
        checked(at.run())
        assert runner.state == "stopped" and active_runs() == 0
        assert [i.value for i in at.info if "paused" in i.value] == [runner.note]
        assert "released" in runner.note
        assert runner.run.optimizer is None and all(p.grad is None for p in runner.run.model.parameters())
        assert _buttons(at) == {"go": True, "pause": False, "resume": False, "stop": False}
    finally:
        runner.stop()


def test_the_janitor_stops_the_fine_tune_of_a_session_gone(app_env, monkeypatch) -> None:
    """A fine-tune is in the Lab janitor's care, as a Lab run is: once its session has been gone for longer
    than Streamlit waits for a reconnect, the sweep stops it and its slot comes back."""
    from components import lab

    at = lab_page(RUN_TIMEOUT_S)
    runner = _long_fine_tune(at)
    try:
        (session, kind), *others = [key for key, entry in lab._REGISTRY.items() if entry.runner is runner]
        assert kind == "finetune" and not others
        _wait_for(lambda: runner.steps_done >= 1)
        monkeypatch.setattr(lab, "_connected", lambda session_id: session_id != session)
        assert lab.sweep(now=time.monotonic() + lab.GRACE_S / 2) == [] and runner.state == "running"
        assert lab.sweep(now=time.monotonic() + lab.GRACE_S + 1) == [session]
        runner.join(RUN_TIMEOUT_S)
        assert runner.state == "stopped" and active_runs() == 0
        assert runner.run.optimizer is None
        assert all(entry.runner is not runner for entry in lab._REGISTRY.values())
    finally:
        runner.stop()
