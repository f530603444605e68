"""Expert axis orderings (id, load, co-activation PC1) and the top-N filter, on hand-made cases."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from moeviz.analysis.expert_order import (
    coactivation_pc1,
    expert_counts,
    expert_options,
    expert_order,
    top_experts,
)


def balance_rows(counts_by_layer: dict[int, list[int]]) -> pd.DataFrame:
    return pd.concat(
        [
            pd.DataFrame({"layer": layer, "site": "mlp", "expert": np.arange(len(c)), "count": c})
            for layer, c in counts_by_layer.items()
        ],
        ignore_index=True,
    )


def block_matrix(blocks: list[list[int]], e: int, inside: float = 10.0, noise: float = 0.0) -> np.ndarray:
    rng = np.random.default_rng(0)
    m = rng.uniform(0, noise, (e, e)) if noise else np.zeros((e, e))
    for block in blocks:
        m[np.ix_(block, block)] += inside
    return (m + m.T) / 2


def test_order_by_id_and_by_load():
    counts = np.array([5, 9, 0, 9, 2])
    assert expert_order(counts).tolist() == [0, 1, 2, 3, 4]
    assert expert_order(counts, by="load").tolist() == [1, 3, 0, 4, 2]  # ties by id
    frame = balance_rows({1: [5, 0, 0, 1], 2: [0, 3, 3, 1]})  # summed over layers: 5, 3, 3, 2
    assert expert_order(frame, by="load").tolist() == [0, 1, 2, 3]
    assert expert_counts(frame).tolist() == [5, 3, 3, 2]


def test_pc1_separates_interleaved_blocks():
    blocks = [[0, 2, 4, 6], [1, 3, 5, 7]]
    order = expert_order(np.ones(8), by="coactivation", coactivation=block_matrix(blocks, 8))
    assert sorted(order[:4].tolist()) == blocks[0]  # deterministic sign: expert 0's block first
    assert sorted(order[4:].tolist()) == blocks[1]
    # noise and unequal loads do not break the separation
    noisy = block_matrix(blocks, 8, noise=2.0)
    order = expert_order(np.arange(8), by="coactivation", coactivation=noisy)
    assert sorted(order[:4].tolist()) == blocks[0]


def test_pc1_on_three_unequal_blocks_keeps_each_block_contiguous():
    e = 24
    perm = np.random.default_rng(3).permutation(e)
    blocks = [sorted(perm[:4].tolist()), sorted(perm[4:12].tolist()), sorted(perm[12:].tolist())]
    order = expert_order(np.ones(e), by="coactivation", coactivation=block_matrix(blocks, e, noise=0.5))
    where = {int(x): i for i, x in enumerate(order)}
    for block in blocks:
        positions = sorted(where[x] for x in block)
        assert positions[-1] - positions[0] == len(block) - 1, (block, positions)


def test_pc1_sign_and_frame_input_are_deterministic():
    m = block_matrix([[0, 1, 2], [3, 4, 5, 6]], 7, noise=1.0)
    pc1 = coactivation_pc1(m)
    assert pc1[np.flatnonzero(pc1)[0]] < 0
    np.testing.assert_allclose(coactivation_pc1(3 * m), 3 * pc1)  # same sign whatever the scale
    e = m.shape[0]
    frame = pd.DataFrame(
        {
            "expert": np.repeat(np.arange(e), e),
            "co_expert": np.tile(np.arange(e), e),
            "pair_count": m.reshape(-1),
        }
    )
    counts = np.ones(e)
    assert (
        expert_order(counts, by="coactivation", coactivation=frame).tolist()
        == expert_order(counts, by="coactivation", coactivation=m).tolist()
    )


def test_degenerate_coactivation_falls_back_to_load_then_id():
    order = expert_order(np.array([1, 4, 4, 0]), by="coactivation", coactivation=np.zeros((4, 4)))
    assert order.tolist() == [1, 2, 0, 3]


def test_top_experts_filters_by_total_load():
    frame = balance_rows({1: [5, 0, 0, 1, 7], 2: [0, 3, 3, 1, 0]})  # totals 5, 3, 3, 2, 7
    top = top_experts(frame, 2)
    assert sorted(top["expert"].unique().tolist()) == [0, 4]
    assert len(top) == 4 and top.index.is_monotonic_increasing  # both layers, frame order kept
    assert sorted(top_experts(frame, 3)["expert"].unique().tolist()) == [0, 1, 4]  # tie 1/2 → lower id
    assert len(top_experts(frame, 0)) == 0
    assert set(top_experts(frame, 99)["expert"]) == set(range(5))


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown expert order"):
        expert_order(np.ones(3), by="random")
    with pytest.raises(ValueError, match="needs the co-activation"):
        expert_order(np.ones(3), by="coactivation")
    with pytest.raises(ValueError, match="square"):
        expert_order(np.ones(3), by="coactivation", coactivation=np.ones((3, 2)))
    with pytest.raises(ValueError, match="n must be"):
        top_experts(balance_rows({1: [1, 2]}), -1)


def test_expert_options_label_each_expert_with_its_load():
    options = expert_options(np.array([2, 0, 6]))
    assert list(options.values()) == [2, 0, 1]
    assert list(options) == ["2 · 6 slots · 2.25× fair", "0 · 2 slots · 0.75× fair", "1 · 0 slots · dead"]
    assert list(expert_options(np.array([2, 0, 6]), order=np.array([1, 0])).values()) == [1, 0]
