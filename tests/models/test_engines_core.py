"""The importers' shared core on the sample models' configs: the routing layout read without weights equals
the loaded model's MoE layers, and `routed_trace` places layers, aligns token ids (the seq−1 rule), sets
aside rows the engine did not run, refuses what cannot be real, and gives a Trace without logits that
round-trips through Parquet and `Trace.concat` without allocating [N, E]."""

from __future__ import annotations

import numpy as np
import pytest

from moeviz.engines.layout import routing_layout
from moeviz.engines.routed import RoutedSequence, routed_trace
from moeviz.errors import EngineFormatError
from moeviz.trace import Trace
from tests.support.traces import assert_traces_equal

DEEPSEEK = "sample:deepseek-v3-bias"  # 4 hidden layers, layer 0 dense, 16 experts, top-4
MIXTRAL = "sample:mixtral-healthy"  # 4 MoE layers, 8 experts, top-2


def _ids(rng: np.random.Generator, rows: int, layers: int, k: int, e: int) -> np.ndarray:
    """[rows, layers, k] distinct ids per (row, layer)."""
    return np.argsort(rng.random((rows, layers, e)), axis=2)[..., :k].astype(np.int32)


@pytest.mark.parametrize("source", [DEEPSEEK, MIXTRAL])
def test_the_layout_from_the_config_equals_the_loaded_models_moe_layers(source):
    import moeviz

    layout = routing_layout(source)
    loaded = moeviz.load_model(source)
    sites = loaded.sites
    assert layout.moe_layers == tuple(s.layer for s in sites)
    assert {(s.num_experts, s.top_k, s.score_fn) for s in sites} == {
        (layout.num_experts, layout.top_k, layout.score_fn)
    }
    assert layout.num_hidden_layers == loaded.info.num_layers
    assert (layout.n_group, layout.topk_group) == (sites[0].n_group, sites[0].topk_group)
    assert layout.dense_layers == tuple(
        i for i in range(layout.num_hidden_layers) if i not in layout.moe_layers
    )


def test_a_hidden_layer_axis_drops_the_dense_layer_and_aligns_the_whole_sequence():
    layout = routing_layout(DEEPSEEK)
    rng = np.random.default_rng(0)
    ids = _ids(rng, 6, 4, 4, 16)
    ids[:, 0] = 0  # SGLang writes dense layers as 0
    tokens = np.arange(7) + 100  # the whole sequence: its last token never ran
    trace = routed_trace(layout, [RoutedSequence(ids, tokens, prompt_len=3)], source="sglang-routed")
    assert [r.layer for r in trace.layers] == [1, 2, 3]
    for out, routing in enumerate(trace.layers):
        np.testing.assert_array_equal(routing.experts, ids[:, out + 1])
        np.testing.assert_array_equal(routing.token_rows, np.arange(6))
        assert not routing.has_logits and not routing.has_weights and routing.ranked
        assert routing.decision_source == "sglang-routed"
        assert np.isnan(routing.scores).all() and routing.scores.strides == (0, 0)  # no [N, E] array
    table = trace.tokens
    np.testing.assert_array_equal(table["token_id"], tokens)
    assert table["phase"].tolist() == ["prompt"] * 3 + ["generated"] * 4
    assert table["step"].tolist() == [0, 0, 0, 1, 2, 3, 4]


def test_only_the_routed_tokens_may_be_given_and_other_counts_are_refused():
    layout = routing_layout(MIXTRAL)
    ids = _ids(np.random.default_rng(1), 5, 4, 2, 8)
    trace = routed_trace(layout, [RoutedSequence(ids, np.arange(5))], source="vllm-routed")
    assert len(trace.tokens) == 5
    with pytest.raises(EngineFormatError, match=r"s: 4 token ids for 5 rows .* expected 6 .* or 5"):
        routed_trace(layout, [RoutedSequence(ids, np.arange(4), label="s")], source="vllm-routed")
    with_start = RoutedSequence(ids, np.arange(9), start=3, label="s")  # 3 prompt tokens before the rows
    trace = routed_trace(layout, [with_start], source="vllm-routed")
    np.testing.assert_array_equal(trace.layers[0].token_rows, np.arange(3, 8))
    np.testing.assert_array_equal(trace.layers[0].experts, ids[:, 0])


def test_rows_the_engine_did_not_run_stay_in_the_table_without_routing():
    layout = routing_layout(MIXTRAL)
    ids = _ids(np.random.default_rng(2), 6, 4, 2, 8)
    ids[:2] = -1  # prefix-cache hits
    trace = routed_trace(layout, [RoutedSequence(ids, np.arange(7))], source="vllm-routed")
    assert len(trace.tokens) == 7
    np.testing.assert_array_equal(trace.layers[2].token_rows, np.arange(2, 6))
    np.testing.assert_array_equal(trace.layers[2].experts, ids[2:, 2])
    assert any("2 of 6 positions" in note for note in trace.model.notes)


def test_what_cannot_be_real_is_refused_with_its_place():
    layout = routing_layout(DEEPSEEK)
    rng = np.random.default_rng(3)
    ids = _ids(rng, 4, 3, 4, 16)
    ids[2, 1, 3] = ids[2, 1, 0]
    with pytest.raises(EngineFormatError, match=r"f, position 2, MoE layer 1: 3 distinct expert ids of 4"):
        routed_trace(layout, [RoutedSequence(ids, label="f")], source="x")
    with pytest.raises(EngineFormatError, match=r"f: 2 experts per token in the file, the model routes"):
        routed_trace(layout, [RoutedSequence(_ids(rng, 4, 3, 2, 16), label="f")], source="x")
    with pytest.raises(EngineFormatError, match=r"f: 5 layers on the layer axis"):
        routed_trace(layout, [RoutedSequence(_ids(rng, 4, 5, 4, 16), label="f")], source="x")
    with pytest.raises(EngineFormatError, match=r"the file holds no sequence"):
        routed_trace(layout, [], source="x")


def test_sequences_without_ids_keep_unknown_tokens_and_several_sequences_stack():
    layout = routing_layout(MIXTRAL)
    rng = np.random.default_rng(4)
    a, b = _ids(rng, 3, 4, 2, 8), _ids(rng, 5, 4, 2, 8)
    trace = routed_trace(layout, [RoutedSequence(a), RoutedSequence(b)], source="x", decode_tokens=False)
    assert trace.tokens["seq"].tolist() == [0] * 3 + [1] * 5
    assert (trace.tokens["token_id"] == -1).all() and set(trace.tokens["token"]) == {"⟨?⟩"}
    np.testing.assert_array_equal(trace.layers[1].experts, np.concatenate([a[:, 1], b[:, 1]]))


def test_an_imported_trace_round_trips_and_concatenates_without_logits(tmp_path):
    layout = routing_layout(DEEPSEEK)
    rng = np.random.default_rng(5)
    ids = _ids(rng, 8, 3, 4, 16)
    trace = routed_trace(layout, [RoutedSequence(ids, np.arange(9), prompt_len=4)], source="megatron-trace")
    read = Trace.from_parquet(trace.to_parquet(tmp_path / "t.parquet"))
    assert_traces_equal(trace, read)
    assert read.layers[0].logits.strides == (0, 0)  # read back as the absent view, not as an [N, E] array
    both = Trace.concat([trace, read])
    assert not both.layers[0].has_logits and both.layers[0].logits.shape == (16, 16)
    np.testing.assert_array_equal(both.layers[0].experts, np.concatenate([ids[:, 0], ids[:, 0]]))
    from moeviz.report import build_report

    report = build_report(read)
    assert report.layers["aux_loss_topk"].isna().all() and report.layers["z_loss"].isna().all()
    assert report.layers["load_entropy"].notna().all()
