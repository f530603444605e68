"""The Routing playground's bias table (over 20 experts: one table instead of an input per expert) refuses a
cell that is not a finite number with one message naming the expert and what was typed (NaN, text, an
empty cell, Infinity), not "expected 24 finite numbers, got shape [24]"; `parse_bias` is what it calls."""

from __future__ import annotations

import math

import pytest

from moeviz.analysis.reroute import parse_bias
from moeviz.errors import InputError
from tests.support.app import local_tiny_model, run_page

EXPERTS = 24  # over MAX_CATEGORICAL (20): the page draws the table


@pytest.fixture
def table_page(tiny_model_dir, monkeypatch):
    """The playground on a 24-expert Mixtral, and the key of its bias table."""
    local_tiny_model(tiny_model_dir, monkeypatch, "mixtral", num_local_experts=EXPERTS)
    at = run_page("pages/playground.py", timeout_s=180)
    editors = [e for e in at.data_editor if str(e.key).startswith("pg_bias_table_")]
    assert len(editors) == 1 and len(editors[0].value) == EXPERTS
    return at, editors[0].key


def _typed(at, key: str, expert: int, value) -> None:
    """A cell of the table edited as the browser sends it (the raw value; Streamlit reads text that is not
    a number as NaN)."""
    at.session_state[key] = {"edited_rows": {expert: {"bias": value}}, "added_rows": [], "deleted_rows": []}
    at.run()
    assert not at.exception, [e.value for e in at.exception]


@pytest.mark.parametrize(
    ("typed", "message"),
    [
        ("abc", "bias of expert 17: 'abc' is not a finite number"),
        ("NaN", "bias of expert 17: 'NaN' is not a finite number"),
        ("Infinity", "bias of expert 17: 'Infinity' is not a finite number"),
        (None, "bias of expert 17 is empty"),
    ],
)
def test_a_bad_cell_is_named_by_expert_and_value(table_page, typed, message):
    at, key = table_page
    _typed(at, key, 17, typed)
    errors = [e.value for e in at.error]
    assert len(errors) == 1 and errors[0].startswith(message), errors
    assert "shape" not in errors[0]


def test_a_number_typed_as_text_is_taken(table_page):
    at, key = table_page
    _typed(at, key, 17, "0.5")
    assert not at.error, [e.value for e in at.error]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ([0.0, float("nan"), 1.0], "bias of expert 1: nan is not a finite number"),
        ([0.0, 1.0, -math.inf], "bias of expert 2: -inf is not a finite number"),
        ([0.0, "x", 1.0], "bias of expert 1: 'x' is not a finite number"),
        ([0.0, 1.0, ""], "bias of expert 2 is empty"),
        ([True, 0.0, 1.0], "bias of expert 0: True is not a finite number"),
        ([0.0, 1.0], "bias: expected one number per expert (3), got 2"),
    ],
)
def test_parse_bias_names_the_first_bad_value(values, message):
    with pytest.raises(InputError) as info:
        parse_bias(values, 3)
    assert str(info.value).startswith(message), str(info.value)


def test_parse_bias_reads_numbers_and_numeric_text():
    assert parse_bias([0, -0.25, " 1e-3 ", "2"], 4) == [0.0, -0.25, 0.001, 2.0]
