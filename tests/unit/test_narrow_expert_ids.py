"""Imported routing keeps expert ids in the narrowest integer type that holds them (`moeviz.engines.routed`:
int8 up to 128 experts, int16 beyond; one or two bytes per id, so a 1 M-token rollout fits in memory);
captures hold int64. Every trace-level analysis must give the same answer on both, at expert counts where
id arithmetic (i · E + j) overflows the narrow type: E = 128 in int8, E = 256 in int16."""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest

from moeviz.analysis import (
    balance_frame,
    coactivation_frame,
    domain_specialisation_frame,
    expert_balance_frame,
    path_frame,
    repetition_frame,
    transition_frame,
)
from moeviz.analysis.compare import expert_drift_frame, routing_agreement_frame
from moeviz.analysis.engine_diff import engine_diff
from moeviz.analysis.losses import loss_frame
from moeviz.analysis.scale_frames import (
    coactivation_pair_counts,
    layer_coactivation_frame,
    next_layer_transition_frame,
    token_scores_frame,
)
from tests.support.traces import make_trace, random_layer

K = 8


@pytest.fixture(scope="module", params=[128, 256], ids=["E=128 int8", "E=256 int16"])
def traces(request):
    from moeviz.engines.routed import narrowest_id_type

    e = request.param
    rng = np.random.default_rng(0)
    layers = [dataclasses.replace(random_layer(rng, 400, e, K, skew=2.0), layer=i) for i in range(3)]
    wide = make_trace(layers, e, seq_lengths=[150, 250])
    dtype = narrowest_id_type(e)
    narrow = dataclasses.replace(
        wide, layers=[dataclasses.replace(r, experts=r.experts.astype(dtype)) for r in wide.layers]
    )
    assert narrow.layers[0].experts.dtype == {128: np.int8, 256: np.int16}[e]
    return wide, narrow


ANALYSES = {
    "balance": balance_frame,
    "expert balance": expert_balance_frame,
    "losses": loss_frame,
    "coactivation": coactivation_frame,
    "coactivation, rank-adjacent": lambda t: coactivation_frame(t, adjacent_only=True),
    "transitions": transition_frame,
    "top-1 transitions": lambda t: transition_frame(t, top1=True),
    "paths": path_frame,
    "repetition": repetition_frame,
    "domains": lambda t: domain_specialisation_frame(t, ["a", "b"]),
    "coactivation at scale": lambda t: layer_coactivation_frame(t, 1),
    "transitions at scale": lambda t: next_layer_transition_frame(t, 0),
    "pair counts": lambda t: pd.DataFrame(coactivation_pair_counts(t)),
    "one token's scores": lambda t: token_scores_frame(t, 1, 7),
}
COMPARISONS = {
    "agreement": routing_agreement_frame,
    "drift": expert_drift_frame,
    "engine diff": lambda a, b: engine_diff(a, b).differing_frame(),
}


@pytest.mark.parametrize("name", list(ANALYSES))
def test_int16_expert_ids_give_the_int64_answer(traces, name):
    wide, narrow = traces
    expected, got = ANALYSES[name](wide), ANALYSES[name](narrow)
    pd.testing.assert_frame_equal(got, expected, check_dtype=False)


@pytest.mark.parametrize("name", list(COMPARISONS))
def test_comparing_int16_with_int64_ids_is_comparing_the_same_routing(traces, name):
    wide, narrow = traces
    pd.testing.assert_frame_equal(
        COMPARISONS[name](narrow, wide), COMPARISONS[name](wide, wide), check_dtype=False
    )
