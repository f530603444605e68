"""The Trace of real captures: the routing frame's schema and values, and the Parquet round trip. The file
format on synthetic traces: tests/unit/test_trace_format.py."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

import moeviz
from moeviz.trace import ROUTING_COLUMNS, Trace
from tests.support.traces import assert_traces_equal

REQUIRED = ["seq", "pos", "token_id", "token", "layer", "rank", "expert", "weight", "score"]


@pytest.mark.parametrize("family", ["deepseek_v3", "switch_transformers", "jetmoe"])
def test_parquet_round_trip(tiny_model_dir, tmp_path, family):
    loaded = moeviz.load_model(
        tiny_model_dir(family, **({"expert_capacity": 2} if family == "switch_transformers" else {}))
    )
    trace = moeviz.capture(loaded, token_ids=[[5, 6, 7, 8, 9], [10, 11]], generate=2)
    path = trace.to_parquet(tmp_path / "t.parquet")
    assert_traces_equal(trace, Trace.from_parquet(path))
    assert not list(tmp_path.glob(".*partial"))


def test_routing_frame_schema_and_values(tiny_model_dir):
    loaded = moeviz.load_model(tiny_model_dir("deepseek_v3"))
    trace = moeviz.capture(loaded, token_ids=[[5, 6, 7, 8], [9, 10, 11]])
    frame = trace.routing_frame()
    assert list(frame.columns) == ROUTING_COLUMNS and set(REQUIRED) <= set(frame.columns)
    layers = [r.layer for r in trace.layers]
    assert len(frame) == 7 * len(layers) * 2
    assert not frame.duplicated(["seq", "pos", "layer", "rank"]).any()
    # Rank 0 holds the largest weight.
    wide = frame.pivot_table(index=["seq", "pos", "layer"], columns="rank", values="weight")
    assert (wide[0] >= wide[1]).all()
    # score is the sigmoid of that expert's raw logit (deepseek_v3 scores with sigmoid), before renorm.
    np.testing.assert_allclose(frame.score, 1 / (1 + np.exp(-frame.logit.astype(np.float64))), rtol=1e-6)
    # Selection score includes the balancing bias, the score does not.
    routing = trace.layers[0]
    sel = frame[frame.layer == routing.layer]
    np.testing.assert_allclose(sel.selection_score - sel.score, routing.bias[sel.expert], atol=1e-6)
    # Weights sum to routed_scaling_factor (deepseek_v3 renormalises, then scales).
    sums = frame.groupby(["seq", "pos", "layer"]).weight.sum()
    np.testing.assert_allclose(sums, loaded.model.config.routed_scaling_factor, rtol=1e-5)


def test_dropped_tokens_are_minus_one_with_zero_weight(tiny_model_dir):
    loaded = moeviz.load_model(tiny_model_dir("switch_transformers", expert_capacity=1))
    frame = moeviz.capture(loaded, token_ids=[[5, 6, 7, 8, 9, 10, 11, 12]]).routing_frame()
    dropped = frame[frame.expert == -1]
    assert len(dropped) > 0
    assert (dropped.weight == 0).all() and dropped.score.isna().all()
    kept = frame[frame.expert >= 0]
    # Capacity 1: each expert takes at most one token per sequence per layer.
    assert kept.groupby(["site", "layer", "seq", "expert"]).size().max() == 1


def test_scores_frame_matches_layer(sample_model):
    trace = moeviz.capture(sample_model, "one two three")
    routing = trace.layers[2]
    frame = trace.scores_frame(routing.layer)
    assert len(frame) == len(routing.token_rows) * routing.num_experts
    dispatched = frame[frame.dispatched].sort_values(["row", "weight"], ascending=[True, False])
    np.testing.assert_array_equal(dispatched.expert.to_numpy().reshape(-1, routing.k), routing.experts)


def test_concat_equals_one_batched_capture(tiny_model_dir):
    loaded = moeviz.load_model(tiny_model_dir("qwen3_moe"))
    seqs = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    whole = moeviz.capture(loaded, token_ids=seqs)
    halves = [moeviz.capture(loaded, token_ids=seqs[:2]), moeviz.capture(loaded, token_ids=seqs[2:])]
    parts = Trace.concat(halves)
    key = ["seq", "pos"]
    pd.testing.assert_frame_equal(
        parts.routing_frame().sort_values([*key, "layer", "rank"]).reset_index(drop=True),
        whole.routing_frame().sort_values([*key, "layer", "rank"]).reset_index(drop=True),
        atol=1e-5,
    )


# ---- Parquet format version 2: each token's logits once, on its rank-0 row ------------------------------


# ---- scores and selection scores derive from the logits ---------------------------------------------------


def test_capture_builds_the_token_table_on_first_use(sample_model):
    """The token table (and its decoded strings) is built when first read; a pickle carries it built."""
    import pickle

    trace = moeviz.capture(sample_model, "one two three")
    assert "_tokens" in trace.__dict__ and not isinstance(trace.__dict__["_tokens"], pd.DataFrame)  # lazy
    copy = pickle.loads(pickle.dumps(trace))  # builds the token table
    pd.testing.assert_frame_equal(copy.tokens, trace.tokens)
    assert list(trace.tokens["token"]) == sample_model.token_texts(trace.tokens["token_id"].tolist())
