"""The "vllm-routed" importer on files written as vLLM writes them (tests/support/vllm_files.py): the three
forms, each trap (seq−1 rows, MoE-layer vs hidden-layer axes, dense layers, −1 prefix-cache rows, 0.21's
zeroed prefix-cache rows and packed axis, routed_experts_prompt_start, dtypes) and every refusal."""

from __future__ import annotations

import numpy as np
import pytest

from moeviz.engines import import_routing
from moeviz.errors import EngineFormatError, InputError
from moeviz.trace import Trace
from tests.support.traces import assert_traces_equal
from tests.support.vllm_files import (
    chat_response,
    completion_response,
    expert_dtype,
    hidden_axis,
    numpy2base64,
    random_routing,
    write_json,
    write_jsonl,
)

DEEPSEEK = "sample:deepseek-v3-bias"  # 4 hidden layers, layer 0 dense, MoE layers 1-3, 16 experts, top-4
MIXTRAL = "sample:mixtral-healthy"  # 4 hidden layers, all MoE, 8 experts, top-2
DS_MOE, DS_E, DS_K = (1, 2, 3), 16, 4
MX_E, MX_K = 8, 2


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def tokens(r: np.random.Generator, n: int) -> list[int]:
    return [int(t) for t in r.integers(3, 2048, n)]


def routed(trace: Trace, seq: int) -> np.ndarray:
    """[positions, MoE layers, k] of sequence `seq`, −1 where a position has no routing."""
    table = trace.tokens
    rows = table.index[table["seq"] == seq]
    out = np.full((len(rows), len(trace.layers), trace.layers[0].experts.shape[1]), -1, np.int64)
    for i, layer in enumerate(trace.layers):
        where = np.searchsorted(layer.token_rows, rows)
        hit = (where < len(layer.token_rows)) & (
            layer.token_rows[np.minimum(where, len(layer.token_rows) - 1)] == rows
        )
        out[hit, i] = layer.experts[where[hit]]
    return out


# --- first form: CompletionOutput.routed_experts saved with np.save -----------------------------------


def test_npy_first_form_round_trips_with_dense_layer_and_last_token_unrouted(tmp_path):
    r = rng(1)
    moe = random_routing(r, 9, 3, DS_E, DS_K)  # 10 tokens: the last sampled one never ran
    path = tmp_path / "out.npy"
    np.save(path, hidden_axis(moe, DS_MOE, 4).astype(np.int32))  # vLLM <= 0.20: int32, dense layer 0 zero
    ids = tokens(r, 10)
    trace = import_routing("vllm-routed", [path], DEEPSEEK, token_ids=[np.array(ids)])
    assert [layer.layer for layer in trace.layers] == [1, 2, 3]
    got = routed(trace, 0)
    np.testing.assert_array_equal(got[:9], moe)
    assert (got[9] == -1).all()
    assert trace.tokens["token_id"].tolist() == ids
    layer = trace.layers[0]
    assert layer.decision_source == "vllm-routed" and layer.ranked and not layer.has_logits
    assert np.isnan(layer.scores).all() and not layer.has_weights


def test_npy_token_ids_for_only_the_routed_rows_align(tmp_path):
    moe = random_routing(rng(2), 6, 4, MX_E, MX_K)
    path = tmp_path / "out.npy"
    np.save(path, moe.astype(np.int32))
    trace = import_routing("vllm-routed", [path], MIXTRAL, token_ids=[np.arange(6) + 5])
    np.testing.assert_array_equal(routed(trace, 0), moe)


def test_npy_token_count_that_disagrees_is_refused(tmp_path):
    path = tmp_path / "out.npy"
    np.save(path, random_routing(rng(3), 6, 4, MX_E, MX_K).astype(np.int32))
    with pytest.raises(EngineFormatError, match=r"9 token ids for 6 rows .* expected 7 .* or 6"):
        import_routing("vllm-routed", [path], MIXTRAL, token_ids=[np.arange(9)])


def test_npz_is_refused(tmp_path):
    path = tmp_path / "out.npz"
    np.savez(path, a=np.zeros((2, 4, 2), np.int32))
    with pytest.raises(EngineFormatError, match=r"an \.npz archive.*np\.save"):
        import_routing("vllm-routed", [path], MIXTRAL)


def test_pickled_npy_is_refused_without_unpickling(tmp_path):
    path = tmp_path / "out.npy"
    np.save(path, np.array([{"x": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(EngineFormatError, match="never unpickled"):
        import_routing("vllm-routed", [path], MIXTRAL)


def test_npy_whose_header_promises_more_bytes_than_follow_is_refused(tmp_path):
    path = tmp_path / "out.npy"
    np.save(path, random_routing(rng(4), 5, 4, MX_E, MX_K).astype(np.int32))
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(EngineFormatError, match=r"header says \[5, 4, 2\] int32 \(160 bytes\) but 152"):
        import_routing("vllm-routed", [path], MIXTRAL)


def test_a_file_from_another_model_is_refused(tmp_path):
    path = tmp_path / "out.npy"
    np.save(path, random_routing(rng(5), 5, 4, MX_E, MX_K).astype(np.int32))  # top-2: mixtral's
    with pytest.raises(
        EngineFormatError, match=r"2 experts per token in the file, the model routes each token to 4"
    ):
        import_routing("vllm-routed", [path], DEEPSEEK)


# --- vLLM 0.21: nested int16 lists, prompt routing on the response, MoE layers only ---------------------


def test_v021_completion_shares_the_prompt_routing_between_choices(tmp_path):
    r = rng(6)
    prompt = tokens(r, 5)
    gens = [tokens(r, 4), tokens(r, 3)]
    rows = [random_routing(r, 5 + len(g) - 1, 3, DS_E, DS_K) for g in gens]  # MoE-layer axis: 3 of 4 layers
    rows[1][:5] = rows[0][:5]  # one prompt, routed once
    response = completion_response([prompt], [list(zip(gens, rows, strict=True))], form="v0.21")
    trace = import_routing("vllm-routed", [write_json(tmp_path / "r.json", response)], DEEPSEEK)
    for seq, (gen, expected) in enumerate(zip(gens, rows, strict=True)):
        got = routed(trace, seq)
        np.testing.assert_array_equal(got[:-1], expected)
        assert (got[-1] == -1).all()  # the last sampled token never ran
        table = trace.tokens[trace.tokens["seq"] == seq]
        assert table["token_id"].tolist() == prompt + gen
        assert table["phase"].tolist() == ["prompt"] * 5 + ["generated"] * len(gen)


def test_v021_minus_one_prefix_cache_rows_are_set_aside(tmp_path):
    r = rng(7)
    prompt, gen = tokens(r, 6), tokens(r, 3)
    rows = random_routing(r, 8, 4, MX_E, MX_K)
    rows[:4] = -1  # the docs' sentinel for prompt positions served from the prefix cache
    path = write_json(tmp_path / "r.json", chat_response(prompt, [(gen, rows)], form="v0.21"))
    trace = import_routing("vllm-routed", [path], MIXTRAL)
    got = routed(trace, 0)
    assert (got[:4] == -1).all() and (got[8] == -1).all()
    np.testing.assert_array_equal(got[4:8], rows[4:])
    assert any("4 of 8 positions" in note and "prefix-cache" in note for note in trace.model.notes)


def test_v021_zeroed_prefix_cache_rows_are_refused_with_their_cause(tmp_path):
    r = rng(8)
    prompt, gen = tokens(r, 6), tokens(r, 3)
    rows = random_routing(r, 8, 4, MX_E, MX_K)
    rows[:4] = 0  # what vLLM 0.21.0's np.zeros host buffer holds for positions it did not compute
    path = write_json(tmp_path / "r.json", chat_response(prompt, [(gen, rows)], form="v0.21"))
    with pytest.raises(EngineFormatError, match=r"prompt positions 0–3 hold all-zero routing.*prefix cache"):
        import_routing("vllm-routed", [path], MIXTRAL)


def test_v021_deepseek_axis_with_moe_layers_packed_first_is_read_as_moe_layers(tmp_path):
    r = rng(9)
    prompt, gen = tokens(r, 4), tokens(r, 3)
    moe = random_routing(r, 6, 3, DS_E, DS_K)
    packed = np.concatenate([moe, np.zeros((6, 1, DS_K), np.int64)], axis=1)  # 4 entries, the last one 0
    path = write_json(tmp_path / "r.json", chat_response(prompt, [(gen, packed)], form="v0.21"))
    trace = import_routing("vllm-routed", [path], DEEPSEEK)
    np.testing.assert_array_equal(routed(trace, 0)[:6], moe)
    assert any("MoE layers first" in note for note in trace.model.notes)


def test_v021_second_prompt_without_its_prompt_routing_starts_after_its_prompt(tmp_path):
    r = rng(10)
    prompts = [tokens(r, 4), tokens(r, 5)]
    gens = [tokens(r, 3), tokens(r, 3)]
    rows = [random_routing(r, len(p) + len(g) - 1, 4, MX_E, MX_K) for p, g in zip(prompts, gens, strict=True)]
    outputs = [[(gens[0], rows[0])], [(gens[1], rows[1])]]
    path = write_json(tmp_path / "r.json", completion_response(prompts, outputs, form="v0.21"))
    trace = import_routing("vllm-routed", [path], MIXTRAL)
    np.testing.assert_array_equal(routed(trace, 0)[:-1], rows[0])
    second = routed(trace, 1)
    assert (second[:5] == -1).all()  # vLLM 0.21 returned only the first prompt's routing
    np.testing.assert_array_equal(second[5:-1], rows[1][5:])


def test_v021_several_prompts_without_token_ids_are_refused(tmp_path):
    r = rng(11)
    prompts = [tokens(r, 4), tokens(r, 5)]
    outputs = [[(tokens(r, 2), random_routing(r, len(p) + 1, 4, MX_E, MX_K))] for p in prompts]
    response = completion_response(prompts, outputs, form="v0.21", return_token_ids=False)
    with pytest.raises(EngineFormatError, match="several prompts and one prompt_routed_experts"):
        import_routing("vllm-routed", [write_json(tmp_path / "r.json", response)], MIXTRAL)


def test_v021_one_prompt_with_n_choices_needs_no_token_ids(tmp_path):
    r = rng(12)
    prompt = tokens(r, 4)
    gens = [tokens(r, 3), tokens(r, 3)]
    rows = [random_routing(r, 6, 4, MX_E, MX_K) for _ in gens]
    rows[1][:4] = rows[0][:4]
    response = completion_response(
        [prompt], [list(zip(gens, rows, strict=True))], form="v0.21", return_token_ids=False
    )
    trace = import_routing("vllm-routed", [write_json(tmp_path / "r.json", response)], MIXTRAL)
    for seq in (0, 1):
        np.testing.assert_array_equal(routed(trace, seq), rows[seq])  # no ids: only the routed rows
        assert (trace.tokens[trace.tokens["seq"] == seq]["token_id"] == -1).all()


# --- vLLM >= 0.22: base64 of .npy bytes per choice, every hidden layer -----------------------------------


@pytest.mark.parametrize("dtype", [None, np.uint16, np.int32])
def test_base64_npy_deepseek_hidden_axis_with_dense_zeros(tmp_path, dtype):
    r = rng(13)
    prompt, gen = tokens(r, 5), tokens(r, 4)
    moe = random_routing(r, 8, 3, DS_E, DS_K)
    rows = hidden_axis(moe, DS_MOE, 4)
    response = completion_response(
        [prompt], [[(gen, rows)]], form="base64", dtype=dtype or expert_dtype(DS_E)
    )
    trace = import_routing("vllm-routed", [write_json(tmp_path / "r.json", response)], DEEPSEEK)
    got = routed(trace, 0)
    np.testing.assert_array_equal(got[:8], moe)
    assert (got[8] == -1).all()
    assert trace.tokens["token_id"].tolist() == prompt + gen


def test_base64_chat_response(tmp_path):
    r = rng(14)
    prompt, gen = tokens(r, 3), tokens(r, 5)
    rows = random_routing(r, 7, 4, MX_E, MX_K)
    response = chat_response(prompt, [(gen, rows)], form="base64", dtype=expert_dtype(MX_E))
    trace = import_routing("vllm-routed", [write_json(tmp_path / "r.json", response)], MIXTRAL)
    np.testing.assert_array_equal(routed(trace, 0)[:7], rows)
    assert trace.tokens["phase"].tolist() == ["prompt"] * 3 + ["generated"] * 5


def test_base64_routed_experts_prompt_start_is_recovered_from_the_token_ids(tmp_path):
    r = rng(15)
    prompt, gen, start = tokens(r, 6), tokens(r, 3), 4
    rows = random_routing(r, 6 + 3 - 1 - start, 4, MX_E, MX_K)  # positions 4 … 7
    response = completion_response([prompt], [[(gen, rows)]], form="base64", dtype=expert_dtype(MX_E))
    trace = import_routing("vllm-routed", [write_json(tmp_path / "r.json", response)], MIXTRAL)
    got = routed(trace, 0)
    assert (got[:start] == -1).all() and (got[8] == -1).all()
    np.testing.assert_array_equal(got[start:8], rows)
    assert any("routed_experts_prompt_start" in note for note in trace.model.notes)


def test_base64_prompt_start_without_token_ids_is_recovered_from_usage(tmp_path):
    r = rng(22)
    prompt, gen, start = tokens(r, 6), tokens(r, 3), 2
    rows = random_routing(r, 6 + 3 - 1 - start, 4, MX_E, MX_K)
    response = completion_response(
        [prompt], [[(gen, rows)]], form="base64", dtype=expert_dtype(MX_E), return_token_ids=False
    )
    trace = import_routing("vllm-routed", [write_json(tmp_path / "r.json", response)], MIXTRAL)
    got = routed(trace, 0)
    assert len(got) == 8 and (got[:start] == -1).all()
    np.testing.assert_array_equal(got[start:], rows)


def test_base64_all_zero_capture_of_monolithic_kernels_is_refused(tmp_path):
    r = rng(16)
    prompt, gen = tokens(r, 4), tokens(r, 3)
    zeros = np.zeros((6, 4, MX_K), np.int64)  # vLLM issue #54730: right shape, every id 0
    response = completion_response([prompt], [[(gen, zeros)]], form="base64", dtype=expert_dtype(MX_E))
    with pytest.raises(EngineFormatError, match=r"position 0, MoE layer 0: all 2 expert ids are 0.*#54730"):
        import_routing("vllm-routed", [write_json(tmp_path / "r.json", response)], MIXTRAL)


def test_base64_that_is_not_base64_or_not_npy_is_refused(tmp_path):
    r = rng(17)
    response = completion_response(
        [tokens(r, 3)], [[(tokens(r, 2), random_routing(r, 4, 4, MX_E, MX_K))]], form="base64", dtype=np.uint8
    )
    response["choices"][0]["routed_experts"] = "not base64!"
    with pytest.raises(EngineFormatError, match="choice 0, routed_experts: not base64"):
        import_routing("vllm-routed", [write_json(tmp_path / "a.json", response)], MIXTRAL)
    response["choices"][0]["routed_experts"] = numpy2base64(np.zeros(3, np.uint8))[:-4] + "AAAA"
    with pytest.raises(EngineFormatError, match=r"header says|not a \.npy file"):
        import_routing("vllm-routed", [write_json(tmp_path / "b.json", response)], MIXTRAL)


def test_token_ids_that_contradict_the_response_are_refused(tmp_path):
    r = rng(18)
    prompt, gen = tokens(r, 4), tokens(r, 3)
    response = completion_response(
        [prompt], [[(gen, random_routing(r, 6, 4, MX_E, MX_K))]], form="base64", dtype=np.uint8
    )
    other = np.array(prompt + gen)
    other[2] += 1
    with pytest.raises(InputError, match="differ from the file's at position 2"):
        import_routing("vllm-routed", [write_json(tmp_path / "r.json", response)], MIXTRAL, token_ids=[other])


def test_jsonl_and_json_list_of_responses_keep_their_order(tmp_path):
    r = rng(19)
    responses, expected = [], []
    for _ in range(3):
        prompt, gen = tokens(r, 3), tokens(r, 2)
        rows = random_routing(r, 4, 4, MX_E, MX_K)
        responses.append(completion_response([prompt], [[(gen, rows)]], form="base64", dtype=np.uint8))
        expected.append(rows)
    for path in (write_jsonl(tmp_path / "r.jsonl", responses), write_json(tmp_path / "r.json", responses)):
        trace = import_routing("vllm-routed", [path], MIXTRAL)
        for seq, rows in enumerate(expected):
            np.testing.assert_array_equal(routed(trace, seq)[:4], rows)


def test_choice_without_routing_is_skipped_and_none_at_all_is_refused(tmp_path):
    r = rng(20)
    with_routing = completion_response(
        [tokens(r, 3)], [[(tokens(r, 2), random_routing(r, 4, 4, MX_E, MX_K))]], form="base64", dtype=np.uint8
    )
    without = completion_response(
        [tokens(r, 3)], [[(tokens(r, 2), random_routing(r, 4, 4, MX_E, MX_K))]], form="base64", dtype=np.uint8
    )
    without["choices"][0]["routed_experts"] = None
    trace = import_routing(
        "vllm-routed", [write_jsonl(tmp_path / "r.jsonl", [without, with_routing])], MIXTRAL
    )
    assert trace.tokens["seq"].nunique() == 1
    assert any("line 1, choice 0 carries no routed experts" in note for note in trace.model.notes)
    with pytest.raises(EngineFormatError, match="--enable-return-routed-experts"):
        import_routing("vllm-routed", [write_json(tmp_path / "n.json", without)], MIXTRAL)


def test_other_engines_responses_are_refused_with_the_right_format(tmp_path):
    sglang = {"text": "", "meta_info": {"routed_experts": "AAAA"}}
    with pytest.raises(EngineFormatError, match="sglang-routed"):
        import_routing("vllm-routed", [write_json(tmp_path / "s.json", sglang)], MIXTRAL)
    megatron = {"object": "text_completion", "choices": [{"index": 0, "moe_topk_indices": [[[0, 1]]]}]}
    with pytest.raises(EngineFormatError, match="megatron-replay"):
        import_routing("vllm-routed", [write_json(tmp_path / "m.json", megatron)], MIXTRAL)


def test_import_then_parquet_round_trip(tmp_path):
    r = rng(21)
    prompt = tokens(r, 5)
    gens = [tokens(r, 3), tokens(r, 4)]
    rows = [hidden_axis(random_routing(r, 5 + len(g) - 1, 3, DS_E, DS_K), DS_MOE, 4) for g in gens]
    response = completion_response(
        [prompt], [list(zip(gens, rows, strict=True))], form="base64", dtype=np.uint8
    )
    trace = import_routing("vllm-routed", [write_json(tmp_path / "r.json", response)], DEEPSEEK)
    trace.to_parquet(tmp_path / "routes.parquet")
    assert_traces_equal(trace, Trace.from_parquet(tmp_path / "routes.parquet"))
