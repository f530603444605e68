"""The Routing playground: switching the sidebar model from a sample to a 256-expert model
leaves no stale widget state behind; the aux loss's paradoxes are explained exactly when the numbers on the
page show them."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import moeviz
from moeviz.analysis.reroute import RerouteSettings, reroute_layer
from tests.support.app import app_test_env, run_page
from tests.support.scale_models import SHAPES, with_tokenizer
from tests.support.traces import expert_sets

SAMPLE = "sample:mixtral-healthy"
TEXT = "The quick brown fox jumps over the lazy dog, and then it runs back home."


@pytest.fixture(scope="module")
def scale_folder(tiny_model_dir):
    """A DeepSeek-V3-shaped model, 256 experts in 8 groups (4 blocks: the switch is tested, not the depth)."""
    shape = dict(SHAPES["deepseek-v3"], num_hidden_layers=4, first_k_dense_replace=1)
    return with_tokenizer(tiny_model_dir("deepseek_v3", **shape))


def _ok(at) -> None:
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]


def test_switching_to_256_experts_leaves_no_stale_widget_state(scale_folder, monkeypatch) -> None:
    app_test_env(monkeypatch)
    from components import access

    monkeypatch.setenv("MOEVIZ_MODEL_DIRS", str(scale_folder.parent))
    at = run_page("pages/playground.py", timeout_s=300, model=SAMPLE)
    assert at.number_input(key="pg_bias_0")  # the 8-expert page: one bias input per expert
    at.selectbox(key="model_choice").set_value(access.LOCAL_FOLDER).run()
    at.text_input(key="model_folder").set_value(str(scale_folder)).run()
    _ok(at)
    assert "256 experts" in at.caption[0].value
    k = at.slider(key="pg_k").value
    at.slider(key="pg_k").set_value(k - 1).run()  # two changes: the second one raised the KeyError
    _ok(at)
    at.slider(key="pg_temperature").set_value(2.0).run()
    _ok(at)
    at.slider(key="pg_k").set_value(k - 2).run()
    _ok(at)
    assert not [n for n in at.number_input if str(n.key).startswith("pg_bias_")]  # one table instead

    at.selectbox(key="model_choice").set_value(SAMPLE).run()  # and back: 8 inputs, from the sample's bias
    _ok(at)
    for value in (1, 2):
        at.slider(key="pg_k").set_value(value).run()
        _ok(at)
    assert [n.value for n in at.number_input if str(n.key).startswith("pg_bias_")] == [0.0] * 8


# ---- the aux loss's paradoxes, explained exactly when the numbers show them -----------------------------
DROPS = "Why is the aux loss below its balanced value?"
BIAS = "Why does the aux loss fall while the load gets worse?"


def _temperature_note(temperature: float) -> str:
    return f"Why does temperature {temperature:g} move no token?"


def _notes(at) -> set[str]:
    """The questions of the page's teaching points (bold, first in each)."""
    return {i.value.split("**")[1] for i in at.info if i.value.startswith("**Why")}


def _expected(trace, layer: int, settings: RerouteSettings) -> set[str]:
    """The notes the numbers of `settings` call for, each condition computed here from the re-routings (expert
    sets compared by hand, the captured P from the captured scores)."""
    routing = trace.layer(layer)
    mine = reroute_layer(trace, layer, settings)
    captured = reroute_layer(trace, layer, RerouteSettings.captured(routing))
    notes = set()
    if mine.dropped_slots and mine.aux_loss_dispatched < settings.k:
        notes.add(DROPS)
    same_p = np.array_equal(mine.scores.mean(axis=0), captured.scores.mean(axis=0))  # softmax: P = scores
    if (
        settings.bias is not None
        and np.any(settings.bias)
        and settings.k == routing.k
        and same_p
        and not mine.dropped_slots
        and mine.aux_loss_dispatched < captured.aux_loss_dispatched
        and mine.load.max() > captured.load.max()
    ):
        notes.add(BIAS)
    at_one = reroute_layer(trace, layer, dataclasses.replace(settings, temperature=1.0))
    if settings.temperature != 1.0 and expert_sets(mine.experts) == expert_sets(at_one.experts):
        notes.add(_temperature_note(settings.temperature))
    return notes


@pytest.fixture(scope="module")
def healthy():
    """(trace, the first MoE layer) of the mixtral sample on TEXT: a softmax router without a bias."""
    loaded = moeviz.load_model(SAMPLE)
    return moeviz.capture(loaded, TEXT), loaded.sites[0].layer


def _page(model: str, layer: int, monkeypatch):
    app_test_env(monkeypatch)
    return run_page("pages/playground.py", timeout_s=300, model=model, prompt=TEXT, layer=str(layer))


def test_notes_follow_their_conditions_on_a_softmax_router(healthy, monkeypatch) -> None:
    trace, layer = healthy
    routing = trace.layer(layer)
    captured = RerouteSettings.captured(routing)
    at = _page(SAMPLE, layer, monkeypatch)
    assert _notes(at) == set() == _expected(trace, layer, captured)

    at.slider(key="pg_temperature").set_value(2.0).run()  # softmax: the order of the logits is kept
    _ok(at)
    expected = _expected(trace, layer, dataclasses.replace(captured, temperature=2.0))
    assert _notes(at) == expected == {_temperature_note(2.0)}
    at.slider(key="pg_temperature").set_value(1.0).run()

    at.toggle(key="pg_capacity_on").set_value(True).run()  # then C = ceil(kT/E · ½): many slots dropped
    at.number_input(key="pg_cf").set_value(0.5).run()
    _ok(at)
    expected = _expected(trace, layer, dataclasses.replace(captured, capacity_factor=0.5))
    assert _notes(at) == expected == {DROPS}
    at.toggle(key="pg_capacity_on").set_value(False).run()

    # +1 on the expert of smallest P: every token takes it, its P stays small, the loss falls
    p = reroute_layer(trace, layer, captured).scores.mean(axis=0)
    for expert, paradox in ((int(np.argmin(p)), True), (int(np.argmax(p)), False)):
        bias = np.zeros(routing.num_experts, dtype=np.float32)
        bias[expert] = 1.0
        at.number_input(key=f"pg_bias_{expert}").set_value(1.0).run()
        _ok(at)
        expected = _expected(trace, layer, dataclasses.replace(captured, bias=bias))
        assert _notes(at) == expected and (BIAS in expected) == paradox
        at.number_input(key=f"pg_bias_{expert}").set_value(0.0).run()
    assert _notes(at) == set()


def test_temperature_moves_tokens_of_a_biased_router(monkeypatch) -> None:
    # DeepSeek-V3's sigmoid + bias within groups: flatter scores let the bias decide, tokens move, no note
    model = "sample:deepseek-v3-bias"
    loaded = moeviz.load_model(model)
    trace, layer = moeviz.capture(loaded, TEXT), loaded.sites[0].layer
    at = _page(model, layer, monkeypatch)
    at.slider(key="pg_temperature").set_value(5.0).run()
    _ok(at)
    settings = dataclasses.replace(RerouteSettings.captured(trace.layer(layer)), temperature=5.0)
    expected = _expected(trace, layer, settings)
    assert _notes(at) == expected and _temperature_note(5.0) not in expected
