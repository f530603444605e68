"""The checks every engine import passes (`moeviz.engines.checks`), against independent computations: the
first repeated row against `np.unique` per row, the range and all-zero refusals, the layer axis, and the
unrouted rows. No model: the layout facts are given as numbers."""

from __future__ import annotations

import numpy as np
import pytest

from moeviz.engines.checks import (
    check_expert_sets,
    first_repeated_row,
    layer_axis,
    unrouted_rows,
)
from moeviz.errors import EngineFormatError


def _distinct_rows(rng: np.random.Generator, n: int, k: int, e: int) -> np.ndarray:
    return np.argsort(rng.random((n, e)), axis=1)[:, :k].astype(np.int16)


def _where(row: int) -> str:
    return f"row {row}"


@pytest.mark.parametrize("k", [1, 2, 6, 8])
def test_first_repeated_row_equals_a_per_row_unique_count(k):
    rng = np.random.default_rng(k)
    ids = _distinct_rows(rng, 3000, k, 64)
    assert first_repeated_row(ids) is None
    if k == 1:
        return
    broken = rng.choice(3000, size=5, replace=False)
    for row in broken:
        i, j = rng.choice(k, size=2, replace=False)
        ids[row, i] = ids[row, j]
    expected = next(r for r in range(len(ids)) if len(np.unique(ids[r])) < k)
    assert first_repeated_row(ids) == expected == broken.min()


def test_first_repeated_row_finds_a_repeat_past_the_first_chunk(monkeypatch):
    import moeviz.engines.checks as checks

    monkeypatch.setattr(checks, "_CHUNK_ROWS", 7)
    ids = _distinct_rows(np.random.default_rng(0), 50, 4, 16)
    ids[33, 3] = ids[33, 0]
    assert first_repeated_row(ids) == 33


def test_ids_outside_the_experts_are_refused_with_the_row():
    ids = np.array([[0, 1], [2, 8], [3, 4]])
    with pytest.raises(EngineFormatError, match=r"row 1: expert ids \[2, 8\] outside \[0, 8\)"):
        check_expert_sets(ids, 8, _where)
    with pytest.raises(EngineFormatError, match=r"row 0: expert ids \[-1, 1\] outside"):
        check_expert_sets(np.array([[-1, 1], [2, 3]]), 8, _where)


def test_repeated_ids_are_refused_with_the_count_of_distinct_ones():
    ids = np.array([[0, 1, 2], [5, 5, 1]])
    with pytest.raises(EngineFormatError, match=r"row 1: 2 distinct expert ids of 3 \(\[5, 5, 1\]\)"):
        check_expert_sets(ids, 8, _where)


def test_an_all_zero_row_is_named_as_the_known_kernel_failure():
    ids = np.zeros((4, 8), np.uint8)
    with pytest.raises(EngineFormatError, match=r"row 0: all 8 expert ids are 0 .*vLLM issue #54730"):
        check_expert_sets(ids, 128, _where)


def test_top1_rows_are_always_distinct():
    check_expert_sets(np.zeros((5, 1), np.int32), 4, _where)  # k = 1: one id, nothing can repeat


def test_unrouted_rows_are_all_minus_one_only():
    ids = np.zeros((3, 2, 2), np.int16)
    ids[1] = -1
    ids[2, 0] = -1  # -1 in one layer only: not an unrouted row (the set check refuses it)
    np.testing.assert_array_equal(unrouted_rows(ids), [False, True, False])


def test_layer_axis_places_moe_layers_on_either_axis():
    moe = (1, 2, 3)
    ids = np.zeros((5, 4, 2), np.int16)  # every hidden layer; dense layer 0 written as 0
    assert layer_axis(ids, 4, moe, "f") == ([1, 2, 3], "hidden layers")
    ids[:, 0] = -1  # ... or as -1
    assert layer_axis(ids, 4, moe, "f") == ([1, 2, 3], "hidden layers")
    assert layer_axis(np.zeros((5, 3, 2)), 4, moe, "f") == ([0, 1, 2], "MoE layers")


def test_a_dense_layer_with_routing_or_a_wrong_layer_count_is_refused():
    moe = (1, 2, 3)
    ids = np.zeros((5, 4, 2), np.int16)
    ids[2, 0] = [3, 4]
    with pytest.raises(EngineFormatError, match=r"f: layer 0 is dense in the model, but the file routes"):
        layer_axis(ids, 4, moe, "f")
    # a row the engine did not run may hold anything there: only routed rows are checked
    routed = np.ones(5, bool)
    routed[2] = False
    assert layer_axis(ids, 4, moe, "f", routed=routed)[1] == "hidden layers"
    with pytest.raises(EngineFormatError, match=r"f: 6 layers on the layer axis; the model has 4 hidden"):
        layer_axis(np.zeros((5, 6, 2)), 4, moe, "f")
