"""The Lab page in-process (Streamlit AppTest): it renders with the defaults, a preset fills the controls, a
tiny run ends with the curves drawing exactly the runner's history and opens on the other pages, and the
server's limit of trainings shows the busy message. In the browser (Start grows the curve, Pause stops
it): tests/browser/test_app_browser_lab.py."""

from __future__ import annotations

import zipfile
from io import BytesIO

import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from moeviz.lab import PRESETS, LabConfig
from tests.support.app import app_test_env
from tests.support.lab_app import chart_frame, checked, lab_page

# a run of a few seconds: one layer, a narrow model, short sequences
TINY = {"experts": 4, "k": 2, "d_model": 16, "layers": 1, "batch": 2, "seq": 16, "steps": 6, "eval_every": 3}
RUN_TIMEOUT_S = 60


@pytest.fixture
def app_env(monkeypatch):
    app_test_env(monkeypatch)


def control(at: AppTest, field: str):
    return at.number_input(key=f"lab_{field}_widget")


def test_renders_with_the_defaults(app_env) -> None:
    at = lab_page(RUN_TIMEOUT_S)
    assert at.title[0].value.startswith("Lab")
    defaults = LabConfig()
    for field in ("experts", "k", "aux_coef", "z_coef", "bias_rate", "router_noise", "lr", "steps", "seed"):
        assert control(at, field).value == pytest.approx(getattr(defaults, field)), field
    assert at.toggle(key="lab_capacity_on_widget").value is (defaults.capacity_factor is not None)
    assert at.button(key="lab_pause").disabled and not at.button(key="lab_start").disabled


def test_a_preset_fills_the_controls(app_env) -> None:
    at = lab_page(RUN_TIMEOUT_S)
    control(at, "aux_coef").set_value(0.2)
    at.button(key="lab_preset_collapse").click()
    checked(at.run())
    collapse = PRESETS["collapse"]
    assert collapse.aux_coef < 0
    assert control(at, "aux_coef").value == pytest.approx(collapse.aux_coef)
    assert control(at, "experts").value == collapse.experts
    at.button(key="lab_preset_healthy").click()
    checked(at.run())
    assert control(at, "aux_coef").value == pytest.approx(PRESETS["healthy"].aux_coef)


def test_a_short_run_draws_the_runners_history_and_opens_on_the_other_pages(app_env) -> None:
    at = lab_page(RUN_TIMEOUT_S)
    for field, value in TINY.items():
        control(at, field).set_value(value)
    at.button(key="lab_start").click()
    checked(at.run())
    runner = at.session_state["lab_runner"]
    try:
        runner.join(RUN_TIMEOUT_S)  # its thread ends with the run
        assert runner.state == "done", runner.error
        checked(at.run())
        history, load = runner.snapshot()
        assert len(history) == TINY["steps"]
        pd.testing.assert_frame_equal(chart_frame(at, "Loss"), history, check_dtype=False)
        # the load entropy the Lab draws is the library's normalised one (1 = even, the dashed rule)
        assert history["load_entropy"].between(0, 1).all()
        (entropy,) = [
            c.proto.spec for c in at.get("vega_lite_chart") if '"text": "Load entropy"' in c.proto.spec
        ]
        assert '"datum":1.0' in entropy.replace(" ", "")
        shown = chart_frame(at, "Expert load, layer 0")[["step", "expert", "load"]]
        expected = load[load["layer"] == 0][["step", "expert", "load"]].reset_index(drop=True)
        pd.testing.assert_frame_equal(shown, expected, check_dtype=False)
        assert not at.button(key="lab_start").disabled  # unlocked for the next run

        with zipfile.ZipFile(BytesIO(_zip(runner))) as archive:
            assert "moeviz-lab-model/config.json" in archive.namelist()
        at.button(key="lab_open").click()  # the other pages open the trained model
        checked(at.run())
        (name,) = at.session_state["lab_models"]
        assert at.session_state["model"] == f"lab: {name}"
        at.switch_page("pages/load.py")
        checked(at.run())
        assert at.selectbox(key="model_choice").value == f"lab: {name}"
    finally:
        runner.stop()


def _zip(runner) -> bytes:
    from components import lab

    return lab.zip_bytes(runner)


def test_busy_server_shows_the_busy_message(app_env, monkeypatch) -> None:
    from moeviz.lab import runner

    monkeypatch.setattr(runner, "max_runs", lambda: 1)
    monkeypatch.setitem(runner._ACTIVE, -1, 0)  # the one slot taken by another session's run
    at = lab_page(RUN_TIMEOUT_S)
    at.button(key="lab_start").click()
    checked(at.run())
    assert "lab_runner" not in at.session_state
    assert any("busy" in w.value for w in at.warning), [w.value for w in at.warning]


def test_runners_of_gone_sessions_are_stopped(app_env, monkeypatch) -> None:
    """Streamlit has no session-end hook: a sweep stops the runners of a session disconnected for longer
    than Streamlit keeps it for a reconnect (its Lab run and its fine-tune), and forgets them; a connected
    session's runners are left alone."""
    from components import lab

    class Runner:
        stopped = False

        def stop(self, wait=None) -> None:
            self.stopped = True

    runners = {(session, kind): Runner() for session in ("gone", "here") for kind in ("lab", "finetune")}
    registry = {key: lab._Entry(runner, 0.0) for key, runner in runners.items()}
    monkeypatch.setattr(lab, "_REGISTRY", registry)
    monkeypatch.setattr(lab, "_connected", lambda session_id: session_id == "here")
    assert lab.sweep(now=lab.GRACE_S / 2) == [] and not any(r.stopped for r in runners.values())
    assert lab.sweep(now=lab.GRACE_S + 1) == ["gone"]
    stopped = [key for key, runner in runners.items() if runner.stopped]
    assert stopped == [("gone", "lab"), ("gone", "finetune")]
    assert list(lab._REGISTRY) == [("here", "lab"), ("here", "finetune")]


def test_the_page_shows_the_memory_a_run_needs_and_refuses_one_above_the_budget(app_env, monkeypatch) -> None:
    from moeviz.lab.budget import memory_estimate
    from moeviz.lab.data import lab_corpus

    at = lab_page(RUN_TIMEOUT_S)
    need = memory_estimate(LabConfig(), lab_corpus().vocab_size)
    assert any(f"≈ {need.total / 2**30:.2f} GiB" in c.value for c in at.caption), [
        c.value for c in at.caption
    ]
    monkeypatch.setenv("MOEVIZ_LAB_MEMORY_GIB", str(need.total / 2**30 / 2))
    at.button(key="lab_start").click()
    checked(at.run())
    assert "lab_runner" not in at.session_state
    assert any("the server allows" in w.value for w in at.warning), [w.value for w in at.warning]


def test_a_server_without_the_lab_says_so(app_env, monkeypatch) -> None:
    monkeypatch.setenv("MOEVIZ_LAB_MAX_RUNS", "0")
    at = lab_page(RUN_TIMEOUT_S)
    assert any("The Lab is disabled on this server" in i.value for i in at.info)
    assert not [b for b in at.button if b.key == "lab_start"]
