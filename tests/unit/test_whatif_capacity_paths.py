"""The capacity replay against a slow re-implementation written here from its definition
(docs/deployment-whatifs.md, "Capacity-factor replay"): per dispatch group C = ⌈(T·k / E)·CF⌉ clamped to
T·k; per (group, expert) keep the C largest weights, ties → earlier token, then earlier slot (``probs``), or
the first C arrivals in token, then slot order (``position``); slots the model dropped (-1) are not replay
drops. Random routing with tied weights, dropped slots, tokens without a valid slot and sequences of uneven
length; CFs from tiny (C = 0 or 1) to huge (nothing drops). Every way the replay ranks must give the
definition's frames: one sort per group, one sort of all, the stable argsort when the packed key does not
fit, and one or a few groups at a time."""

from __future__ import annotations

import math
from fractions import Fraction
from itertools import pairwise

import numpy as np
import pytest

import moeviz.whatif.capacity as capacity
from moeviz.whatif.capacity import replay_capacity
from moeviz.whatif.routes import LayerRoutes, Routes

LENGTHS = (37, 1, 120, 64, 5, 300, 2)
# 5e-324 · (T·k/E) rounds to 0 for T = 1 (C = 0: all dropped), 1e-9 gives C = 1, 1e300 keeps everything
CFS = (1.0, 5e-324, 1e-9, 0.3, 1.3, 4.0, 16.0, 1e300)
BUCKETS = 7
# the module's knobs that pick how it ranks; the definition's answer must not depend on them
PATHS = {
    "one sort per group": {},
    "one sort of all": {"_ROW_PADDING": 0},
    "stable argsort": {"_KEY_BITS": 0},
    "one group at a time": {"_CHUNK_SLOTS": 1},
    "a few groups at a time": {"_CHUNK_SLOTS": 300},
}


def _routes(seed: int, experts: int = 16, k: int = 4) -> Routes:
    """Two layers of skewed routing, weights on a coarse grid (ties); the first has ~5% dropped slots and
    two tokens with none valid, the second none dropped."""
    rng = np.random.default_rng(seed)
    n = sum(LENGTHS)
    seq = np.repeat(np.arange(len(LENGTHS)), LENGTHS)
    pos = np.concatenate([np.arange(m) for m in LENGTHS])
    popularity = 1.0 / np.arange(1, experts + 1) ** 1.2
    layers = []
    for layer in range(2):
        keys = rng.random((n, experts)) ** (1.0 / rng.permutation(popularity))
        chosen = np.argsort(-keys, axis=1)[:, :k].astype(np.int64)
        weights = (rng.integers(0, 6, (n, k)) / 8).astype(np.float32)
        if layer == 0:
            chosen[rng.random((n, k)) < 0.05] = -1
            chosen[[3, 40]] = -1
            weights[chosen < 0] = 0.0
        layers.append(LayerRoutes(layer, "mlp", chosen, weights, seq, pos, experts))
    return Routes("random", layers)


def _groups(seq: np.ndarray, group_tokens: int | None) -> list[range]:
    if group_tokens is not None:
        return [range(i, min(i + group_tokens, len(seq))) for i in range(0, len(seq), group_tokens)]
    cuts = [0] + [i for i in range(1, len(seq)) if seq[i] != seq[i - 1]] + [len(seq)]
    return [range(a, b) for a, b in pairwise(cuts)]


def _capacity(tokens: int, k: int, experts: int, cf: float, exact: bool) -> int:
    if exact:
        c = math.ceil(Fraction(tokens * k, experts) * Fraction(repr(cf)))
    else:
        c = math.ceil((tokens * k / experts) * cf)
    return min(c, tokens * k)


def _replay(layer: LayerRoutes, cf: float, policy: str, group_tokens: int | None, exact: bool):
    """(the layer's row of layers_frame, assigned [E], dropped [E], assigned by bucket, dropped by bucket)."""
    n, k, experts = layer.tokens, layer.k, layer.num_experts
    dropped = np.zeros((n, k), dtype=bool)
    caps = []
    for rows in _groups(layer.seq, group_tokens):
        cap = _capacity(len(rows), k, experts, cf, exact)
        caps.append(cap)
        for e in range(experts):
            arrivals = [(t, j) for t in rows for j in range(k) if layer.experts[t, j] == e]
            if policy == "probs":
                arrivals.sort(key=lambda tj: (-float(layer.weights[tj]), tj))
            for t, j in arrivals[cap:]:
                dropped[t, j] = True
    valid = layer.experts >= 0
    assigned = np.array([(layer.experts == e).sum() for e in range(experts)])
    lost = np.array([(dropped & (layer.experts == e)).sum() for e in range(experts)])
    bucket = np.zeros(n, dtype=np.int64)
    for rows in _groups(layer.seq, None):
        for i, t in enumerate(rows):
            bucket[t] = i * BUCKETS // len(rows)
    pos_assigned = np.bincount(bucket, weights=valid.sum(1), minlength=BUCKETS).astype(np.int64)
    pos_dropped = np.bincount(bucket, weights=dropped.sum(1), minlength=BUCKETS).astype(np.int64)
    total = int(valid.sum())
    row = {
        "layer": layer.layer,
        "cf": cf,
        "policy": policy,
        "capacity": max(caps),
        "capacity_min": min(caps),
        "assigned": total,
        "dropped": int(dropped.sum()),
        "dropped_fraction": int(dropped.sum()) / total,
        "tokens_all_dropped": int(((valid.sum(1) > 0) & ((valid & ~dropped).sum(1) == 0)).sum()),
        "overflowing_experts": int((lost > 0).sum()),
    }
    return row, assigned, lost, pos_assigned, pos_dropped


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize(
    ("group_tokens", "exact"), [(None, False), (16, False), (None, True), (100_000, False)]
)
def test_every_ranking_path_gives_the_definition(monkeypatch, path, policy, group_tokens, exact) -> None:
    for name, value in PATHS[path].items():
        monkeypatch.setattr(capacity, name, value)
    argsorts = []
    ranks = capacity.capacity_ranks
    monkeypatch.setattr(capacity, "capacity_ranks", lambda *a: argsorts.append(1) or ranks(*a))
    routes = _routes(seed=len(path) + len(policy))
    result = replay_capacity(
        routes, CFS, policy=policy, buckets=BUCKETS, exact=exact, group_tokens=group_tokens
    )
    assert bool(argsorts) == (path == "stable argsort")
    layers, experts, positions = result.layers_frame(), result.experts_frame(), result.position_frame()
    want_rows = []
    want_pos = {cf: np.zeros((2, BUCKETS), dtype=np.int64) for cf in CFS}  # summed over layers
    for layer in routes.layers:
        for cf in CFS:
            row, assigned, lost, pos_assigned, pos_dropped = _replay(layer, cf, policy, group_tokens, exact)
            want_rows.append(row)
            got = experts[(experts.layer == layer.layer) & (experts.cf == cf)]
            np.testing.assert_array_equal(got.expert, np.arange(layer.num_experts))
            np.testing.assert_array_equal(got.assigned, assigned)
            np.testing.assert_array_equal(got.dropped, lost)
            np.testing.assert_array_equal(got.dropped_fraction, lost / np.maximum(assigned, 1))
            want_pos[cf] += [pos_assigned, pos_dropped]
    for cf in CFS:
        at = positions[positions.cf == cf]
        np.testing.assert_array_equal(at.bucket, np.arange(BUCKETS))
        np.testing.assert_array_equal(at.assigned, want_pos[cf][0])
        np.testing.assert_array_equal(at.dropped, want_pos[cf][1])
    assert layers.to_dict("records") == want_rows  # by layer, then CF in the order given
    # the test has teeth: a one-token group gets C = 0 at the tiniest CF in float order (exact: 1), the huge
    # CF drops nothing, tokens lose every slot, and CF 1 drops
    assert (layers.capacity_min == 0).any() == (not exact and group_tokens != 100_000)
    assert layers[layers.cf == 1e300].dropped.sum() == 0
    assert (layers.tokens_all_dropped > 0).any() and layers[layers.cf == 1.0].dropped.sum() > 0


def test_the_priority_key_orders_by_descending_weight() -> None:
    """Ascending keys = descending float32 weights, over signs, zeros, subnormals and infinities."""
    values = np.array(
        [0.5, -0.5, 0.0, 1e-45, -1e-45, np.inf, -np.inf, 3.4e38, -3.4e38, 1.0, 0.25, 1e-40, 0.5, -2.0],
        dtype=np.float32,
    )
    keys = capacity._priority_key(values)
    assert keys.dtype == np.uint32
    want = sorted(range(len(values)), key=lambda i: (-float(values[i]), i))
    assert np.argsort(keys, kind="stable").tolist() == want
    assert keys[values == 0.5][0] == keys[values == 0.5][1]  # equal weights tie: arrival decides
