"""The deployment what-ifs in the library: the smallest capacity factor that drops less
than a share, a dispatch group of N tokens, the shuffled fit/evaluate split, the hit-rate curve's bytes and
the EP time model's stated lack of a per-message latency. Each against a computation of its own."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moeviz.errors import InputError
from moeviz.trace import ExpertLoad, ModelInfo
from moeviz.whatif.capacity import replay_capacity, smallest_cf
from moeviz.whatif.ep import DEFINITION, split_load_steps
from moeviz.whatif.offload import hit_rate_curve, simulate_offload
from tests.support.traces import make_routes


def skewed_routes(tokens: int = 600, experts: int = 8, k: int = 2, sequences: int = 6, seed: int = 0):
    """Two layers of top-k routing skewed towards low expert ids (so capacity drops), `sequences` sequences
    of equal length, with random combination weights."""
    rng = np.random.default_rng(seed)
    p = np.linspace(3.0, 1.0, experts)
    p /= p.sum()
    layers = [
        np.stack([rng.choice(experts, size=k, replace=False, p=p) for _ in range(tokens)]) for _ in range(2)
    ]
    weights = [rng.random((tokens, k)).astype(np.float32) for _ in layers]
    return make_routes(
        layers, experts, weights=weights, seq=np.repeat(np.arange(sequences), tokens // sequences)
    )


def pooled_drop(routes, cf: float, **kwargs) -> float:
    """The share of all assignments `replay_capacity` drops at `cf` (every layer pooled)."""
    frame = replay_capacity(routes, [cf], **kwargs).layers_frame()
    return frame["dropped"].sum() / frame["assigned"].sum()


def by_hand_drops(routes, cf: float, group_tokens: int) -> int:
    """Slots dropped with dispatch groups of `group_tokens` consecutive rows, counted cell by cell:
    Σ_(group, expert) max(0, assigned − ceil(T_g·k/E·cf)) (Megatron's float order)."""
    dropped = 0
    for layer in routes.layers:
        for start in range(0, layer.tokens, group_tokens):
            rows = layer.experts[start : start + group_tokens]
            capacity = math.ceil((len(rows) * layer.k / layer.num_experts) * cf)
            counts = np.bincount(rows[rows >= 0], minlength=layer.num_experts)
            dropped += int(np.maximum(counts - capacity, 0).sum())
    return dropped


@pytest.mark.parametrize("group_tokens", [None, 64])
@pytest.mark.parametrize("exact", [False, True])
def test_smallest_cf_is_the_first_grid_cf_whose_replay_drops_less(group_tokens, exact) -> None:
    """Walking the grid CF = 0.01·i upwards with `replay_capacity` until the pooled drop share is below x
    finds the CF `smallest_cf` reports, and the grid point below it drops at least x."""
    routes = skewed_routes()
    for max_drop in (0.05, 0.01):
        found = smallest_cf(routes, max_drop, group_tokens=group_tokens, exact=exact)
        options = dict(group_tokens=group_tokens, exact=exact)
        i = 1
        while pooled_drop(routes, round(i * 0.01, 10), **options) >= max_drop:
            i += 1
        assert found.cf == pytest.approx(i * 0.01)
        assert found.dropped_fraction == pytest.approx(pooled_drop(routes, found.cf, **options))
        assert found.below_cf == pytest.approx((i - 1) * 0.01)
        assert found.below_dropped_fraction >= max_drop
        assert f"{found.cf:g}" in found.readout and f"< {max_drop:.2%}" in found.readout


def test_smallest_cf_refuses_a_share_nothing_can_reach() -> None:
    with pytest.raises(InputError, match="nothing drops less than 0"):
        smallest_cf(skewed_routes(), 0.0)


def test_a_dispatch_group_of_n_tokens_drops_what_its_cells_overflow() -> None:
    """With groups of 64 consecutive tokens (sequences of 100 packed across group edges) the replay drops,
    per CF, what the cells of those groups overflow counted by hand; one sequence per group differs."""
    routes = skewed_routes()
    for cf in (0.75, 1.0, 1.5):
        frame = replay_capacity(routes, [cf], group_tokens=64).layers_frame()
        assert int(frame["dropped"].sum()) == by_hand_drops(routes, cf, 64)
    result = replay_capacity(routes, [1.0], group_tokens=64)
    assert "a batch of 64 consecutive tokens" in result.definition and result.to_json()["group_tokens"] == 64
    assert (
        "group_tokens" not in replay_capacity(routes, [1.0]).to_json()
    )  # the CLI's default JSON is unchanged


def test_the_fit_part_is_drawn_at_random_with_a_seed_and_named() -> None:
    """The shuffled split's fit sequences are numpy's default_rng(seed).permutation's first half (not the
    first sequences, which in a corpus are the first domains); the two parts share none and cover all."""
    routes = skewed_routes(tokens=1200, sequences=12)
    fit, rest, how = routes.split(0.5)
    drawn = np.sort(np.random.default_rng(0).permutation(np.arange(12))[:6])
    assert np.unique(fit.layers[0].seq).tolist() == drawn.tolist() != list(range(6))
    assert set(np.unique(rest.layers[0].seq)) == set(range(12)) - set(drawn.tolist())
    assert how == "fitted on 6 of 12 sequences drawn at random (seed 0), evaluated on the other 6"
    assert np.unique(routes.split(0.5, seed=1)[0].layers[0].seq).tolist() != drawn.tolist()
    first, _, ordered = routes.split(0.5, order="ordered")
    assert np.unique(first.layers[0].seq).tolist() == list(range(6)) and "in order" in ordered


def test_a_load_tables_steps_are_split_the_same_way() -> None:
    counts = np.arange(10 * 1 * 4).reshape(10, 1, 4)
    info = ModelInfo(source="engine-model", model_type="test", architecture="test", num_layers=1)
    load = ExpertLoad(model=info, counts=counts, layers=[0], top_k=2, source="sglang-dump")
    fit, rest, how = split_load_steps(load, 0.5)
    drawn = np.sort(np.random.default_rng(0).permutation(np.arange(10))[:5])
    assert fit.steps == [str(i) for i in drawn] and np.array_equal(fit.counts, counts[drawn])
    assert sorted(fit.steps + rest.steps, key=int) == [str(i) for i in range(10)]
    assert "steps of the load table drawn at random (seed 0)" in how


def test_the_hit_rate_curve_bytes_are_misses_times_the_expert_bytes() -> None:
    """bytes = misses × one expert's bytes (it held the miss count: expert_bytes defaulted to 1), equal to
    `simulate_offload`'s bytes at the same cache; no bytes column when the expert bytes are not given."""
    routes = skewed_routes()
    curve = hit_rate_curve(routes, [2, 4], policies=("lru",), expert_bytes=3_000_000)
    for row in curve.itertuples():
        one = simulate_offload(routes, row.cache, "lru", expert_bytes=3_000_000)
        assert row.bytes == int(one.layers_frame()["bytes"].sum()) == row.misses * 3_000_000
    assert "bytes" not in hit_rate_curve(routes, [2], policies=("lru",)).columns


def test_the_ep_time_model_says_it_has_no_per_message_latency() -> None:
    assert "no per-message latency" in DEFINITION
