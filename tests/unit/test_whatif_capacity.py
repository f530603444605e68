"""Capacity-factor replay: Megatron's rounding, hand-computed drops for both policies, and an independent
per-expert loop on random routes."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moeviz.errors import InputError
from moeviz.whatif.capacity import expert_capacity, replay_capacity
from tests.support.traces import make_routes


def test_capacity_rounding():
    assert expert_capacity(440, 2, 8, 1.1) == 122  # Megatron's float order lands one above
    assert expert_capacity(440, 2, 8, 1.1, exact=True) == 121
    assert expert_capacity(4, 2, 4, 1.0) == 2
    assert expert_capacity(5, 2, 4, 1.0) == 3  # 2.5 → 3
    assert expert_capacity(1, 2, 64, 1.0) == 1  # a decode step: ceil of anything positive ≥ 1
    assert expert_capacity(3, 1, 3, 1.25) == 2


# Hand-computed: one seq of 4 tokens, k = 2, E = 4, CF = 1.0 → C = ceil(4·2/4·1) = 2.
# Expert 0 is chosen by tokens 0 (w .6), 1 (w .5), 2 (w .6), 3 (w .9); everyone else fits.
#   probs:    keep 3 (.9), then the tie .6 goes to the earlier token 0 → drop tokens 1, 2 at expert 0
#   position: keep tokens 0, 1 → drop tokens 2, 3 at expert 0
EXPERTS = [[0, 1], [0, 2], [0, 3], [0, 1]]
WEIGHTS = [[0.6, 0.4], [0.5, 0.5], [0.6, 0.4], [0.9, 0.1]]


@pytest.mark.parametrize(("policy", "dropped_tokens"), [("probs", {1, 2}), ("position", {2, 3})])
def test_hand_computed(policy, dropped_tokens):
    result = replay_capacity(
        make_routes([EXPERTS], 4, weights=[WEIGHTS], seq=[0, 0, 0, 0]), cfs=[1.0], policy=policy, buckets=4
    )
    row = result.layers_frame().iloc[0]
    assert row.capacity == 2 and row.dropped == 2 and row.dropped_fraction == pytest.approx(2 / 8)
    assert row.overflowing_experts == 1 and row.tokens_all_dropped == 0
    experts = result.experts_frame().set_index("expert")
    assert experts.loc[0, "dropped"] == 2 and experts.loc[0, "assigned"] == 4
    positions = result.position_frame().set_index("bucket")
    for t in range(4):  # one token per bucket, two slots each
        assert positions.loc[t, "drop_rate"] == pytest.approx(0.5 if t in dropped_tokens else 0.0)
    assert result.to_json()["layers"] == [
        {"layer": 0, "cf": 1.0, "policy": policy, "capacity": 2, "dropped_fraction": 0.25}
    ]


def test_tie_within_a_token_is_slot_order_and_all_dropped_tokens():
    # k = 2, E = 2, CF = 0.5 → C = ceil(3·2/2·0.5) = 2 per expert; tokens 0,1 take both slots of both experts,
    # so token 2 is dropped entirely under position; under probs it keeps nothing either (weights lowest).
    experts = [[0, 1], [1, 0], [0, 1]]
    weights = [[0.5, 0.5], [0.5, 0.5], [0.1, 0.1]]
    for policy in ("position", "probs"):
        result = replay_capacity(
            make_routes([experts], 2, weights=[weights], seq=[0, 0, 0]), cfs=[0.5], policy=policy
        )
        row = result.layers_frame().iloc[0]
        assert row.capacity == 2 and row.dropped == 2 and row.tokens_all_dropped == 1


def test_model_dropped_slots_are_not_replay_drops():
    experts = [[0, -1], [-1, -1], [0, 1]]
    weights = [[1.0, 0.0], [0.0, 0.0], [0.7, 0.3]]
    result = replay_capacity(make_routes([experts], 2, weights=[weights], seq=[0, 0, 0]), cfs=[100.0])
    row = result.layers_frame().iloc[0]
    assert row.assigned == 3 and row.dropped == 0 and row.tokens_all_dropped == 0


def reference_drops(experts, weights, seqs, num_experts, cf, policy):
    """Per seq, per expert: gather its assignments, sort by the policy, drop past capacity."""
    k = experts.shape[1]
    dropped = np.zeros(experts.shape, dtype=bool)
    for s in np.unique(seqs):
        rows = np.flatnonzero(seqs == s)
        cap = math.ceil((len(rows) * k / num_experts) * cf)
        for e in range(num_experts):
            slots = [(t, j) for t in rows for j in range(k) if experts[t, j] == e]
            if policy == "probs":
                slots.sort(key=lambda tj: (-float(weights[tj]), tj[0], tj[1]))
            for t, j in slots[cap:]:
                dropped[t, j] = True
    return dropped


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("seed", range(4))
def test_equals_per_expert_loop(policy, seed):
    rng = np.random.default_rng(seed)
    num_experts, k, n = int(rng.integers(2, 9)), 2, 120
    experts = np.stack([rng.choice(num_experts, size=k, replace=False) for _ in range(n)])
    experts[rng.random((n, k)) < 0.05] = -1
    weights = np.round(rng.random((n, k)), 1).astype(np.float32)  # coarse: many ties
    seqs = np.sort(rng.integers(0, 5, n))
    routes = make_routes([experts, experts[::-1]], num_experts, weights=[weights, weights[::-1]], seq=seqs)
    cfs = [0.5, 1.0, 1.25, 2.0]
    result = replay_capacity(routes, cfs=cfs, policy=policy, buckets=3)
    frame = result.layers_frame().set_index(["layer", "cf"])
    for li, (ex, w) in enumerate([(experts, weights), (experts[::-1], weights[::-1])]):
        for cf in cfs:
            ref = reference_drops(ex, w, seqs, num_experts, cf, policy)
            assert frame.loc[(li, cf), "dropped"] == ref.sum()
            kept = ((ex >= 0) & ~ref).sum(1)
            assert frame.loc[(li, cf), "tokens_all_dropped"] == np.sum(((ex >= 0).sum(1) > 0) & (kept == 0))
            per_expert = result.experts_frame().query("layer == @li and cf == @cf")["dropped"].to_numpy()
            assert per_expert.tolist() == [int(ref[ex == e].sum()) for e in range(num_experts)]


def test_decode_steps_never_drop_and_large_cf_never_drops():
    rng = np.random.default_rng(1)
    n, num_experts = 50, 8
    experts = np.stack([rng.choice(num_experts, size=2, replace=False) for _ in range(n)])
    weights = rng.random((n, 2)).astype(np.float32)
    single = make_routes(
        [experts], num_experts, weights=[weights], seq=np.arange(n)
    )  # every seq one token: T = 1
    assert replay_capacity(single, cfs=[0.01, 1.0]).layers_frame()["dropped"].sum() == 0
    one = make_routes([experts], num_experts, weights=[weights], seq=np.zeros(n, dtype=int))
    assert replay_capacity(one, cfs=[num_experts / 2]).layers_frame()["dropped"].sum() == 0


def test_bad_inputs():
    routes = make_routes([EXPERTS], 4, weights=[WEIGHTS], seq=[0, 0, 0, 0])
    with pytest.raises(InputError, match="drop policy"):
        replay_capacity(routes, policy="random")
    with pytest.raises(InputError, match="positive"):
        replay_capacity(routes, cfs=[0.0])
