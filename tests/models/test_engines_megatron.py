"""The "megatron-trace" and "megatron-replay" importers on files written as Megatron-Core writes them
(tests/support/megatron_files.py): layer numbering (block index, 1-based layer_number, MoE ordinal), rank
files merged in rank order, forward passes within a step, MTP records, the bf16 logits sidecar and its
offsets, the replay output's seq−1 rows and MoE-layer axis, and every refusal."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from moeviz.engines import import_routing
from moeviz.errors import EngineFormatError, InputError
from moeviz.trace import Trace
from tests.support.megatron_files import RouterTraceWriter, bf16_values, chat_response, completion_response
from tests.support.traces import assert_traces_equal

DEEPSEEK = "sample:deepseek-v3-bias"  # 4 hidden layers, layer 0 dense, MoE layers 1-3, 16 experts, top-4
MIXTRAL = "sample:mixtral-healthy"  # 4 hidden layers, all MoE, 8 experts, top-2
DS_MOE, DS_E, DS_K = (1, 2, 3), 16, 4
MX_MOE, MX_E, MX_K = (0, 1, 2, 3), 8, 2


def routing(r: np.random.Generator, n: int, layers: int, e: int, k: int) -> np.ndarray:
    """[n, layers, k]: k distinct ids per (token, layer), in score-like (random) order."""
    return np.argsort(r.random((n, layers, e)), axis=-1)[..., :k]


def sets(trace: Trace, seq: int) -> np.ndarray:
    """[positions, MoE layers, k] of sequence `seq` with each row sorted (Megatron's ids compare as sets)."""
    table = trace.tokens
    rows = table.index[table["seq"] == seq].to_numpy()
    out = np.full((len(rows), len(trace.layers), trace.layers[0].experts.shape[1]), -1, np.int64)
    for i, layer in enumerate(trace.layers):
        where = {int(row): j for j, row in enumerate(layer.token_rows)}
        for p, row in enumerate(rows):
            if int(row) in where:
                out[p, i] = np.sort(layer.experts[where[int(row)]])
    return out


def sorted_rows(ids: np.ndarray) -> np.ndarray:
    return np.sort(ids, axis=-1)


# --- megatron-trace ------------------------------------------------------------------------------------


def test_hook_trace_with_block_indices_round_trips_as_sets(tmp_path):
    r = np.random.default_rng(0)
    w = RouterTraceWriter(tmp_path, rank=0)
    passes = [routing(r, 6, 3, DS_E, DS_K) for _ in range(2)]
    for step, ids in enumerate(passes):
        for i, block in enumerate(DS_MOE):  # decoder.layers.N: the block index, MoE layers only
            w.hook_call(step, block, ids[:, i])
    trace = import_routing("megatron-trace", [w.flush()], DEEPSEEK)
    assert [layer.layer for layer in trace.layers] == [1, 2, 3]
    for seq, ids in enumerate(passes):
        np.testing.assert_array_equal(sets(trace, seq), sorted_rows(ids))
    layer = trace.layers[0]
    assert layer.decision_source == "megatron-trace" and not layer.ranked and not layer.has_logits
    assert (trace.tokens["token_id"] == -1).all() and len(trace.tokens) == 12


@pytest.mark.parametrize(
    ("model", "moe", "e", "k"), [(MIXTRAL, MX_MOE, MX_E, MX_K), (DEEPSEEK, DS_MOE, DS_E, DS_K)]
)
def test_one_based_layer_numbers_map_to_the_block_before(tmp_path, model, moe, e, k):
    r = np.random.default_rng(1)
    ids = routing(r, 5, len(moe), e, k)
    w = RouterTraceWriter(tmp_path, rank=0)
    w.record_indices(ids, step=0, layer_ids=[m + 1 for m in moe])  # the inference recorder's layer_number
    trace = import_routing("megatron-trace", [w.flush()], model)
    assert [layer.layer for layer in trace.layers] == list(moe)
    np.testing.assert_array_equal(sets(trace, 0), sorted_rows(ids))
    assert any("1-based layer_number" in note for note in trace.model.notes)


def test_moe_ordinal_layer_numbers_map_to_the_moe_layers(tmp_path):
    r = np.random.default_rng(2)
    ids = routing(r, 4, 3, DS_E, DS_K)
    w = RouterTraceWriter(tmp_path, rank=0)
    w.record_indices(ids, step=0)  # record_indices without layer_ids: 0, 1, 2
    trace = import_routing("megatron-trace", [w.flush()], DEEPSEEK)
    np.testing.assert_array_equal(sets(trace, 0), sorted_rows(ids))
    assert any("MoE ordinals" in note for note in trace.model.notes)


def test_layer_numbers_that_fit_no_numbering_are_refused(tmp_path):
    r = np.random.default_rng(3)
    w = RouterTraceWriter(tmp_path, rank=0)
    w.record_indices(routing(r, 4, 4, DS_E, DS_K), step=0, layer_ids=[0, 1, 2, 3])  # dense block 0 routed
    with pytest.raises(EngineFormatError, match=r"numbers its MoE layers \[0, 1, 2, 3\].*blocks \[1, 2, 3\]"):
        import_routing("megatron-trace", [w.flush()], DEEPSEEK)


def test_a_pass_missing_a_layer_is_refused(tmp_path):
    r = np.random.default_rng(4)
    w = RouterTraceWriter(tmp_path, rank=0)
    ids = routing(r, 4, 3, DS_E, DS_K)
    for step in range(2):
        for i, block in enumerate(DS_MOE):
            if not (step == 1 and block == 2):
                w.hook_call(step, block, ids[:, i])
    with pytest.raises(EngineFormatError, match=r"step 1: no router call for layer 2"):
        import_routing("megatron-trace", [w.flush()], DEEPSEEK)


def test_micro_batches_within_a_step_are_separate_sequences(tmp_path):
    r = np.random.default_rng(5)
    w = RouterTraceWriter(tmp_path, rank=0)
    micro = [routing(r, 3, 4, MX_E, MX_K) for _ in range(3)]
    for ids in micro:  # training: advance_step once per iteration, the routers fire once per micro-batch
        for i, block in enumerate(MX_MOE):
            w.hook_call(7, block, ids[:, i])
    trace = import_routing("megatron-trace", [w.flush()], MIXTRAL)
    assert trace.tokens["seq"].nunique() == 3
    for seq, ids in enumerate(micro):
        np.testing.assert_array_equal(sets(trace, seq), sorted_rows(ids))
    assert any("several forward passes" in note for note in trace.model.notes)


def test_rank_files_are_merged_in_rank_order(tmp_path):
    r = np.random.default_rng(6)
    by_rank = {rank: routing(r, 4, 4, MX_E, MX_K) for rank in (0, 1)}
    paths = {}
    for rank, ids in by_rank.items():
        w = RouterTraceWriter(tmp_path / "run", rank=rank)
        w.record_indices(ids, step=0)
        paths[rank] = w.flush()
    for files in ([paths[1], paths[0]], [tmp_path / "run"]):  # given out of order, or as the folder
        trace = import_routing("megatron-trace", files, MIXTRAL)
        for seq, rank in enumerate((0, 1)):
            np.testing.assert_array_equal(sets(trace, seq), sorted_rows(by_rank[rank]))


def test_identical_ranks_are_noted(tmp_path):
    ids = routing(np.random.default_rng(7), 4, 4, MX_E, MX_K)
    for rank in (0, 1):
        w = RouterTraceWriter(tmp_path, rank=rank)
        w.record_indices(ids, step=0)
        w.flush()
    trace = import_routing("megatron-trace", [tmp_path], MIXTRAL)
    assert any("ranks 0 and 1 routed identically" in note for note in trace.model.notes)


def test_a_line_of_another_rank_and_a_rank_given_twice_are_refused(tmp_path):
    ids = routing(np.random.default_rng(8), 2, 4, MX_E, MX_K)
    w = RouterTraceWriter(tmp_path / "a", rank=0)
    w.record_indices(ids, step=0)
    path = w.flush()
    other = tmp_path / "b" / "router_trace_rank0.jsonl"
    other.parent.mkdir()
    shutil.copy(path, other)
    with pytest.raises(EngineFormatError, match="a second trace of rank 0"):
        import_routing("megatron-trace", [path, other], MIXTRAL)
    renamed = tmp_path / "b" / "router_trace_rank3.jsonl"
    other.rename(renamed)
    with pytest.raises(EngineFormatError, match=r"line 1: rank 0 in a trace of rank 3"):
        import_routing("megatron-trace", [renamed], MIXTRAL)


def test_mtp_records_are_skipped(tmp_path):
    r = np.random.default_rng(9)
    ids = routing(r, 4, 3, DS_E, DS_K)
    w = RouterTraceWriter(tmp_path, rank=0)
    for i, block in enumerate(DS_MOE):
        w.hook_call(0, block, ids[:, i])
    w.hook_call(0, 0, routing(r, 4, 1, DS_E, DS_K)[:, 0], block="mtp", mtp_idx=0)
    trace = import_routing("megatron-trace", [w.flush()], DEEPSEEK)
    np.testing.assert_array_equal(sets(trace, 0), sorted_rows(ids))
    assert any("1 router calls of multi-token-prediction heads" in note for note in trace.model.notes)


def _trace_with_logits(tmp_path, r):
    ids = routing(r, 5, 3, DS_E, DS_K)
    logits = r.standard_normal((5, 3, DS_E)).astype(np.float32) * 3
    w = RouterTraceWriter(tmp_path, rank=0)
    for i, block in enumerate(DS_MOE):
        w.hook_call(0, block, ids[:, i], logits=logits[:, i])
    return w.flush(), ids, logits


def test_bf16_logits_sidecar_becomes_the_layers_logits(tmp_path):
    path, _, logits = _trace_with_logits(tmp_path, np.random.default_rng(10))
    trace = import_routing("megatron-trace", [path], DEEPSEEK)
    for i, layer in enumerate(trace.layers):
        assert layer.has_logits
        np.testing.assert_array_equal(layer.logits, bf16_values(logits[:, i]))  # exact: bf16 fits fp32
        expected = 1 / (1 + np.exp(-bf16_values(logits[:, i]).astype(np.float64)))
        np.testing.assert_allclose(layer.scores, expected, rtol=1e-6)  # sigmoid, as the config says
    trace.to_parquet(tmp_path / "routes.parquet")
    assert_traces_equal(trace, Trace.from_parquet(tmp_path / "routes.parquet"))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("logit_offset", 10**6, r"logits at bytes 1000000…1000160 of logits_rank0\.bin, which has 480"),
        ("logit_offset", 1, r"logits at bytes 1…161"),
        ("logit_bytes", 158, r"logit_bytes 158 for bf16 logits of shape \[5, 16\]"),
        ("logit_shape", [5, 8], r"logit_shape \[5, 8\], expected \[num_tokens 5, experts 16\]"),
    ],
)
def test_sidecar_offsets_bytes_and_shapes_are_checked_before_reading(tmp_path, field, value, message):
    path, _, _ = _trace_with_logits(tmp_path, np.random.default_rng(11))
    lines = path.read_text().splitlines()
    record = json.loads(lines[1])
    record[field] = value
    lines[1] = json.dumps(record)
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(EngineFormatError, match=message):
        import_routing("megatron-trace", [path], DEEPSEEK)


def test_missing_sidecar_keeps_the_routing_without_logits(tmp_path):
    path, ids, _ = _trace_with_logits(tmp_path, np.random.default_rng(12))
    (tmp_path / "logits_rank0.bin").unlink()
    trace = import_routing("megatron-trace", [path], DEEPSEEK)
    assert not trace.layers[0].has_logits
    np.testing.assert_array_equal(sets(trace, 0), sorted_rows(ids))
    assert any("logits_rank0.bin, which is not next to it" in note for note in trace.model.notes)


def test_trace_token_ids_align_and_disagreeing_counts_are_refused(tmp_path):
    r = np.random.default_rng(13)
    w = RouterTraceWriter(tmp_path, rank=0)
    w.record_indices(routing(r, 4, 4, MX_E, MX_K), step=0)
    path = w.flush()
    trace = import_routing("megatron-trace", [path], MIXTRAL, token_ids=[np.array([5, 6, 7, 8])])
    assert trace.tokens["token_id"].tolist() == [5, 6, 7, 8]
    with pytest.raises(EngineFormatError, match="6 token ids for 4 rows"):
        import_routing("megatron-trace", [path], MIXTRAL, token_ids=[np.arange(6)])


def test_malformed_trace_lines_are_refused(tmp_path):
    w = RouterTraceWriter(tmp_path, rank=0)
    w.record_indices(routing(np.random.default_rng(14), 2, 4, MX_E, MX_K), step=0)
    path = w.flush()
    good = path.read_text().splitlines()
    cases = [
        ("{not json", r"line 2: not JSON"),
        (json.dumps({**json.loads(good[1]), "stage": "post_dispatch"}), r"line 2: stage 'post_dispatch'"),
        (json.dumps({**json.loads(good[1]), "topk": 3}), r"line 2: topk 3; the model routes each token to 2"),
        (
            json.dumps({**json.loads(good[1]), "num_tokens": 3}),
            r"line 2: top_indices \[2, 2\], expected \[num_tokens 3",
        ),
        (json.dumps({**json.loads(good[1]), "step": "0"}), r"line 2: `step` is '0', expected int"),
    ]
    for line, message in cases:
        path.write_text("\n".join([good[0], line, *good[2:]]) + "\n")
        with pytest.raises(EngineFormatError, match=message):
            import_routing("megatron-trace", [path], MIXTRAL)


def test_a_binary_file_is_refused(tmp_path):
    (tmp_path / "logits_rank0.bin").write_bytes(b"\xff\xfe\x00\x80" * 8)
    with pytest.raises(EngineFormatError, match=r"logits_rank0\.bin: not a JSON Lines router trace"):
        import_routing("megatron-trace", [tmp_path / "logits_rank0.bin"], MIXTRAL)


def test_ragged_top_indices_are_refused_even_with_the_right_total(tmp_path):
    w = RouterTraceWriter(tmp_path, rank=0)
    w.record_indices(routing(np.random.default_rng(16), 2, 4, MX_E, MX_K), step=0)
    path = w.flush()
    lines = path.read_text().splitlines()
    record = json.loads(lines[0])
    record["top_indices"] = [[1, 2, 3], [4]]  # 4 ids for 2 tokens × top-2, but not 2 per token
    lines[0] = json.dumps(record)
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(EngineFormatError, match=r"line 1: top_indices rows of different lengths"):
        import_routing("megatron-trace", [path], MIXTRAL)


def test_lines_with_their_keys_in_another_order_read_the_same(tmp_path):
    ids = routing(np.random.default_rng(17), 3, 4, MX_E, MX_K)
    w = RouterTraceWriter(tmp_path, rank=0)
    w.record_indices(ids, step=0)
    path = w.flush()
    reordered = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps({"top_indices": r.pop("top_indices"), **r}) + "\n" for r in reordered))
    trace = import_routing("megatron-trace", [path], MIXTRAL)
    np.testing.assert_array_equal(sets(trace, 0), sorted_rows(ids))


def test_trace_with_ids_outside_the_experts_is_refused(tmp_path):
    ids = routing(np.random.default_rng(15), 3, 4, MX_E, MX_K)
    ids[1, 2, 0] = MX_E
    w = RouterTraceWriter(tmp_path, rank=0)
    w.record_indices(ids, step=0)
    with pytest.raises(
        EngineFormatError, match=r"step 0, position 1, MoE layer 2: expert ids .* outside \[0, 8\)"
    ):
        import_routing("megatron-trace", [w.flush()], MIXTRAL)


# --- megatron-replay ---------------------------------------------------------------------------------


def _replay_choices(r, model_layers, e, k, lengths):
    out = []
    for p, g in lengths:
        prompt = [int(t) for t in r.integers(3, 2048, p)]
        generated = [int(t) for t in r.integers(3, 2048, g)]
        out.append((prompt, generated, routing(r, p + g - 1, model_layers, e, k)))
    return out


@pytest.mark.parametrize("wrapped", [False, True])
def test_replay_completion_moe_layers_seq_minus_one_and_tokens(tmp_path, wrapped):
    r = np.random.default_rng(20)
    choices = _replay_choices(r, 3, DS_E, DS_K, [(5, 4), (3, 2)])  # MoE layers only: 3 of 4 blocks
    path = tmp_path / "r.json"
    path.write_text(json.dumps(completion_response(choices, wrapped=wrapped)))
    trace = import_routing("megatron-replay", [path], DEEPSEEK)
    assert [layer.layer for layer in trace.layers] == [1, 2, 3]
    for seq, (prompt, generated, rows) in enumerate(choices):
        got = sets(trace, seq)
        np.testing.assert_array_equal(got[:-1], sorted_rows(rows))
        assert (got[-1] == -1).all()  # the last generated token never ran
        table = trace.tokens[trace.tokens["seq"] == seq]
        assert table["token_id"].tolist() == prompt + generated
        assert table["phase"].tolist() == ["prompt"] * len(prompt) + ["generated"] * len(generated)
    layer = trace.layers[0]
    assert layer.decision_source == "megatron-replay" and not layer.ranked
    assert wrapped == any("serialised array wrapper" in note for note in trace.model.notes)


def test_replay_jsonl_chat_with_and_without_token_ids(tmp_path):
    r = np.random.default_rng(21)
    (p1, g1, rows1), (p2, g2, rows2) = _replay_choices(r, 4, MX_E, MX_K, [(4, 3), (2, 5)])
    path = tmp_path / "r.jsonl"
    lines = [chat_response(p1, g1, rows1, tokenized=True), chat_response(p2, g2, rows2, tokenized=False)]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    trace = import_routing("megatron-replay", [path], MIXTRAL)
    np.testing.assert_array_equal(sets(trace, 0)[:-1], sorted_rows(rows1))
    assert trace.tokens[trace.tokens["seq"] == 0]["token_id"].tolist() == p1 + g1
    second = trace.tokens[trace.tokens["seq"] == 1]
    assert (second["token_id"] == -1).all() and len(second) == 6  # no ids: only the routed rows
    assert second["phase"].tolist() == ["prompt"] * 2 + ["generated"] * 4  # usage.prompt_tokens
    np.testing.assert_array_equal(sets(trace, 1), sorted_rows(rows2))


def test_replay_prompt_rows_that_contradict_the_routing_are_refused(tmp_path):
    r = np.random.default_rng(22)
    choices = _replay_choices(r, 4, MX_E, MX_K, [(4, 3)])
    response = json.loads(json.dumps(completion_response(choices)))  # the rows as separate JSON lists
    response["choices"][0]["prompt_moe_topk_indices"][1][0] = [7, 6]
    path = tmp_path / "r.json"
    path.write_text(json.dumps(response))
    with pytest.raises(EngineFormatError, match=r"prompt_moe_topk_indices \(4 rows\) are not the first rows"):
        import_routing("megatron-replay", [path], MIXTRAL)


def test_replay_with_a_hidden_layer_axis_routing_a_dense_layer_is_refused(tmp_path):
    r = np.random.default_rng(23)
    choices = _replay_choices(r, 4, DS_E, DS_K, [(3, 2)])  # 4 routed layers for a model with 3 MoE layers
    path = tmp_path / "r.json"
    path.write_text(json.dumps(completion_response(choices)))
    with pytest.raises(
        EngineFormatError, match="layer 0 is dense in the model, but the file routes tokens there"
    ):
        import_routing("megatron-replay", [path], DEEPSEEK)


def test_replay_token_ids_given_must_match_the_response(tmp_path):
    r = np.random.default_rng(24)
    choices = _replay_choices(r, 4, MX_E, MX_K, [(3, 3)])
    path = tmp_path / "r.json"
    path.write_text(json.dumps(completion_response(choices)))
    given = np.array(choices[0][0] + choices[0][1])
    given[4] += 1
    with pytest.raises(InputError, match="differ from the file's at position 4"):
        import_routing("megatron-replay", [path], MIXTRAL, token_ids=[given])


def test_replay_refuses_other_files(tmp_path):
    vllm = {"object": "text_completion", "choices": [{"index": 0, "routed_experts": "AAAA"}]}
    (tmp_path / "v.json").write_text(json.dumps(vllm))
    with pytest.raises(EngineFormatError, match="vllm-routed"):
        import_routing("megatron-replay", [tmp_path / "v.json"], MIXTRAL)
    bare = {"object": "text_completion", "choices": [{"index": 0, "text": ""}]}
    (tmp_path / "b.json").write_text(json.dumps(bare))
    with pytest.raises(EngineFormatError, match="--moe-enable-routing-replay"):
        import_routing("megatron-replay", [tmp_path / "b.json"], MIXTRAL)
    wrapped = completion_response(
        _replay_choices(np.random.default_rng(25), 4, MX_E, MX_K, [(2, 2)]), wrapped=True
    )
    wrapped["choices"][0]["moe_topk_indices"][1]["dtype"] = "float32"
    (tmp_path / "f.json").write_text(json.dumps(wrapped))
    with pytest.raises(EngineFormatError, match="an ndarray of dtype 'float32'"):
        import_routing("megatron-replay", [tmp_path / "f.json"], MIXTRAL)


def test_replay_parquet_round_trip(tmp_path):
    choices = _replay_choices(np.random.default_rng(26), 3, DS_E, DS_K, [(4, 3), (2, 2)])
    path = tmp_path / "r.json"
    path.write_text(json.dumps(completion_response(choices)))
    trace = import_routing("megatron-replay", [path], DEEPSEEK)
    trace.to_parquet(tmp_path / "routes.parquet")
    assert_traces_equal(trace, Trace.from_parquet(tmp_path / "routes.parquet"))
