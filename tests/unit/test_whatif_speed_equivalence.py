"""The fast what-if simulators give exactly what their definitions give: `replay_capacity` and `simulate_ep`
against the loop-by-loop references of tests/support/whatif_reference.py on random routing (several
sequences of uneven length, slots the model dropped, tied weights, skewed experts). Integer counts must be
equal; floats equal too (they come from the same integer counts by the same operations)."""

from __future__ import annotations

import numpy as np
import pytest

from moeviz.whatif.capacity import replay_capacity
from moeviz.whatif.ep import EPConfig, fit_placement, simulate_ep
from moeviz.whatif.routes import LayerRoutes, Routes
from tests.support import whatif_reference as ref


def random_routes(seed: int, experts: int = 16, k: int = 4, lengths=(37, 1, 120, 64, 5)) -> Routes:
    """Skewed random routing: Zipf-like popularity, distinct experts per token, ~5% slots dropped (-1),
    weights on a coarse grid so that ties happen."""
    rng = np.random.default_rng(seed)
    n = sum(lengths)
    popularity = 1.0 / np.arange(1, experts + 1) ** 1.2
    layers = []
    for layer in range(3):
        keys = rng.random((n, experts)) ** (1.0 / rng.permutation(popularity))
        chosen = np.argsort(-keys, axis=1)[:, :k].astype(np.int64)
        chosen[rng.random((n, k)) < 0.05] = -1
        weights = (rng.integers(1, 6, (n, k)) / 8).astype(np.float32)
        weights[chosen < 0] = 0.0
        seq = np.repeat(np.arange(len(lengths)), lengths)
        pos = np.concatenate([np.arange(m) for m in lengths])
        layers.append(LayerRoutes(layer, "mlp", chosen, weights, seq, pos, experts))
    return Routes("random", layers)


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("group_tokens", [None, 50])
def test_capacity_replay_matches_the_reference(policy, exact, group_tokens) -> None:
    routes = random_routes(1)
    cfs = (1.25, 0.5, 1.0, 0.5, 2.0, 0.75)  # unsorted, with a repeat
    result = replay_capacity(routes, cfs, policy=policy, buckets=7, exact=exact, group_tokens=group_tokens)
    cfs = tuple(dict.fromkeys(cfs))  # a repeated CF is replayed once
    layers, experts, positions = result.layers_frame(), result.experts_frame(), result.position_frame()
    want_assigned = np.zeros((len(cfs), 7), dtype=np.int64)
    want_dropped = np.zeros((len(cfs), 7), dtype=np.int64)
    for layer in routes.layers:
        want = ref.capacity_replay(layer, cfs, policy, 7, exact, group_tokens)
        got = layers[layers.layer == layer.layer].to_dict("records")
        assert got == want["layers"]
        for ci, cf in enumerate(cfs):
            rows = experts[(experts.layer == layer.layer) & (experts.cf == cf)].iloc[: layer.num_experts]
            assigned, dropped = want["experts"][float(cf)]
            np.testing.assert_array_equal(rows.assigned.to_numpy(), assigned)
            np.testing.assert_array_equal(rows.dropped.to_numpy(), dropped)
            want_assigned[ci] += want["positions"][float(cf)][0]
            want_dropped[ci] += want["positions"][float(cf)][1]
    np.testing.assert_array_equal(positions.assigned.to_numpy(), want_assigned.reshape(-1))
    np.testing.assert_array_equal(positions.dropped.to_numpy(), want_dropped.reshape(-1))
    assert layers.dropped.sum() > 0 and (layers.tokens_all_dropped > 0).any()  # the test has teeth


@pytest.mark.parametrize(
    "config",
    [
        EPConfig(gpus=4, gpus_per_node=2),
        EPConfig(gpus=4, gpus_per_node=2, redundant=4, placement="eplb", expert_flops_per_token=1e9),
        EPConfig(
            gpus=4, gpus_per_node=2, redundant=8, placement="eplb", replica="vllm", source="round-robin"
        ),
        EPConfig(gpus=8, gpus_per_node=4, redundant=8, placement="traffic", message_dtype="fp8"),
    ],
    ids=["contiguous", "eplb-even", "eplb-vllm", "traffic"],
)
def test_expert_parallelism_matches_the_reference(config) -> None:
    routes = random_routes(2)
    placement = fit_placement(routes, config)
    result = simulate_ep(routes, config, placement)
    frame = result.layers_frame()
    for i, layer in enumerate(routes.layers):
        want = ref.ep_layer(layer, placement.phy2log[i], config)
        np.testing.assert_array_equal(result.gpu_load[i], want.pop("gpu_load"))
        got = frame.iloc[i].to_dict()
        assert got.keys() == want.keys()
        for key, value in want.items():
            if isinstance(value, float) and np.isnan(value):
                assert np.isnan(got[key]), key
            else:
                assert got[key] == value, key
    assert frame.dispatch_bytes_inter.sum() > 0
