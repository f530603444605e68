"""Offloading cache: the vectorised simulator against a plain per-step reference, hand-worked sequences,
and Belady against an exhaustive search."""

from __future__ import annotations

import functools
import itertools
import math

import numpy as np
import pytest

from moeviz.errors import InputError
from moeviz.whatif.offload import POLICIES, hit_rate_curve, simulate_offload
from moeviz.whatif.routes import Routes
from tests.support.traces import make_layer_routes, make_routes


def steps_routes(layers: list[list[list[list[int]]]], experts: int) -> Routes:
    """Routes of layers[l][seq][step] = that token's expert list (-1 = dropped slot), the shape the per-step
    reference reads; all lists of one width k."""
    out = []
    for li, seqs in enumerate(layers):
        steps = [(s, e) for s, seq_steps in enumerate(seqs) for e in seq_steps]
        out.append(make_layer_routes([e for _, e in steps], experts, layer=li, seq=[s for s, _ in steps]))
    return make_routes(out)


def reference(steps: list[list[int]], cache: int, policy: str) -> list[int]:
    """Plain per-step simulation of one seq: misses at each step. Obviously correct, slow."""
    needs = [sorted({e for e in s if e >= 0}) for s in steps]
    resident: list[int] = []
    last: dict[int, tuple[int, int]] = {}  # expert -> (step, order of its touch within the step)
    count: dict[int, int] = {}
    out = []
    for t, need in enumerate(needs):
        hits = [e for e in need if e in resident]
        misses = [e for e in need if e not in resident]
        order = hits + misses  # mixtral-offloading touches hits first, then loads misses, ascending id
        for e in hits:
            last[e] = (t, order.index(e))
            count[e] = count.get(e, 0) + 1
        for e in misses:
            if len(resident) >= cache:
                candidates = [r for r in resident if r not in need]
                resident.remove(min(candidates, key=lambda r: victim_key(r, t, steps, last, count, policy)))
            resident.append(e)
            last[e] = (t, order.index(e))
            count[e] = count.get(e, 0) + 1
        out.append(len(misses))
    return out


def victim_key(e: int, t: int, steps, last, count, policy: str):
    if policy == "lru":
        return last[e]
    if policy == "lfu":
        return (count[e], last[e], e)
    later = [u for u in range(t + 1, len(steps)) if e in steps[u]]
    return (-(later[0] if later else math.inf), e)


def random_layers(rng, layers: int, experts: int, k: int) -> list:
    out = []
    for _ in range(layers):
        seqs = []
        for _ in range(int(rng.integers(1, 5))):
            length = int(rng.integers(1, 30))
            steps = []
            for _ in range(length):
                chosen = rng.choice(experts, size=k, replace=False).tolist()
                if rng.random() < 0.15:
                    chosen[int(rng.integers(k))] = -1  # a slot the model's capacity dropped
                steps.append(chosen)
            seqs.append(steps)
        out.append(seqs)
    return out


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", range(6))
def test_vectorised_equals_reference(policy, seed):
    rng = np.random.default_rng(seed)
    experts, k = int(rng.integers(3, 9)), int(rng.integers(1, 4))
    layers = random_layers(rng, 3, experts, k)
    for cache in range(k, experts + 2):
        result = simulate_offload(steps_routes(layers, experts), cache, policy, expert_bytes=10)
        per_step = {}
        for li, seqs in enumerate(layers):
            ref = [reference(steps, cache, policy) for steps in seqs]
            assert result.misses[li] == sum(map(sum, ref)), (policy, seed, cache, li)
            for r in ref:
                for t, m in enumerate(r):
                    per_step[t] = per_step.get(t, 0) + m
        assert result.step_misses.tolist() == [per_step[t] for t in range(len(per_step))]


@pytest.mark.parametrize("group_cells", [None, 1])
@pytest.mark.parametrize("seed", range(4))
def test_hit_rate_curve_equals_reference_at_every_cache(seed, group_cells, monkeypatch):
    """The curve replays cache sizes within 4× of each other together (and one at a time when the state's
    memory bound says so): each size's misses equal the per-step reference's."""
    import moeviz.whatif.offload as offload

    if group_cells is not None:
        monkeypatch.setattr(offload, "_GROUP_CELLS", group_cells)
    rng = np.random.default_rng(100 + seed)
    experts, k = int(rng.integers(6, 24)), int(rng.integers(1, 4))
    layers = random_layers(rng, 3, experts, k)
    caches = [*range(experts + 2, k - 1, -1), k + 1]  # descending, one size twice, one past E
    curve = hit_rate_curve(steps_routes(layers, experts), caches, expert_bytes=3)
    assert curve["cache"].tolist() == caches * len(POLICIES)
    for row in curve.itertuples():
        per_layer = [[reference(steps, row.cache, row.policy) for steps in seqs] for seqs in layers]
        misses = [sum(map(sum, ref)) for ref in per_layer]
        requested = [sum(len({e for e in s if e >= 0}) for steps in seqs for s in steps) for seqs in layers]
        assert row.misses == sum(misses) and row.bytes == 3 * sum(misses), (row.policy, row.cache)
        assert row.hit_rate == pytest.approx(1 - sum(misses) / sum(requested), abs=1e-12)
        rates = [1 - m / r for m, r in zip(misses, requested, strict=True)]
        assert row.layer_mean_hit_rate == pytest.approx(np.mean(rates), abs=1e-12)


# Hand-worked, cache of 2, one seq, k = 1 (expert per step), H = hit, M = miss:
#   steps   0 1 0 2 0 1 1 2
#   LRU:    M M H M(evicts 1) H M(evicts 2) H M(evicts 0)          -> 3 hits
#   LFU:    M M H M(evicts 1: count 1 vs 0's 2) H M(evicts 2: 1 vs 3) H(1: count 2) M(evicts 1: 2 vs 0's 3)
#           -> 3 hits
#   Belady: M M H M(evicts 1: next 5 vs 0's 4) H M(evicts 0: never vs 2's 7) H H  -> 4 hits
HAND = [[0], [1], [0], [2], [0], [1], [1], [2]]


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("lru", [1, 1, 0, 1, 0, 1, 0, 1]),
        ("lfu", [1, 1, 0, 1, 0, 1, 0, 1]),
        ("belady", [1, 1, 0, 1, 0, 1, 0, 0]),
    ],
)
def test_hand_worked(policy, expected):
    result = simulate_offload(steps_routes([[HAND]], 3), 2, policy, expert_bytes=5, bandwidth_gbps=1e-9)
    assert result.step_misses.tolist() == expected
    assert result.hits[0] == 8 - sum(expected)
    frame = result.layers_frame()
    assert frame.loc[0, "bytes"] == 5 * sum(expected)
    assert frame.loc[0, "stall_s"] == pytest.approx(5 * sum(expected))
    assert frame.loc[0, "tokens_per_s_bound"] == pytest.approx(8 / (5 * sum(expected)))


def test_lfu_and_lru_differ_by_hand():
    # cache 2: 0 0 0 1 2 1 ... LRU evicts 0 at step 4 (1 is newer); LFU evicts 1 (count 1 < 3)
    #   LRU:  M H H M M(evicts 0) H        -> misses 3
    #   LFU:  M H H M M(evicts 1) M(evicts 2: count 1 < 0's 3) -> misses 4
    steps = [[0], [0], [0], [1], [2], [1]]
    lru = simulate_offload(steps_routes([[steps]], 3), 2, "lru", expert_bytes=1)
    lfu = simulate_offload(steps_routes([[steps]], 3), 2, "lfu", expert_bytes=1)
    assert lru.step_misses.tolist() == [1, 0, 0, 1, 1, 0]
    assert lfu.step_misses.tolist() == [1, 0, 0, 1, 1, 1]


def test_lru_touches_hits_before_misses_ascending():
    # k = 2, cache 3: step 0 loads {0, 2}; step 1 needs {1, 2}: hit 2 touched first, then 1 loaded.
    # Step 2 needs {3, 4}: evicts the two least recent among {0, 1, 2}: 0 (step 0) then 2 (step 1, touched
    # before 1), leaving 1 -> step 3 needing {1, 4} hits both.
    steps = [[0, 2], [1, 2], [3, 4], [1, 4]]
    result = simulate_offload(steps_routes([[steps]], 5), 3, "lru", expert_bytes=1)
    assert result.step_misses.tolist() == [2, 1, 2, 0]


@pytest.mark.parametrize("seed", range(4))
def test_at_cache_k_every_policy_is_the_overlap(seed):
    rng = np.random.default_rng(seed)
    k, experts = 2, 6
    steps = [rng.choice(experts, size=k, replace=False).tolist() for _ in range(40)]
    overlap = sum(len(set(a) & set(b)) for a, b in itertools.pairwise(steps))
    rates = {
        p: simulate_offload(steps_routes([[steps]], experts), k, p, expert_bytes=1).hit_rate for p in POLICIES
    }
    assert all(r == pytest.approx(overlap / (k * len(steps))) for r in rates.values())


def exhaustive_min_misses(steps: list[list[int]], cache: int) -> int:
    needs = [frozenset(e for e in s if e >= 0) for s in steps]

    @functools.cache
    def best(t: int, resident: frozenset) -> int:
        if t == len(needs):
            return 0
        need = needs[t]
        missing = need - resident
        free = cache - len(resident)
        evict = max(0, len(missing) - free)
        candidates = sorted(resident - need)
        out = math.inf
        for victims in _combinations(candidates, evict):
            out = min(out, len(missing) + best(t + 1, (resident - set(victims)) | missing))
        return out

    return best(0, frozenset())


def _combinations(items, r):
    from itertools import combinations

    return combinations(items, r)


@pytest.mark.parametrize("seed", range(25))
def test_belady_is_optimal_on_tiny_sequences(seed):
    rng = np.random.default_rng(100 + seed)
    experts, k = int(rng.integers(2, 6)), int(rng.integers(1, 3))
    k = min(k, experts)
    steps = [rng.choice(experts, size=k, replace=False).tolist() for _ in range(int(rng.integers(1, 9)))]
    for cache in range(k, experts + 1):
        routes = steps_routes([[steps]], experts)
        belady = int(simulate_offload(routes, cache, "belady", expert_bytes=1).misses[0])
        assert belady == exhaustive_min_misses(steps, cache)
        for other in ("lru", "lfu"):
            assert belady <= simulate_offload(routes, cache, other, expert_bytes=1).misses[0]


@pytest.mark.parametrize("policy", POLICIES)
def test_cache_of_all_experts_only_cold_misses(policy):
    rng = np.random.default_rng(7)
    layers = random_layers(rng, 2, 5, 2)
    for cache in (5, 9):
        result = simulate_offload(steps_routes(layers, 5), cache, policy, expert_bytes=1)
        for li, seqs in enumerate(layers):
            cold = sum(len({e for s in steps for e in s if e >= 0}) for steps in seqs)
            assert result.misses[li] == cold


def test_cache_below_k_is_refused():
    with pytest.raises(InputError, match="cannot hold"):
        simulate_offload(steps_routes([[[[0, 1]]]], 3), 1, "lru", expert_bytes=1)
    with pytest.raises(InputError, match="unknown offload policy"):
        simulate_offload(steps_routes([[[[0, 1]]]], 3), 2, "fifo", expert_bytes=1)


def test_frames_json_and_curve():
    rng = np.random.default_rng(3)
    routes = steps_routes(random_layers(rng, 2, 6, 2), 6)
    result = simulate_offload(routes, 3, "belady", expert_bytes=100)
    steps = result.steps_frame()
    assert steps["cumulative_bytes"].iloc[-1] == result.misses.sum() * 100
    assert np.all(np.diff(steps["cumulative_bytes"]) >= 0)
    payload = result.to_json()
    assert set(payload) == {"model", "tokens", "definition", "layers"}
    assert set(payload["layers"][0]) == {"layer", "policy", "cache", "hits", "misses", "hit_rate", "bytes"}
    assert "Belady" in payload["definition"]
    curve = hit_rate_curve(routes, [2, 3, 4, 6])
    assert set(curve["policy"]) == set(POLICIES) and len(curve) == 12
    belady = curve[curve.policy == "belady"].set_index("cache")["hit_rate"]
    for policy in ("lru", "lfu"):
        other = curve[curve.policy == policy].set_index("cache")["hit_rate"]
        assert np.all(belady >= other - 1e-12)


def test_one_long_stream():
    rng = np.random.default_rng(5)
    steps = [rng.choice(16, size=2, replace=False).tolist() for _ in range(4096)]
    result = simulate_offload(steps_routes([[steps]], 16), 4, "lru", expert_bytes=1)
    assert result.misses[0] == sum(reference(steps, 4, "lru"))
